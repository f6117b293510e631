"""tests/conftest.py: GPU tests skip without a Hopper GPU, and FAIL on a Hopper GPU when
the CUDA extension did not load (never a quietly skipped GPU suite on the target machine).
The device is faked in a child pytest run; no GPU is needed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CONFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")


def run_child(tmp_path, cuda: bool, capability: tuple[int, int], extension: bool):
    (tmp_path / "conftest.py").write_text(
        "import torch\n"
        "import dsv4._ops\n"
        f"torch.cuda.is_available = lambda: {cuda}\n"
        f"torch.cuda.get_device_capability = lambda *a: {capability}\n"
        f"dsv4._ops.HAS_CUDA_EXTENSION = {extension}\n"
        "dsv4._ops.EXTENSION_ERROR = None if dsv4._ops.HAS_CUDA_EXTENSION else 'faked: no _C'\n"
        f"exec(compile(open({CONFTEST!r}).read(), {CONFTEST!r}, 'exec'))\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a Hopper GPU\n")
    (tmp_path / "test_child.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_kernel():\n    pass\n\ndef test_cpu():\n    pass\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(CONFTEST)),
                                                                    os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)


def test_hopper_without_extension_fails(tmp_path):
    r = run_child(tmp_path, cuda=True, capability=(9, 0), extension=False)
    assert r.returncode == 1, r.stdout
    assert "1 failed, 1 passed" in r.stdout, r.stdout
    assert "a Hopper GPU is present but the CUDA extension dsv4._C did not load" in r.stdout


@pytest.mark.parametrize("cuda,capability", [(False, (0, 0)), (True, (8, 0)), (True, (10, 0))])
def test_no_hopper_skips(tmp_path, cuda, capability):
    r = run_child(tmp_path, cuda=cuda, capability=capability, extension=False)
    assert r.returncode == 0, r.stdout
    assert "1 passed, 1 skipped" in r.stdout, r.stdout
    assert "GPU test skipped" in r.stdout
