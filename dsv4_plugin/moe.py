"""dsv4 routed experts (NVFP4 and MXFP4) for vLLM 0.33.0's DeepSeek V4 / V4.1 MoE.

Hook: vLLM's supported quantization-plugin API (``register_quantization_config``),
not a patch. vLLM resolves every DeepSeek V4 / V4.1 checkpoint (FP8 linear layers,
fp4/fp8 experts) to its quantization method ``deepseek_v4_fp8``, whose class on CUDA
is ``vllm.models.deepseek_v41.quant_config.DeepseekV4FP8Config``.
:func:`register_moe` registers :class:`DSV4DeepseekV4Config`, a subclass of that
class, under the same name. Name, checkpoint detection
(``override_quantization_method``), an explicit ``--quantization``, linear layers,
shared experts: all vLLM's, unchanged. Only ``get_quant_method`` differs, and only
for routed experts, only when the DSV4 attention backend is selected, only for fp4
experts (``expert_dtype: "fp4"``, minus the ``ignore`` lists, exactly as vLLM decides
it) and unless ``DSV4_MOE=0``:

* ModelOpt NVFP4 experts (``quantization_config.moe_quant_algo == "NVFP4"``) get
  :class:`DSV4ModelOptNvFp4FusedMoE`: vLLM's ``ModelOptNvFp4FusedMoE`` (same
  parameters, same checkpoint loading) with dsv4's kernel;
* MXFP4 experts (DeepSeek's native V4-Flash / V4-Pro / V4.1-Flash checkpoints: no
  ``moe_quant_algo``) get :class:`DSV4Mxfp4FusedMoE`: vLLM's ``Mxfp4MoEMethod``
  (same parameters, same checkpoint loading) with dsv4's kernel when
  ``DSV4_MOE_MXFP4=1`` (:func:`mxfp4_claimed`); by default they stay on vLLM's
  kernels (one log line).

FP8 experts (``expert_dtype: "fp8"``) stay on vLLM's kernels (one log line).

Both methods build a modular ``FusedMoEKernel``: vLLM's prepare/finalize (no
activation quantization, EP dispatch when configured) around :class:`DSV4Experts`, a
``FusedMoEExpertsModular`` that calls ``dsv4.moe.routed_moe`` with vLLM's
``topk_ids`` / ``topk_weights`` / ``expert_map``. Weights are converted once at load
by ``dsv4.moe.prepare_moe_weights`` and the checkpoint-layout copies released, so
features that need those copies or a different kernel interface are refused at
construction (:data:`REFUSALS`), each with one message naming it and ``DSV4_MOE=0``.

Activation mode (``DSV4_MOE_ACTIVATION``, unset = the format's default):
  * NVFP4: ``bf16`` (default, W4A16: e2m1 x e4m3 weights dequantize exactly to bf16;
    what vLLM itself runs on Hopper (Humming W4A16); Hopper has no FP4 tensor cores, so
    A4 would cost accuracy for no speed) or ``nvfp4`` (W4A4 with the checkpoint's
    ``input_scale``, max over experts as vLLM's Blackwell NVFP4 backends use it: the
    numerics of a Blackwell deployment).
  * MXFP4: ``fp8`` (default, W4A8: FP8 activations per token and per 128 along K,
    FP8 tensor cores; vLLM's own Hopper numerics for these checkpoints (Humming W4A8)
    and DeepSeek's reference; GEMM1's scales are powers of two exactly when vLLM's
    DeepGEMM E8M0 setting is on, ``is_deep_gemm_e8m0_used``, as vLLM quantizes them)
    or ``bf16`` (W4A16: e2m1 x 2^e is exact in bf16).
"""

from __future__ import annotations

import torch

from vllm import envs
from vllm.config.quantization import QuantizationConfigArgs
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe import modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
    mxfp4_w4a16_moe_quant_config,
    nvfp4_w4a16_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceNoOP,
)
from vllm.model_executor.layers.quantization.modelopt import (
    ModelOptNvFp4Config,
    ModelOptNvFp4FusedMoE,
)
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    QuantKey,
    is_layer_skipped,
    kFp8Dynamic128Sym,
    kMxfp4Static,
    kNvfp4Dynamic,
    kNvfp4Static,
)
from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used
# The class vLLM's get_quantization_config("deepseek_v4_fp8") returns on CUDA (V4
# and V4.1 checkpoints alike; vllm/model_executor/layers/quantization/__init__.py).
from vllm.models.deepseek_v41.quant_config import DeepseekV4FP8Config

