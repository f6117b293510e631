"""Finds the incumbent kernels dsv4 is measured against (optional benchmark dependencies).

The incumbents are what vLLM 0.33.0 runs for DeepSeek V4 on Hopper:

* ``flashmla``: FlashMLA's SM90 sparse kernels, compiled into the vLLM wheel as
  ``vllm/_flashmla_C.abi3.so`` (ops ``torch.ops._flashmla_C.sparse_decode_fwd`` /
  ``sparse_prefill_fwd``; Python API ``vllm/third_party/flashmla/flash_mla_interface.py``);
* ``humming``: the ``humming-kernels==0.1.19`` package (JIT through NVRTC at first use),
  vLLM's MoE kernel on compute capability 9.0;
* ``moe_c``: ``vllm/_moe_C_stable_libtorch.abi3.so`` (Marlin's MoE GEMM and vLLM's
  ``moe_align_block_size`` routing prep);
* ``vllm_c``: ``vllm/_C_stable_libtorch.abi3.so`` (92 MB; vLLM's own kernels, among them
  ``per_token_group_fp8_quant``, which quantizes the block-FP8 MoE input before Humming
  W4A8's GEMM1);
* ``vllm_py``: vLLM's Python package, a whole ``vllm/`` tree (the staged tree of
  ``scripts/gpu_serve_smoke.py``, ``/tmp/dsv4-serve/site``) or the installed
  vllm==0.33.0: without expert parallelism vLLM sums a token's expert outputs with its
  Triton kernel ``moe_fused_mul_sum`` (``vllm/model_executor/layers/fused_moe/
  moe_fused_mul_sum.py``), which the MoE incumbent runs from there.

Nothing of them is part of dsv4. They are found, in this order, in

1. the folders given explicitly (``--anchors DIR[:DIR]`` of the benchmarks),
2. the folders in the environment variable ``DSV4_ANCHORS`` (``os.pathsep``-separated),
3. an installed ``vllm==0.33.0`` / ``humming-kernels==0.1.19``.

A folder is what ``scripts/fetch_anchors.py`` makes: the few files above extracted from
the two PyPI wheels, with a ``MANIFEST.json`` naming their versions. vLLM's libraries are
built on torch's stable C ABI and load without vLLM installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["VLLM_VERSION", "HUMMING_VERSION", "ENV_VAR", "Anchors", "find_anchors", "vllm_module", "extract_wheel", "fetch",
           "FLASHMLA_FILES", "MOE_C_FILES", "VLLM_C_FILES", "HUMMING_PREFIX"]

VLLM_VERSION = "0.33.0"
HUMMING_VERSION = "0.1.19"
ENV_VAR = "DSV4_ANCHORS"
MANIFEST = "MANIFEST.json"
FLASHMLA_FILES = ("vllm/_flashmla_C.abi3.so", "vllm/third_party/flashmla/flash_mla_interface.py")
MOE_C_FILES = ("vllm/_moe_C_stable_libtorch.abi3.so",)
VLLM_C_FILES = ("vllm/_C_stable_libtorch.abi3.so",)
HUMMING_PREFIX = "humming/"


@dataclass
class Anchors:
    """What was found. ``missing`` maps each absent incumbent to the reason."""

    flashmla: bool = False
    humming: object = None  # the imported humming module
    moe_c: bool = False
    vllm_c: bool = False
    vllm_py: Optional[str] = None  # the folder whose vllm/ package the incumbents' Python glue reads
    sources: dict = field(default_factory=dict)  # incumbent -> where it came from
    missing: dict = field(default_factory=dict)  # incumbent -> why it is absent

    def summary(self) -> str:
        """One line: what was found where, and what is missing and why."""
        have = [f"{k} ({v})" for k, v in self.sources.items()]
        miss = [f"{k}: {v}" for k, v in self.missing.items()]
        parts = []
        if have:
            parts.append("incumbents: " + ", ".join(have))
        if miss:
            parts.append("missing: " + "; ".join(miss))
        return " | ".join(parts) if parts else "no incumbents searched"


def _folders(paths) -> list[str]:
    out = []
    for p in list(paths or []) + os.environ.get(ENV_VAR, "").split(os.pathsep):
        if p and p not in out:
            out.append(p)
    return out


def _manifest_ok(folder: str, key: str, version: str) -> Optional[str]:
    """None if the folder's manifest names the expected version of ``key``, else why not."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            got = json.load(f).get("versions", {}).get(key)
    except (OSError, ValueError) as e:
        return f"{path} unreadable ({e})"
    if got != version:
        return f"{path} names {key} {got}, expected {version}"
    return None


def _load_library(path: str) -> Optional[str]:
    import torch

    try:
        torch.ops.load_library(path)
    except Exception as e:  # a library that cannot load is reported, never fatal
        return f"{path} failed to load: {type(e).__name__}: {e}"
    return None


