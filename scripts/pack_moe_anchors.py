"""Packs the MoE side by side's incumbents for the GPU machine (no vLLM there, no package
index, 64 MiB carried per call): vLLM 0.33.0's two kernel libraries that Humming's whole call
needs (``moe_c`` 46 MB and ``vllm_c`` 92 MB, 102 MB in xz), its Python package without
compiled files (``vllm_py``: the weighted sum of the tensor-parallel rows, 8 MB in xz), and
the small anchors folder (FlashMLA, humming: ``scripts/fetch_anchors.py``).

    python scripts/pack_moe_anchors.py [--wheel-dir DIR] [--out .devbuild/moe-anchors]

Makes ``--out``/p0, p1, p2 (each under 45 MB): the xz of the two libraries in three parts
with its sha256, the Python tree's xz, and the anchors folder. On the machine,
``scripts/device_moe_stage.sh`` copies whichever parts a call carries to /tmp (kept while
the machine is warm, 30 s after a call returns) and, once all three came, unpacks them into
/tmp/va (a vLLM folder) and /tmp/anc; then ``DSV4_ANCHORS=/tmp/anc:/tmp/va``. So three calls
back to back, carrying p0, then p1, then p2 (each with whatever else the call needs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]  # run by path: the sibling script and dsv4

from dsv4.bench.anchors import (HUMMING_VERSION, MANIFEST, MOE_C_FILES, VLLM_C_FILES, VLLM_VERSION,  # noqa: E402
                                fetch)
from pack_vllm_for_device import LEFT_OUT, _xz_tar  # noqa: E402  (the serve pack's tree rule and tar.xz)

PART = 34_000_000  # bytes of the libraries' xz per part: three parts, each call's carry well under 64 MiB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel-dir", default=None,
                    help="folder holding the vllm and humming-kernels wheels (default: pip download into a temp dir)")
    ap.add_argument("--out", default=".devbuild/moe-anchors")
    args = ap.parse_args(argv)
    wheel_dir = args.wheel_dir
    tmp = None
    if wheel_dir is None:
        import tempfile

        wheel_dir = tmp = tempfile.mkdtemp(prefix="dsv4-moe-anchors-")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", wheel_dir,
                        f"vllm=={VLLM_VERSION}", f"humming-kernels=={HUMMING_VERSION}"], check=True)
    try:
        whl = [w for w in os.listdir(wheel_dir) if w.startswith(f"vllm-{VLLM_VERSION}-") and w.endswith(".whl")]
        if not whl:
            print(f"pack_moe_anchors: no vllm-{VLLM_VERSION} wheel in {wheel_dir}", file=sys.stderr)
            return 1
        shutil.rmtree(args.out, ignore_errors=True)
        parts = [os.path.join(args.out, f"p{i}") for i in range(3)]
        for p in parts:
            os.makedirs(p)
        fetch(os.path.join(parts[0], "anc"), wheel_dir=wheel_dir)  # FlashMLA + humming, ~6 MB
        manifest = ("va/" + MANIFEST, json.dumps({"versions": {"vllm": VLLM_VERSION}}).encode(), 0o644)
        with zipfile.ZipFile(os.path.join(wheel_dir, whl[0])) as z:
            libs = [manifest] + [("va/" + n, z.read(n), 0o644) for n in MOE_C_FILES + VLLM_C_FILES]
            # the Python tree: scripts/pack_vllm_for_device.py's rule (no compiled file, nothing of LEFT_OUT)
            tree = [manifest] + [("va/" + i.filename, z.read(i), 0o644) for i in z.infolist()
                                 if not i.filename.endswith(("/", ".so")) and not i.filename.startswith(LEFT_OUT)]
        _xz_tar(tree, os.path.join(parts[2], "vtree.tar.xz"))
        lib_xz = os.path.join(args.out, "vl.tar.xz")
        _xz_tar(libs, lib_xz)
        data = open(lib_xz, "rb").read()
        os.remove(lib_xz)
        if len(data) > 3 * PART:
            print(f"pack_moe_anchors: the libraries' xz is {len(data)} bytes, over 3 parts of {PART}", file=sys.stderr)
            return 1
        for i, p in enumerate(parts):
            with open(os.path.join(p, f"vl.part{i}"), "wb") as f:
                f.write(data[i * PART:(i + 1) * PART])
        with open(os.path.join(parts[2], "vl.sha256"), "w") as f:
            f.write(hashlib.sha256(data).hexdigest() + "\n")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    for p in parts:
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)
        print(f"{p}: {size / 2**20:.1f} MiB")
    print("device calls, back to back (each within 30 s of the last one's return), each carrying one part "
          f"and running `bash scripts/device_moe_stage.sh {args.out}` first: {', '.join(parts)}; "
          "then DSV4_ANCHORS=/tmp/anc:/tmp/va")
    return 0


if __name__ == "__main__":
    sys.exit(main())