from dsv4 import _env
from dsv4.formats import MXFP4_BLOCK, NVFP4_BLOCK
from dsv4.moe import modes

logger = init_logger(__name__)

# vLLM's own name for DeepSeek V4 / V4.1 checkpoints; the plugin keeps it.
QUANT_NAME = "deepseek_v4_fp8"


def mxfp4_claimed() -> bool:
    """DSV4_MOE_MXFP4=1 claims MXFP4 routed experts (DeepSeek's native checkpoints) for
    dsv4. Off by default until dsv4's MXFP4 MoE measures ahead of the Humming W4A8 call
    vLLM runs for them at every size (not yet: V4-Pro at M = 8192 on an H100, 0.992x, and
    M >= 2048 in the H200 run of record; docs/perf.md, "Routed-expert MoE (MXFP4)"), so they
    stay on vLLM's kernels with one log line (README "Left to vLLM"). A switch of
    dsv4._env: unset or empty, 0 or 1; anything else is an error naming it."""
    return _env.switch("DSV4_MOE_MXFP4", False)


# Activation modes per expert format, the default first (dsv4.moe.modes).
ACTIVATION_MODES = modes.ACTIVATIONS


def moe_enabled() -> bool:
    """DSV4_MOE=0 keeps vLLM's own MoE kernels (a switch of dsv4._env: unset or empty,
    0 or 1; anything else is an error naming it)."""
    return _env.switch("DSV4_MOE", True)


def activation_mode(fmt: str) -> str:
    """The activation mode DSV4_MOE_ACTIVATION picks for experts of format ``fmt`` (a
    choice of dsv4._env: unset or empty is the format's default; anything the format
    does not run is an error naming the variable, the format and its modes)."""
    allowed = ACTIVATION_MODES[fmt]
    return _env.choice("DSV4_MOE_ACTIVATION", allowed, modes.default_activation(fmt),
                       f" for {fmt.upper()} routed experts")


def _dsv4_moe_ops():
    from dsv4 import moe as ops

    return ops


