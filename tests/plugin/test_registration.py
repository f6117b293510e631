"""Entry-point discovery, idempotent register(), version check, seam checks."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

import pytest


def test_entry_point_is_discoverable():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "dsv4"]
    assert len(eps) == 1, "dsv4 is not installed with its vllm.general_plugins entry point"
    assert eps[0].value == "dsv4_plugin:register"
    import dsv4_plugin

    assert eps[0].load() is dsv4_plugin.register


def test_vllm_loads_the_plugin_and_register_is_idempotent():
    import vllm.plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import dsv4_plugin
    from dsv4_plugin.attention import seam_installed
    from dsv4_plugin.moe import QUANT_NAME

    # vLLM's own loader (what runs in the API server, engine core and workers).
    plugins = vllm.plugins.load_plugins_by_group(vllm.plugins.DEFAULT_PLUGINS_GROUP)
    assert "dsv4" in plugins
    for _ in range(3):
        plugins["dsv4"]()
    vllm.plugins.load_general_plugins()
    dsv4_plugin.register()

    assert list(AttentionBackendEnum.__members__).count("DSV4") == 1
    assert AttentionBackendEnum["DSV4"].get_path() == "dsv4_plugin.attention.DSV4AttentionBackend"
    assert seam_installed()
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    assert QUANTIZATION_METHODS.count(QUANT_NAME) == 1


def test_other_vllm_version_gets_one_clear_message(monkeypatch, caplog):
    import dsv4_plugin
    from dsv4_plugin import _version

    monkeypatch.setattr(_version, "installed_vllm_version", lambda: "0.34.1")
    monkeypatch.setattr(dsv4_plugin, "version_problem", _version.version_problem)
    monkeypatch.setattr(dsv4_plugin, "_registered", False)
    monkeypatch.setattr(dsv4_plugin, "_warned_version", False)
    with caplog.at_level(logging.ERROR, logger="dsv4_plugin"):
        dsv4_plugin.register()  # must not raise
        dsv4_plugin.register()
    msgs = [r.getMessage() for r in caplog.records if r.name == "dsv4_plugin"]
    assert len(msgs) == 1
    assert "vllm 0.34.1" in msgs[0] and "vllm==0.33.0" in msgs[0] and "NOT registered" in msgs[0]
    assert not dsv4_plugin._registered


def test_seam_check_fails_loudly_when_vllm_code_changed(monkeypatch, plugin):
    from dsv4_plugin import attention

    attention.check_seam()  # the installed vLLM is the one we expect
    key = next(iter(attention.EXPECTED_SOURCE_SHA256))
    monkeypatch.setitem(attention.EXPECTED_SOURCE_SHA256, key, "0" * 64)
    with pytest.raises(attention.SeamChangedError, match="vllm==0.33.0") as ei:
        attention.check_seam()
    assert "_select_dsv4_attn_cls: source changed" in str(ei.value)
