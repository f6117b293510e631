"""Placeholder that carries the skip reason when vllm==0.33.0 is missing."""


def test_vllm_importable():
    import vllm

    from dsv4_plugin._version import SUPPORTED_VLLM

    assert vllm.__version__.split("+")[0] == SUPPORTED_VLLM