def _storages(obj, seen=None) -> set[int]:
    """data_ptrs of every tensor storage reachable from a weights object."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        seen.add(obj.untyped_storage().data_ptr())
    elif isinstance(obj, dict):
        for v in obj.values():
            _storages(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _storages(v, seen)
    elif hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            _storages(v, seen)
    return seen


class DSV4Experts(mk.FusedMoEExpertsModular):
    """Modular experts that run ``dsv4.moe.routed_moe`` (standard activation format).

    Takes unquantized (bf16) hidden states, does routing prep, both grouped GEMMs,
    clamped SwiGLU, the activation quantization of its mode and the weighted top-k
    combine itself, honours ``expert_map`` (-1 = expert not on this rank) for expert
    parallelism. ``fmt``: the checkpoint's expert format, "nvfp4" or "mxfp4".
    """

    def __init__(
        self,
        moe_config: FusedMoEConfig,
        quant_config: FusedMoEQuantConfig,
        *,
        fmt: str,
        activation: str,
        swiglu_limit: float | None = None,
        a13_scale: torch.Tensor | None = None,
        a2_scale: torch.Tensor | None = None,
        ue8m0: bool = True,
    ):
        super().__init__(moe_config, quant_config)
        if fmt not in ACTIVATION_MODES:
            raise ValueError(f"dsv4: fmt must be one of {tuple(ACTIVATION_MODES)}, got {fmt!r}")
        if activation not in ACTIVATION_MODES[fmt]:
            raise ValueError(f"dsv4: activation must be one of {ACTIVATION_MODES[fmt]} for {fmt} "
                             f"experts, got {activation!r}")
        if activation == "nvfp4" and (a13_scale is None or a2_scale is None):
            raise ValueError('dsv4: activation="nvfp4" needs the checkpoint input scales')
        self.dsv4_format = fmt
        self.dsv4_activation = activation
        self.swiglu_limit = None if swiglu_limit is None else float(swiglu_limit)
        self.dsv4_a13_scale = a13_scale
        self.dsv4_a2_scale = a2_scale
        self.dsv4_ue8m0 = bool(ue8m0)
        self.weights = None

    # -- weights ---------------------------------------------------------------

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """One-time conversion of the layer's stacked vLLM tensors into dsv4's layout."""
        extra = {}
        if self.dsv4_format == "nvfp4":
            extra = {"w13_scale_2": layer.w13_weight_scale_2, "w2_scale_2": layer.w2_weight_scale_2}
        self.weights = _dsv4_moe_ops().prepare_moe_weights(
            layer.w13_weight, layer.w13_weight_scale, layer.w2_weight, layer.w2_weight_scale,
            format=self.dsv4_format, activation=self.dsv4_activation, **extra,
        )
        # The layer's checkpoint-layout tensors are only read for their shapes
        # from now on; if prepare made copies, release the originals (keeping the
        # shapes through a zero-stride view) so expert memory is not held twice.
        kept = _storages(self.weights)
        for name in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"):
            p = getattr(layer, name)
            if p.untyped_storage().data_ptr() not in kept and p.numel() > 0:
                p.data = p.data.new_empty(1).expand(p.shape)

    # -- capability flags used by vLLM's oracle ----------------------------------

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True  # dsv4 has CUDA (sm_90a) kernels and float32 CPU kernels

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key: QuantKey | None, activation_key: QuantKey | None) -> bool:
        if weight_key == kNvfp4Static:
            return activation_key in (None, kNvfp4Dynamic)
        return weight_key == kMxfp4Static and activation_key in (None, kFp8Dynamic128Sym)

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return not moe_parallel_config.use_batched_activation_format

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True

    def supports_expert_map(self) -> bool:
        return True

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()  # routed_moe applies topk weights and sums

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        return ((0,), (0,), (M, K))

    # -- compute -----------------------------------------------------------------

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: mk.ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool,
    ) -> None:
        if self.weights is None:
            raise RuntimeError("DSV4Experts: weights were never loaded")
        if apply_router_weight_on_input:
            raise NotImplementedError("dsv4 experts apply the router weights after GEMM2")
        if activation != MoEActivation.SILU:
            raise NotImplementedError(f"dsv4 experts implement SwiGLU only, got {activation}")
        # routed_moe casts ids/weights/expert_map to the dtypes the ops take
        _dsv4_moe_ops().routed_moe(
            hidden_states,
            topk_ids,
            topk_weights,
            self.weights,
            swiglu_limit=self.swiglu_limit,
            ue8m0=self.dsv4_ue8m0,
            a13_scale=self.dsv4_a13_scale,
            a2_scale=self.dsv4_a2_scale,
            expert_map=expert_map,
            out=output,
            check_ids=False,  # ids come from vLLM's router; the kernels drop invalid ones
        )


class DSV4MoEUnsupportedError(NotImplementedError):
    """A vLLM feature the dsv4 MoE does not support was requested."""


def _refusal(fmt: str, feature: str, why: str, remedy: str | None = None) -> DSV4MoEUnsupportedError:
    return DSV4MoEUnsupportedError(
        f"dsv4 {fmt.upper()} MoE does not support {feature} ({why}); "
        f"{remedy or f'turn {feature} off'}, or set DSV4_MOE=0 to keep vLLM's MoE kernels "
        "(attention still runs dsv4)"
    )


def _moe_quant_override(vc, mc) -> bool:
    qc = getattr(vc.model_config, "quantization_config", None)
    return isinstance(qc, QuantizationConfigArgs) and qc.moe is not None


# Features refused at construction: (formats, feature, why, predicate on (vllm_config,
# moe_config)), the first one that is on raises; a feature's remedy is "turn it off".
REFUSALS = (
    (("nvfp4", "mxfp4"), "LoRA", "the experts run dsv4's kernel, which has no LoRA path",
     lambda vc, mc: vc.lora_config is not None),
    (("nvfp4", "mxfp4"), "DeepEP low-latency all2all", "it hands experts batched "
     "activations; dsv4 takes the standard token layout",
     lambda vc, mc: mc.moe_parallel_config.use_deepep_ll_kernels),
    (("nvfp4", "mxfp4"), "EPLB", "weights are converted once at load into dsv4's layout, "
     "so experts cannot move", lambda vc, mc: mc.moe_parallel_config.enable_eplb),
    (("nvfp4", "mxfp4"), "sleep mode", "level 2 discards the weights and reloads them into "
     "checkpoint-layout tensors that dsv4 released after converting them",
     lambda vc, mc: vc.model_config.enable_sleep_mode),
    (("nvfp4", "mxfp4"), "pre-processed weights", "--load-format ipc_cache / sharded_state "
     "hand over vLLM's post-processed expert tensors, not the checkpoint layout dsv4 converts",
     lambda vc, mc: vc.load_config.load_format in ("ipc_cache", "sharded_state")),
    (("nvfp4", "mxfp4"), "a MoE quantization override (--quantization-config moe)",
     "the dsv4 experts run the checkpoint's own format, in the activation mode "
     "DSV4_MOE_ACTIVATION names", _moe_quant_override),
    (("mxfp4",), "VLLM_HUMMING_INPUT_QUANT_CONFIG", "it configures vLLM's Humming MoE "
     "kernels, which dsv4 replaces; DSV4_MOE_ACTIVATION picks dsv4's activation mode",
     lambda vc, mc: bool(envs.VLLM_HUMMING_INPUT_QUANT_CONFIG)),
)
WEIGHT_RELOAD_REFUSAL = ("weight reload", "the checkpoint-layout expert tensors were "
                         "released after the first conversion")


def check_supported(vllm_config, moe_config: FusedMoEConfig, fmt: str) -> None:
    """Raise DSV4MoEUnsupportedError for the first refused feature that is on."""
    for formats, feature, why, is_on in REFUSALS:
        if fmt in formats and is_on(vllm_config, moe_config):
            raise _refusal(fmt, feature, why)
    # Any multiple of the scale block runs: dsv4's prepare pads N with zeros to its
    # kernels' tile (NVFP4 and MXFP4 W4A16: 64, V4.1-Flash at TP 8: 288 -> 320; MXFP4
    # W4A8: 32).
    n = moe_config.intermediate_size_per_partition
    block = {"nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK}[fmt]
    if n % block:
        raise _refusal(fmt, f"a per-rank expert intermediate size of {n}", f"an {fmt.upper()} scale "
                       f"covers {block} elements along it, so it must be a multiple of {block}",
                       f"pick a tensor-parallel size that divides it into multiples of {block}")


def _refuse_eplb(fmt: str, moe_config: FusedMoEConfig) -> None:
    # Also when the method is built outside a vLLM config (check_supported's caller).
    if moe_config.moe_parallel_config.enable_eplb:
        raise _refusal(fmt, *next(r[1:3] for r in REFUSALS if r[1] == "EPLB"))


def _prepare_finalize(method: FusedMoEMethodBase, layer: RoutedExperts):
    pf = maybe_make_prepare_finalize(
        moe=method.moe,
        quant_config=method.moe_quant_config,
        routing_tables=layer._expert_routing_tables(),
        allow_new_interface=True,
        use_monolithic=False,
    )
    assert pf is not None
    return pf


def _swiglu_limit(method: FusedMoEMethodBase, layer: RoutedExperts):
    limit = getattr(layer, "swiglu_limit", None)
    return method.moe.swiglu_limit if limit is None else limit


class _DSV4Method:
    """What dsv4's two MoE methods share, ahead of vLLM's method in their bases: the
    experts class, the activation mode and its log line, and the features the converted
    weights cannot serve (EPLB, pre-processed weights)."""

    # vLLM's ipc_cache loader checks this before loading; dsv4 converts the
    # checkpoint layout itself (and REFUSALS names the feature at construction).
    supports_pre_processed_weights = False

    def _init_dsv4(self, fmt: str, moe_config: FusedMoEConfig, activation: str | None) -> None:
        self.experts_cls = DSV4Experts
        self.dsv4_activation = activation or activation_mode(fmt)
        _refuse_eplb(fmt, moe_config)
        logger.info_once(
            "dsv4 plugin: DeepSeek V4 %s routed experts run dsv4.moe.routed_moe "
            "(activation=%s, %s)", fmt.upper(), self.dsv4_activation, modes.NUMERICS[self.dsv4_activation]
        )

    @property
    def supports_eplb(self) -> bool:
        return False


# The class name must contain "ModelOpt": vLLM 0.33.0's RoutedExperts.weight_loader
# picks the ModelOpt loading rules (per-tensor weight_scale_2 / input_scale, combined
# w13 scales) by the quantization method's class name (fused_moe/routed_experts.py).
class DSV4ModelOptNvFp4FusedMoE(_DSV4Method, ModelOptNvFp4FusedMoE):
    """vLLM's ModelOpt NVFP4 MoE method (same weights and loading), dsv4 kernel. The
    per-rank N of vLLM's parameters (a multiple of 16, check_supported) need not fit
    dsv4's tile: its prepare pads N with zeros (V4.1-Flash at TP 8: 288 -> 320)."""

    def __init__(self, quant_config: ModelOptNvFp4Config, moe_config: FusedMoEConfig,
                 activation: str | None = None) -> None:
        # Not ModelOptNvFp4FusedMoE.__init__: that one selects one of vLLM's own
        # NVFP4 backends (and logs it); everything it sets is set here instead.
        FusedMoEMethodBase.__init__(self, moe_config)
        self.quant_config = quant_config
        self.use_a16 = False
        self.per_token_activation = False
        self.nvfp4_backend = None
        self.use_global_sf = False
        self._init_dsv4("nvfp4", moe_config, activation)

    def get_fused_moe_quant_config(self, layer: RoutedExperts) -> FusedMoEQuantConfig:
        # Activations enter unquantized (the experts quantize them themselves in
        # nvfp4 mode), so prepare/finalize must not quantize: the W4A16 config.
        return nvfp4_w4a16_moe_quant_config(
            g1_alphas=layer.w13_weight_scale_2,
            g2_alphas=layer.w2_weight_scale_2,
            w1_scale=layer.w13_weight_scale,
            w2_scale=layer.w2_weight_scale,
            gemm1_clamp_limit=_swiglu_limit(self, layer),
        )

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        if getattr(self, "moe_kernel", None) is not None:
            # vLLM's reload_weights / layerwise reload runs this again after loading
            # into the (released) checkpoint-layout tensors.
            raise _refusal("nvfp4", *WEIGHT_RELOAD_REFUSAL)
        if self.moe.is_act_and_mul and not torch.allclose(
            layer.w13_weight_scale_2[:, 0], layer.w13_weight_scale_2[:, 1]
        ):
            logger.warning_once(
                "dsv4 plugin: w1 and w3 weight_scale_2 differ; dsv4 applies each to its "
                "own rows (gate / up)"
            )
        a13 = a2 = None
        if self.dsv4_activation == "nvfp4":
            # One activation scale for all experts (the quantized tensor is shared),
            # like vLLM's Blackwell NVFP4 backends (amax_for_moe_activation_quant).
            a13 = layer.w13_input_scale.max().float().reshape(1)
            a2 = layer.w2_input_scale.max().float().reshape(1)
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        experts = DSV4Experts(self.moe, self.moe_quant_config, fmt="nvfp4",
                              activation=self.dsv4_activation,
                              swiglu_limit=_swiglu_limit(self, layer), a13_scale=a13, a2_scale=a2)
        experts.process_weights_after_loading(layer)
        self.moe_kernel = mk.FusedMoEKernel(_prepare_finalize(self, layer), experts)


