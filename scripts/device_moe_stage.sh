#!/bin/bash
# On the GPU machine, first in a call: stages the MoE incumbents that scripts/pack_moe_anchors.py
# packed (the parts this call carries: DIR/p0, p1 or p2) into /tmp, which a warm machine keeps
# between calls; once all three parts came, unpacks vLLM's libraries and Python tree into
# /tmp/va and the anchors folder into /tmp/anc. Also unpacks any dsv4 builds carried as
# DIR/so/NAME.so.xz into /tmp/so/NAME.so (A/B runs: scripts/moe_ab.sh BUILDS=NAME=/tmp/so/NAME.so).
#   bash scripts/device_moe_stage.sh [DIR]      (default .devbuild/moe-anchors)
# Prints one line: what /tmp holds, and "anchors ready: DSV4_ANCHORS=/tmp/anc:/tmp/va" when done.
set -u
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
D=${1:-.devbuild/moe-anchors}
mkdir -p /tmp/moe-parts /tmp/so
for p in "$D"/p0 "$D"/p1 "$D"/p2; do
  [ -d "$p" ] || continue
  for f in "$p"/*; do
    if [ "$(basename "$f")" = anc ]; then mkdir -p /tmp/anc && cp -r "$f"/. /tmp/anc/; else cp "$f" /tmp/moe-parts/; fi
  done
done
if [ -d "$D/so" ]; then
  for f in "$D"/so/*.so.xz; do [ -e "$f" ] && xz -dc "$f" > /tmp/so/"$(basename "$f" .xz)"; done
fi
if [ ! -f /tmp/va/MANIFEST.json ] && [ -f /tmp/moe-parts/vl.part0 ] && [ -f /tmp/moe-parts/vl.part1 ] \
   && [ -f /tmp/moe-parts/vl.part2 ] && [ -f /tmp/moe-parts/vtree.tar.xz ]; then
  cat /tmp/moe-parts/vl.part0 /tmp/moe-parts/vl.part1 /tmp/moe-parts/vl.part2 > /tmp/moe-parts/vl.tar.xz
  if [ "$(sha256sum /tmp/moe-parts/vl.tar.xz | cut -d' ' -f1)" = "$(cat /tmp/moe-parts/vl.sha256)" ]; then
    tar -C /tmp -xJf /tmp/moe-parts/vl.tar.xz && tar -C /tmp -xJf /tmp/moe-parts/vtree.tar.xz
  else
    echo "device_moe_stage: the parts' sha256 does not match vl.sha256 (parts from two packings?)"
  fi
  rm -f /tmp/moe-parts/vl.tar.xz
fi
echo "staged: $(ls /tmp/moe-parts 2>/dev/null | tr '\n' ' ')| builds: $(ls /tmp/so 2>/dev/null | tr '\n' ' ')"
[ -f /tmp/va/MANIFEST.json ] && [ -d /tmp/anc ] && echo "anchors ready: DSV4_ANCHORS=/tmp/anc:/tmp/va"
true
