"""Packs vLLM 0.33.0 for the GPU machine (no vLLM, no package index, 64 MiB per call):
the parts that ``scripts/gpu_serve_smoke.py stage`` unpacks into /tmp there.

    python scripts/pack_vllm_for_device.py [--wheel-dir .devbuild/serve/wheels] [--out .devbuild/serve]

What it makes (all under ``--out``, gitignored ``.devbuild/``), from the wheels in
``--wheel-dir`` (``pip download``-ed there first if missing: the vllm==0.33.0 wheel and
the cp312 manylinux wheels of :data:`EXTRA_WHEELS` and :data:`LIB_WHEELS`):

* ``vtree.tar.xz``: the vllm wheel's files without its compiled libraries, its Rust
  frontend binary (``vllm/vllm-rs``) and its SM100-only FMHA sources
  (``vllm/third_party/fmha_sm100/``); with DeepGEMM's JIT headers
  (``vllm/third_party/deep_gemm/include``, needed: DeepGEMM compiles its kernels with the
  machine's nvcc at first use) and ``vllm-0.33.0.dist-info`` (the plugin reads vLLM's
  version from it). About 8.5 MB.
* ``libs.tar.xz`` in chunks: the compiled libraries of :data:`LIBS` (vLLM's own
  kernels, the MoE library, FlashMLA, DeepGEMM's host library, ...) and every file of
  the :data:`LIB_WHEELS` (the CuTe DSL's compiler and runtime), about 172 MB
  compressed; vLLM's are built on torch's stable C ABI and load on torch 2.11 (every
  torch symbol they import is exported by torch 2.11.0's libraries).
* the extra wheels, as they are (zips).

They are spread over ``p1`` .. ``pN`` by :func:`layout` (each call's parts within
:data:`PART_BUDGET`, the last one's with the dsv4 extension), each with a ``parts.json``
naming every part of the set with its sha256, so ``stage`` knows when the set is
complete. The last call carries ``pN`` and the dsv4 extension (``dsv4/_C.abi3.so``,
~14 MB) and runs the smoke. The device-call sequence is printed at the end.

The CuTe DSL (``nvidia-cutlass-dsl[cu13]==4.8.0``, vLLM 0.33.0's pin), what it needs at
run time, as read in its 4.8.0 wheels (``cutlass/_mlir/_mlir_libs/__init__.py``,
``cutlass/base_dsl/env_manager.py``, ``cutlass/runtime.py``) and checked on a CPU machine:

* vLLM needs it on CUDA: ``models/deepseek_v4/compressor.py:473`` runs the CuTe DSL
  compressor for head_dim 512 with no Triton fallback, and ``has_cutedsl()`` (cutlass
  importable) turns on more CuTe DSL kernels (indexer q, K-cache gather, the router's
  low-latency GEMMs); every one of them also imports ``quack.compile_utils``
  (``quack-kernels==0.6.5``, pure Python) and ``cuda.bindings.driver``.
* Wheels: ``nvidia-cutlass-dsl`` (only a ``.pth`` putting ``nvidia_cutlass_dsl/dsl_packages``
  on sys.path, and metadata), ``-libs-base`` and ``-libs-core`` (the ``cutlass`` Python
  package), ``-libs-cu13`` (the compiler ``_cutlass_ir.cu13.*.so`` with LLVM, libNVVM and
  the PTX compiler library linked in, 184 MB, and ``cu13/lib/libcute_dsl_runtime.so``,
  42 MB; 88 MB as a zip, 61 MB in xz). ``-libs-cu12`` is a hard requirement of the
  metadata only: the loader (``_select_and_load_cutlass_ir_toolkit``) takes every
  ``_cutlass_ir.cu{N}`` it finds next to it and picks the newest N the driver supports,
  so cu13 alone is chosen on the CUDA 13 driver; no environment variable is involved.
  The runtime library is found by walking up from ``env_manager.py`` to
  ``nvidia_cutlass_dsl/cu13/lib`` (``CUTE_DSL_LIBS`` overrides), so the wheels' layout is
  kept as it is under the staged site folder.
* The image has the rest (``.library/device/KINDS.md``; torch 2.11.0+cu130 itself
  requires ``cuda-bindings>=13.0.3,<14`` and ``typing-extensions>=4.10``): cuda-bindings
  (``driver``, ``runtime``, ``nvrtc`` are imported), typing-extensions, protobuf (a
  metadata requirement only: no Python file of the DSL imports it), einops, numpy.
  ``torch-c-dlpack-ext`` (quack's requirement) is not needed: apache-tvm-ffi skips it
  when ``torch.Tensor`` has ``__dlpack_c_exchange_api__``, which torch 2.11 has.
* The JIT needs no nvcc, ptxas or CUDA_HOME: the compiler library lowers to PTX and
  assembles it in process (a compile of vLLM's C128 compressor kernel with fake tensors
  succeeded on a machine without a GPU, nvcc off PATH, no CUDA_HOME, and ran no
  program); CUDA_HOME / nvdisasm matter only for SASS dumps. At run time it needs the
  driver (``libcuda.so.1``) and apache-tvm-ffi (vLLM compiles with ``--enable-tvm-ffi``).
  The cu13 build is CUDA 13.4 and the H200's driver 580 is CUDA 13.0: the loader only
  asks for the same major; that its modules load and run on that driver is what the
  probe's ``cute_dsl_check`` (a small kernel compiled and run there) shows.
* Staged here from the parts into a temporary folder and imported with Python 3.12 and
  the children's PYTHONPATH: ``cutlass`` came from ``site/nvidia_cutlass_dsl/dsl_packages``,
  loaded ``_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so`` and found the runtime
  library under ``site/nvidia_cutlass_dsl/cu13/lib``.
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
# what the offline engine on Hopper never imports and is large: FlashInfer, TileLang, z3,
# tokenspeed, cuda-tile / cuda-python (the image has cuda-bindings), NCCL's Python
# bindings (one GPU), cuDNN's frontend, video codecs, fastsafetensors, instanttensor,
# OpenTelemetry, MCP, anthropic, supervisor, mistral-common (the tokenizer is not
# initialised); docs/vllm-lazy-imports.md lists where vLLM imports those lazily
# and why this configuration does not get there. The CuTe DSL's Python packages and quack
# are here, its compiled libraries in :data:`LIB_WHEELS` (the module docstring says why
# each). An import by name alone found too few: openai's sniffio was missing on the
# machine (``stage`` skips a wheel whose distribution the image has).
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
    "nvidia-cutlass-dsl==4.8.0", "nvidia-cutlass-dsl-libs-base==4.8.0", "nvidia-cutlass-dsl-libs-core==4.8.0",
    "quack-kernels==0.6.5",
)
# Wheels of compiled libraries whose files go into ``libs.tar.xz`` as they lie in the
# wheel (dist-info too), not as zips: the CuTe DSL's compiler and runtime, 88 MB as a
# zip, 61 MB in xz (one call less).
LIB_WHEELS = ("nvidia-cutlass-dsl-libs-cu13==4.8.0",)
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
CALL_LIMIT = 64 * 2**20  # what one device call carries: the working tree and the carry list
TREE_BUDGET = 8 * 2**20  # the repo's tracked files (~2.8 MB) and untracked ones, with room
PART_BUDGET = CALL_LIMIT - TREE_BUDGET  # one call's parts (56 MiB)
SO_BUDGET = 20 * 2**20  # the dsv4 extension the last call also carries (15.7 MB at 9dee17b), with room to grow


def layout(small_size: int, lib_size: int, part_budget: int = PART_BUDGET, so_budget: int = SO_BUDGET) -> list[int]:
    """The bytes of ``libs.tar.xz`` each call carries, one entry a call: call 1 carries the
    small files (``vtree.tar.xz`` and the wheels, ``small_size`` bytes, so that its probe
    already imports vLLM) and fills up with libraries; the other calls share the rest in
    proportion to their room (``part_budget``, less ``so_budget`` for the last, which also
    carries the dsv4 extension). The one definition of the part layout."""
    if small_size > part_budget:
        raise SystemExit(f"pack: the small files ({small_size / 2**20:.1f} MiB) exceed one call")
    if small_size + lib_size <= part_budget - so_budget:
        return [lib_size]
    # call 1 fills up; when all but the extension would fit there, call 2 takes half the libraries
    first = part_budget - small_size if small_size + lib_size > part_budget else lib_size // 2
    rest = lib_size - first
    n = 1
    while (n - 1) * part_budget + (part_budget - so_budget) < rest:
        n += 1
    room = [part_budget] * (n - 1) + [part_budget - so_budget]
    sizes = [rest * r // sum(room) for r in room]
    sizes[-1] += rest - sum(sizes)  # rounding, a few bytes
    return [first] + sizes


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
    missing = [r for r in EXTRA_WHEELS + LIB_WHEELS if _wheel_for(wheel_dir, r) is None]
    if missing:
        _pip_download(wheel_dir, missing, py312=True)
    extras, lib_wheels = [], []
    for reqs, found in ((EXTRA_WHEELS, extras), (LIB_WHEELS, lib_wheels)):
        for r in reqs:
            w = _wheel_for(wheel_dir, r)
            if w is None:
                raise SystemExit(f"pack: no cp312 wheel for {r} in {wheel_dir}")
            found.append(w)

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
    for w in lib_wheels:
        with zipfile.ZipFile(os.path.join(wheel_dir, w)) as z:
            libs += [(i.filename, z.read(i), (i.external_attr >> 16) & 0o777) for i in z.infolist()
                     if not i.filename.endswith("/")]
    print(f"vtree: {len(tree)} files, {sum(len(d) for _, d, _ in tree) / 2**20:.1f} MiB; "
          f"libs: {len(libs)} files, {sum(len(d) for _, d, _ in libs) / 2**20:.1f} MiB")
    key = hashlib.sha256((vllm_whl + json.dumps(LIBS) + json.dumps(LEFT_OUT) + json.dumps(lib_wheels)).encode()).hexdigest()
    stamp = os.path.join(work, "built-from")
    if not (os.path.exists(stamp) and open(stamp).read() == key):  # xz -9 of 480 MB takes ~10 minutes
        print("compressing (about ten minutes)", flush=True)
        _xz_tar(tree, os.path.join(work, "vtree.tar.xz"))
        _xz_tar(libs, os.path.join(work, "libs.tar.xz"))
        with open(stamp, "w") as f:
            f.write(key)

    small = [("vtree.tar.xz", os.path.join(work, "vtree.tar.xz"))] + [(w, os.path.join(wheel_dir, w)) for w in extras]
    sizes = layout(sum(os.path.getsize(p) for _, p in small), os.path.getsize(os.path.join(work, "libs.tar.xz")))
    chunks, calls = [], []
    with open(os.path.join(work, "libs.tar.xz"), "rb") as f:
        for i, n in enumerate(sizes):
            name = f"libs.tar.xz.part{i:02d}"
            with open(os.path.join(work, name), "wb") as g:
                g.write(f.read(n))
            chunks.append(name)
            calls.append((small if i == 0 else []) + [(name, os.path.join(work, name))])
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
        # parts.json (~12 KB) travels in TREE_BUDGET's room
        if sum(os.path.getsize(p) for _, p in c) > PART_BUDGET - (SO_BUDGET if k == len(calls) - 1 else 0):
            raise SystemExit(f"pack: {d} exceeds its call's budget")
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
        if k == 1 or last:  # the Python files are there after call 1, the libraries after the last
            cmd += " && python3 scripts/gpu_serve_smoke.py probe --out $OUT"
        if last:  # a call may take 600 s: staging the libraries and the probe take ~1-2 minutes of them
            cmd += " && python3 scripts/gpu_serve_smoke.py run --out $OUT --budget 450"
        carry = [f"{args.out}/p{k}"] + ([so] if last else [])
        size = sum(os.path.getsize(os.path.join(args.out, f"p{k}", f)) for f in os.listdir(os.path.join(args.out, f"p{k}")))
        size += os.path.getsize(so) if last and os.path.exists(so) else 0
        print(f"  {k}. command: {cmd}\n     carry: {json.dumps(carry)}  ({size / 2**20:.1f} MiB"
              f"{'' if not last or os.path.exists(so) else ' + the extension, not built here'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
