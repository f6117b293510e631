"""vLLM 0.33.0's engine with the dsv4 plugin on the GPU machine (issue 35): stage, probe, run.

The GPU machine has torch 2.11.0+cu130, Python 3.12, nvcc 13.0 and triton 3.6.0, but no
vLLM and no package index, and a call carries at most 64 MiB. ``scripts/pack_vllm_for_device.py``
(run here) makes the parts; this script, run there from the repo root, stages them in
``/tmp/dsv4-serve`` (kept while the machine is warm) and runs the smoke.

What is carried (``pack_vllm_for_device.py`` prints the exact calls):

* the vllm==0.33.0 wheel's Python files, its dist-info and DeepGEMM's JIT headers
  (``vtree.tar.xz``, ~8.5 MB);
* compiled libraries (``libs.tar.xz`` in chunks, ~174 MB in all): vLLM's that DeepSeek V4
  on Hopper uses: ``_C_stable_libtorch`` (vLLM's kernels), ``_moe_C_stable_libtorch``
  (routing, Marlin MoE), ``_flashmla_C`` + ``_flashmla_extension_C`` (FlashMLA sparse, the
  reference backend), ``_deepselect_C`` (indexer top-k), DeepGEMM's host library
  (indexer logits, the o_proj ``fp8_einsum``, the mHC GEMM; it JIT-compiles with the
  machine's nvcc), three small helpers; and the CuTe DSL's compiler and runtime (the
  ``nvidia-cutlass-dsl-libs-cu13`` wheel's files, ~61 MB: on CUDA, vLLM's DeepSeek V4
  compressor for head_dim 512 is a CuTe DSL kernel with no fallback, and with the DSL
  there vLLM also takes its CuTe DSL indexer-q, K-gather and router kernels; the pack
  script's docstring says what the DSL needs: no nvcc, its own PTX compiler);
* the cp312 wheels of what the engine may import and the image lacks (55, ~29 MB: the
  closure of vLLM's requirements less the image's packages and less what the offline
  engine never imports, listed in ``pack_vllm_for_device.py``, with the CuTe DSL's Python
  packages and quack); ``stage`` unpacks only those whose distribution the image does not
  already have; transformers, tokenizers, huggingface_hub, safetensors, numpy, triton,
  cuda-bindings are the image's own;
* the dsv4 extension ``dsv4/_C.abi3.so`` (~16 MB, built by the lead with /work/dvenv),
  with the last call.

Four calls (``pack_vllm_for_device.layout``), back to back: ``stage p1 && probe`` (vLLM's
Python files and the wheels are there: the probe shows a missing Python package),
``stage p2``, ``stage p3``, ``stage p4 && probe && run`` (the libraries are there); the
probe prints what is still missing, so a failed import costs no engine run; once the
libraries are there it also compiles one of vLLM's
CuTe DSL kernels (the C128 compressor, fake tensors) and compiles and runs a small one
(:func:`cute_dsl_check`), so a DSL that cannot JIT or load on the driver shows before any
engine starts.

``stage`` also runs the staged ``.pth`` files as site.py would (the CuTe DSL's puts
``nvidia_cutlass_dsl/dsl_packages``, where ``cutlass`` lives, on sys.path): Python reads
``.pth`` files only in site folders, never in PYTHONPATH entries, so the paths they add
are kept in ``site/.pth-paths.json`` and put on every vLLM process's path by
:func:`child_env` (PYTHONPATH, inherited by the model registry's subprocess) and again
by the staged vLLM plugin (:func:`vllm_plugin`, loaded by every vLLM process).

Left out of vLLM, and why: FlashAttention 2/3 (480 MB; DeepSeek V4 attends through FlashMLA
or dsv4); the Kimi delta-attention and QuTLASS libraries (other models); the Rust frontend
``vllm-rs`` (``vllm serve`` only; the engine is the same); SM100 FMHA sources; TileLang
(210 MB with TVM; vLLM's DeepSeek V4 CUDA model runs its mHC (hyper-connection) mixing
through TileLang kernels: replaced below); FlashInfer (every FlashInfer import on this
configuration's path is behind ``has_flashinfer()``, an opt-in backend, SM100/SM120, or
the sampler switch of workaround 3: docs/vllm-lazy-imports.md lists each lazy
import of the DeepSeek V4 / V4.1 CUDA paths with its guard); the CuTe DSL's cu12 flavour
(the DSL loads any ``_cutlass_ir.cu{N}`` present and picks the newest the driver takes).

Workarounds, in this script only (never in dsv4), applied in each engine's process before
the model is built:

1. mHC without TileLang: the names vLLM's V4 / V4.1 CUDA model modules call
   (``mhc_pre_tilelang``, ``mhc_post_tilelang``, ``mhc_fused_post_pre_tilelang``,
   ``mhc_pre_broadcast_tilelang``, ``hc_head_fused_kernel_tilelang``,
   ``mhc_pre_delayed_tilelang``, ``mhc_fused_post_pre_delayed_tilelang``) are rebound to
   vLLM's own torch references (``vllm/model_executor/kernels/mhc/torch.py``) plus the
   fused RMSNorm the TileLang kernels apply; ``kernel_config.enable_jit_warmup=False``
   (its warmups compile TileLang). Both attention backends and both MoE paths run the same
   replacement, so the A/B comparisons are unaffected.
2. ``vllm.vllm_flash_attn`` without FlashAttention's libraries: its package ``__init__``
   raises ImportError without them, and vLLM imports it on every CUDA path (the attention
   layers, the model loader, the fused-MoE package), so the package is registered without
   that check (:func:`flash_attn_without_kernels`); DeepSeek V4 attends through FlashMLA or
   dsv4, and a call into FlashAttention would fail with vLLM's own error, in the log.
3. FlashInfer's sampler off (``VLLM_USE_FLASHINFER_SAMPLER=0``, :func:`child_env`): FlashInfer
   is not carried, and vLLM's GPU sampler imports its backend when the model runner is built
   (``vllm/v1/sample/ops/topk_topp_sampler.py``); the smoke samples greedily, which vLLM's
   own PyTorch sampler does, the same for every configuration.
4. torch 2.11 vs vLLM's pinned 2.14: none needed at import (every engine, worker and
   DeepSeek V4 module imports on 2.11 with the carried wheels); any found at run time is
   added to :func:`apply_workarounds` and listed here.
5. ``VLLM_DEEP_GEMM_WARMUP=skip`` (:func:`child_env`): vLLM's default warmup JIT-compiles
   576 DeepGEMM kernels with the machine's nvcc before the first request; on the H200 the
   first configuration spent its whole 240 s in it (2026-12-05) while the later ones found
   the cache warm. Skipped, each kernel compiles at its first use, the same for every
   configuration.
6. ``language_model_only=True``: the V4.1 model is vLLM's vision-language class, whose
   multimodal processor requires a tokenizer (``skip_tokenizer_init`` raised "requires a
   tokenizer" on the H200); the examples have none, and the smoke sends token ids only.
   vLLM's own switch (``--language-model-only``: every modality limit 0) builds no
   processor; it does not change the language model. Harmless for V4 (no multimodal
   config).

The engine: ``vllm.LLM`` (the engine ``vllm serve`` runs), in-process engine core
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), dummy weights (``load_format="dummy"``, seeded),
``skip_tokenizer_init``, prompts as token ids (lengths 7, 300 and 1500: decode and
prefill, the 1500-token one past the indexer's top-k 512 on the ratio-1 and ratio-4
layers), greedy, 8 new tokens, top-5 logprobs per step. Configurations: each example x
{dsv4, vLLM's FlashMLA sparse backend (``FLASHMLA_SPARSE_DSV4`` / ``FLASHMLA_SPARSE_DSV41``)}
x {CUDA graphs (default), ``enforce_eager``}, then dsv4 with ``DSV4_MOE=0`` (vLLM's MoE),
then the V4 example with MXFP4 experts (:func:`example_dir`) through dsv4's W4A8
(``DSV4_MOE_MXFP4=1``) and through vLLM's (``0``), each in its own process. Output: token
ids per configuration, agreement between pairs (identical tokens, first-step logprob max
|diff| over the tokens both top-5 sets hold, and at each prompt's first divergence each
run's logprob margin for its own token over the other's), a summary table,
``$OUT/serve_smoke.json`` and ``$OUT/serve_logs.txt``. A configuration takes 40-110 s on
the H200 (engine start 43-110 s, the first one of a machine the longest: JIT caches);
``--jobs 2`` runs two engines at once on the GPU (each takes a quarter of its memory); a
configuration whose engine fails at start from the other engine's memory traffic
(:data:`SHARED_GPU_ERRORS`) runs again alone after the others.

    python3 scripts/gpu_serve_smoke.py stage DIR      # copy DIR's parts to /tmp; unpack when complete
    python3 scripts/gpu_serve_smoke.py probe --out $OUT
    python3 scripts/gpu_serve_smoke.py run --out $OUT [--only NAME,...] [--budget 500] [--jobs 1|2|3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGE = "/tmp/dsv4-serve"
SITE = os.path.join(STAGE, "site")
EXAMPLES = {"v4": os.path.join(ROOT, "examples", "dsv4-tiny-nvfp4"),
            "v41": os.path.join(ROOT, "examples", "dsv41-tiny-nvfp4"),
            "v4mx": os.path.join(STAGE, "examples", "dsv4-tiny-mxfp4")}  # made by example_dir
FLASHMLA = {"v4": "FLASHMLA_SPARSE_DSV4", "v41": "FLASHMLA_SPARSE_DSV41"}
PROMPT_LENS = (7, 300, 1500)
MAX_TOKENS = 8
LOGPROBS = 5
PROBE_MODULES = (
    "pydantic", "msgspec", "zmq", "vllm", "vllm.config", "vllm.entrypoints.llm", "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
    "vllm.models.deepseek_v4.nvidia.model", "vllm.models.deepseek_v41.nvidia.vl_model",
    "vllm.models.deepseek_v4.sparse_mla", "vllm.models.deepseek_v41.sparse_mla",
    "vllm.model_executor.layers.quantization.modelopt", "vllm.model_executor.layers.quantization.fp8",
    "vllm.model_executor.layers.quantization.mxfp4", "vllm.model_executor.model_loader.dummy_loader",
    "vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch", "vllm._flashmla_C", "vllm._deepselect_C",
    "vllm.third_party.deep_gemm", "humming", "dsv4._C", "dsv4_plugin.attention_v4", "dsv4_plugin.attention_v41",
    "dsv4_plugin.moe",
    # the CuTe DSL and the vLLM modules of its kernels this configuration reaches
    # (docs/vllm-lazy-imports.md): imported lazily by vLLM, so only the probe
    # shows a missing piece before an engine run does
    "cutlass", "cutlass.cute", "quack.compile_utils", "cuda.bindings.driver",
    "vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl",
    "vllm.models.deepseek_v4.nvidia.ops.dequant_gather_k_cutedsl",
    "vllm.models.deepseek_v4.nvidia.ops.fused_indexer_q_cutedsl",
    "vllm.model_executor.kernels.linear.cute_dsl._ll_bf16_dotprod",
    "vllm.model_executor.kernels.linear.cute_dsl._ll_bf16_splitk",
)
PTH_PATHS = ".pth-paths.json"  # in SITE: the sys.path entries the staged .pth files add (stage)


def site_paths() -> list[str]:
    """The staged site folder and the paths its ``.pth`` files add (``stage`` ran them), in
    sys.path order: Python does not read ``.pth`` files in PYTHONPATH entries."""
    try:
        with open(os.path.join(SITE, PTH_PATHS)) as f:
            added = json.load(f)
    except FileNotFoundError:
        added = []
    return [SITE] + [p for p in added if p != SITE]


def add_site_paths() -> list[str]:
    """Puts :func:`site_paths` on this process's sys.path where missing (after the site
    folder if it is there); returns what it added."""
    added = []
    for p in site_paths():
        if p not in sys.path:
            at = sys.path.index(SITE) + 1 if SITE in sys.path else 0
            sys.path.insert(at, p)
            added.append(p)
    return added


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    paths = site_paths() + [ROOT, os.path.join(ROOT, "scripts")]  # scripts: this module, the smoke's vLLM plugin
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cache = os.path.join(STAGE, "cache")
    env.update({
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: the patches below apply
        "VLLM_CACHE_ROOT": os.path.join(cache, "vllm"),  # torch.compile artifacts, kept while warm
        "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
        "DG_JIT_CACHE_DIR": os.path.join(cache, "deep_gemm"),
        "CUTE_DSL_CACHE_DIR": os.path.join(cache, "cute_dsl"),
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",  # FlashInfer is not carried: workaround 3 of the module docstring
        "VLLM_DEEP_GEMM_WARMUP": "skip",  # workaround 5 of the module docstring
    })
    if not env.get("CUDA_HOME"):
        nvcc = shutil.which("nvcc")
        env["CUDA_HOME"] = os.path.dirname(os.path.dirname(nvcc)) if nvcc else "/usr/local/cuda"
    env.update(extra or {})
    return env


# ----------------------------------------------------------------------------- stage


def _sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def _installed(wheel: str) -> bool:
    """Whether the machine's Python already has the wheel's distribution (any version): its
    own stays, so that the carried one never shadows what the image's packages were built with."""
    import importlib.metadata as md

    try:
        md.distribution(wheel.split("-")[0])
        return True
    except md.PackageNotFoundError:
        return False


