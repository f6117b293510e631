"""vLLM 0.33.0's real DeepSeek V4 MoE layers on CPU, end to end: the model built from a
two-layer variant of the tiny V4 example (layer 0 hash-routed, layer 1 biased top-k),
a synthetic checkpoint (fresh random data, the checkpoint's own tensor names) loaded
through the model's ``load_weights`` (its name mapping and vLLM's expert weight
loader), vLLM's ``process_weights_after_loading`` and the MoE layer's forward (the
gate, vLLM's router, the quantization method's kernel, the shared expert, the
runner's combine and, with tensor parallel, its all-reduce), and an independent
float32 computation of the same layer.

Stand-ins, beyond _cpu_model.py's construction ones, each only for a compiled kernel
that cannot run here (no GPU, no vllm._C):

* the FP8 block linear kernel of the shared expert (vLLM's CPU platform has none):
  :class:`Fp8BlockLinearStandIn` dequantizes the e4m3 weight with its e8m0 128x128
  block scales and multiplies in float32;
* vLLM's CPU routing kernels ``biased_topk_cpu`` / ``hash_topk_cpu`` (vllm._C),
  which vLLM's ``CPURouter`` calls for DeepSeek V4's sqrtsoftplus scoring:
  :func:`biased_topk_stand_in` / :func:`hash_topk_stand_in`, written from that
  router's docstring (weight = sqrt(softplus(logit)); biased layers select the top k
  of weight + bias, hash layers take ``tid2eid[input_id]``; the selected unbiased
  weights are renormalized to sum to routed_scaling_factor).
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.nn.functional as F

from _cpu_model import V4_EXAMPLE, cuda_construction_stand_ins, engine_config, model_class

# Fewer and smaller experts than the tiny V4 example (16 of 256 x 512) so that dsv4's
# load-time conversion (pure torch on CPU) stays quick on CI's two cores.
E, K, N, TOPK, VOCAB = 8, 512, 128, 4, 1024
LAYERS = (0, 1)  # hash-routed, biased top-k
LIMIT, SCALING = 10.0, 1.5  # the example's swiglu_limit and routed_scaling_factor


def write_variant(dst: str, fmt: str, n: int = N) -> str:
    """The tiny V4 config with two layers (window-only attention), a small vocabulary,
    E experts of intermediate size n (hidden K), NVFP4 (ModelOpt) or MXFP4 (DeepSeek's
    native) experts."""
    with open(os.path.join(V4_EXAMPLE, "config.json")) as f:
        raw = json.load(f)
    assert (raw["hidden_size"], raw["num_experts_per_tok"], raw["swiglu_limit"],
            raw["routed_scaling_factor"], raw["num_hash_layers"]) == (K, TOPK, LIMIT, SCALING, 1)
    raw.update(num_hidden_layers=len(LAYERS), vocab_size=VOCAB, compress_ratios=[0] * 3,
               n_routed_experts=E, moe_intermediate_size=n)
    if fmt == "mxfp4":
        raw["quantization_config"].pop("moe_quant_algo")
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(raw, f)
    return dst


# -- stand-ins -------------------------------------------------------------------------


class Fp8BlockLinearStandIn:
    """FP8 block linear kernel stand-in: float32 dequantize-and-multiply."""

    def process_weights_after_loading(self, layer):
        pass

    def apply_weights(self, layer, x, bias=None):
        w = dequantize_fp8_block(layer.weight, layer.weight_scale_inv)
        return (x.float() @ w.T).to(x.dtype)


def _sqrtsoftplus(logits):
    return torch.sqrt(F.softplus(logits.float()))


def _renormalized(scores, ids, scaling):
    w = scores.gather(1, ids.long())
    return (w / w.sum(-1, keepdim=True) * scaling).float(), ids.to(torch.int32)


def biased_topk_stand_in(hidden_states, gating_output, correction_bias, topk, renormalize,
                         scoring_func, num_fused_shared_experts, routed_scaling_factor,
                         apply_routed_scaling_factor_on_output):
    assert (renormalize, scoring_func, num_fused_shared_experts) == (True, "sqrtsoftplus", 0)
    s = _sqrtsoftplus(gating_output)
    return _renormalized(s, torch.topk(s + correction_bias, topk, dim=-1).indices, routed_scaling_factor)


def hash_topk_stand_in(gating_output, tid2eid, topk, scoring_func, num_fused_shared_experts,
                       num_experts, routed_scaling_factor):
    assert (scoring_func, num_fused_shared_experts, tid2eid.shape[1]) == ("sqrtsoftplus", 0, topk)
    return _renormalized(_sqrtsoftplus(gating_output), tid2eid, routed_scaling_factor)


@contextlib.contextmanager
def kernel_stand_ins():
    import pytest
    import vllm.model_executor.layers.fused_moe.router.cpu_router as cpu_router
    import vllm.model_executor.layers.quantization.fp8 as fp8

    with cuda_construction_stand_ins():
        mp = pytest.MonkeyPatch()
        try:
            mp.setattr(fp8, "init_fp8_linear_kernel", lambda **kw: Fp8BlockLinearStandIn())
            mp.setattr(cpu_router, "biased_topk_cpu", biased_topk_stand_in)
            mp.setattr(cpu_router, "hash_topk_cpu", hash_topk_stand_in)
            yield
        finally:
            mp.undo()


# -- the model ---------------------------------------------------------------------------


def build(path: str, ensure_distributed, **engine_kwargs):
    """(vllm_config, model) of vLLM's DeepseekV4ForCausalLM with dsv4 selected."""
    from vllm.config import set_current_vllm_config

    cfg = engine_config(path, "dsv4", **engine_kwargs)
    with kernel_stand_ins(), set_current_vllm_config(cfg):
        ensure_distributed(cfg)
        with torch.device("cpu"):
            model = model_class(V4_EXAMPLE)(vllm_config=cfg)
    return cfg, model


