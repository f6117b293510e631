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
    assert AttentionBackendEnum["DSV4"].get_path() == "dsv4_plugin.attention_v4.DSV4AttentionBackend"
    assert seam_installed("deepseek_v4") and seam_installed("deepseek_v41")
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    assert QUANTIZATION_METHODS.count(QUANT_NAME) == 1
    from vllm.model_executor.layers.quantization import get_quantization_config

    from dsv4_plugin.moe import DSV4DeepseekV4Config

    assert get_quantization_config(QUANT_NAME) is DSV4DeepseekV4Config


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


@pytest.mark.parametrize("model", ["deepseek_v4", "deepseek_v41"])
def test_seam_check_fails_loudly_when_vllm_code_changed(monkeypatch, plugin, model):
    from dsv4_plugin import attention

    seam = attention.SEAMS[model]
    attention.check_seam(model)  # the installed vLLM is the one we expect
    assert seam.problems == []
    key = next(iter(seam.expected_sha256))
    monkeypatch.setitem(seam.expected_sha256, key, "0" * 64)
    with pytest.raises(attention.SeamChangedError, match="vllm==0.33.0") as ei:
        attention.check_seam(model)
    assert "_select_dsv4_attn_cls: source changed" in str(ei.value)


def _cfg(backend, pcp=1):
    import types

    from vllm.config import AttentionConfig

    return types.SimpleNamespace(
        attention_config=AttentionConfig(backend=backend),
        parallel_config=types.SimpleNamespace(prefill_context_parallel_size=pcp),
    )


@pytest.mark.parametrize("model", ["deepseek_v4", "deepseek_v41"])
def test_seam_mismatch_stops_only_a_process_that_selected_dsv4(monkeypatch, caplog, plugin, model):
    """A changed vLLM source is found at register() (one warning), and the seam is
    still installed in its refusing form: vLLM's own backends are untouched, and
    only selecting DSV4 raises SeamChangedError, naming what changed."""
    import importlib

    from dsv4_plugin import attention

    seam = attention.SEAMS[model]
    mod = importlib.import_module(seam.module)
    selector = getattr(attention, seam.selector_name)
    original = selector.__dsv4_original__
    key = next(iter(seam.expected_sha256))
    monkeypatch.setitem(seam.expected_sha256, key, "0" * 64)
    monkeypatch.setattr(mod, attention.SEAM_FUNCTION, original)  # as before register()
    monkeypatch.setattr(seam, "problems", [])
    with caplog.at_level(logging.WARNING, logger="dsv4_plugin"):
        attention.install_attention_seams()
    warned = [r.getMessage() for r in caplog.records if r.name == "dsv4_plugin"]
    assert len(warned) == 1 and "will refuse" in warned[0] and "source changed" in warned[0]
    assert getattr(mod, attention.SEAM_FUNCTION) is selector
    assert selector.__dsv4_original__ is original

    vllm_cls = original(_cfg("FLASHMLA_SPARSE"))
    assert selector(_cfg("FLASHMLA_SPARSE")) is vllm_cls  # other processes: unchanged
    with pytest.raises(attention.SeamChangedError, match="source changed"):
        selector(_cfg("dsv4"))
