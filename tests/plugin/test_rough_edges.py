"""What a user hits around the edges: no-op without dsv4, non-CUDA platforms, missing
extension / wrong GPU, refused features with the dsv4 MoE, MXFP4 checkpoints,
explicit --quantization, and the README's tiny-model commands."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import types

import pytest

from _cpu_model import V41_EXAMPLE, V4_EXAMPLE, build_model, engine_config

REPO = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))


# -- without --attention-backend dsv4 --------------------------------------------------


@pytest.mark.parametrize("example", [V4_EXAMPLE, V41_EXAMPLE])
def test_no_backend_no_change(plugin, example):
    """Quantization name and every quantization method are vLLM's own when dsv4 is
    not selected: the plugin's config class only inherits vLLM's behaviour."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4FusedMoE
    from vllm.models.deepseek_v41.quant_config import DeepseekV4FP8Config

    from dsv4_plugin.moe import DSV4DeepseekV4Config

    cfg, model = build_model(example, None)
    assert cfg.model_config.quantization == "deepseek_v4_fp8"
    # the claim (override_quantization_method) is vLLM's, not re-implemented
    assert "override_quantization_method" not in vars(DSV4DeepseekV4Config)
    assert issubclass(DSV4DeepseekV4Config, DeepseekV4FP8Config)
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert experts and all(type(m.quant_method) is ModelOptNvFp4FusedMoE for m in experts)
    for m in model.modules():
        assert not type(m).__module__.startswith("dsv4_plugin"), type(m)


@pytest.mark.parametrize("user_quant", ["deepseek_v4_fp8", "fp8", "modelopt_fp4"])
def test_explicit_quantization_is_vllms_decision(plugin, user_quant):
    """--quantization goes through vLLM's own resolution (DeepseekV4FP8Config's
    override_quantization_method, inherited); the plugin never renames it."""
    from vllm.models.deepseek_v41.quant_config import DeepseekV4FP8Config

    cfg = engine_config(V4_EXAMPLE, "dsv4", quantization=user_quant)
    hf_quant = cfg.model_config.hf_config.quantization_config
    expected = DeepseekV4FP8Config.override_quantization_method(
        hf_quant, user_quant, hf_config=cfg.model_config.hf_config) or user_quant
    assert cfg.model_config.quantization == expected


_NON_CUDA = r"""
import logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
import vllm.plugins
vllm.plugins.load_general_plugins()
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.model_executor.layers.quantization import get_quantization_config
from vllm.engine.arg_utils import EngineArgs
assert "DSV4" not in AttentionBackendEnum.__members__
assert not get_quantization_config("deepseek_v4_fp8").__module__.startswith("dsv4_plugin")
import vllm.models.deepseek_v4.nvidia.model as m
assert m._select_dsv4_attn_cls.__module__.startswith("vllm."), m._select_dsv4_attn_cls
try:
    EngineArgs(model=sys.argv[1], load_format="dummy", skip_tokenizer_init=True,
               attention_backend="dsv4").create_engine_config()
except ValueError as e:
    assert "Unknown attention backend" in str(e), e
    print("REJECTED")
"""