def _anchor_manifest(version: str) -> None:
    """Makes the staged tree a folder of the benchmarks' anchors (dsv4.bench.anchors: its
    MANIFEST.json naming vLLM's version), so that the MoE side-by-side finds vLLM's kernel
    library there (``DSV4_ANCHORS=.anchors:/tmp/dsv4-serve/site``) without staging it again."""
    sys.path.insert(0, ROOT)
    from dsv4.bench.anchors import VLLM_VERSION, write_manifest

    if version != VLLM_VERSION:
        print(f"stage: the parts are vLLM {version}, the benchmarks expect {VLLM_VERSION}: no anchor manifest")
        return
    libs = []
    for d, _, files in os.walk(os.path.join(SITE, "vllm")):
        libs += [os.path.relpath(os.path.join(d, f), SITE) for f in files if f.endswith(".so")]
    write_manifest(SITE, {"vllm": version}, [(n, os.path.getsize(os.path.join(SITE, n))) for n in sorted(libs)])


def _write_pth_paths() -> list[str]:
    """Runs the staged ``.pth`` files as site.py runs a site folder's (a line naming a
    folder adds it, an ``import`` line is executed: the CuTe DSL's inserts
    ``nvidia_cutlass_dsl/dsl_packages``), in a clean interpreter (``-I -S``), and writes
    the sys.path entries they add to ``SITE/.pth-paths.json`` for :func:`site_paths`."""
    code = ("import json, site, sys; before = list(sys.path); site.addsitedir(sys.argv[1]); "
            "print(json.dumps([p for p in sys.path if p not in before and p != sys.argv[1]]))")
    p = subprocess.run([sys.executable, "-I", "-S", "-c", code, SITE], capture_output=True, text=True)
    if p.returncode != 0:
        print(f"stage: the staged .pth files failed: {p.stderr.strip()[-2000:]}")
        added = []
    else:
        added = json.loads(p.stdout.strip().splitlines()[-1])
    with open(os.path.join(SITE, PTH_PATHS), "w") as f:
        json.dump(added, f)
    return added


