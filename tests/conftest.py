import pytest
import torch

import dsv4._ops


def _gpu_ready() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if not dsv4._ops.HAS_CUDA_EXTENSION:
        return False, f"dsv4._C not built ({dsv4._ops.EXTENSION_ERROR})"
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        return False, f"kernels target sm_90a, device is sm_{major}x"
    return True, ""


def pytest_collection_modifyitems(config, items):
    ready, why = _gpu_ready()
    if ready:
        return
    skip = pytest.mark.skip(reason=f"GPU test skipped: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