def test_non_cuda_platform_claims_nothing():
    """A fresh interpreter on vLLM's CPU platform, no stand-ins: one log line, no
    backend, no seam, vLLM's own quantization class; dsv4 is then an unknown backend."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, "-c", _NON_CUDA, V4_EXAMPLE], env=env,
                         capture_output=True, text=True, timeout=600, cwd="/")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "REJECTED" in res.stdout
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if "dsv4 plugin inactive" in ln]
    assert len(lines) == 1 and "NVIDIA GPUs only" in lines[0]


# -- selecting dsv4 where its kernels cannot run ----------------------------------------


def _cuda_platform(monkeypatch, cap):
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    monkeypatch.setattr(type(current_platform), "get_device_capability",
                        classmethod(lambda cls, device_id=0: None if cap is None else DeviceCapability(*cap)))


def test_device_problem_names_the_missing_piece(monkeypatch):
    import dsv4
    from _stand_ins import REAL_DEVICE_PROBLEM

    monkeypatch.setattr(dsv4, "HAS_CUDA_EXTENSION", False)
    assert "CUDA extension (dsv4._C)" in REAL_DEVICE_PROBLEM()
    monkeypatch.setattr(dsv4, "HAS_CUDA_EXTENSION", True)
    assert "need an NVIDIA GPU" in REAL_DEVICE_PROBLEM()  # vLLM's CPU platform
    for cap, name in [((10, 0), "sm_100"), ((8, 9), "sm_89"), ((12, 0), "sm_120")]:
        _cuda_platform(monkeypatch, cap)
        assert REAL_DEVICE_PROBLEM().endswith(f"this GPU is {name}")
    _cuda_platform(monkeypatch, (9, 0))
    assert REAL_DEVICE_PROBLEM() is None


@pytest.mark.parametrize("example", [V4_EXAMPLE, V41_EXAMPLE])
def test_dsv4_without_kernels_fails_at_model_construction_with_one_line(plugin, monkeypatch, example):
    """Before any weight is loaded (the first decoder layer), not at the first kernel."""
    from dsv4_plugin import attention

    monkeypatch.setattr(attention, "device_problem", lambda: "dsv4's kernels are built for "
                        "sm_90 (Hopper: H100, H200); this GPU is sm_100")
    monkeypatch.setattr(attention, "_device_checked", False)
    with pytest.raises(attention.DSV4UnavailableError) as ei:
        build_model(example, "dsv4")
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("--attention-backend dsv4: ") and "sm_100" in msg


# -- features the dsv4 MoE refuses --------------------------------------------------------


def _feature_cfg(**over):
    vc = types.SimpleNamespace(
        lora_config=None,
        model_config=types.SimpleNamespace(enable_sleep_mode=False, quantization_config=None),
        load_config=types.SimpleNamespace(load_format="dummy"),
    )
    mc = types.SimpleNamespace(intermediate_size_per_partition=288, moe_parallel_config=types.SimpleNamespace(
        use_deepep_ll_kernels=False, enable_eplb=False))
    where = {"lora": (vc, "lora_config"), "sleep": (vc.model_config, "enable_sleep_mode"),
             "load": (vc.load_config, "load_format"), "quant": (vc.model_config, "quantization_config"),
             "n": (mc, "intermediate_size_per_partition")}
    for k, v in over.items():
        obj, attr = where.get(k, (mc.moe_parallel_config, k))
        setattr(obj, attr, v)
    return vc, mc


def _moe_override():
    from vllm.config.quantization import QuantizationConfigArgs

    return QuantizationConfigArgs(moe="mxfp8")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("over,feature", [
    ({"lora": object()}, "LoRA"),
    ({"use_deepep_ll_kernels": True}, "DeepEP low-latency all2all"),
    ({"enable_eplb": True}, "EPLB"),
    ({"sleep": True}, "sleep mode"),
    ({"load": "ipc_cache"}, "pre-processed weights"),
    ({"load": "sharded_state"}, "pre-processed weights"),
    ({"quant": "override"}, "a MoE quantization override (--quantization-config moe)"),
])
def test_refused_features_name_themselves_and_dsv4_moe_0(plugin, fmt, over, feature):
    from dsv4_plugin.moe import DSV4MoEUnsupportedError, check_supported

    if over.get("quant") == "override":
        over = {"quant": _moe_override()}
    check_supported(*_feature_cfg(), fmt)  # nothing on: accepted
    with pytest.raises(DSV4MoEUnsupportedError) as ei:
        check_supported(*_feature_cfg(**over), fmt)
    msg = str(ei.value)
    assert msg.startswith(f"dsv4 {fmt.upper()} MoE does not support {feature} (")
    assert "DSV4_MOE=0" in msg and "\n" not in msg


def test_mxfp4_only_refusals(plugin, monkeypatch):
    """vLLM's Humming knob and a per-rank N that MXFP4 scales cannot tile: refused for
    MXFP4 experts, with the message naming each; NVFP4 experts are not affected."""
    from dsv4_plugin.moe import DSV4MoEUnsupportedError, check_supported

    monkeypatch.setenv("VLLM_HUMMING_INPUT_QUANT_CONFIG", '{"dtype": "float8e4m3"}')
    check_supported(*_feature_cfg(), "nvfp4")
    with pytest.raises(DSV4MoEUnsupportedError, match=r"^dsv4 MXFP4 MoE does not support "
                       r"VLLM_HUMMING_INPUT_QUANT_CONFIG \(.*DSV4_MOE=0"):
        check_supported(*_feature_cfg(), "mxfp4")
    monkeypatch.delenv("VLLM_HUMMING_INPUT_QUANT_CONFIG")
    check_supported(*_feature_cfg(n=144), "nvfp4")
    with pytest.raises(DSV4MoEUnsupportedError) as ei:
        check_supported(*_feature_cfg(n=144), "mxfp4")
    assert str(ei.value).startswith("dsv4 MXFP4 MoE does not support a per-rank expert "
                                    "intermediate size of 144 (")
    assert "tensor-parallel size" in str(ei.value) and "DSV4_MOE=0" in str(ei.value)


def test_per_rank_n_by_scale_block(plugin):
    """The per-rank N each format's scales can tile: NVFP4 any multiple of 16 (288, V4.1-
    Flash at TP 8, and 144 at TP 16 run: prepare pads them with zeros to 320 / 192),
    MXFP4 of 32; anything else is refused at construction with one line, not a crash
    in prepare (V4.1-Flash at TP 32: 72)."""
    from dsv4_plugin.moe import DSV4MoEUnsupportedError, check_supported

    for n in (288, 144, 80):
        check_supported(*_feature_cfg(n=n), "nvfp4")
    check_supported(*_feature_cfg(n=288), "mxfp4")
    for fmt, n, block in (("nvfp4", 72, 16), ("nvfp4", 40, 16), ("mxfp4", 80, 32)):
        with pytest.raises(DSV4MoEUnsupportedError) as ei:
            check_supported(*_feature_cfg(n=n), fmt)
        msg = str(ei.value)
        assert msg.startswith(f"dsv4 {fmt.upper()} MoE does not support a per-rank expert intermediate size of {n} (")
        assert f"multiples of {block}" in msg and "DSV4_MOE=0" in msg and "\n" not in msg


def test_refusal_happens_while_the_real_model_is_built(plugin, monkeypatch):
    """Sleep mode on the real V4 model: refused at the first routed-expert layer;
    with DSV4_MOE=0 the same model builds with vLLM's MoE and dsv4 attention."""
    import vllm.engine.arg_utils as arg_utils
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4FusedMoE

    from dsv4_plugin.moe import DSV4MoEUnsupportedError

    real = arg_utils.EngineArgs.create_engine_config

    def with_sleep_mode(self, *a, **k):
        cfg = real(self, *a, **k)
        cfg.model_config.enable_sleep_mode = True  # what --enable-sleep-mode sets
        return cfg

    monkeypatch.setattr(arg_utils.EngineArgs, "create_engine_config", with_sleep_mode)
    with pytest.raises(DSV4MoEUnsupportedError, match="sleep mode"):
        build_model(V4_EXAMPLE, "dsv4")
    monkeypatch.setenv("DSV4_MOE", "0")
    cfg, model = build_model(V4_EXAMPLE, "dsv4")
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert experts and all(type(m.quant_method) is ModelOptNvFp4FusedMoE for m in experts)