def _parts_key(man: dict, names) -> str:
    return hashlib.sha256(json.dumps([man["parts"][n]["sha256"] for n in names]).encode()).hexdigest()


def _stamped(path: str, key: str) -> bool:
    try:
        with open(path) as f:
            return f.read() == key
    except FileNotFoundError:
        return False


def cmd_stage(args) -> int:
    with open(os.path.join(args.dir, "parts.json")) as f:
        man = json.load(f)
    parts = os.path.join(STAGE, "parts")
    os.makedirs(parts, exist_ok=True)
    for name, meta in man["parts"].items():
        src = os.path.join(args.dir, name)
        if os.path.exists(src):
            if _sha(src) != meta["sha256"]:
                print(f"stage: {name} is corrupt (sha256 differs)")
                return 1
            shutil.copyfile(src, os.path.join(parts, name))
    # by content: a warm machine may hold another pack's parts of the same names
    have = {n for n, meta in man["parts"].items()
            if os.path.exists(os.path.join(parts, n)) and _sha(os.path.join(parts, n)) == meta["sha256"]}
    missing = sorted(set(man["parts"]) - have)
    if missing:
        calls = sorted({man["parts"][n]["call"] for n in missing})
        print(f"stage: {len(have)}/{len(man['parts'])} parts in {parts}; still to carry: calls {calls} "
              f"({', '.join(missing)})")
    t = time.time()
    py_ready, libs_ready = os.path.join(SITE, ".python-ready"), os.path.join(SITE, ".libs-ready")
    # each stamp holds the sha256 of its parts: a machine still warm from another pack's
    # staging unpacks this one's again instead of keeping the other's
    py_key = _parts_key(man, ["vtree.tar.xz", *man["wheels"]])
    libs_key = _parts_key(man, man["lib_chunks"])
    if {"vtree.tar.xz", *man["wheels"]} <= have and not _stamped(py_ready, py_key):
        shutil.rmtree(SITE, ignore_errors=True)
        os.makedirs(SITE)
        with tarfile.open(os.path.join(parts, "vtree.tar.xz"), "r:xz") as tar:
            tar.extractall(SITE, filter="data")
        skipped = []
        for w in man["wheels"]:
            if _installed(w):
                skipped.append(w.split("-")[0])
                continue
            with zipfile.ZipFile(os.path.join(parts, w)) as z:
                for info in z.infolist():
                    z.extract(info, SITE)
                    mode = (info.external_attr >> 16) & 0o777
                    if mode:
                        os.chmod(os.path.join(SITE, info.filename), mode)
        # dsv4 is not pip-installed there: a dist-info on the path gives vLLM's plugin loader
        # one general plugin, the smoke's vllm_plugin, which every vLLM process loads (the
        # model registry's inspection subprocess too, which no patch of ours reaches
        # otherwise). It applies the flash-attn workaround and then calls dsv4's entry point
        # of pyproject.toml (dsv4_plugin:register): as two entry points, dsv4's ran first and
        # its model import failed in that subprocess (vLLM loads them in discovery order).
        di = os.path.join(SITE, "dsv4-0.0.0+smoke.dist-info")
        os.makedirs(di, exist_ok=True)
        with open(os.path.join(di, "METADATA"), "w") as f:
            f.write("Metadata-Version: 2.1\nName: dsv4\nVersion: 0.0.0+smoke\n")
        with open(os.path.join(di, "entry_points.txt"), "w") as f:
            f.write("[vllm.general_plugins]\ndsv4 = gpu_serve_smoke:vllm_plugin\n")
        pth = _write_pth_paths()
        with open(py_ready, "w") as f:
            f.write(py_key)
        print(f"stage: vLLM's Python files and the wheels unpacked into {SITE} ({time.time() - t:.0f} s); "
              f"the image already has {skipped or 'none of them'}; the .pth files add {pth or 'nothing'}")
    if set(man["lib_chunks"]) <= have and _stamped(py_ready, py_key) and not _stamped(libs_ready, libs_key):
        joined = os.path.join(STAGE, "libs.tar.xz")
        with open(joined, "wb") as out:
            for c in man["lib_chunks"]:
                with open(os.path.join(parts, c), "rb") as f:
                    shutil.copyfileobj(f, out)
        with lzma.open(joined) as xz, tarfile.open(fileobj=xz, mode="r|") as tar:
            tar.extractall(SITE, filter="data")
        os.remove(joined)
        _anchor_manifest(man["vllm"])
        with open(libs_ready, "w") as f:
            f.write(libs_key)
        print(f"stage: vLLM's libraries unpacked ({time.time() - t:.0f} s); {SITE} is also a benchmark "
              f"anchor folder (DSV4_ANCHORS)")
    py_ok = _stamped(py_ready, py_key)
    print(f"stage: python {'ready' if py_ok else 'not ready'}, "
          f"libraries {'ready' if py_ok and _stamped(libs_ready, libs_key) else 'not ready'}")
    return 0


