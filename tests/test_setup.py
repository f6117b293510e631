"""setup.py finds the CUDA toolkit that nvcc belongs to, or fails at once with the fix.

Fake toolkits (shell-script nvcc, empty libcudart.so) in a temporary folder; no build runs.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import re
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = os.path.join(ROOT, "setup.py")

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="shell-script nvcc stand-ins need Linux")


@pytest.fixture
def setup_py(monkeypatch):
    """setup.py's functions, without running setup(): DSV4_CUDA=0 skips the CUDA probe."""
    import setuptools

    monkeypatch.setenv("DSV4_CUDA", "0")
    monkeypatch.setattr(setuptools, "setup", lambda **kw: None)
    spec = importlib.util.spec_from_file_location("dsv4_setup_under_test", SETUP)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    return mod


def script(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def toolkit(base, release="13.0", cudart=True):
    """A folder that looks like a CUDA toolkit: bin/nvcc answering --version and -dryrun."""
    script(base / "bin" / "nvcc",
           f'case "$*" in *--version*) echo "Cuda compilation tools, release {release}, V{release}.88";; '
           '*-dryrun*) echo "#$ _HERE_=$(cd "$(dirname "$0")" && pwd)" >&2;; esac\n')
    if cudart:
        (base / "lib64").mkdir(parents=True, exist_ok=True)
        (base / "lib64" / "libcudart.so").write_bytes(b"")
    return base


def test_wrapper_script_nvcc(setup_py, tmp_path, monkeypatch):
    """/usr/local/bin/nvcc as `exec /usr/local/cuda-13.0/bin/nvcc "$@"`: torch would guess
    /usr/local and fail at link; setup.py asks the wrapper where the real nvcc runs."""
    tk = toolkit(tmp_path / "cuda-13.0")
    script(tmp_path / "wrap" / "bin" / "nvcc", f'exec {tk}/bin/nvcc "$@"\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'wrap' / 'bin'}:/usr/bin:/bin")
    home, how = setup_py._cuda_home()
    assert home == str(tk)
    assert "wrap/bin/nvcc" in how


def test_symlinked_nvcc(setup_py, tmp_path, monkeypatch):
    tk = toolkit(tmp_path / "cuda-13.0")
    (tmp_path / "links").mkdir()
    os.symlink(tk / "bin" / "nvcc", tmp_path / "links" / "nvcc")
    monkeypatch.setenv("PATH", f"{tmp_path / 'links'}:/usr/bin:/bin")
    assert setup_py._cuda_home()[0] == str(tk)


def test_nvcc_of_no_toolkit(setup_py, tmp_path, monkeypatch):
    """An nvcc whose folder has no libcudart: the fix, not an 11-minute compile."""
    toolkit(tmp_path / "broken", cudart=False)
    monkeypatch.setenv("PATH", f"{tmp_path / 'broken' / 'bin'}:/usr/bin:/bin")
    with pytest.raises(setup_py.BuildError, match="not the CUDA toolkit it belongs to.*set CUDA_HOME"):
        setup_py._cuda_home()


@pytest.mark.parametrize("var", ["CUDA_HOME", "CUDA_PATH"])
def test_cuda_home_not_a_toolkit(setup_py, tmp_path, monkeypatch, var):
    monkeypatch.setenv(var, str(tmp_path))
    with pytest.raises(setup_py.BuildError, match=f"{var}=.* is not a CUDA toolkit"):
        setup_py._cuda_home()


def test_cuda_home_wins_over_path(setup_py, tmp_path, monkeypatch):
    tk = toolkit(tmp_path / "chosen")
    toolkit(tmp_path / "other")
    monkeypatch.setenv("PATH", f"{tmp_path / 'other' / 'bin'}:/usr/bin:/bin")
    monkeypatch.setenv("CUDA_HOME", str(tk))
    assert setup_py._cuda_home() == (str(tk), "CUDA_HOME")


def test_no_nvcc_anywhere(setup_py, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(setup_py, "DEFAULT_CUDA_HOME", str(tmp_path / "none"))
    home, why = setup_py._cuda_home()
    assert home is None and "nvcc not found" in why


def test_cuda_major_must_match_torch(setup_py, tmp_path):
    tk = toolkit(tmp_path / "cuda-12.4", release="12.4")
    assert setup_py._check_cuda_major(str(tk), "12.8") == "12.4"
    with pytest.raises(setup_py.BuildError, match="CUDA 12.4 but torch was built with CUDA 13.0"):
        setup_py._check_cuda_major(str(tk), "13.0")


def test_build_fails_in_seconds_with_the_fix(tmp_path):
    """The whole setup.py, as pip runs it, with a wrong CUDA_HOME: one dsv4 line, no traceback."""
    env = dict(os.environ, DSV4_CUDA="1", CUDA_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, SETUP, "--name"], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=120)
    assert r.returncode != 0
    assert "dsv4:" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # a CUDA torch names the bad folder; a CPU torch says it has no CUDA
    assert f"CUDA_HOME={tmp_path}" in r.stderr or "has no CUDA" in r.stderr, r.stderr


def test_no_undeclared_or_unused_cutlass():
    """No csrc file includes a CUTLASS or CuTe header, so the build requires no
    nvidia-cutlass wheel. A kernel that starts using them fails here until the
    dependency is declared again (setup.py's include path, install.sh, README)."""
    include = re.compile(r'^\s*#\s*include\s*[<"](cute|cutlass)/', re.M)
    users = []
    for path in glob.glob(os.path.join(ROOT, "csrc", "**", "*"), recursive=True):
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                if include.search(f.read()):
                    users.append(os.path.relpath(path, ROOT))
    assert users == []
    for name in ("setup.py", "pyproject.toml", os.path.join("scripts", "install.sh")):
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            assert "cutlass" not in f.read().lower(), f"{name} still asks for CUTLASS, which no kernel uses"


def _install_sh_torch() -> str:
    """The torch release scripts/install.sh installs by default (its DSV4_TORCH default)."""
    with open(os.path.join(ROOT, "scripts", "install.sh"), encoding="utf-8") as f:
        pins = re.findall(r"\$\{DSV4_TORCH:-torch==([0-9.]+)\}", f.read())
    assert len(pins) == 1, f"install.sh should name one default torch, found {pins}"
    return pins[0]


def test_install_sh_torch_is_the_one_vllm_pins():
    """install.sh's default torch is the release vllm 0.33.0 requires, so adding vLLM to that
    venv keeps torch and the dsv4._C built against it (.ci/run runs that sequence); the
    README says the same number. Where vllm is installed, its own metadata is checked too."""
    pin = _install_sh_torch()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert f"default `torch=={pin}`" in readme, "README's install steps name another default torch"
    try:
        reqs = importlib.metadata.requires("vllm") or []
    except importlib.metadata.PackageNotFoundError:
        return  # the CPU suite's venv; .ci/run checks the real install
    assert [r for r in reqs if r.replace(" ", "").startswith("torch==")] == [f"torch=={pin}"]


def test_install_sh_creates_the_log_before_following_it():
    """install.sh shows the build's progress by following build/install.log while pip runs
    in the background; pip's redirection opens the file only once the background job is
    forked, so the file must exist before `tail -f` starts (else "tail: cannot open", and
    no progress is shown)."""
    with open(os.path.join(ROOT, "scripts", "install.sh"), encoding="utf-8") as f:
        text = f.read()
    create, follow = text.find(': > "$LOG"'), text.find('tail -n +1 -f')
    assert 0 <= create < text.find('-e ".[test]" >> "$LOG"') < follow, "build/install.log created, appended, followed"