def _installed_version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _candidates(folders: list[str], rel: str, dist: str, version: str, why: list[str]):
    """The anchor folders, in order, that hold ``rel`` and whose manifest names ``dist``
    ``version``; a folder whose manifest names another adds its reason to ``why``."""
    for d in folders:
        if not os.path.exists(os.path.join(d, rel)):
            continue
        bad = _manifest_ok(d, dist, version)
        if bad:
            why.append(bad)
            continue
        yield d


def find_anchors(paths=None, *, load: bool = True) -> Anchors:
    """Looks for the incumbents (see the module docstring) and, with ``load``, loads them.

    Parameters
    ----------
    paths : list of str, optional
        Anchor folders searched before ``DSV4_ANCHORS`` and the installed packages.
    load : bool
        Load the libraries and import humming (needs CUDA torch); ``False`` only locates.

    Returns
    -------
    Anchors
        Never raises for a missing or broken incumbent: it lands in ``missing``.
    """
    a = Anchors()
    folders = _folders(paths)
    libs = {"flashmla": FLASHMLA_FILES[0], "moe_c": MOE_C_FILES[0], "vllm_c": VLLM_C_FILES[0]}
    for name, rel in libs.items():
        why = []
        for d in _candidates(folders, rel, "vllm", VLLM_VERSION, why):
            path = os.path.join(d, rel)
            err = _load_library(path) if load else None
            if err:
                why.append(err)
                continue
            setattr(a, name, True)
            a.sources[name] = path
            break
        else:
            ver = _installed_version("vllm")
            spec = importlib.util.find_spec("vllm") if ver else None
            if ver == VLLM_VERSION and spec and spec.origin:
                path = os.path.join(os.path.dirname(spec.origin), os.path.basename(rel))
                err = _load_library(path) if load else None
                if err is None and os.path.exists(path):
                    setattr(a, name, True)
                    a.sources[name] = path
                else:
                    why.append(err or f"{path} not found")
            elif ver:
                why.append(f"vllm {ver} is installed, the anchors are vllm {VLLM_VERSION}'s")
            if not getattr(a, name):
                where = f"no {rel} in {', '.join(folders)}" if folders else f"{ENV_VAR} unset"
                a.missing[name] = "; ".join(why) or f"{where} and vllm=={VLLM_VERSION} not installed"
    _find_humming(a, folders, load)
    _find_vllm_python(a, folders)
    return a


def _find_vllm_python(a: Anchors, folders: list[str]) -> None:
    """The first anchor folder holding vLLM's whole Python package (``vllm/__init__.py`` and
    a manifest naming vllm 0.33.0), else the installed vllm==0.33.0. Only located (sys.path
    untouched): the incumbents load single modules from it by path (:func:`vllm_module`)."""
    why = []
    for d in _candidates(folders, os.path.join("vllm", "__init__.py"), "vllm", VLLM_VERSION, why):
        a.vllm_py = a.sources["vllm_py"] = os.path.join(d, "vllm")
        return
    ver = _installed_version("vllm")
    spec = importlib.util.find_spec("vllm") if ver == VLLM_VERSION else None
    if spec is not None and spec.origin:
        a.vllm_py = a.sources["vllm_py"] = os.path.dirname(spec.origin)
        return
    where = f"no vllm/__init__.py in {', '.join(folders)}" if folders else f"{ENV_VAR} unset"
    a.missing["vllm_py"] = "; ".join(why) or f"{where} and vllm=={VLLM_VERSION} not installed"


def vllm_module(a: Anchors, rel: str, name: str):
    """One module of vLLM's Python package, loaded from its file (``rel`` under the
    package, e.g. ``model_executor/layers/fused_moe/moe_fused_mul_sum.py``) as ``name``:
    the module's own imports run, its package's ``__init__`` does not (vLLM's fused-MoE
    package imports FlashAttention's wrapper, which fails without FlashAttention's
    libraries, and no anchor carries them). Raises RuntimeError naming what is missing."""
    if a.vllm_py is None:
        raise RuntimeError(f"dsv4: vLLM's Python package is needed ({rel}): {a.missing.get('vllm_py')}")
    if name in sys.modules:
        return sys.modules[name]
    root = os.path.dirname(a.vllm_py)
    if root not in sys.path:  # the module's own imports (vllm.platforms, vllm.triton_utils): last,
        sys.path.append(root)  # so the folder's other packages never shadow the environment's
    path = os.path.join(a.vllm_py, rel)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"dsv4: cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        raise RuntimeError(f"dsv4: loading vLLM's {path} failed: {type(e).__name__}: {e}") from e
    sys.modules[name] = mod
    return mod