# ----------------------------------------------------------------------------- probe

_PROBE_CHILD = r"""
import importlib, json, os, sys, traceback
res = {"ok": [], "fail": {}, "missing": []}
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
try:
    import gpu_serve_smoke
    gpu_serve_smoke.flash_attn_without_kernels()  # as every configuration's process does
except BaseException as e:
    res["fail"]["flash_attn_without_kernels"] = f"{type(e).__name__}: {e}"
for m in sys.argv[1].split(","):
    try:
        importlib.import_module(m); res["ok"].append(m)
    except BaseException as e:
        tb = traceback.extract_tb(e.__traceback__)
        res["fail"][m] = f"{type(e).__name__}: {e} @ {tb[-1].filename}:{tb[-1].lineno}" if tb else repr(e)
        if isinstance(e, ModuleNotFoundError) and e.name and e.name not in res["missing"]:
            res["missing"].append(e.name)
try:
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    res["plugin_registered"] = "DSV4" in AttentionBackendEnum.__members__
except BaseException as e:
    res["plugin_registered"] = f"{type(e).__name__}: {e}"
try:  # the CuTe DSL: the toolkit flavour it loaded, its runtime library, one JIT compile
    import time
    import cutlass
    import cutlass._mlir._mlir_libs as mlir_libs
    from cutlass.base_dsl.env_manager import get_prefix_dsl_libs
    v = cutlass.CUDA_VERSION
    dsl = res["cute_dsl"] = {"cuda": f"{v.major}.{v.minor}", "compiler": os.path.basename(mlir_libs._cutlass_ir.__file__),
                             "runtime": get_prefix_dsl_libs("CUTE_DSL")}
    from vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl import (
        _SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL as kernel)
    t = time.time()
    kernel.compile(kernel.CompileKey(head_size=512, state_width=512))  # fake tensors: compile only
    dsl["compile_c128_s"] = round(time.time() - t, 1)
    dsl.update(gpu_serve_smoke.cute_dsl_check())
except BaseException as e:
    res["cute_dsl_error"] = f"{type(e).__name__}: {e}"[-2000:]
print("PROBE_JSON " + json.dumps(res))
"""


def cute_dsl_check(run: bool = True) -> dict:
    """One small CuTe DSL kernel (adds 1 to 32 floats) through vLLM's own compile path
    (``compile_cutedsl``: fake tensors, TVM-FFI, the caller's stream), then run on a CUDA
    tensor: the DSL's compiler, its runtime library and the driver together (the DSL is
    built with CUDA 13.4, the H200's driver 580 is CUDA 13.0), before an engine needs them.
    ``run=False`` compiles only (no GPU needed)."""
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings.driver import CUstream
    from quack.compile_utils import make_fake_tensor
    from vllm.model_executor.warmup.jit_warmup_cutedsl_helper import compile_cutedsl

    def add_one(x):
        tidx, _, _ = cute.arch.thread_idx()
        x[tidx] = x[tidx] + cutlass.Float32(1.0)

    def launch(x, stream):
        kernel(x).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    # annotations as objects: this module's are strings (``from __future__ import
    # annotations``), which the DSL would evaluate in the module's globals
    add_one.__annotations__ = {"x": cute.Tensor}
    launch.__annotations__ = {"x": cute.Tensor, "stream": CUstream}
    kernel, launch = cute.kernel(add_one), cute.jit(launch)
    t = time.time()
    fn = compile_cutedsl(launch, make_fake_tensor(cutlass.Float32, (32,), divisibility=4))
    out = {"compile_add_one_s": round(time.time() - t, 2)}
    if run:
        import torch

        x = torch.zeros(32, device="cuda")
        fn(x)
        torch.cuda.synchronize()
        out["add_one_ran"] = bool((x == 1).all())
    return out