def test_weight_reload_is_refused(plugin):
    """A second process_weights_after_loading (vLLM's reload_weights) is refused."""
    from test_moe import E, _Layer, _moe_config, _nvfp4_config

    from dsv4 import formats
    from dsv4_plugin.moe import DSV4MoEUnsupportedError, DSV4ModelOptNvFp4FusedMoE

    import torch

    w = formats.random_nvfp4_moe_weights(E, 128, 256, generator=torch.Generator().manual_seed(3))
    method = DSV4ModelOptNvFp4FusedMoE(_nvfp4_config(), _moe_config(E, E), activation="bf16")
    layer = _Layer(w, expert_map=None, global_num_experts=E)
    method.process_weights_after_loading(layer)
    with pytest.raises(DSV4MoEUnsupportedError, match="weight reload.*DSV4_MOE=0"):
        method.process_weights_after_loading(layer)


# -- MXFP4 / FP8 expert checkpoints --------------------------------------------------------


def _variant(tmp_path, example, edit):
    with open(os.path.join(example, "config.json")) as f:
        raw = json.load(f)
    edit(raw)
    d = tmp_path / os.path.basename(example)
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    return str(d)


@pytest.mark.parametrize("claim", [True, False, None])
@pytest.mark.parametrize("example", [V4_EXAMPLE, V41_EXAMPLE])
def test_mxfp4_experts_claim_switch(plugin, tmp_path, monkeypatch, example, claim):
    """MXFP4 (native V4-Flash / V4.1-Flash) experts: dsv4's MXFP4 method under
    DSV4_MOE_MXFP4=1; by default (and =0), vLLM's method with one log line (dsv4 attention)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from dsv4_plugin import moe

    path = _variant(tmp_path, example, lambda raw: raw["quantization_config"].pop("moe_quant_algo"))
    cfg = engine_config(path, "dsv4")
    lines = []
    monkeypatch.setattr(moe, "logger", types.SimpleNamespace(
        info_once=lambda msg, *a: lines.append(msg % a)))
    if claim is None:
        monkeypatch.delenv("DSV4_MOE_MXFP4", raising=False)
    else:
        monkeypatch.setenv("DSV4_MOE_MXFP4", "1" if claim else "0")
    layer = RoutedExperts.__new__(RoutedExperts)
    with set_current_vllm_config(cfg):
        for i in range(3):
            got = cfg.quant_config._dsv4_method_for(layer, f"model.layers.{i}.ffn.experts")
            assert got is (moe.DSV4Mxfp4FusedMoE if claim else None)
    for name in ("DSV4_MOE_MXFP4", "DSV4_MOE"):  # one rule for the plugin's switches (dsv4._env)
        monkeypatch.setenv(name, "yes")
        with set_current_vllm_config(cfg), pytest.raises(
                ValueError, match=f'^dsv4: environment variable {name} must be 0 or 1 \\(or unset\\), got "yes"$'):
            cfg.quant_config._dsv4_method_for(layer, "model.layers.0.ffn.experts")
        monkeypatch.delenv(name)
    if claim:
        assert not lines
    else:
        assert lines and all("MXFP4 routed experts stay on vLLM's MoE kernels" in ln for ln in lines)
        assert "Humming W4A8: dsv4's MXFP4 MoE is not yet ahead" in lines[0] and "DSV4_MOE_MXFP4=1" in lines[0]


def test_fp8_experts_are_left_to_vllm_with_one_log_line(plugin, tmp_path, monkeypatch):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from dsv4_plugin import moe

    path = _variant(tmp_path, V4_EXAMPLE, lambda raw: raw.update(expert_dtype="fp8"))
    cfg = engine_config(path, "dsv4")
    lines = []
    monkeypatch.setattr(moe, "logger", types.SimpleNamespace(
        info_once=lambda msg, *a: lines.append(msg % a)))
    layer = RoutedExperts.__new__(RoutedExperts)
    with set_current_vllm_config(cfg):
        assert cfg.quant_config._dsv4_method_for(layer, "model.layers.1.ffn.experts") is None
    assert lines == ["dsv4 plugin: FP8 routed experts stay on vLLM's MoE kernels (dsv4 runs "
                     "NVFP4 and MXFP4 experts); attention runs dsv4"]


# -- the README's tiny-model commands --------------------------------------------------------


def _serve_commands(path):
    with open(path) as f:
        text = f.read()
    cmds = re.findall(r"^(vllm serve examples/\S+.*?(?:\\\n.*?)*)$", text, flags=re.M)
    return [shlex.split(c.replace("\\\n", " ")) for c in cmds]


@pytest.mark.parametrize("doc", ["README.md", "examples/dsv4-tiny-nvfp4/README.md",
                                 "examples/dsv41-tiny-nvfp4/README.md"])
def test_readme_serve_commands_work_offline(plugin, doc, monkeypatch):
    """Each `vllm serve examples/...` command in the docs, through vLLM's real serve
    parser, up to the engine config, with the Hub unreachable (HF_HUB_OFFLINE=1)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(REPO)
    cmds = _serve_commands(os.path.join(REPO, doc))
    assert cmds, f"no `vllm serve examples/...` command in {doc}"
    parser = make_arg_parser(FlexibleArgumentParser())
    for argv in cmds:
        assert argv[:2] == ["vllm", "serve"]
        args = parser.parse_args(["--model", argv[2], *argv[3:]])
        cfg = AsyncEngineArgs.from_cli_args(args).create_engine_config()
        assert cfg.attention_config.backend is AttentionBackendEnum["DSV4"]
        assert cfg.model_config.skip_tokenizer_init
        # without a tokenizer vLLM cannot build a multimodal processor: the V4.1 commands
        # need --language-model-only (the H200 run failed with "requires a tokenizer")
        assert not (cfg.model_config.is_multimodal_model and cfg.model_config.supports_multimodal_inputs), argv
