"""Packs vLLM 0.33.0 for the GPU machine (no vLLM, no package index, 64 MiB per call):
the parts that ``scripts/gpu_serve_smoke.py stage`` unpacks into /tmp there.

    python scripts/pack_vllm_for_device.py [--wheel-dir .devbuild/serve/wheels] [--out .devbuild/serve]

What it makes (all under ``--out``, gitignored ``.devbuild/``), from the wheels in
``--wheel-dir`` (``pip download``-ed there first if missing: the vllm==0.33.0 wheel and
the cp312 manylinux wheels of :data:`EXTRA_WHEELS`):

* ``vtree.tar.xz``: the vllm wheel's files without its compiled libraries, its Rust
  frontend binary (``vllm/vllm-rs``) and its SM100-only FMHA sources
  (``vllm/third_party/fmha_sm100/``); with DeepGEMM's JIT headers
  (``vllm/third_party/deep_gemm/include``, needed: DeepGEMM compiles its kernels with the
  machine's nvcc at first use) and ``vllm-0.33.0.dist-info`` (the plugin reads vLLM's
  version from it). About 8.5 MB.
* ``libs.tar.xz`` in chunks: the compiled libraries of :data:`LIBS` (vLLM's own
  kernels, the MoE library, FlashMLA, DeepGEMM's host library, ...), about 111 MB
  compressed; built on torch's stable C ABI, they load on torch 2.11
  (every torch symbol they import is exported by torch 2.11.0's libraries).
* the extra wheels, as they are (zips).

They are spread over ``p1``, ``p2``, ``p3`` (each under :data:`PART_BUDGET`), each with a
``parts.json`` naming every part of the set with its sha256, so ``stage`` knows when the
set is complete. The last call carries ``p3`` and the dsv4 extension (``dsv4/_C.abi3.so``,
~13 MB) and runs the smoke. The device-call sequence is printed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

# The staging checks each part against this hash on the GPU machine: one definition for both sides.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_serve_smoke import _sha  # noqa: E402

VLLM = "vllm==0.33.0"
# The wheels vLLM's engine, config and DeepSeek V4 model modules import that the GPU
# machine's image lacks, at the versions vllm 0.33.0 was tested with here (/work/vvenv):
# the closure of vllm 0.33.0's requirements (markers for CPython 3.12 on Linux) less the
# image's packages (.library/device/KINDS.md "Python packages already there") and less
# what the offline engine on Hopper never imports and is large: FlashInfer, the CUTLASS
# DSL, TileLang, z3, tokenspeed, cuda-tile / cuda-python (the image has cuda-bindings),
# NCCL's Python bindings (one GPU), cuDNN's frontend, video codecs, quack, fastsafetensors,
# instanttensor, OpenTelemetry, MCP, anthropic, supervisor, mistral-common (the tokenizer
# is not initialised). An import by name alone found too few: openai's sniffio was
# missing on the machine (``stage`` skips a wheel whose distribution the image has).
EXTRA_WHEELS = (
    "annotated-types==0.8.0", "apache-tvm-ffi==0.1.11", "astor==0.8.1", "blake3==1.0.11", "cachetools==8.0.2",
    "cbor2==6.3.0", "compressed-tensors==0.17.0", "depyf==0.20.0", "dill==0.4.1", "docstring-parser==0.18.0",
    "fastapi==0.136.3", "httpcore2==2.16.2", "httpx2==2.16.2", "humming-kernels==0.1.19", "ijson==3.6.0",
    "interegular==0.3.3", "jiter==0.19.0", "jmespath==1.1.0", "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1", "lark==1.2.2", "llguidance==1.7.6", "lm-format-enforcer==0.11.3",
    "loguru==0.7.3", "msgspec==0.23.0", "nvtx==0.2.15", "openai==3.60.0", "orjson==3.13.0", "oss-harmony==0.0.11",
    "outlines-core==0.2.14", "partial-json-parser==0.2.1.1.post7", "prometheus-fastapi-instrumentator==8.1.0",
    "pybase64==1.5.1", "pydantic==2.14.4", "pydantic-core==2.50.5", "pydantic-extra-types==2.11.1",
    "pyjwt==2.15.1", "python-json-logger==4.2.0", "python-multipart==0.0.34", "pyzmq==27.3.0",
    "referencing==0.37.0", "rpds-py==2026.9.1", "setproctitle==1.3.8", "sniffio==1.3.1", "sse-starlette==3.7.1",
    "starlette==1.10.0", "truststore==0.10.5", "typing-inspection==0.4.5", "uvicorn==0.55.0",
    "watchfiles==1.3.0", "xgrammar==0.2.8",
)
LIBS = (
    "vllm/_C_stable_libtorch.abi3.so",        # vLLM's kernels (quant, norms, cache ops, FP8 GEMMs)
    "vllm/_moe_C_stable_libtorch.abi3.so",    # routing (top-k), moe_align, Marlin MoE
    "vllm/_flashmla_C.abi3.so",               # FlashMLA sparse decode / prefill (the A/B backend)
    "vllm/_flashmla_extension_C.abi3.so",
    "vllm/_deepselect_C.abi3.so",             # the sparse indexer's top-k
    "vllm/third_party/deep_gemm/_C_extension.abi3.so",  # indexer logits, fp8_einsum (o_proj), mHC GEMM
    "vllm/cumem_allocator.abi3.so", "vllm/fs_io_C.abi3.so", "vllm/spinloop.abi3.so",
)
# Left out of the wheel: FlashAttention 2/3 (480 MB; DeepSeek V4 attends through FlashMLA
# or dsv4), the Kimi delta-attention and QuTLASS libraries (other models), the Rust
# frontend (``vllm serve`` only), SM100 FMHA sources.
LEFT_OUT = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
            "vllm/_flashkda_C.abi3.so", "vllm/_qutlass_C.abi3.so", "vllm/vllm-rs", "vllm/third_party/fmha_sm100/")
PART_BUDGET = 55 * 2**20  # per call, leaving room for the repo's tracked files (~3 MB) under 64 MiB
SO_BUDGET = 14 * 2**20  # the dsv4 extension the last call also carries (~13 MB)


def _pip_download(dest: str, reqs, py312: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", dest]
    if py312:
        cmd += ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
        for plat in ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                     "manylinux2014_x86_64", "manylinux1_x86_64", "any"):
            cmd += ["--platform", plat]
    subprocess.run(cmd + list(reqs), check=True)


def _wheel_for(wheel_dir: str, req: str) -> str | None:
    name, ver = req.split("==")
    stem = name.replace("-", "_").lower() + "-" + ver + "-"
    for w in sorted(os.listdir(wheel_dir)):
        if w.lower().startswith(stem) and w.endswith(".whl") and ("cp312" in w or "abi3" in w or w.endswith("-none-any.whl")):
            return w
    return None


def _xz_tar(members, out_path: str) -> None:
    """members: [(arcname, bytes, mode)] -> a .tar.xz."""
    with lzma.open(out_path, "wb", preset=9) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for name, data, mode in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode or 0o644
            tar.addfile(info, io.BytesIO(data))


def build(wheel_dir: str, out: str) -> dict:
    os.makedirs(wheel_dir, exist_ok=True)
    vllm_whl = _wheel_for(wheel_dir, VLLM)
    if vllm_whl is None:
        _pip_download(wheel_dir, [VLLM], py312=False)
        vllm_whl = _wheel_for(wheel_dir, VLLM)
    missing = [r for r in EXTRA_WHEELS if _wheel_for(wheel_dir, r) is None]
    if missing:
        _pip_download(wheel_dir, missing, py312=True)
    extras = []
    for r in EXTRA_WHEELS:
        w = _wheel_for(wheel_dir, r)
        if w is None:
            raise SystemExit(f"pack: no cp312 wheel for {r} in {wheel_dir}")
        extras.append(w)

    work = os.path.join(out, "build")
    os.makedirs(work, exist_ok=True)
    tree, libs = [], []
    with zipfile.ZipFile(os.path.join(wheel_dir, vllm_whl)) as z:
        names = set(z.namelist())
        absent = [n for n in LIBS if n not in names]
        if absent:
            raise SystemExit(f"pack: {vllm_whl} lacks {absent}")
        for info in z.infolist():
            n = info.filename
            if n.endswith("/") or n.endswith(".so") or any(n.startswith(p) for p in LEFT_OUT):
                if n in LIBS:
                    libs.append((n, z.read(n), (info.external_attr >> 16) & 0o777))
                continue
            tree.append((n, z.read(n), (info.external_attr >> 16) & 0o777))
    print(f"vtree: {len(tree)} files, {sum(len(d) for _, d, _ in tree) / 2**20:.1f} MiB; "
          f"libs: {len(libs)} files, {sum(len(d) for _, d, _ in libs) / 2**20:.1f} MiB")
    key = hashlib.sha256((vllm_whl + json.dumps(LIBS) + json.dumps(LEFT_OUT)).encode()).hexdigest()
    stamp = os.path.join(work, "built-from")
    if not (os.path.exists(stamp) and open(stamp).read() == key):  # xz -9 of 245 MB takes minutes
        print("compressing (a few minutes)", flush=True)
        _xz_tar(tree, os.path.join(work, "vtree.tar.xz"))
        _xz_tar(libs, os.path.join(work, "libs.tar.xz"))
        with open(stamp, "w") as f:
            f.write(key)

    # Call 1 carries vtree + wheels (so its probe already imports vLLM) and the first
    # libs chunk; the other calls carry equal chunks, the last one leaving room for the
    # dsv4 extension (:data:`SO_BUDGET`).
    small = [("vtree.tar.xz", os.path.join(work, "vtree.tar.xz"))] + [(w, os.path.join(wheel_dir, w)) for w in extras]
    small_size = sum(os.path.getsize(p) for _, p in small)
    lib_size = os.path.getsize(os.path.join(work, "libs.tar.xz"))
    first = max(PART_BUDGET - small_size, 0)
    rest = lib_size - first
    n_rest = 1
    while (n_rest - 1) * PART_BUDGET + (PART_BUDGET - SO_BUDGET) < rest:
        n_rest += 1
    each = -(-rest // n_rest)
    sizes = [first] + [each] * n_rest
    chunks, calls = [], [list(small)]
    with open(os.path.join(work, "libs.tar.xz"), "rb") as f:
        for i, n in enumerate(sizes):
            b = f.read(n)
            if not b:
                break
            name = f"libs.tar.xz.part{i:02d}"
            with open(os.path.join(work, name), "wb") as g:
                g.write(b)
            chunks.append(name)
            if i == 0:
                calls[0].append((name, os.path.join(work, name)))
            else:
                calls.append([(name, os.path.join(work, name))])
    manifest = {"vllm": VLLM.split("==")[1], "calls": len(calls),
                "parts": {name: {"sha256": _sha(path), "call": k + 1}
                          for k, c in enumerate(calls) for name, path in c},
                "wheels": extras, "lib_chunks": chunks}
    for old in os.listdir(out):
        if old[:1] == "p" and old[1:].isdigit():
            shutil.rmtree(os.path.join(out, old))
    for k, c in enumerate(calls):
        d = os.path.join(out, f"p{k + 1}")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        for name, path in c:
            shutil.copyfile(path, os.path.join(d, name))
        with open(os.path.join(d, "parts.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        total = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
        print(f"{d}: {len(c)} files, {total / 2**20:.1f} MiB")
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel-dir", default=".devbuild/serve/wheels")
    ap.add_argument("--out", default=".devbuild/serve")
    args = ap.parse_args(argv)
    m = build(args.wheel_dir, args.out)
    n = m["calls"]
    so = "dsv4/_C.abi3.so"
    print(f"\nDevice calls (back to back: the machine keeps /tmp only while warm, 30 s after a call):")
    for k in range(1, n + 1):
        last = k == n
        cmd = f"python3 scripts/gpu_serve_smoke.py stage {args.out}/p{k}"
        cmd += (" && python3 scripts/gpu_serve_smoke.py probe && python3 scripts/gpu_serve_smoke.py run --out $OUT"
                " --budget 480" if last else
                " && python3 scripts/gpu_serve_smoke.py probe --out $OUT")
        carry = [f"{args.out}/p{k}"] + ([so] if last else [])
        print(f"  {k}. command: {cmd}\n     carry: {json.dumps(carry)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