def machine_facts() -> dict:
    facts = {"python": sys.version.split()[0], "nvcc": shutil.which("nvcc"), "xz": shutil.which("xz"),
             "staged": os.path.isdir(SITE)}
    for mod in ("torch", "triton", "numpy", "transformers", "tokenizers", "huggingface_hub", "safetensors"):
        try:
            facts[mod] = __import__(mod).__version__
        except Exception as e:
            facts[mod] = f"absent ({type(e).__name__})"
    try:
        import torch
        facts["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception as e:
        facts["gpu"] = repr(e)
    if facts["nvcc"]:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        facts["nvcc_version"] = out[-1] if out else "?"
    return facts


def cmd_probe(args) -> int:
    facts = machine_facts()
    print("machine:", json.dumps(facts))
    res = {"facts": facts}
    if facts["staged"]:
        p = subprocess.run([sys.executable, "-c", _PROBE_CHILD, ",".join(PROBE_MODULES)], env=child_env(),
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        line = [x for x in p.stdout.splitlines() if x.startswith("PROBE_JSON ")]
        res["imports"] = json.loads(line[-1][11:]) if line else {"error": p.stderr[-4000:]}
        imp = res["imports"]
        print(f"imports ok: {len(imp.get('ok', []))}/{len(PROBE_MODULES)}; missing modules: {imp.get('missing')}; "
              f"plugin registered: {imp.get('plugin_registered')}")
        for m, why in imp.get("fail", {}).items():
            print(f"  FAIL {m}: {why}")
        print(f"CuTe DSL: {imp.get('cute_dsl')}" + (f"; FAIL {imp['cute_dsl_error']}" if imp.get("cute_dsl_error") else ""))
        if "error" in imp:
            print(imp["error"])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


# ----------------------------------------------------------------------------- workarounds


def _rms(x, w, eps):
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w.float()).to(torch.bfloat16)


def flash_attn_without_kernels() -> None:
    """Registers ``vllm.vllm_flash_attn`` without its package ``__init__``'s check, which raises
    ImportError when neither FlashAttention library is there (left out: 480 MB). vLLM imports
    the package wherever it runs on CUDA (``fa_utils`` via the attention layers, the model
    loader, the fused-MoE package); its interface module loads without the libraries
    (``FA2_AVAILABLE = FA3_AVAILABLE = False``), so a call into FlashAttention, if any, fails
    there and shows in the run's log."""
    import importlib
    import importlib.machinery
    import types

    name = "vllm.vllm_flash_attn"
    if name in sys.modules:
        return
    import vllm

    d = os.path.join(os.path.dirname(vllm.__file__), "vllm_flash_attn")
    m = types.ModuleType(name)
    m.__path__, m.__package__ = [d], name
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    m.__spec__.submodule_search_locations = [d]
    sys.modules[name] = m
    vllm.vllm_flash_attn = m
    fi = importlib.import_module(name + ".flash_attn_interface")
    for n in ("FA2_AVAILABLE", "FA3_AVAILABLE", "compile_flash_attn_varlen_func_from_specs",
              "fa_version_unsupported_reason", "flash_attn_varlen_func", "get_scheduler_metadata",
              "is_fa_version_supported"):
        setattr(m, n, getattr(fi, n))


def vllm_plugin() -> None:
    """The staged vLLM general plugin: the staged ``.pth`` paths (the CuTe DSL's
    ``dsl_packages``; :func:`child_env` puts them on PYTHONPATH too, this covers a process
    started with another environment), the flash-attn workaround, then dsv4's own entry
    point (``dsv4_plugin:register``, pyproject.toml). vLLM loads general plugins in every
    process it starts, before it imports a model, and its model registry inspects a model's
    class in a fresh subprocess (``registry._run_in_subprocess``), where dsv4's registration
    imports the model and the ``vllm.vllm_flash_attn`` import would otherwise fail."""
    add_site_paths()
    flash_attn_without_kernels()
    import dsv4_plugin

    dsv4_plugin.register()


def apply_workarounds() -> list[str]:
    """Patches for what is not carried (see the module docstring); returns what was patched."""
    flash_attn_without_kernels()
    import torch
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch, mhc_pre_delayed_torch, mhc_pre_torch

    def pre(residual, fn, hc_scale, hc_base, rms_eps, pre_eps, sk_eps, post_mult, repeat, n_splits=1,
            norm_weight=None, norm_eps=1e-6):
        post, comb, x = mhc_pre_torch(residual, fn, hc_scale, hc_base, rms_eps, pre_eps, sk_eps, post_mult, repeat)
        return post, comb, (x if norm_weight is None else _rms(x, norm_weight, norm_eps))

    def pre_broadcast(x, fn, hc_scale, hc_base, rms_eps, pre_eps, sk_eps, post_mult, repeat, n_splits=1,
                      norm_weight=None, norm_eps=1e-6, fn_broadcast=None):
        hc = fn.shape[1] // x.shape[-1]
        residual = x.unsqueeze(1).expand(-1, hc, -1).contiguous()
        return (residual, *pre(residual, fn, hc_scale, hc_base, rms_eps, pre_eps, sk_eps, post_mult, repeat,
                               norm_weight=norm_weight, norm_eps=norm_eps))

    def post(x, residual, post_mix, comb_mix):
        return mhc_post_torch(x, residual, post_mix, comb_mix)

    def fused_post_pre(x, residual, post_mix, comb_mix, fn, hc_scale, hc_base, rms_eps, pre_eps, sk_eps,
                       post_mult, repeat, n_splits=1, tile_n=1, norm_weight=None, norm_eps=1e-6):
        r = post(x, residual, post_mix, comb_mix)
        return (r, *pre(r, fn, hc_scale, hc_base, rms_eps, pre_eps, sk_eps, post_mult, repeat,
                        norm_weight=norm_weight, norm_eps=norm_eps))

    def hc_head(hs, fn, hc_scale, hc_base, rms_eps, hc_eps):
        # out = sum_i (sigmoid(mix_i * scale + base_i) + eps) * residual_i, mixes from the
        # RMS-normalised flattened streams (HCHeadOp's docstring, vllm/model_executor/layers/mhc.py)
        t, hc, h = hs.shape
        xf = hs.reshape(t, hc * h).float()
        mixes = (xf @ fn.float().t()) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + rms_eps)
        gate = torch.sigmoid(mixes * hc_scale.float()[0] + hc_base.float()) + hc_eps
        return (gate.unsqueeze(-1) * hs.float()).sum(1).to(torch.bfloat16)

    def pre_delayed(residual, fn, hc_scale, hc_base, rms_eps, pre_eps, sk_eps, post_mult, repeat,
                    pre_mix=None, x=None, norm_weight=None, norm_eps=1e-6):
        p, c, li, pm = mhc_pre_delayed_torch(residual, fn, hc_scale, hc_base, rms_eps, pre_eps, sk_eps,
                                             post_mult, repeat, pre_mix=pre_mix, x=x)
        return p, c, (li if norm_weight is None else _rms(li, norm_weight, norm_eps)), pm

    def fused_post_pre_delayed(x, residual, post_mix, comb_mix, fn, hc_scale, hc_base, rms_eps, pre_eps, sk_eps,
                               post_mult, repeat, pre_mix=None, norm_weight=None, norm_eps=1e-6, capture_aux=False):
        r = post(x, residual, post_mix, comb_mix)
        aux = r.mean(dim=1) if capture_aux else r.new_empty(0, r.shape[-1])
        return (r, *pre_delayed(r, fn, hc_scale, hc_base, rms_eps, pre_eps, sk_eps, post_mult, repeat,
                                pre_mix=pre_mix, norm_weight=norm_weight, norm_eps=norm_eps), aux)

    table = {
        "vllm.models.deepseek_v4.nvidia.model": {
            "mhc_pre_tilelang": pre, "mhc_post_tilelang": post, "mhc_fused_post_pre_tilelang": fused_post_pre,
            "mhc_pre_broadcast_tilelang": pre_broadcast, "hc_head_fused_kernel_tilelang": hc_head},
        "vllm.models.deepseek_v41.nvidia.model": {
            "mhc_post_tilelang": post, "mhc_pre_delayed_tilelang": pre_delayed},
        "vllm.models.deepseek_v41.nvidia.ops.mhc": {
            "mhc_post_tilelang": post, "mhc_fused_post_pre_delayed_tilelang": fused_post_pre_delayed},
    }
    done = ["vllm_flash_attn: package registered without its FA2/FA3 check"]
    import importlib

    for mod_name, names in table.items():
        mod = importlib.import_module(mod_name)
        for n, f in names.items():
            if not hasattr(mod, n):
                raise RuntimeError(f"smoke: {mod_name} has no {n}: vLLM differs from 0.33.0")
            setattr(mod, n, f)
            done.append(f"{mod_name.removeprefix('vllm.models.')}.{n}")
    return done


