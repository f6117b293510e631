"""Shared setup for the vLLM plugin tests (CPU only).

* Every test here is marked ``vllm`` and skipped, with one reason, when
  vllm==0.33.0 is not importable.
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
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# The tests read local configs only; offline, a missing file fails at once
# instead of after the Hub client's retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

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
