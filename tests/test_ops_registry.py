"""Every op exists, has a fake kernel and a CPU kernel, and the Python schema mirror
(used when the extension is absent) matches csrc/registration.cpp."""

import pytest
import torch

import dsv4
import dsv4._ops as ops


@pytest.mark.parametrize("name", sorted(ops.SCHEMAS))
def test_schema_mirror_matches(name):
    schema = str(getattr(torch.ops.dsv4, name).default._schema)
    assert schema == f"dsv4::{name}{ops.SCHEMAS[name]}"


def test_extension_state_is_reported():
    assert isinstance(dsv4.HAS_CUDA_EXTENSION, bool)
    if not dsv4.HAS_CUDA_EXTENSION:
        assert ops.EXTENSION_ERROR


@pytest.mark.skipif(ops.HAS_CUDA_EXTENSION, reason="only meaningful for a pure-Python install")
def test_missing_extension_error_says_how_to_build():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA tensor")
    with pytest.raises(RuntimeError, match="pip install --no-build-isolation"):
        dsv4.quantize_nvfp4(torch.zeros(1, 16, dtype=torch.bfloat16, device="cuda"), 1.0)