# ----------------------------------------------------------------------------- one configuration


def example_dir(model: str) -> str:
    """The model folder of a configuration. ``v4mx``, the MXFP4 variant of the V4 example
    (DeepSeek's native checkpoints: ``expert_dtype: fp4`` without ``moe_quant_algo``, so vLLM
    builds its Mxfp4MoEMethod), is written from the NVFP4 example's config at first use."""
    path = EXAMPLES[model]
    if model == "v4mx" and not os.path.exists(os.path.join(path, "config.json")):
        with open(os.path.join(EXAMPLES["v4"], "config.json")) as f:
            raw = json.load(f)
        raw["quantization_config"].pop("moe_quant_algo")
        assert raw["expert_dtype"] == "fp4"
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw, f, indent=1)
    return path


def configs() -> list[dict]:
    out = []
    for model in ("v4", "v41"):
        for graphs in (False, True):
            for backend in ("dsv4", FLASHMLA[model]):
                out.append({"name": f"{model}-{'dsv4' if backend == 'dsv4' else 'flashmla'}-"
                                    f"{'graphs' if graphs else 'eager'}",
                            "model": model, "backend": backend, "graphs": graphs, "env": {}})
        out.append({"name": f"{model}-dsv4-eager-vllmmoe", "model": model, "backend": "dsv4", "graphs": False,
                    "env": {"DSV4_MOE": "0"}})
    # MXFP4 experts: dsv4's W4A8 (opt-in, DSV4_MOE_MXFP4=1) against vLLM's own (the default)
    out.append({"name": "v4mx-dsv4-eager-dsv4moe", "model": "v4mx", "backend": "dsv4", "graphs": False,
                "env": {"DSV4_MOE_MXFP4": "1"}})
    out.append({"name": "v4mx-dsv4-eager-vllmmoe", "model": "v4mx", "backend": "dsv4", "graphs": False,
                "env": {"DSV4_MOE_MXFP4": "0"}})
    # eager first (fewer moving parts), then CUDA graphs, vLLM's MoE last, MXFP4 after it; V4 before V4.1
    return sorted(out, key=lambda c: (c["model"] == "v4mx", "DSV4_MOE" in c["env"], c["graphs"], c["model"] != "v4",
                                      c["backend"] != "dsv4", c["name"]))


def prompts(seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[0] + [rng.randrange(2, 129000) for _ in range(n - 1)] for n in PROMPT_LENS]


def _layer_summary(model) -> dict:
    kinds: dict = {}
    for m in model.modules():
        name = type(m).__name__
        if "Attention" in name or "MoE" in name or "Experts" in name:
            kinds[name] = kinds.get(name, 0) + 1
        qm = getattr(m, "quant_method", None)
        if qm is not None and "MoE" in type(qm).__name__:
            kinds["quant:" + type(qm).__name__] = kinds.get("quant:" + type(qm).__name__, 0) + 1
    return kinds


