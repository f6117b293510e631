"""Every op exists, has a fake kernel and a CPU kernel, and the Python schema mirror
(used when the extension is absent) matches csrc/registration.cpp."""

import subprocess
import sys
import textwrap

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


def test_missing_extension_error_says_how_to_build():
    # A fresh interpreter where dsv4._C cannot be imported, as after a pure-Python
    # install; the CUDA kernel is reached by redispatch, so no GPU is needed.
    code = textwrap.dedent(
        """
        import sys, torch
        sys.modules["dsv4._C"] = None
        import dsv4
        assert not dsv4.HAS_CUDA_EXTENSION
        x, g = torch.zeros(1, 16, dtype=torch.bfloat16), torch.ones(1)
        assert dsv4.quantize_nvfp4(x, g)[0].shape == (1, 8)  # CPU kernels still work
        cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
        try:
            torch.ops.dsv4.quantize_nvfp4.default.redispatch(cuda, x, g)
        except RuntimeError as e:
            print(e)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "dsv4::quantize_nvfp4" in proc.stdout and "pip install --no-build-isolation" in proc.stdout
