"""Build vLLM 0.33.0's real DeepSeek V4 / V4.1 models from the tiny example configs on CPU.

The model classes are the CUDA ones (``vllm/models/deepseek_v4/nvidia/model.py``,
``vllm/models/deepseek_v41/nvidia/vl_model.py``), constructed as a Hopper worker
constructs them. Construction makes a few calls that need a CUDA driver or a CUDA
kernel library; :func:`cuda_construction_stand_ins` replaces exactly those, each
with a named stand-in that only lets construction finish (nothing here runs a
forward pass through them):

* ``current_platform.get_device_capability`` -> 9.0 (an H200), so every
  capability-keyed choice is the Hopper one (V4.1's 584-byte V4 KV record,
  64-token kernel blocks, FlashMLA's o_proj recipe);
* ``torch.cuda.Stream`` / ``torch.cuda.Event`` -> inert objects (the model makes
  aux streams and events at construction);
* ``fp8.init_fp8_linear_kernel`` -> :class:`UnrunFp8LinearKernel` (vLLM's CPU
  platform has no block-FP8 GEMM to pick for the FP8 linear layers);
* ``modelopt.select_nvfp4_moe_backend`` -> Marlin (what vLLM picks on Hopper; its
  oracle finds no NVFP4 backend on CPU). Only used when vLLM's own NVFP4 MoE
  method is built, i.e. not with the dsv4 MoE;
* ``mxfp4.select_deepseek_v4_mxfp4_moe_backend`` -> Humming (what vLLM 0.33.0 picks
  for DeepSeek V4's MXFP4 experts on Hopper: ``oracle/mxfp4.py``
  ``_get_priority_backends``, Humming ahead of Marlin by ``prioritize_humming``).
  On CPU the oracle offers only its CPU experts, which need AMX tiles
  (``CPUExpertsMxfp4._supports_current_device``), so without this the build of
  vLLM's own MXFP4 method would depend on the host's CPU. Only used when vLLM's own
  MXFP4 MoE method is built (``DSV4_MOE=0``).

The engine configuration is the one a Hopper worker gets (:func:`engine_config`):
vLLM's CPU platform, on an x86 CPU without AMX tiles, turns chunked prefill and
prefix caching off for MLA models and raises ``max_num_batched_tokens`` to
``max_model_len`` (``vllm/platforms/cpu.py`` ``check_and_update_config``,
``amx_mla_or_dsv4_enabled``); vLLM's CUDA platform leaves all three as the engine
arguments set them. :func:`cuda_engine_limits` keeps them, so the tests see the same
scheduler limits on any CPU, and :func:`engine_config` checks that vLLM kept the
limits a test asked for.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch

HERE = os.path.dirname(__file__)
EXAMPLES = os.path.join(HERE, "..", "..", "examples")
V4_EXAMPLE = os.path.join(EXAMPLES, "dsv4-tiny-nvfp4")
V41_EXAMPLE = os.path.join(EXAMPLES, "dsv41-tiny-nvfp4")


class InertStream:
    """torch.cuda.Stream stand-in: constructed, never used."""

    def __init__(self, *args, **kwargs):
        pass


class InertEvent:
    """torch.cuda.Event stand-in: constructed, never used."""

    def __init__(self, *args, **kwargs):
        pass


class UnrunFp8LinearKernel:
    """FP8 linear kernel stand-in: the linear layers are built, never run."""


@contextlib.contextmanager
def cuda_construction_stand_ins():
    import pytest
    import vllm.model_executor.layers.quantization.fp8 as fp8
    import vllm.model_executor.layers.quantization.modelopt as modelopt
    import vllm.model_executor.layers.quantization.mxfp4 as mxfp4
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (Mxfp4MoeBackend,
                                                                   backend_to_kernel_cls)
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(type(current_platform), "get_device_capability",
                   classmethod(lambda cls, device_id=0: DeviceCapability(9, 0)))
        mp.setattr(torch.cuda, "Stream", InertStream)
        mp.setattr(torch.cuda, "Event", InertEvent)
        mp.setattr(fp8, "init_fp8_linear_kernel", lambda **kw: UnrunFp8LinearKernel())
        mp.setattr(modelopt, "select_nvfp4_moe_backend",
                   lambda **kw: (NvFp4MoeBackend.MARLIN, None))
        humming = Mxfp4MoeBackend.HUMMING
        mp.setattr(mxfp4, "select_deepseek_v4_mxfp4_moe_backend",
                   lambda moe: (humming, backend_to_kernel_cls(humming)[0]))
        yield
    finally:
        mp.undo()


# What vLLM's CPU platform may override for an MLA model and the CUDA platform leaves
# as set: (config attribute of VllmConfig, field).
CUDA_KEPT_LIMITS = (("scheduler_config", "enable_chunked_prefill"),
                    ("scheduler_config", "max_num_batched_tokens"),
                    ("cache_config", "enable_prefix_caching"))


@contextlib.contextmanager
def cuda_engine_limits():
    """The CPU platform's ``check_and_update_config`` with the engine limits of
    :data:`CUDA_KEPT_LIMITS` as they were before it ran, i.e. as vLLM's CUDA platform
    leaves them. Everything else the CPU platform decides stays (block size, worker
    class, compilation mode)."""
    import pytest
    from vllm.platforms import current_platform

    platform = type(current_platform)
    real = platform.check_and_update_config

    def keep_limits(cls, vllm_config):
        kept = [getattr(getattr(vllm_config, part), name) for part, name in CUDA_KEPT_LIMITS]
        real(vllm_config)
        for (part, name), value in zip(CUDA_KEPT_LIMITS, kept):
            setattr(getattr(vllm_config, part), name, value)

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(platform, "check_and_update_config", classmethod(keep_limits))
        yield
    finally:
        mp.undo()


def engine_config(example: str, backend: str | None, **kwargs):
    """vLLM's engine config for ``example`` as a Hopper worker gets it; the scheduler
    limits given in ``kwargs`` (max_num_batched_tokens, max_num_seqs, max_model_len)
    are checked to be the ones vLLM kept, with chunked prefill on."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs = {"max_model_len": 4096, **kwargs}
    with cuda_engine_limits():
        cfg = EngineArgs(
            model=example,
            load_format="dummy",
            skip_tokenizer_init=True,
            attention_backend=backend,
            **kwargs,
        ).create_engine_config()
    check_engine_limits(cfg, kwargs)
    return cfg