def _compilation(graphs: bool, no_compile: bool) -> dict | None:
    """vLLM's default with graphs (torch.compile, piecewise + full CUDA graphs), few capture
    sizes; ``no_compile``: CUDA graphs of the whole decode step without torch.compile (the
    fallback if Inductor on torch 2.11 fails under vLLM 0.33.0's compiler passes).
    ``enforce_eager`` turns both off (vllm/config/vllm.py)."""
    if not graphs:
        return None
    cc = {"cudagraph_capture_sizes": [1, 2, 4]}
    if no_compile:
        cc.update(mode=0, cudagraph_mode="FULL_DECODE_ONLY")
    return cc


def cmd_one(args) -> int:
    cfg = next(c for c in configs() if c["name"] == args.config)
    result = {"name": cfg["name"], "stage": "workarounds", "compile": cfg["graphs"] and not args.no_compile}

    def emit():
        print("SMOKE_JSON " + json.dumps(result), flush=True)

    try:
        result["patched"] = apply_workarounds()
        result["stage"] = "engine"
        t = time.time()
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=example_dir(cfg["model"]), load_format="dummy", skip_tokenizer_init=True, seed=0,
                  max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=2048, gpu_memory_utilization=0.25,
                  enforce_eager=not cfg["graphs"], attention_backend=cfg["backend"],
                  kernel_config={"enable_jit_warmup": False},
                  language_model_only=True,  # workaround 6 of the module docstring
                  compilation_config=_compilation(cfg["graphs"], args.no_compile))
        result["startup_s"] = round(time.time() - t, 1)
        result["stage"] = "layers"
        try:
            result["layers"] = llm.apply_model(_layer_summary)[0]
        except Exception as e:
            result["layers"] = f"{type(e).__name__}: {e}"
        result["stage"] = "generate"
        t = time.time()
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=LOGPROBS, detokenize=False,
                            ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()], sp, use_tqdm=False)
        result["generate_s"] = round(time.time() - t, 2)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        # the top LOGPROBS of every step (the chosen token among them), per prompt
        result["step_logprobs"] = [[{str(k): v.logprob for k, v in step.items()} for step in (o.outputs[0].logprobs
                                                                                               or [])] for o in outs]
        result["first_logprobs"] = [steps[0] if steps else {} for steps in result["step_logprobs"]]
        result["stage"] = "done"
    except BaseException as e:
        import traceback

        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-6000:]
        if isinstance(e, ModuleNotFoundError):
            result["missing_module"] = e.name
    emit()
    return 0 if result["stage"] == "done" else 1


# ----------------------------------------------------------------------------- driver and comparison


def _margin(step: dict, chosen: int, other: int) -> float | None:
    """How much more likely ``chosen`` was than ``other`` at one step (logprob difference),
    None where ``other`` is not among the step's top LOGPROBS."""
    lc, lo = step.get(str(chosen)), step.get(str(other))
    return None if lc is None or lo is None else round(lc - lo, 4)


def agreement(a: dict, b: dict) -> dict:
    """Greedy tokens of two configurations on the same prompts and dummy weights. At each
    prompt's first divergence, the margin by which each run preferred its own token over
    the other's: with random weights the top logits lie within ~0.01 of each other, so a
    divergence whose margins are below the logprob differences the two runs show
    elsewhere is a near-tie (an fp8/bf16 rounding order decides it), not a defect."""
    same = total = 0
    first_div, margins = [], []
    for p, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
        n = min(len(ta), len(tb))
        total += max(len(ta), len(tb))
        same += sum(x == y for x, y in zip(ta[:n], tb[:n]))
        i = next((i for i in range(n) if ta[i] != tb[i]), None)
        first_div.append(i)
        sa, sb = (r.get("step_logprobs", [[]] * (p + 1))[p] for r in (a, b))
        if i is not None and i < len(sa) and i < len(sb):
            margins.append({"prompt": p, "step": i, "tokens": [ta[i], tb[i]],
                            "margin_a": _margin(sa[i], ta[i], tb[i]), "margin_b": _margin(sb[i], tb[i], ta[i])})
    diffs = []
    for la, lb in zip(a["first_logprobs"], b["first_logprobs"]):
        common = set(la) & set(lb)
        diffs += [abs(la[k] - lb[k]) for k in common]
    return {"same_tokens": round(same / max(total, 1), 3), "first_divergence": first_div,
            "first_step_logprob_maxdiff": round(max(diffs), 4) if diffs else None, "divergence_margins": margins}


PAIRS = (("dsv4-eager", "flashmla-eager"), ("dsv4-graphs", "flashmla-graphs"), ("dsv4-graphs", "dsv4-eager"),
         ("flashmla-graphs", "flashmla-eager"), ("dsv4-eager-vllmmoe", "dsv4-eager"),
         ("dsv4-eager-vllmmoe", "flashmla-eager"), ("dsv4-eager-dsv4moe", "dsv4-eager-vllmmoe"))


def _run_config(c: dict, args, left: float) -> tuple[dict, str, str]:
    """One configuration in its own process (``one``), at most ``left`` seconds: its result
    (the child's SMOKE_JSON line, or "crashed" with the last stderr line), stdout, stderr."""
    t = time.time()
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "one", "--config", c["name"]]
        p = subprocess.run(cmd + (["--no-compile"] if args.no_compile else []), env=child_env(c["env"]),
                           cwd=ROOT, capture_output=True, text=True, timeout=min(left - 10, args.per_config))
        out, err = p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")) + "\n[timed out]"
    line = [x for x in out.splitlines() if x.startswith("SMOKE_JSON ")]
    r = json.loads(line[-1][11:]) if line else {"name": c["name"], "stage": "crashed",
                                                 "error": (err.strip().splitlines() or ["?"])[-1]}
    r["wall_s"] = round(time.time() - t, 1)
    return r, out, err


# What vLLM raises at engine start when another engine on the same GPU allocates or frees
# memory while this one profiles (vllm/v1/worker/gpu_worker.py's profiling check,
# vllm/v1/core/kv_cache_planning.py's KV-cache sizing). With --jobs 2 on an H100 (2026-12-05)
# three configurations failed so, and all three ran alone (docs/plugin.md, "Every
# configuration through the engine"). Such a configuration is run again alone after the others.
SHARED_GPU_ERRORS = ("Error in memory profiling", "No available memory for the cache blocks")


