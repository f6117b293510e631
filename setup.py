"""Build script for dsv4.

The CUDA extension ``dsv4._C`` (abi3, ops registered through TORCH_LIBRARY, no
pybind) is built when the installed torch has CUDA and nvcc is found. Otherwise
the package installs as pure Python and only the CPU (reference) kernels work.

Environment:
  DSV4_CUDA=0|1         force the pure-Python install (0) or require the CUDA build (1)
  DSV4_CUDA_ARCHS="90a" semicolon list of targets (default 90a: wgmma needs sm_90a)
  MAX_JOBS=N            parallel nvcc jobs (ninja)
  DSV4_PTXAS_VERBOSE=1  print registers / spills per kernel
  DSV4_BUILD_ONLY="quantize attention"  development: compile only these csrc/ families
"""

import glob
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _cutlass_include() -> str:
    try:
        import cutlass_library
    except ImportError as e:
        raise RuntimeError(
            "dsv4: building the CUDA extension needs the CUTLASS/CuTe headers from the "
            "'nvidia-cutlass' wheel: pip install nvidia-cutlass"
        ) from e
    inc = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    if not os.path.isdir(os.path.join(inc, "cute")):
        raise RuntimeError(f"dsv4: nvidia-cutlass is installed but {inc} holds no CuTe headers")
    return inc


def _add_pip_cuda_headers() -> None:
    """torch's pip CUDA build ships cuBLAS/cuSPARSE/... headers as nvidia-* wheels that
    a bare nvcc toolkit may lack; CPATH puts them after the toolkit's own headers."""
    try:
        import nvidia
    except ImportError:
        return
    dirs = [d for base in nvidia.__path__ for d in sorted(glob.glob(os.path.join(base, "*", "include")))]
    if dirs:
        os.environ["CPATH"] = os.pathsep.join(filter(None, [os.environ.get("CPATH"), *dirs]))


def _want_cuda():
    """Returns (build?, reason). Never guesses silently: the reason is printed."""
    mode = os.environ.get("DSV4_CUDA", "auto")
    if mode == "0":
        return False, "DSV4_CUDA=0"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        reason = "torch is not importable in the build environment (use pip install --no-build-isolation)"
    else:
        if torch.version.cuda is None:
            reason = f"torch {torch.__version__} has no CUDA"
        elif CUDA_HOME is None:
            reason = "nvcc not found (set CUDA_HOME)"
        else:
            return True, ""
    if mode == "1":
        raise RuntimeError(f"dsv4: DSV4_CUDA=1 but the CUDA extension cannot be built: {reason}")
    return False, reason


def _extensions():
    build, reason = _want_cuda()
    if not build:
        print(f"dsv4: building WITHOUT the CUDA extension ({reason}); CPU kernels only", file=sys.stderr)
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    _add_pip_cuda_headers()

    archs = os.environ.get("DSV4_CUDA_ARCHS", "90a").split(";")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
    nvcc = [
        "-O3",
        "-std=c++20",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "-lineinfo",
        "-DNDEBUG",
        "-DPy_LIMITED_API=0x030A0000",
        *gencode,
    ]
    if os.environ.get("DSV4_PTXAS_VERBOSE") == "1":
        nvcc.append("-Xptxas=-v")
    sources = sorted(glob.glob("csrc/**/*.cu", recursive=True)) + sorted(
        glob.glob("csrc/**/*.cpp", recursive=True)
    )
    # Development only: build a subset of kernel families, e.g. "quantize attention".
    only = os.environ.get("DSV4_BUILD_ONLY")
    if only:
        keep = tuple(f"csrc/{f}/" for f in only.split())
        sources = [s for s in sources if s.startswith(keep) or s == "csrc/registration.cpp"]
    ext = CUDAExtension(
        name="dsv4._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc"), _cutlass_include()],
        extra_compile_args={"cxx": ["-O3", "-std=c++20", "-DPy_LIMITED_API=0x030A0000"], "nvcc": nvcc},
        py_limited_api=True,
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()
setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {},
)
