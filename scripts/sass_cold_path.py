"""Static size of a warp-specialized kernel's cold path, per role, from its SASS.

    python3 scripts/sass_cold_path.py OBJ [--cuobjdump PATH] [--kernel SUBSTRING]

For each kernel whose mangled name contains SUBSTRING (default sparse_mqa_fwd_kernel),
disassembles OBJ with `cuobjdump -sass` (nvdisasm must be on PATH or NVDISASM_PATH) and
walks the control-flow graph from each role's entry to its first target instruction:

* producer: from after `USETMAXREG.DEALLOC` to its first `SYNCS.ARRIVE` (or cp.async arrive);
* consumer: from after `USETMAXREG.TRY_ALLOC` to its first `HGMMA`;
* entry: from the kernel's first instruction to its first KV row load (`LDG.E.NA.128`) and
  to its first dequantized store (`STS.128`): the cooperative first round's path
  (csrc/attention/sparse_mqa_first_round.cuh), run by every warp before the role split (in
  instances without it, the producer's path through the role split).

Two bounds of the code a cold warp fetches before its first useful event (no GPU needed):

* shortest: bytes on the shortest path (16 bytes per instruction); a lower bound of what
  one warp executes (the executed path depends on run-time branches, so ptxas moving code
  between branches can make it grow while the code shrinks);
* first pass: bytes reachable by fallthrough and forward jumps without passing a target (a
  first pass through every loop), with the 128-byte lines they occupy; an upper bound of
  the code a first pass can touch.

Used in docs/perf-history/2026-12-04-attention-fixed-cost.md and
2026-12-04-attention-code-diet.md (issue 34, plan step 2).
"""

from __future__ import annotations

import argparse
import heapq
import os
import re
import subprocess
import sys

_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s*(.*?)\s*;")
_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")


def parse(text: str) -> dict[str, list[tuple[int, str]]]:
    """Kernels of a `cuobjdump -sass` listing: name -> [(address, instruction text)]."""
    kernels: dict[str, list[tuple[int, str]]] = {}
    cur = None
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            cur = kernels.setdefault(m.group(1), [])
            continue
        m = _INSTR.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2)))
    return kernels


def successors(ins: list[tuple[int, str]]) -> list[list[int]]:
    """Control-flow successors per instruction index (a CALL goes to its callee, a RET back
    to every call site)."""
    at = {a: k for k, (a, _) in enumerate(ins)}
    out, calls = [], []
    for i, (_, text) in enumerate(ins):
        pred = re.match(r"^@(!?U?P[T0-9]+)\s+", text)
        body = text[pred.end():] if pred else text
        always = pred is None or pred.group(1) == "PT"
        op = body.split()[0]
        nxt = [i + 1] if i + 1 < len(ins) else []
        if op.startswith(("BRA", "CALL")):
            j = at[int(re.search(r"0x([0-9a-f]+)", body).group(1), 16)]
            if op.startswith("CALL"):
                calls.append(i)
                out.append([j])
            else:
                out.append([j] if always else [j] + nxt)
        elif op.startswith(("EXIT", "RET")):
            out.append([] if always else nxt)
        else:
            out.append(nxt)
    for i, (_, text) in enumerate(ins):
        if "RET." in text:
            out[i] = out[i] + [c + 1 for c in calls]
    return out


def cold_path(ins, succ, start: int, is_target) -> dict:
    dist, heap, best = {start: 1}, [(1, start)], None
    while heap:
        d, i = heapq.heappop(heap)
        if d > dist[i]:
            continue
        if is_target(ins[i][1]):
            best = (d, i)
            break
        for j in succ[i]:
            if d + 1 < dist.get(j, 1 << 60):
                dist[j] = d + 1
                heapq.heappush(heap, (d + 1, j))
    seen, stack = set(), [start]
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        if not is_target(ins[i][1]):
            stack += [j for j in succ[i] if j > i]
    return dict(shortest=16 * best[0] if best else None, first=hex(ins[best[1]][0]) if best else None,
                first_pass=16 * len(seen), lines=len({ins[i][0] // 128 for i in seen}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("obj")
    ap.add_argument("--cuobjdump", default=os.environ.get("CUOBJDUMP", "cuobjdump"))
    ap.add_argument("--kernel", default="sparse_mqa_fwd_kernel")
    a = ap.parse_args(argv)
    proc = subprocess.run([a.cuobjdump, "-sass", a.obj], capture_output=True, text=True)
    if proc.returncode:
        print(f"sass_cold_path: {a.cuobjdump} -sass {a.obj} failed: {proc.stderr.strip()}", file=sys.stderr)
        return 1
    arrive = lambda t: "SYNCS.ARRIVE" in t or "ARRIVES." in t  # noqa: E731
    hgmma = lambda t: "HGMMA" in t  # noqa: E731
    row_load = lambda t: "LDG.E.NA.128" in t  # noqa: E731
    sts128 = lambda t: "STS.128" in t  # noqa: E731
    print("| kernel | role | to | shortest B | first pass B (128-B lines) | first target at |")
    print("|---|---|---|---:|---:|---|")
    for name, ins in parse(proc.stdout).items():
        if a.kernel not in name:
            continue
        succ = successors(ins)
        dec = next((i + 1 for i, (_, t) in enumerate(ins) if "USETMAXREG.DEALLOC" in t), None)
        inc = next((i + 1 for i, (_, t) in enumerate(ins) if "USETMAXREG.TRY_ALLOC" in t), None)
        roles = (("producer", dec, "SYNCS.ARRIVE", arrive), ("consumer", inc, "HGMMA", hgmma),
                 ("entry", 0, "LDG.E.NA.128", row_load), ("entry", 0, "STS.128", sts128))
        for role, start, what, target in roles:
            if start is None:
                continue
            r = cold_path(ins, succ, start, target)
            print(f"| {name} | {role} | {what} | {r['shortest']} | {r['first_pass']} ({r['lines']}) | {r['first']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