def shared_gpu_failure(r: dict) -> bool:
    """Whether a configuration's failure is the shared GPU's, not its own (see SHARED_GPU_ERRORS)."""
    return r.get("stage") == "engine" and any(m in str(r.get("error", "")) for m in SHARED_GPU_ERRORS)


def cmd_run(args) -> int:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    start = time.time()
    os.makedirs(args.out, exist_ok=True)
    chosen = [c for c in configs() if not args.only or c["name"] in args.only.split(",")]
    results, logs, again = {}, {}, []
    lock, stop = threading.Lock(), threading.Event()

    def work(c: dict, shared_gpu_error: str | None = None) -> None:
        alone = shared_gpu_error is not None  # the retry of a failure beside another engine
        left = args.budget - (time.time() - start)
        if stop.is_set() or left < 60:
            why = "the run stopped (see above)" if stop.is_set() else "time budget spent"
            with lock:
                results[c["name"]] = {"name": c["name"], "stage": "skipped", "error": why}
                if alone:  # its failure beside another engine stays on record
                    results[c["name"]]["shared_gpu_error"] = shared_gpu_error
            return
        r, out, err = _run_config(c, args, left)
        if not alone and args.jobs > 1 and shared_gpu_failure(r):
            with lock:
                again.append((c, str(r.get("error"))))
                print(f"[{time.time() - start:5.0f} s] {c['name']}: {r.get('error')!s:.90} "
                      "(the GPU is shared with another engine: run again alone at the end)", flush=True)
            return
        if alone:
            r["shared_gpu_error"] = shared_gpu_error
        status = "ok" if r.get("stage") == "done" else f"FAILED at {r.get('stage')}: {r.get('error')}"
        out_log = [x for x in out.splitlines() if not x.startswith("SMOKE_JSON ")]  # vLLM logs to stdout
        with lock:
            results[c["name"]] = r
            print(f"[{time.time() - start:5.0f} s] {c['name']}: {status}", flush=True)
            if r.get("tokens"):
                print(f"    tokens {r['tokens']}", flush=True)
            logs[c["name"]] = (f"===== {c['name']} ({status})\n--- stdout\n" + "\n".join(out_log[-150:]) +
                               "\n--- stderr\n" + "\n".join(err.splitlines()[-120:]) +
                               ("\n" + r.get("traceback", "")))
            with open(os.path.join(args.out, "serve_smoke.json"), "w") as f:  # partial results survive a kill
                json.dump({"results": results}, f, indent=1)
            if r.get("missing_module") or r.get("stage") == "workarounds":  # every configuration would stop there
                print("stopping: every configuration imports the same modules first", flush=True)
                stop.set()

    # --jobs engines at once on the one GPU (each takes gpu_memory_utilization 0.25 of it);
    # configurations start in configs() order
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(work, chosen))
    for c, error in again:
        work(c, shared_gpu_error=error)
    results = {c["name"]: results[c["name"]] for c in chosen if c["name"] in results}
    logs = [logs[n] for n in results if n in logs]
    comps = {}
    for model in ("v4", "v41", "v4mx"):
        for x, y in PAIRS:
            a, b = results.get(f"{model}-{x}"), results.get(f"{model}-{y}")
            if a and b and a.get("stage") == b.get("stage") == "done":
                comps[f"{model}: {x} vs {y}"] = agreement(a, b)
    with open(os.path.join(args.out, "serve_smoke.json"), "w") as f:
        json.dump({"results": results, "comparisons": comps}, f, indent=1)
    with open(os.path.join(args.out, "serve_logs.txt"), "w") as f:
        f.write("\n".join(logs))
    print("\nlayers per configuration (module class: count):")
    for n, r in results.items():
        if r.get("layers"):
            print(f"  {n}: {r['layers']}")
    print("\ncomparison                                  same tokens  first divergence  first-step logprob max|diff|")
    for k, v in comps.items():
        print(f"  {k:<42} {v['same_tokens']:>10}  {str(v['first_divergence']):>16}  {v['first_step_logprob_maxdiff']}")
        for m in v.get("divergence_margins", []):
            print(f"      prompt {m['prompt']} step {m['step']}: tokens {m['tokens']}, each run's preference for its "
                  f"own token: {m['margin_a']} / {m['margin_b']} (logprob; None: not in the other's top {LOGPROBS})")
    print("\nconfiguration                 status      startup s  generate s")
    for n, r in results.items():
        st = "ok" if r.get("stage") == "done" else f"FAIL@{r.get('stage')}"
        print(f"  {n:<27} {st:<11} {r.get('startup_s', '-'):>9}  {r.get('generate_s', '-'):>10}"
              + ("" if st == "ok" else f"  {str(r.get('error'))[:200]}"))
    return 0 if all(r.get("stage") == "done" for r in results.values()) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage", help="copy a call's parts to /tmp; unpack once all are there")
    s.add_argument("dir")
    s = sub.add_parser("probe", help="machine facts and the import closure, with what is missing")
    s.add_argument("--out", default=None)
    s = sub.add_parser("run", help="every configuration, each in its own process; comparisons; table")
    s.add_argument("--out", required=True)
    s.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    s.add_argument("--budget", type=float, default=500, help="seconds; no configuration starts past it")
    s.add_argument("--per-config", type=float, default=240, help="seconds one configuration may take")
    s.add_argument("--no-compile", action="store_true", help="CUDA graphs without torch.compile")
    s.add_argument("--jobs", type=int, default=1, choices=(1, 2, 3),
                   help="configurations run at once on the GPU (each engine takes a quarter of its memory)")
    s = sub.add_parser("one", help="one configuration in this process (run starts these)")
    s.add_argument("--config", required=True)
    s.add_argument("--no-compile", action="store_true")
    s = sub.add_parser("list", help="the configuration names")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        print("\n".join(c["name"] for c in configs()))
        return 0
    return {"stage": cmd_stage, "probe": cmd_probe, "run": cmd_run, "one": cmd_one}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