class DSV4Mxfp4FusedMoE(_DSV4Method, Mxfp4MoEMethod):
    """vLLM's MXFP4 MoE method (same weights, DeepSeek V4's stacked w13 / w2 layout and
    its e8m0 scale loading), dsv4 kernel. N is not rounded up for a vLLM backend:
    dsv4's prepare pads it to its own tile with zeros."""

    def __init__(self, moe_config: FusedMoEConfig, activation: str | None = None) -> None:
        # Not Mxfp4MoEMethod.__init__: that one selects one of vLLM's own MXFP4
        # backends (and logs it); what the inherited create_weights and apply read is
        # set here. Nothing here reads self.mxfp4_backend (the methods that do are
        # overridden below).
        FusedMoEMethodBase.__init__(self, moe_config)
        self.weight_dtype = "mxfp4"
        self._init_dsv4("mxfp4", moe_config, activation)

    @property
    def skip_forward_padding(self) -> bool:
        return False

    @property
    def has_unpadded_output(self) -> bool:
        return False

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype,
                            moe_parallel_config):
        return FusedMoEMethodBase.maybe_roundup_sizes(
            self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config
        )

    def get_fused_moe_quant_config(self, layer: RoutedExperts) -> FusedMoEQuantConfig:
        # Activations enter unquantized (the W4A8 experts quantize them themselves,
        # per token and per 128 along K), so prepare/finalize must not quantize.
        return mxfp4_w4a16_moe_quant_config(
            w1_scale=layer.w13_weight_scale,
            w2_scale=layer.w2_weight_scale,
            gemm1_clamp_limit=_swiglu_limit(self, layer),
        )

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        if self.moe_kernel is not None:
            raise _refusal("mxfp4", *WEIGHT_RELOAD_REFUSAL)
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        # GEMM1's per-128 activation scales: powers of two exactly when vLLM's own
        # block-FP8 quantization of the MoE input uses them (per_token_group_quant_fp8).
        experts = DSV4Experts(self.moe, self.moe_quant_config, fmt="mxfp4",
                              activation=self.dsv4_activation,
                              swiglu_limit=_swiglu_limit(self, layer),
                              ue8m0=is_deep_gemm_e8m0_used())
        experts.process_weights_after_loading(layer)
        self.moe_kernel = mk.FusedMoEKernel(_prepare_finalize(self, layer), experts)