def load(cfg, model, ckpt: dict) -> set:
    """The checkpoint through the model's load_weights, then vLLM's post-load step for
    the MoE layers (routed experts, gate, shared expert)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with kernel_stand_ins(), set_current_vllm_config(cfg):
        loaded = model.load_weights(iter(ckpt.items()))
        for i in LAYERS:
            process_weights_after_loading(model.model.layers[i].ffn, cfg.model_config, torch.device("cpu"))
    return loaded


def forward(cfg, model, layer: int, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """vLLM's DeepseekV4MoE.forward of one layer (routed + shared experts)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with kernel_stand_ins(), set_current_vllm_config(cfg), set_forward_context(None, cfg, num_tokens=x.shape[0]):
        return model.model.layers[layer].ffn(x, input_ids)


# -- a synthetic checkpoint (the checkpoint's names, before vLLM's mapping) --------------


def _fp4_codes(rows, cols, g):
    return torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)


def checkpoint(fmt: str, seed: int, n: int = N) -> dict:
    """Gate, routing tables, routed experts in ``fmt`` of intermediate size n, FP8
    shared expert (also of intermediate size n), for LAYERS."""
    g = torch.Generator().manual_seed(seed)
    ckpt = {}
    for layer in LAYERS:
        pre = f"layers.{layer}.ffn."
        ckpt[pre + "gate.weight"] = torch.randn(E, K, generator=g) * 0.02
        if layer == 0:
            ckpt[pre + "gate.tid2eid"] = torch.stack(
                [torch.randperm(E, generator=g)[:TOPK] for _ in range(VOCAB)]).to(torch.int32)
        else:
            ckpt[pre + "gate.bias"] = torch.rand(E, generator=g) * 0.3
        for e in range(E):
            for w, (rows, cols) in (("w1", (n, K)), ("w3", (n, K)), ("w2", (K, n))):
                p = f"{pre}experts.{e}.{w}."
                ckpt[p + "weight"] = _fp4_codes(rows, cols, g)
                if fmt == "nvfp4":  # ModelOpt: e4m3 scale per 16, fp32 global (dequant) scale
                    ckpt[p + "weight_scale"] = (torch.rand(rows, cols // 16, generator=g) * 2 + 0.25).to(
                        torch.float8_e4m3fn)
                    ckpt[p + "weight_scale_2"] = torch.rand((), generator=g) * 0.03 + 0.02
                    ckpt[p + "input_scale"] = torch.rand((), generator=g) + 0.5
                else:  # DeepSeek's MXFP4: e8m0 scale per 32, named ".scale" in the checkpoint
                    ckpt[p + "scale"] = torch.randint(120, 125, (rows, cols // 32), generator=g,
                                                      dtype=torch.uint8).view(torch.float8_e8m0fnu)
        for w, (rows, cols) in (("w1", (n, K)), ("w3", (n, K)), ("w2", (K, n))):
            p = f"{pre}shared_experts.{w}."
            ckpt[p + "weight"] = torch.randn(rows, cols, generator=g).to(torch.float8_e4m3fn)
            ckpt[p + "scale"] = torch.randint(118, 122, (-(-rows // 128), -(-cols // 128)), generator=g,
                                              dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return ckpt


def tokens(seed: int, M: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16)
    return x, torch.randint(0, VOCAB, (M,), generator=g)


# -- the independent float32 computation ---------------------------------------------------

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """[..., C/2] uint8 -> [..., C] float32, the low nibble holding the even element."""
    return E2M1[torch.stack([packed & 15, packed >> 4], -1).long()].flatten(-2)


def dequantize_fp8_block(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    scale = s.view(torch.uint8).float().sub(127).exp2()
    scale = scale.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    return w.float() * scale


_decoded: dict = {}


def expert_weights(ckpt: dict, layer: int, e: int, fmt: str) -> dict:
    """float32 w1, w3 [N, K] and w2 [K, N] of one expert, exactly as encoded (decoded
    once per checkpoint)."""
    key = (id(ckpt), layer, e)
    if key in _decoded and _decoded[key][0] is ckpt:
        return _decoded[key][1]
    out = {}
    for w in ("w1", "w3", "w2"):
        p = f"layers.{layer}.ffn.experts.{e}.{w}."
        v = fp4_values(ckpt[p + "weight"])
        if fmt == "nvfp4":
            v = v * ckpt[p + "weight_scale"].float().repeat_interleave(16, -1) * ckpt[p + "weight_scale_2"]
        else:
            v = v * ckpt[p + "scale"].view(torch.uint8).float().sub(127).exp2().repeat_interleave(32, -1)
        out[w] = v
    _decoded[key] = (ckpt, out)
    return out


def swiglu(g, u, limit):
    g = g.clamp(max=limit) if limit is not None else g
    u = u.clamp(-limit, limit) if limit is not None else u
    return g * torch.sigmoid(g) * u


def routing(ckpt: dict, layer: int, x: torch.Tensor, input_ids: torch.Tensor, *, bias=True,
            hashed=True, scaling=SCALING):
    """(ids [M, k], weights [M, k]) of DeepSeek V4's sqrtsoftplus routing: hash layers
    take tid2eid[input_id], the others the top k of score + bias; the selected scores
    renormalized to sum to the routed scaling factor."""
    pre = f"layers.{layer}.ffn.gate."
    scores = torch.sqrt(F.softplus(x.float() @ ckpt[pre + "weight"].T))
    if hashed and pre + "tid2eid" in ckpt:
        ids = ckpt[pre + "tid2eid"][input_ids].long()
    else:
        ids = torch.topk(scores + (ckpt[pre + "bias"] if bias and pre + "bias" in ckpt else 0), TOPK,
                         dim=-1).indices
    w = scores.gather(1, ids)
    return ids, w / w.sum(-1, keepdim=True) * scaling


def shared_expert(ckpt: dict, layer: int, x: torch.Tensor) -> torch.Tensor:
    p = f"layers.{layer}.ffn.shared_experts."
    w = {n: dequantize_fp8_block(ckpt[p + n + ".weight"], ckpt[p + n + ".scale"]) for n in ("w1", "w3", "w2")}
    xf = x.float()
    return swiglu(xf @ w["w1"].T, xf @ w["w3"].T, LIMIT) @ w["w2"].T


def reference(ckpt: dict, layer: int, x: torch.Tensor, input_ids: torch.Tensor, fmt: str, *,
              quantize=None, limit=LIMIT, **routing_kw) -> torch.Tensor:
    """float32 DeepseekV4MoE output: shared expert + routed experts.

    quantize: None (activations used as given) or (q1, q2), the quantize-dequantize
    of GEMM1's input and of GEMM2's input (the clamped SwiGLU output, float32).
    limit, routing_kw (see :func:`routing`): what the test varies to show that the
    comparison would notice each feature missing.
    """
    ids, weights = routing(ckpt, layer, x, input_ids, **routing_kw)
    out = shared_expert(ckpt, layer, x)
    xf = x.float()
    for e in range(E):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        w = expert_weights(ckpt, layer, e, fmt)
        xe = xf[rows] if quantize is None else quantize[0](xf[rows])
        h = swiglu(xe @ w["w1"].T, xe @ w["w3"].T, limit)
        if quantize is not None:
            h = quantize[1](h)
        out.index_add_(0, rows, (h @ w["w2"].T) * weights[rows, slots, None])
    return out


def clamped_fraction(ckpt: dict, layer: int, x: torch.Tensor, input_ids: torch.Tensor, fmt: str) -> float:
    """Share of the routed experts' gate pre-activations above swiglu_limit."""
    ids, _ = routing(ckpt, layer, x, input_ids)
    above = total = 0
    for e in ids.unique().tolist():
        rows = (ids == e).any(1)
        gate = x[rows].float() @ expert_weights(ckpt, layer, e, fmt)["w1"].T
        above += int((gate > LIMIT).sum())
        total += gate.numel()
    return above / total


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


TOL = 6e-3  # bf16 output and intermediates vs float32 (measured ~2e-3)


def check_layers(cfg, model, ckpt, fmt, x, input_ids, method_cls, *, quantize=None, tol=TOL):
    """Every MoE layer against the float32 computation, and that the comparison would
    see each of the features it covers go missing."""
    from dsv4_plugin.moe import DSV4Experts

    for layer in LAYERS:
        experts = model.model.layers[layer].ffn.experts.routed_experts
        assert type(experts.quant_method) is method_cls
        assert isinstance(experts.quant_method.moe_kernel.fused_experts, DSV4Experts)
        out = forward(cfg, model, layer, x, input_ids)
        assert out.dtype == torch.bfloat16 and out.shape == (x.shape[0], K)
        ref = reference(ckpt, layer, x, input_ids, fmt, quantize=quantize)
        assert rel_err(out, ref) < tol, (fmt, layer)
        assert 0.02 < clamped_fraction(ckpt, layer, x, input_ids, fmt) < 0.9
        for changed in ({"limit": None}, {"scaling": 1.0},
                        {"hashed": False} if layer == 0 else {"bias": False}):
            other = reference(ckpt, layer, x, input_ids, fmt, quantize=quantize, **changed)
            assert rel_err(other, ref) > 20 * tol, changed
