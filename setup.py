"""Build script for dsv4.

The CUDA extension ``dsv4._C`` (abi3, ops registered through TORCH_LIBRARY, no
pybind) is built when the installed torch has CUDA and nvcc is found. Otherwise
the package installs as pure Python and only the CPU (reference) kernels work.

Environment:
  DSV4_CUDA=0|1         force the pure-Python install (0) or require the CUDA build (1)
  CUDA_HOME             the CUDA toolkit to build with (default: the toolkit that the nvcc
                        on PATH belongs to, found through symlinks and wrapper scripts)
  DSV4_CUDA_ARCHS="90a" semicolon list of targets (default 90a: wgmma needs sm_90a)
  MAX_JOBS=N            parallel nvcc jobs (ninja)
  DSV4_PTXAS_VERBOSE=1  print registers / spills per kernel
  DSV4_BUILD_ONLY="quantize attention"  development: compile only these csrc/ families
"""

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_HOME = "/usr/local/cuda"


class BuildError(RuntimeError):
    """A build prerequisite is missing or wrong; the message says the fix (printed
    without a traceback, in the first seconds of the build)."""


_FIX = ("set CUDA_HOME to the CUDA toolkit folder that holds bin/nvcc and lib64/libcudart.so "
        "(e.g. /usr/local/cuda-13.0), or DSV4_CUDA=0 for the pure-Python install")


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


def _is_toolkit(home: str) -> bool:
    """bin/nvcc, and libcudart where the link step looks (lib64 or targets/*/lib)."""
    libs = glob.glob(os.path.join(home, "lib64", "libcudart.so*")) + glob.glob(
        os.path.join(home, "targets", "*", "lib", "libcudart.so*"))
    return os.access(os.path.join(home, "bin", "nvcc"), os.X_OK) and bool(libs)


def _nvcc_home(nvcc: str) -> str | None:
    """The toolkit an nvcc belongs to. torch's cpp_extension takes dirname(dirname(nvcc)),
    which is wrong for a symlink (/usr/bin/nvcc) or a wrapper script (/usr/local/bin/nvcc
    exec'ing the real one): the link then fails after the whole compile with
    'cannot find -lcudart'. Follow symlinks first; else ask nvcc itself: -dryrun prints
    the real driver's bin folder as _HERE_."""
    home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if _is_toolkit(home):
        return home
    try:
        out = subprocess.run([nvcc, "-dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True,
                             timeout=60).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^#\$ _HERE_=(.+)$", out, re.M)
    home = os.path.dirname(os.path.realpath(m.group(1).strip())) if m else None
    return home if home and _is_toolkit(home) else None


def _cuda_home() -> tuple[str | None, str]:
    """(toolkit folder, how it was found) or (None, why none). Raises BuildError when
    one is named or found but unusable, so the build fails in seconds, not at link."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            if not _is_toolkit(home):
                raise BuildError(f"dsv4: {var}={home} is not a CUDA toolkit (no bin/nvcc or no "
                                   f"lib64/libcudart.so there); {_FIX}")
            return home, f"{var}"
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        if _is_toolkit(DEFAULT_CUDA_HOME):
            return DEFAULT_CUDA_HOME, f"{DEFAULT_CUDA_HOME} (no nvcc on PATH)"
        return None, f"nvcc not found on PATH, no {DEFAULT_CUDA_HOME} and no CUDA_HOME"
    home = _nvcc_home(nvcc)
    if home is None:
        raise BuildError(f"dsv4: found {nvcc} but not the CUDA toolkit it belongs to (no lib64/libcudart.so "
                           f"beside the real nvcc); {_FIX}")
    return home, f"the toolkit of {nvcc}"


def _check_cuda_major(home: str, torch_cuda: str) -> str:
    """nvcc's release; the extension must use the CUDA major version torch was built with."""
    out = subprocess.run([os.path.join(home, "bin", "nvcc"), "--version"], capture_output=True, text=True,
                         timeout=60).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise BuildError(f"dsv4: {home}/bin/nvcc --version printed no release number; {_FIX}")
    if m.group(1) != torch_cuda.split(".")[0]:
        raise BuildError(f"dsv4: {home} is CUDA {m.group(1)}.{m.group(2)} but torch was built with CUDA "
                           f"{torch_cuda}; use a CUDA {torch_cuda.split('.')[0]} toolkit (CUDA_HOME) or a torch "
                           f"built for CUDA {m.group(1)}, or DSV4_CUDA=0 for the pure-Python install")
    return f"{m.group(1)}.{m.group(2)}"


def _want_cuda():
    """Returns (build?, reason). Never guesses silently: the reason is printed.
    On a build, CUDA_HOME is set before torch.utils.cpp_extension is imported (it
    reads the variable once, at import)."""
    mode = os.environ.get("DSV4_CUDA", "auto")
    if mode == "0":
        return False, "DSV4_CUDA=0"
    try:
        import torch
    except ImportError:
        reason = "torch is not importable in the build environment (use pip install --no-build-isolation)"
    else:
        if torch.version.cuda is None:
            reason = f"torch {torch.__version__} has no CUDA"
        else:
            home, how = _cuda_home()
            if home is not None:
                release = _check_cuda_major(home, torch.version.cuda)
                os.environ["CUDA_HOME"] = home
                import torch.utils.cpp_extension as cpp_extension

                cpp_extension.CUDA_HOME = home  # in case it was imported before
                return True, f"CUDA_HOME={home} ({how}), nvcc {release}, torch {torch.__version__}"
            reason = how
    if mode == "1":
        raise BuildError(f"dsv4: DSV4_CUDA=1 but the CUDA extension cannot be built: {reason}")
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
    print(f"dsv4: building the CUDA extension dsv4._C for sm_{','.join(a for a in archs if a)} with {reason}",
          file=sys.stderr)
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
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++20", "-DPy_LIMITED_API=0x030A0000"], "nvcc": nvcc},
        py_limited_api=True,
    )
    return [ext], {"build_ext": BuildExtension}


try:
    ext_modules, cmdclass = _extensions()
except BuildError as e:
    sys.exit(str(e))
setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {},
)
