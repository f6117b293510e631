import pytest
import torch

import dsv4
import dsv4._ops


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _gpu_ready() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        return False, f"kernels target sm_90a, device is sm_{major}x"
    if not dsv4._ops.HAS_CUDA_EXTENSION:
        return False, f"dsv4._C not built ({dsv4._ops.EXTENSION_ERROR})"
    return True, ""


def pytest_report_header(config):
    ext = "loaded" if dsv4._ops.HAS_CUDA_EXTENSION else f"NOT loaded ({dsv4._ops.EXTENSION_ERROR})"
    ready, why = _gpu_ready()
    return [f"dsv4 {dsv4.__file__}: CUDA extension {ext}; GPU tests {'run' if ready else 'skip: ' + why}"]


def pytest_collection_modifyitems(config, items):
    ready, why = _gpu_ready()
    if ready or _hopper():  # on a Hopper GPU without the extension they fail: see pytest_runtest_setup
        return
    skip = pytest.mark.skip(reason=f"GPU test skipped: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """A Hopper GPU is here but dsv4._C did not load (a pure-Python install, or the tests
    importing a checkout that has no built extension): every GPU test fails with the
    reason, instead of the whole GPU suite skipping quietly."""
    if "gpu" in item.keywords and not dsv4._ops.HAS_CUDA_EXTENSION and _hopper():
        pytest.fail(f"dsv4: a Hopper GPU is present but the CUDA extension dsv4._C did not load "
                    f"({dsv4._ops.EXTENSION_ERROR}); dsv4 imported from {dsv4.__file__}. Build it: "
                    "bash scripts/install.sh (README.md, first screen)", pytrace=False)


@pytest.fixture
def poison_allocator():
    """Fill the CUDA caching allocator's free blocks with 0xFF bytes, so an output
    allocated by an op inside the test holds garbage wherever the kernel does not
    write (0xFF is NaN in bf16/fp32/e4m3 and code -6 twice in packed e2m1)."""

    def poison(nbytes: int) -> None:
        torch.cuda.synchronize()
        junk = torch.full((nbytes * 4 + (1 << 20),), 0xFF, dtype=torch.uint8, device="cuda")
        del junk  # back to the cache, still holding 0xFF

    return poison


@pytest.fixture
def poison_smem():
    """Fill the shared memory of every SM (test-only kernel dsv4_testing::poison_shared_memory,
    csrc/testing/poison_smem.cu) on the current stream, so the kernel launched next starts on
    that garbage wherever it reads shared memory it did not write. poison(value): value NaN
    fills 0xFF bytes (NaN in fp32, bf16 and e4m3, every validity bit set), +-inf fills bf16
    +-inf pairs, 0 zeros."""
    try:
        op = torch.ops.dsv4_testing.poison_shared_memory
    except (AttributeError, RuntimeError):
        pytest.fail("dsv4_testing::poison_shared_memory is missing: rebuild the dsv4 CUDA extension")

    def poison(value: float) -> None:
        if value != value:
            pattern = 0xFFFFFFFF
        else:
            half = int(torch.tensor(value, dtype=torch.bfloat16).view(torch.int16)) & 0xFFFF
            pattern = half * 0x10001
        op(pattern)

    return poison