def dsv4_selected() -> bool:
    """Is the DSV4 attention backend selected in the config being built?"""
    from vllm.config import get_current_vllm_config_or_none

    from .attention import is_dsv4_selected

    cfg = get_current_vllm_config_or_none()
    return cfg is not None and is_dsv4_selected(cfg)


class DSV4DeepseekV4Config(DeepseekV4FP8Config):
    """vLLM's ``deepseek_v4_fp8`` config; under DSV4, fp4 routed experts go to dsv4."""

    def _dsv4_method_for(self, layer, prefix):
        """The dsv4 method class for this layer's routed experts, or None (then
        vLLM's own method is used, as without the plugin). The same decision as
        vLLM's get_quant_method between ModelOptNvFp4FusedMoE and Mxfp4MoEMethod
        (RoutedExperts, not skipped, fp4 experts, _is_nvfp4_expert_layer)."""
        if not (isinstance(layer, RoutedExperts) and moe_enabled() and dsv4_selected()):
            return None
        if is_layer_skipped(  # vLLM keeps these unquantized
            prefix=prefix,
            ignored_layers=self.ignored_layers,
            fused_mapping=self.packed_modules_mapping,
        ):
            return None
        if self.expert_dtype != "fp4":
            logger.info_once(
                "dsv4 plugin: %s routed experts stay on vLLM's MoE kernels (dsv4 runs "
                "NVFP4 and MXFP4 experts); attention runs dsv4", self.expert_dtype.upper()
            )
            return None
        if self._is_nvfp4_expert_layer(prefix):
            return DSV4ModelOptNvFp4FusedMoE
        if not mxfp4_claimed():
            logger.info_once(
                "dsv4 plugin: MXFP4 routed experts stay on vLLM's MoE kernels (Humming "
                "W4A8: dsv4's MXFP4 MoE is not yet ahead of it at every size, docs/perf.md; "
                "DSV4_MOE_MXFP4=1 selects dsv4's); attention runs dsv4"
            )
            return None
        return DSV4Mxfp4FusedMoE

    def get_quant_method(self, layer, prefix):
        method = self._dsv4_method_for(layer, prefix)
        if method is None:
            return super().get_quant_method(layer, prefix)
        from vllm.config import get_current_vllm_config

        if method is DSV4ModelOptNvFp4FusedMoE:
            check_supported(get_current_vllm_config(), layer.moe_config, "nvfp4")
            return DSV4ModelOptNvFp4FusedMoE(self._get_nvfp4_config(), layer.moe_config)
        check_supported(get_current_vllm_config(), layer.moe_config, "mxfp4")
        return DSV4Mxfp4FusedMoE(layer.moe_config)


def register_moe() -> None:
    """Make ``deepseek_v4_fp8`` resolve to DSV4DeepseekV4Config (idempotent)."""
    from vllm.model_executor.layers.quantization import (
        get_quantization_config,
        register_quantization_config,
    )

    if get_quantization_config(QUANT_NAME) is not DSV4DeepseekV4Config:
        register_quantization_config(QUANT_NAME)(DSV4DeepseekV4Config)