def _find_humming(a: Anchors, folders: list[str], load: bool) -> None:
    why = []
    for d in _candidates(folders, "humming", "humming-kernels", HUMMING_VERSION, why):
        if d not in sys.path:
            sys.path.insert(0, d)
        break
    else:
        ver = _installed_version("humming-kernels")
        if ver != HUMMING_VERSION:
            why.append(f"humming-kernels {ver} is installed, expected {HUMMING_VERSION}" if ver else
                       f"humming-kernels=={HUMMING_VERSION} not installed and no humming/ in the anchor folders")
            a.missing["humming"] = "; ".join(why)
            return
    if not load:
        a.sources["humming"] = "found"
        return
    try:
        mod = importlib.import_module("humming")
    except Exception as e:
        a.missing["humming"] = "; ".join(why + [f"import humming failed: {type(e).__name__}: {e}"])
        return
    a.humming = mod
    a.sources["humming"] = os.path.dirname(mod.__file__)


# --------------------------------------------------------------------------------------
# making an anchors folder (scripts/fetch_anchors.py)
# --------------------------------------------------------------------------------------


def extract_wheel(wheel: str, dest: str, *, files=(), prefixes=()) -> list[tuple[str, int]]:
    """Extracts the named members (exact ``files`` and everything under ``prefixes``) of a
    wheel into ``dest``. Returns [(member, size)]; raises ValueError naming what was not in
    the wheel."""
    taken = []
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        want = [n for n in names if n in files or any(n.startswith(p) for p in prefixes)]
        absent = [f for f in files if f not in names] + [p for p in prefixes if not any(n.startswith(p) for n in names)]
        if absent:
            raise ValueError(f"dsv4: {os.path.basename(wheel)} lacks {', '.join(absent)}")
        for n in want:
            if n.endswith("/"):
                continue
            target = os.path.realpath(os.path.join(dest, n))
            if not target.startswith(os.path.realpath(dest) + os.sep):  # no member escapes dest
                raise ValueError(f"dsv4: refusing wheel member outside the folder: {n}")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with z.open(n) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            mode = (z.getinfo(n).external_attr >> 16) & 0o777
            if mode:  # keep executables executable (humming runs its nvrtc_compile helper)
                os.chmod(target, mode)
            taken.append((n, z.getinfo(n).file_size))
    return taken


def write_manifest(dest: str, versions: dict, taken: list) -> None:
    path = os.path.join(dest, MANIFEST)
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    files = dict(old.get("files", {}))
    files.update({n: s for n, s in taken})
    with open(path, "w") as f:
        json.dump({"versions": {**old.get("versions", {}), **versions}, "files": files}, f, indent=1, sort_keys=True)


def fetch(dest: str, *, moe_c_dest: Optional[str] = None, vllm_c_dest: Optional[str] = None,
          wheel_dir: Optional[str] = None, pip=(sys.executable, "-m", "pip")) -> list[tuple[str, str, int]]:
    """Downloads the vLLM and humming wheels (``pip download --no-deps``) unless
    ``wheel_dir`` already holds them, and extracts FlashMLA and humming into ``dest``,
    vLLM's MoE library (46 MB) into ``moe_c_dest`` and vLLM's own kernel library (92 MB)
    into ``vllm_c_dest`` when given. Returns [(folder, member, size)]."""
    tmp = None
    if wheel_dir is None:
        wheel_dir = tmp = tempfile.mkdtemp(prefix="dsv4-anchors-")
        subprocess.run([*pip, "download", "--no-deps", "-q", "-d", wheel_dir, f"vllm=={VLLM_VERSION}",
                        f"humming-kernels=={HUMMING_VERSION}"], check=True)
    try:
        wheels = os.listdir(wheel_dir)
        vllm_whl = [w for w in wheels if w.startswith(f"vllm-{VLLM_VERSION}-") and w.endswith(".whl")]
        hum_whl = [w for w in wheels if w.startswith(f"humming_kernels-{HUMMING_VERSION}-") and w.endswith(".whl")]
        if not vllm_whl or not hum_whl:
            raise ValueError(f"dsv4: {wheel_dir} must hold vllm-{VLLM_VERSION}-*.whl and "
                             f"humming_kernels-{HUMMING_VERSION}-*.whl, found {sorted(wheels)}")
        os.makedirs(dest, exist_ok=True)
        out = []
        taken = extract_wheel(os.path.join(wheel_dir, vllm_whl[0]), dest, files=FLASHMLA_FILES)
        write_manifest(dest, {"vllm": VLLM_VERSION}, taken)
        out += [(dest, n, s) for n, s in taken]
        taken = extract_wheel(os.path.join(wheel_dir, hum_whl[0]), dest, prefixes=(HUMMING_PREFIX,))
        write_manifest(dest, {"humming-kernels": HUMMING_VERSION}, taken)
        out += [(dest, n, s) for n, s in taken]
        for lib_dest, files in ((moe_c_dest, MOE_C_FILES), (vllm_c_dest, VLLM_C_FILES)):
            if lib_dest:
                os.makedirs(lib_dest, exist_ok=True)
                taken = extract_wheel(os.path.join(wheel_dir, vllm_whl[0]), lib_dest, files=files)
                write_manifest(lib_dest, {"vllm": VLLM_VERSION}, taken)
                out += [(lib_dest, n, s) for n, s in taken]
        return out
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