def check_engine_limits(cfg, asked: dict) -> None:
    """The limits ``asked`` are the ones in ``cfg``, and chunked prefill is on (as on
    vLLM's CUDA platform for DeepSeek V4)."""
    sched = cfg.scheduler_config
    kept = {"max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs,
            "max_model_len": cfg.model_config.max_model_len}
    for name, value in kept.items():
        if name in asked:
            assert value == asked[name], f"vLLM changed {name}: asked {asked[name]}, got {value}"
    assert sched.enable_chunked_prefill, "vLLM turned chunked prefill off"


_dist_ready = False


def _ensure_distributed(vllm_config) -> None:
    """One gloo process group of world size 1 for this test process."""
    global _dist_ready
    if _dist_ready:
        return
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"file://{tempfile.mktemp(prefix='dsv4-dist-')}",
    )
    initialize_model_parallel(1, 1)
    _dist_ready = True


def model_class(example: str):
    if example == V41_EXAMPLE:
        from vllm.models.deepseek_v41.nvidia.vl_model import DeepseekV41ForCausalLM

        return DeepseekV41ForCausalLM
    from vllm.models.deepseek_v4.nvidia.model import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM


def build_model(example: str, backend: str | None, **kwargs):
    """(vllm_config, model): vLLM's real model for ``example`` with ``backend``."""
    from vllm.config import set_current_vllm_config

    cfg = engine_config(example, backend, **kwargs)
    with cuda_construction_stand_ins(), set_current_vllm_config(cfg):
        _ensure_distributed(cfg)
        with torch.device("cpu"):
            model = model_class(example)(vllm_config=cfg)
    return cfg, model


def kv_cache_specs(cfg) -> dict:
    """Every layer's KV-cache spec, as vLLM's model runner collects them."""
    from vllm.config import set_current_vllm_config

    specs = {}
    with cuda_construction_stand_ins(), set_current_vllm_config(cfg):
        for name, layer in cfg.compilation_config.static_forward_context.items():
            if hasattr(layer, "get_kv_cache_spec"):
                specs[name] = layer.get_kv_cache_spec(cfg)
    return specs
