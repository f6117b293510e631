"""Shared setup for the vLLM plugin tests (CPU only).

* Every test here is marked ``vllm`` and skipped, with one reason, when
  vllm==0.33.0 is not importable.
* The suite's verdicts do not depend on the host: the engine limits and vLLM's
  MXFP4 backend are those of a Hopper worker, whatever the CPU (_cpu_model.py,
  held by test_host_independence.py with the AMX probe patched both ways), and the
  plugin's switches are cleared from the environment before any test sets them.
* ``VLLM_TARGET_DEVICE=cpu`` makes vLLM pick its CPU platform on a machine
  without a GPU driver (otherwise it cannot infer a device and the argument
  parser refuses to build). vLLM's compiled extension modules (vllm._C*,
  vllm._flashmla_C, ...) fail to import without a driver; vLLM itself tolerates
  that, and none of these tests needs them.
* The plugin registers only on vLLM's CUDA platform and DSV4 selection checks for
  dsv4's CUDA extension and an sm_90 GPU. Two named stand-ins let the CPU tests
  run the CUDA code paths: ``_stand_ins.stand_in_for_cuda`` replaces
  ``dsv4_plugin._platform_problem`` and ``dsv4_plugin.attention.device_problem``
  (the real ones are tested in test_rough_edges.py).
* The attention tests share one V4 and one V4.1 model (``attn_models``); vLLM's
  Triton helpers on their path are stood in by ``attn_helpers`` (_stand_ins.py).
  test_stand_ins_match_vllm.py checks those stand-ins in a child process, started
  as soon as that test is collected so it runs alongside the others.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# The tests read local configs only; offline, a missing file fails at once
# instead of after the Hub client's retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The plugin's switches and the vLLM setting it refuses come from the tests alone,
# never from the shell that runs them (each test that needs one sets it).
for _name in ("DSV4_MOE", "DSV4_MOE_ACTIVATION", "VLLM_HUMMING_INPUT_QUANT_CONFIG"):
    os.environ.pop(_name, None)
# The MXFP4 expert tests run dsv4's MXFP4 path, which is opt-in (dsv4_plugin.moe.
# mxfp4_claimed); set here so spawned EP workers inherit it. The default (off) is
# tested in test_rough_edges.py.
os.environ["DSV4_MOE_MXFP4"] = "1"

from dsv4_plugin._version import SUPPORTED_VLLM, version_problem  # noqa: E402

_PROBLEM = version_problem()
if _PROBLEM is None:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the environment
        _PROBLEM = f"vllm is installed but not importable ({type(e).__name__}: {e})"

SKIP_REASON = f"vLLM plugin tests need vllm=={SUPPORTED_VLLM}: {_PROBLEM}"


if _PROBLEM is None:
    from _stand_ins import stand_in_for_cuda

    stand_in_for_cuda()


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.vllm)
            if _PROBLEM is not None:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


class _InterpretChild:
    """_interpret_child.py in a process of its own, output to a temporary file (a pipe
    could fill up while nobody reads it)."""

    def __init__(self):
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(__file__), "_interpret_child.py")],
            stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def result(self, timeout=900) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = -1
        self.log.seek(0)
        return rc, self.log.read()


_INTERPRET_CHILD: _InterpretChild | None = None


def pytest_collection_finish(session):
    # test_stand_ins_match_vllm.py's child needs a fresh interpreter and ~30 s of
    # CPU: start it once the test is known to run, so it overlaps the other tests.
    global _INTERPRET_CHILD
    if _PROBLEM is None and _INTERPRET_CHILD is None and any(
            item.fspath.basename == "test_stand_ins_match_vllm.py" for item in session.items):
        _INTERPRET_CHILD = _InterpretChild()


def pytest_sessionfinish(session, exitstatus):
    if _INTERPRET_CHILD is not None and _INTERPRET_CHILD.proc.poll() is None:
        _INTERPRET_CHILD.proc.kill()  # the session ended before the test waited for it
        _INTERPRET_CHILD.proc.wait()


@pytest.fixture
def interpret_child():
    """(exit code, output) of _interpret_child.py."""
    global _INTERPRET_CHILD
    if _INTERPRET_CHILD is None:
        _INTERPRET_CHILD = _InterpretChild()
    return _INTERPRET_CHILD.result()


def pytest_ignore_collect(collection_path, config):
    # Test modules import vLLM at module level; without it, collect nothing
    # here but keep one placeholder test (test_vllm_available.py) that shows
    # the skip reason.
    if _PROBLEM is not None and collection_path.name.startswith("test_") and \
            collection_path.name != "test_vllm_available.py":
        return True
    return None


@pytest.fixture(scope="session")
def plugin():
    """The plugin, registered the way vLLM does it (entry point, every process)."""
    import dsv4_plugin

    dsv4_plugin.register()
    return dsv4_plugin


@pytest.fixture(scope="session")
def attn_models(plugin):
    """vLLM's real V4 and V4.1 models with dsv4 selected, for the attention tests
    ({"v4" | "v41": (vllm_config, model)}, engine limits of _attn_batch.ENGINE_KWARGS),
    and vLLM's workspace manager on CPU (prefill gathers into it)."""
    import torch
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    from _attn_batch import ENGINE_KWARGS
    from _cpu_model import V41_EXAMPLE, V4_EXAMPLE, build_model

    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device("cpu"))
    return {key: build_model(example, "dsv4", **ENGINE_KWARGS[key])
            for key, example in (("v4", V4_EXAMPLE), ("v41", V41_EXAMPLE))}


@pytest.fixture
def attn_helpers(monkeypatch):
    """_stand_ins' torch stand-ins for vLLM's Triton / FlashMLA attention helpers,
    installed for one test."""
    from _stand_ins import install_attention_helpers

    install_attention_helpers(monkeypatch)
