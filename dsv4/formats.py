"""Reference tensor formats for DeepSeek V4 serving: NVFP4 MoE weights and paged KV caches.

Everything here is plain float32 torch code that runs on CPU or GPU tensors.  It is
the ground truth that the CUDA kernels are tested against, so the arithmetic order
is spelled out and must not be "simplified".

NVFP4 (weights and activations of the MoE)
------------------------------------------
* e2m1 code, 4 bits: bit 3 is the sign, bits 0..2 index the magnitudes
  ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``.  ``E2M1_VALUES[code]`` is the value (code 8 is -0.0).
* Packing: two codes per uint8 byte along the last dim; the LOW nibble holds the
  even element, the HIGH nibble the odd one.  ``[..., K]`` codes -> ``[..., K/2]`` bytes.
* Block scales: one ``float8_e4m3fn`` per 16 consecutive elements of the last dim,
  ``[..., K/16]``.
* Global scale ``g`` (float32): the dequant multiplier,
  ``value = E2M1_VALUES[code] * float(scale) * g``.
* Activations are quantized with the rule of Blackwell deployments
  (:func:`quantize_nvfp4`, DESIGN section 2), weights with ModelOpt's
  (:func:`quantize_nvfp4_weight`).
* ModelOpt checkpoint, per expert and per projection (w1 = gate, w3 = up, w2 = down):
  ``weight`` uint8 ``[N, K/2]``, ``weight_scale`` float8_e4m3fn ``[N, K/16]``,
  ``weight_scale_2`` float32 scalar (= g), ``input_scale`` float32 scalar
  (the activation's global scale).
* vLLM stacked MoE layout: ``w13`` uint8 ``[E, 2N, K/2]`` (rows ``0..N-1`` are w1/gate,
  rows ``N..2N-1`` are w3/up), ``w13_scale`` fp8 ``[E, 2N, K/16]``, ``w13_scale_2``
  float32 ``[E]`` or ``[E, 2]`` (gate, up); ``w2`` uint8 ``[E, K, N/2]``,
  ``w2_scale`` fp8 ``[E, K, N/16]``, ``w2_scale_2`` float32 ``[E]``.

"fp8_ds_mla" paged KV cache (one 512-dim latent per token, MQA)
---------------------------------------------------------------
Per block of ``B`` tokens, byte offsets relative to the start of the block:

* ``[t*576, t*576 + 448)``: token t's dims 0..447 (no-rope part, 7 groups of 64) as
  float8_e4m3fn.
* ``[t*576 + 448, t*576 + 576)``: token t's dims 448..511 (rope part) as 64 raw
  little-endian bfloat16 values.
* ``[B*576 + t*8, B*576 + t*8 + 8)``: token t's 7 UE8M0 exponent bytes (group i is
  scaled by ``2**(byte_i - 127)``) followed by one pad byte (0).
* The block stride is padded to a multiple of 576: ``fp8_ds_mla_block_bytes(B)``.

vLLM hands the cache over as a uint8 view ``[num_blocks, B, 584]`` with
``stride(0)`` = the real block stride (>= ``B*584``) and ``stride(1) == 584``.  The
view's rows do NOT line up with tokens (token t's data is at ``t*576``, not
``t*584``); only the block start ``cache[b, 0, 0]`` is meaningful.  A slot id is
``block_id * B + offset_in_block``.  FlashMLA is given the 4-D view
``[num_blocks, B, 1, 584]``.

"bf16" paged KV cache
---------------------
``bfloat16 [num_blocks, B, 512]`` (or the 4-D view ``[num_blocks, B, 1, 512]``), token
at ``[slot // B, slot % B]``.

Note on exactness: divisions are always done between two tensors on the same device.
On CUDA, ``tensor / python_scalar`` is computed as ``tensor * (1 / scalar)``, which is
not the correctly rounded quotient.
"""

from __future__ import annotations

import numbers

import torch

from . import _checks as C

__all__ = [
    "E2M1_VALUES",
    "round_to_e2m1",
    "pack_fp4",
    "unpack_fp4",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "quantize_nvfp4_weight",
    "stack_modelopt_experts",
    "dequantize_experts",
    "random_nvfp4_moe_weights",
    "KV_DIM",
    "NOPE_DIM",
    "ROPE_DIM",
    "FP8_GROUP",
    "FP8_NUM_GROUPS",
    "FP8_DS_MLA_TOKEN_DATA_BYTES",
    "FP8_DS_MLA_TOKEN_SCALE_BYTES",
    "FP8_DS_MLA_VIEW_LAST_DIM",
    "fp8_ds_mla_block_bytes",
    "new_fp8_ds_mla_cache",
    "write_fp8_ds_mla",
    "read_fp8_ds_mla",
    "dequantize_fp8_ds_mla_cache",
    "new_bf16_cache",
    "write_bf16_cache",
    "read_bf16_cache",
    "kv_cache_layout",
]

# --------------------------------------------------------------------------------------
# NVFP4
# --------------------------------------------------------------------------------------

E2M1_VALUES: list[float] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
]

NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0

# Upper bounds of the magnitude buckets; ``True`` means the bound itself belongs to
# the lower bucket (the tie goes to the even code below), ``False`` that it belongs to
# the upper bucket (the tie goes to the even code above).
_E2M1_THRESHOLDS = [
    (0.25, True),   # 0.25 -> 0
    (0.75, False),  # 0.75 -> 1.0
    (1.25, True),   # 1.25 -> 1.0
    (1.75, False),  # 1.75 -> 2.0
    (2.5, True),    # 2.5  -> 2.0
    (3.5, False),   # 3.5  -> 4.0
    (5.0, True),    # 5.0  -> 4.0
]


def _global_scale(op: str, global_scale, device: torch.device, name: str = "global_scale") -> torch.Tensor:
    """A global scale (a Python number > 0 or a 1-element float32 tensor) as a 0-dim float32
    tensor on ``device``."""
    if isinstance(global_scale, torch.Tensor):
        C.dtype(op, name, global_scale, torch.float32)
        if global_scale.numel() != 1:
            raise C.error(op, f"{name} must have exactly 1 element, got shape {tuple(global_scale.shape)}")
        return global_scale.reshape(()).to(device)
    if isinstance(global_scale, bool) or not isinstance(global_scale, numbers.Real):
        raise C.type_error(op, f"{name} must be a python float or a 1-element float32 tensor, got "
                               f"{type(global_scale).__name__}")
    C.finite_positive(op, name, global_scale)
    return torch.tensor(float(global_scale), dtype=torch.float32, device=device)


def round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Rounds float values to e2m1 codes (round-to-nearest, ties to the even code).

    Args:
        y: float tensor of any shape (float32 recommended; other float dtypes are cast
            to float32 first).

    Returns:
        uint8 tensor of the same shape with codes in ``0..15``.  ``|y| > 6`` (inf too)
        saturates to 6.  The sign bit (bit 3) is ``y < 0``, also when the magnitude
        rounds to 0 (so -0.1 gives code 8); -0.0 gives code 0.  NaN inputs are not
        supported (code 0).
    """
    C.floating("round_to_e2m1", "y", y)
    mag = y.float().abs()
    # Each threshold passed adds one to the magnitude code; NaN passes none.
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for bound, tie_goes_down in _E2M1_THRESHOLDS:
        passed = mag > bound if tie_goes_down else mag >= bound
        code += passed.to(torch.uint8)
    sign = (y < 0).to(torch.uint8) << 3
    return code | sign


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Packs e2m1 codes two per byte.

    Args:
        codes: uint8 ``[..., K]`` with values in ``0..15``, K even.

    Returns:
        uint8 ``[..., K/2]``; byte j = ``codes[..., 2j] | codes[..., 2j+1] << 4``
        (the even element in the LOW nibble).
    """
    C.dtype("pack_fp4", "codes", codes, torch.uint8)
    if codes.dim() == 0 or codes.shape[-1] % 2 != 0:
        raise C.error("pack_fp4", f"codes must have an even last dim, got shape {tuple(codes.shape)}")
    if codes.numel() and bool((codes > 15).any()):
        raise C.error("pack_fp4", "codes must hold 4-bit values (0..15)")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`.

    Args:
        packed: uint8 ``[..., K/2]``.

    Returns:
        uint8 codes ``[..., K]``.
    """
    C.dtype("unpack_fp4", "packed", packed, torch.uint8)
    if packed.dim() == 0:
        raise C.error("unpack_fp4", "packed must have at least 1 dim")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def _quantize_nvfp4_blocks(x: torch.Tensor, g: torch.Tensor):
    """Activation quantizer, the rule of Blackwell deployments (see :func:`quantize_nvfp4`).

    ``x``: float ``[..., K]``; ``g``: 0-dim float32 tensor (the dequant global scale).
    Every reciprocal is an IEEE division of two float32 tensors (``one / t``), never
    ``t / python_scalar``, so the result is the same on CPU and CUDA tensors.
    """
    K = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], K // NVFP4_BLOCK, NVFP4_BLOCK)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    six = torch.tensor(E2M1_MAX, dtype=torch.float32, device=x.device)

    G = one / g  # the encode scale, as vLLM computes it at load (1.0 / input_scale)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    s32 = G * (amax * (one / six))
    s = torch.clamp(s32, max=E4M3_MAX).to(torch.float8_e4m3fn)  # RN-even, satfinite
    sf = s.float()
    # A zero scale (zero block, or a scale that underflowed) has r = 0: codes 0.
    r = torch.where(sf == 0, torch.zeros_like(sf), one / (sf * (one / G)))
    codes = round_to_e2m1(xb * r).reshape(x.shape)
    return pack_fp4(codes), s.reshape(*x.shape[:-1], K // NVFP4_BLOCK)


def _quantize_nvfp4_weight_blocks(w: torch.Tensor, g: torch.Tensor):
    """Weight quantizer (ModelOpt's division rule, see :func:`quantize_nvfp4_weight`).

    ``w``: float ``[..., K]``; ``g``: float32 tensor broadcastable to ``[..., K/16, 1]``.
    """
    K = w.shape[-1]
    wb = w.float().reshape(*w.shape[:-1], K // NVFP4_BLOCK, NVFP4_BLOCK)
    six = torch.tensor(E2M1_MAX, dtype=torch.float32, device=w.device)

    amax = wb.abs().amax(dim=-1, keepdim=True)
    s32 = (amax / six) / g
    s32 = torch.clamp(s32, max=E4M3_MAX)
    s = s32.to(torch.float8_e4m3fn)
    sf = s.float()
    denom = sf * g
    # A zero scale would give 0/0 = NaN or w/0 = inf; its codes are 0.
    y = torch.where(sf == 0, torch.zeros_like(wb), wb / denom)
    codes = round_to_e2m1(y).reshape(w.shape)
    return pack_fp4(codes), s.reshape(*w.shape[:-1], K // NVFP4_BLOCK)


def _f32_step(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` moved by ``k`` float32 ulps (positive finite normal ``t``)."""
    return (t.view(torch.int32) + k).view(torch.float32)


def _nvfp4_rcp_approx_codes(x: torch.Tensor, global_scale) -> torch.Tensor:
    """The e2m1 codes a quantizer with ``rcp.approx`` reciprocals may give.

    :func:`quantize_nvfp4` uses exact reciprocals; the CUDA kernels (like Blackwell
    deployments) use ``rcp.approx.ftz.f32`` for ``rcp(G)`` and for ``r``, which is
    within 1 ulp of the exact reciprocal, so each of those two values is the
    correctly rounded one or a float32 neighbour.  This evaluates all 9 combinations
    (the block scales are the same in all of them: ``rcp(6)`` is exactly RN(1/6) on the
    GPUs measured) and returns every element's 9 candidate codes; a code that is
    none of them is not explained by ``rcp.approx`` rounding.  Candidates differ from
    the exact code only where ``x * r`` lies within a few ulps of a rounding tie.

    Args:
        x: float ``[..., K]``, ``K % 16 == 0``.
        global_scale: as for :func:`quantize_nvfp4`.

    Returns:
        uint8 ``[..., K, 9]``; ``[..., 4]`` (no ulp moved) is the code of
        :func:`quantize_nvfp4`.
    """
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(())
    _, scales = _quantize_nvfp4_blocks(x, g)
    K = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], K // NVFP4_BLOCK, NVFP4_BLOCK)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    sf = scales.float().unsqueeze(-1)
    rcp_g = one / (one / g)
    out = []
    for kg in (-1, 0, 1):
        d = sf * _f32_step(rcp_g, kg)
        for kr in (-1, 0, 1):
            r = torch.where(sf == 0, torch.zeros_like(d), _f32_step(one / torch.where(sf == 0, one, d), kr))
            out.append(round_to_e2m1(xb * r).reshape(x.shape))
    return torch.stack(out, dim=-1)


def quantize_nvfp4(x: torch.Tensor, global_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes activations to NVFP4 with 16-element blocks along the last dim, with
    the rule of Blackwell deployments (DESIGN section 2).

    ``g`` is the dequant multiplier (a checkpoint's ``input_scale``) and ``G = 1 / g``
    the encode scale.  Per block, in float32 and in exactly this order::

        G     = 1 / g                      # IEEE division, once per call
        amax  = max|x|
        s     = e4m3_rn_satfinite(G * (amax * (1 / 6)))
        r     = 0 if s == 0 else 1 / (float(s) * (1 / G))
        codes = round_to_e2m1(x * r)        # RN-even on the e2m1 grid, saturating at 6

    Why this rule: it is what vLLM's Blackwell kernel (``cvt_warp_fp16_to_fp4``),
    FlashInfer and TensorRT-LLM compute for the same checkpoint (their ``rcp`` is
    ``rcp.approx.ftz.f32``, their last step ``cvt.rn.satfinite.e2m1x2.f32`` of the
    product), so W4A4 here gives a Blackwell deployment's codes.  Every reciprocal here
    is the exact IEEE one, as in vLLM's torch reference ``ref_nvfp4_quant``
    (``vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py``); the
    dsv4 CUDA kernels use ``rcp.approx.ftz.f32`` as Blackwell does, which can move a
    code only where ``x * r`` lies within a few ulps of a rounding tie.  The earlier
    rule ``round_to_e2m1(x / (float(s) * g))`` differs from this one exactly at such
    ties: e.g. x = 1.171875 in a block with amax = 5.625 and g = 2^-8 has s = 240 and
    x / (s * g) = 1.25, a tie that goes to 1.0, while x * r = 1.2500001 rounds to 1.5.
    Dequantization uses ``g`` itself: ``E2M1_VALUES[code] * float(s) * g``.

    A product ``x * r`` of -0.0 (a -0.0 input, or any input of a zero-scale block)
    gives code 0 (see :func:`round_to_e2m1`); a Blackwell conversion may give code 8
    (-0.0) there, the same value.  NaN inputs give unspecified codes and scales.

    Args:
        x: float tensor (any float dtype, any leading shape, may be non-contiguous)
            ``[..., K]`` with ``K % 16 == 0``.
        global_scale: ``g``, the dequant multiplier: python float > 0 or a 1-element
            float32 tensor (its value is not checked, to avoid a device sync; a
            non-positive or NaN ``g`` gives meaningless scales).

    Returns:
        ``(packed, scales)``: uint8 ``[..., K/2]`` (see :func:`pack_fp4`) and
        float8_e4m3fn ``[..., K/16]``.
    """
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(())
    return _quantize_nvfp4_blocks(x, g)


def _dequantize_nvfp4_blocks(packed, scales, g, dtype):
    codes = unpack_fp4(packed)
    K = codes.shape[-1]
    vals = _e2m1_decode(codes).reshape(*codes.shape[:-1], K // NVFP4_BLOCK, NVFP4_BLOCK)
    sf = scales.float().unsqueeze(-1)
    out = vals * sf * g
    return out.reshape(codes.shape).to(dtype)


def _check_packed_and_scales(op: str, packed, scales, packed_name="packed", scales_name="scales"):
    """NVFP4 codes uint8 [..., K/2] with their e4m3 block scales [..., K/16]."""
    C.dtype(op, packed_name, packed, torch.uint8)
    C.dtype(op, scales_name, scales, torch.float8_e4m3fn)
    if packed.dim() == 0 or packed.shape[-1] == 0 or packed.shape[-1] % (NVFP4_BLOCK // 2):
        raise C.error(op, f"{packed_name} must have a last dim that is a positive multiple of {NVFP4_BLOCK // 2}, "
                          f"got shape {tuple(packed.shape)}")
    C.shape(op, scales_name, scales, (*packed.shape[:-1], packed.shape[-1] * 2 // NVFP4_BLOCK),
            f" to match {packed_name} {list(packed.shape)}")


def dequantize_nvfp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantizes NVFP4: ``value = E2M1_VALUES[code] * float(scale) * g`` in float32.

    Args:
        packed: uint8 ``[..., K/2]``.
        scales: float8_e4m3fn ``[..., K/16]``.
        global_scale: python float > 0 or 1-element float32 tensor.
        dtype: output dtype (the float32 result is cast to it).

    Returns:
        ``dtype`` tensor ``[..., K]``.
    """
    _check_packed_and_scales("dequantize_nvfp4", packed, scales)
    g = _global_scale("dequantize_nvfp4", global_scale, packed.device)
    return _dequantize_nvfp4_blocks(packed, scales, g, dtype)


def quantize_nvfp4_weight(w: torch.Tensor):
    """Quantizes weight matrices the way ModelOpt does, one global scale per matrix.

    ``weight_scale_2 = amax(|w|) / (6 * 448)`` over each whole ``[N, K]`` matrix
    (1.0 if the matrix is all zero); then per block, with ``g = weight_scale_2``:
    ``s = e4m3(min((amax / 6) / g, 448))`` and ``codes = round_to_e2m1(w / (float(s) * g))``
    (divisions, not the reciprocals of the activation rule in :func:`quantize_nvfp4`:
    weights come quantized in the checkpoint, this only makes test weights).

    Args:
        w: float ``[N, K]`` or ``[E, N, K]`` (any leading dims), ``K % 16 == 0``.

    Returns:
        ``(weight, weight_scale, weight_scale_2)``: uint8 ``[..., N, K/2]``,
        float8_e4m3fn ``[..., N, K/16]``, float32 ``w.shape[:-2]`` (a 0-dim tensor for
        2-D input, ``[E]`` for 3-D input).
    """
    op = "quantize_nvfp4_weight"
    C.floating(op, "w", w)
    if w.dim() < 2:
        raise C.error(op, f"w must be [..., N, K] with at least 2 dims, got shape {tuple(w.shape)}")
    if w.shape[-1] == 0 or w.shape[-1] % NVFP4_BLOCK:
        raise C.error(op, f"w must have a last dim that is a positive multiple of {NVFP4_BLOCK}, got shape "
                          f"{tuple(w.shape)}")
    w32 = w.float()
    amax = w32.abs().amax(dim=(-2, -1))
    denom = torch.tensor(E2M1_MAX * E4M3_MAX, dtype=torch.float32, device=w.device)
    scale_2 = torch.where(amax == 0, torch.ones_like(amax), amax / denom)
    # Broadcast one g per matrix over [..., N, K/16, 1].
    g = scale_2.reshape(*scale_2.shape, 1, 1, 1)
    weight, weight_scale = _quantize_nvfp4_weight_blocks(w32, g)
    return weight, weight_scale, scale_2


def stack_modelopt_experts(experts: list[dict]) -> dict:
    """Stacks per-expert ModelOpt NVFP4 tensors into the vLLM MoE layout.

    Args:
        experts: list of E dicts with keys ``"w1"`` (gate), ``"w3"`` (up), ``"w2"``
            (down), each a dict ``{"weight", "weight_scale", "weight_scale_2"}``
            (optionally ``"input_scale"``) with ModelOpt shapes: w1/w3 ``weight``
            uint8 ``[N, K/2]``, ``weight_scale`` fp8 ``[N, K/16]``; w2 ``weight``
            uint8 ``[K, N/2]``, ``weight_scale`` fp8 ``[K, N/16]``; ``weight_scale_2``
            and ``input_scale`` 1-element float32.

    Returns:
        dict with ``w13`` uint8 ``[E, 2N, K/2]`` (gate rows first), ``w13_scale`` fp8
        ``[E, 2N, K/16]``, ``w13_scale_2`` float32 ``[E, 2]`` (gate, up), ``w2`` uint8
        ``[E, K, N/2]``, ``w2_scale`` fp8 ``[E, K, N/16]``, ``w2_scale_2`` float32
        ``[E]``; plus ``w13_input_scale`` float32 ``[E, 2]`` and ``w2_input_scale``
        float32 ``[E]`` when every projection has an ``input_scale``.
    """
    op = "stack_modelopt_experts"
    if not isinstance(experts, (list, tuple)) or len(experts) == 0:
        raise C.error(op, "experts must be a non-empty list of dicts")
    for e, expert in enumerate(experts):
        if not isinstance(expert, dict):
            raise C.type_error(op, f"experts[{e}] must be a dict, got {type(expert).__name__}")
        for proj in ("w1", "w3", "w2"):
            if proj not in expert or not isinstance(expert[proj], dict):
                raise C.error(op, f"experts[{e}] must have a dict under key {proj!r}")
            for key in ("weight", "weight_scale", "weight_scale_2"):
                if key not in expert[proj]:
                    raise C.error(op, f"experts[{e}][{proj!r}] is missing key {key!r}")
            p = expert[proj]
            name = f"experts[{e}][{proj!r}]"
            _check_packed_and_scales(op, p["weight"], p["weight_scale"], f"{name}['weight']", f"{name}['weight_scale']")
            C.ndim(op, f"{name}['weight']", p["weight"], 2)
            _global_scale(op, p["weight_scale_2"], p["weight"].device, f"{name}['weight_scale_2']")

    n, half_k = experts[0]["w1"]["weight"].shape
    for e, expert in enumerate(experts):
        shapes = {
            "w1": (n, half_k),
            "w3": (n, half_k),
            "w2": (half_k * 2, n // 2),
        }
        for proj, shape in shapes.items():
            C.shape(op, f"experts[{e}][{proj!r}]['weight']", expert[proj]["weight"], shape)

    def scalar(t):
        if isinstance(t, torch.Tensor):
            return t.reshape(()).float()
        return torch.tensor(float(t), dtype=torch.float32)

    out = {
        "w13": torch.stack([torch.cat([x["w1"]["weight"], x["w3"]["weight"]]) for x in experts]),
        "w13_scale": torch.stack(
            [torch.cat([x["w1"]["weight_scale"], x["w3"]["weight_scale"]]) for x in experts]
        ),
        "w13_scale_2": torch.stack(
            [torch.stack([scalar(x["w1"]["weight_scale_2"]), scalar(x["w3"]["weight_scale_2"])])
             for x in experts]
        ),
        "w2": torch.stack([x["w2"]["weight"] for x in experts]),
        "w2_scale": torch.stack([x["w2"]["weight_scale"] for x in experts]),
        "w2_scale_2": torch.stack([scalar(x["w2"]["weight_scale_2"]) for x in experts]),
    }
    if all("input_scale" in x[p] for x in experts for p in ("w1", "w3", "w2")):
        out["w13_input_scale"] = torch.stack(
            [torch.stack([scalar(x["w1"]["input_scale"]), scalar(x["w3"]["input_scale"])])
             for x in experts]
        )
        out["w2_input_scale"] = torch.stack([scalar(x["w2"]["input_scale"]) for x in experts])
    device = experts[0]["w1"]["weight"].device
    return {k: v.to(device) for k, v in out.items()}


def dequantize_experts(w: torch.Tensor, w_scale: torch.Tensor, w_scale_2: torch.Tensor):
    """Dequantizes stacked expert weights (vLLM layout) to float32.

    Args:
        w: uint8 ``[E, rows, K/2]`` (e.g. ``w13`` with rows = 2N, or ``w2`` with rows = K).
        w_scale: float8_e4m3fn ``[E, rows, K/16]``.
        w_scale_2: float32 ``[E]`` (one global scale per expert) or ``[E, 2]`` (for
            ``w13``: column 0 applies to rows ``0..rows/2-1`` (gate), column 1 to the
            rest (up)).  Other float dtypes are cast to float32.

    Returns:
        float32 ``[E, rows, K]``.
    """
    op = "dequantize_experts"
    _check_packed_and_scales(op, w, w_scale, "w", "w_scale")
    C.ndim(op, "w", w, 3, "[E, rows, K/2]")
    C.floating(op, "w_scale_2", w_scale_2)
    w_scale_2 = w_scale_2.float()
    E, rows, _ = w.shape
    if tuple(w_scale_2.shape) == (E,):
        g = w_scale_2.reshape(E, 1, 1, 1)
    elif tuple(w_scale_2.shape) == (E, 2):
        if rows % 2 != 0:
            raise C.error(op, f"w must have an even number of rows for w_scale_2 [E, 2], got {rows}")
        half = rows // 2
        g = torch.cat(
            [w_scale_2[:, :1].expand(E, half), w_scale_2[:, 1:].expand(E, half)], dim=1
        ).reshape(E, rows, 1, 1)
    else:
        raise C.error(op, f"w_scale_2 must have shape [{E}] or [{E}, 2], got {list(w_scale_2.shape)}")
    return _dequantize_nvfp4_blocks(w, w_scale, g.to(w.device), torch.float32)


def random_nvfp4_moe_weights(E: int, N: int, K: int, *, generator=None, device="cpu") -> dict:
    """Random NVFP4 MoE weights in the vLLM layout (for kernel tests).

    Weights are ``N(0, 0.02^2)`` samples quantized with :func:`quantize_nvfp4_weight`
    (one global scale per expert for w13 and one for w2).  Input scales are
    ``amax(|a|) / (6 * 448)`` of a unit-normal sample activation, per expert.

    Args:
        E: number of experts.
        N: intermediate size (per gate/up half), multiple of 16.
        K: hidden size, multiple of 16.
        generator: optional ``torch.Generator``; sampling happens on its device.
        device: device of the returned tensors.

    Returns:
        dict: ``w13`` uint8 ``[E, 2N, K/2]``, ``w13_scale`` fp8 ``[E, 2N, K/16]``,
        ``w13_scale_2`` float32 ``[E]``, ``w2`` uint8 ``[E, K, N/2]``, ``w2_scale`` fp8
        ``[E, K, N/16]``, ``w2_scale_2`` float32 ``[E]``, ``w13_input_scale`` float32
        ``[E]``, ``w2_input_scale`` float32 ``[E]``.
    """
    op = "random_nvfp4_moe_weights"
    for name, value in (("E", E), ("N", N), ("K", K)):
        C.host_int(op, name, value, lo=1)
    for name, value in (("N", N), ("K", K)):
        if value % NVFP4_BLOCK != 0:
            raise C.error(op, f"{name} must be a multiple of {NVFP4_BLOCK}, got {value}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise C.type_error(op, f"generator must be a torch.Generator, got {type(generator).__name__}")
    gen_device = generator.device if generator is not None else torch.device("cpu")

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=gen_device).to(device)

    w13, w13_scale, w13_scale_2 = quantize_nvfp4_weight(randn(E, 2 * N, K) * 0.02)
    w2, w2_scale, w2_scale_2 = quantize_nvfp4_weight(randn(E, K, N) * 0.02)
    fp4_range = E2M1_MAX * E4M3_MAX
    return {
        "w13": w13,
        "w13_scale": w13_scale,
        "w13_scale_2": w13_scale_2,
        "w2": w2,
        "w2_scale": w2_scale,
        "w2_scale_2": w2_scale_2,
        "w13_input_scale": randn(E, 256).abs().amax(dim=1) / fp4_range,
        "w2_input_scale": randn(E, 256).abs().amax(dim=1) / fp4_range,
    }


# --------------------------------------------------------------------------------------
# Paged KV caches
# --------------------------------------------------------------------------------------

KV_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
FP8_GROUP = 64
FP8_NUM_GROUPS = NOPE_DIM // FP8_GROUP  # 7
FP8_DS_MLA_TOKEN_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
FP8_DS_MLA_TOKEN_SCALE_BYTES = 8  # 7 UE8M0 exponents + 1 pad
FP8_DS_MLA_VIEW_LAST_DIM = FP8_DS_MLA_TOKEN_DATA_BYTES + FP8_DS_MLA_TOKEN_SCALE_BYTES  # 584
_UE8M0_BIAS = 127
_FP8_AMAX_FLOOR = 1e-4


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**k`` for an integer tensor ``k`` (0 / inf outside float32 range).

    Built from exponent bits rather than ``torch.exp2`` so that it is exact on every
    device; splitting ``k`` in two halves keeps each factor a normal float32, so
    subnormal results (k down to -149) are exact too.
    """
    k = k.to(torch.int32).clamp(-252, 254)
    half = torch.div(k, 2, rounding_mode="floor")

    def normal_pow2(j):
        return ((j + 127) << 23).view(torch.float32)

    return normal_pow2(half) * normal_pow2(k - half)


def fp8_ds_mla_block_bytes(block_size: int) -> int:
    """Bytes per block of the fp8_ds_mla cache: ``ceil(B * 584 / 576) * 576``."""
    C.host_int("fp8_ds_mla_block_bytes", "block_size", block_size, lo=1)
    unit = FP8_DS_MLA_TOKEN_DATA_BYTES
    return -(-block_size * FP8_DS_MLA_VIEW_LAST_DIM // unit) * unit


def new_fp8_ds_mla_cache(
    num_blocks: int,
    block_size: int,
    *,
    device="cpu",
    fill: str = "zeros",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Allocates an fp8_ds_mla cache shaped like the view vLLM hands over.

    Args:
        num_blocks: number of blocks (>= 0).
        block_size: tokens per block B (> 0).
        device: device of the cache.
        fill: ``"zeros"`` or ``"random"`` (uniform random bytes, to catch reads of
            unwritten bytes).
        generator: optional ``torch.Generator`` for ``fill="random"``.

    Returns:
        uint8 ``[num_blocks, B, 584]`` with strides
        ``(fp8_ds_mla_block_bytes(B), 584, 1)`` over a flat storage of
        ``num_blocks * fp8_ds_mla_block_bytes(B)`` bytes.
    """
    op = "new_fp8_ds_mla_cache"
    C.host_int(op, "num_blocks", num_blocks, lo=0)
    C.host_int(op, "block_size", block_size, lo=1)
    C.one_of(op, "fill", fill, ("zeros", "random"))
    block_bytes = fp8_ds_mla_block_bytes(block_size)
    total = num_blocks * block_bytes
    if fill == "zeros":
        flat = torch.zeros(total, dtype=torch.uint8, device=device)
    else:
        gen_device = generator.device if generator is not None else torch.device("cpu")
        flat = torch.randint(
            0, 256, (total,), dtype=torch.uint8, generator=generator, device=gen_device
        ).to(device)
    return flat.as_strided(
        (num_blocks, block_size, FP8_DS_MLA_VIEW_LAST_DIM),
        (block_bytes, FP8_DS_MLA_VIEW_LAST_DIM, 1),
    )


def kv_cache_layout(cache: torch.Tensor, *, op: str = "kv_cache_layout", name: str = "cache") -> tuple[str, int]:
    """Identifies and validates a paged KV cache tensor (the rules of the sparse MQA ops,
    csrc/attention/sparse_mqa.cu, which call this with their op and argument names).

    Accepted:

    * fp8_ds_mla: uint8 ``[num_blocks, B, 584]`` or ``[num_blocks, B, 1, 584]`` with
      ``stride(-1) == 1``, ``stride(1) == 584`` and ``stride(0) >= B * 584``.
    * bf16: bfloat16 ``[num_blocks, B, 512]`` or ``[num_blocks, B, 1, 512]`` with
      ``stride(-1) == 1``, ``stride(1) == 512`` and ``stride(0) >= B * 512``.

    Returns:
        ``("fp8_ds_mla" | "bf16", block_size)``.

    Raises:
        TypeError if ``cache`` is not a tensor, ValueError for anything else that does
        not match.
    """
    C.tensor(op, name, cache)
    shape = tuple(cache.shape)
    if not (cache.dim() == 3 or (cache.dim() == 4 and cache.shape[2] == 1)):
        raise C.error(op, f"{name} must be [num_blocks, block_size, D] or [num_blocks, block_size, 1, D], got shape "
                          f"{shape}")
    if cache.dtype == torch.uint8:
        kind, last = "fp8_ds_mla", FP8_DS_MLA_VIEW_LAST_DIM
        if cache.shape[-1] != last:
            raise C.error(op, f"{name} is a uint8 (fp8_ds_mla) cache and must have last dim {last}, got shape {shape}")
    elif cache.dtype == torch.bfloat16:
        kind, last = "bf16", KV_DIM
        if cache.shape[-1] != last:
            raise C.error(op, f"{name} is a bf16 cache and must have last dim {last}, got shape {shape}")
    else:
        raise C.error(op, f"{name} must be uint8 (fp8_ds_mla layout) or bfloat16 (bf16 layout), got dtype "
                          f"{cache.dtype}")
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    if block_size <= 0:
        raise C.error(op, f"{name} must have block_size (dim 1) > 0, got shape {shape}")
    if cache.stride(-1) != 1:
        raise C.error(op, f"{name} must have unit stride along its last dim, got strides {cache.stride()}")
    if block_size > 1 and cache.stride(1) != last:
        raise C.error(op, f"{name} must have stride(1) == {last} (rows of one block packed), got strides "
                          f"{cache.stride()}")
    if num_blocks > 1 and cache.stride(0) < block_size * last:
        raise C.error(op, f"{name} block stride (stride(0)) {cache.stride(0)} is smaller than block_size * {last}")
    return kind, block_size


def _as_3d(cache: torch.Tensor) -> torch.Tensor:
    return cache[:, :, 0, :] if cache.dim() == 4 else cache


def _fp8_ds_mla_regions(cache: torch.Tensor):
    """Views ``[num_blocks, B, 576]`` (token data) and ``[num_blocks, B, 8]`` (scales)."""
    num_blocks, block_size, _ = cache.shape
    stride0 = cache.stride(0)
    base = cache.storage_offset()
    data = cache.as_strided(
        (num_blocks, block_size, FP8_DS_MLA_TOKEN_DATA_BYTES),
        (stride0, FP8_DS_MLA_TOKEN_DATA_BYTES, 1),
        base,
    )
    scales = cache.as_strided(
        (num_blocks, block_size, FP8_DS_MLA_TOKEN_SCALE_BYTES),
        (stride0, FP8_DS_MLA_TOKEN_SCALE_BYTES, 1),
        base + block_size * FP8_DS_MLA_TOKEN_DATA_BYTES,
    )
    return data, scales


def _check_slots(op: str, slots, num_slots: int, device, *, allow_negative: bool) -> torch.Tensor:
    """int32/int64 slot ids [n] below ``num_slots`` (negative ones only if allowed), as int64
    on ``device``."""
    C.dtype(op, "slots", slots, torch.int32, torch.int64)
    C.ndim(op, "slots", slots, 1, "[n]")
    slots = slots.to(device=device, dtype=torch.int64)
    if slots.numel():
        if bool((slots >= num_slots).any()):
            raise C.error(op, f"slots must be < num_blocks * block_size = {num_slots}, got max {int(slots.max())}")
        if not allow_negative and bool((slots < 0).any()):
            raise C.error(op, f"slots must be >= 0, got min {int(slots.min())}")
    return slots


def _cache_of_kind(op: str, cache: torch.Tensor, want: str) -> tuple[torch.Tensor, int]:
    """``cache`` validated as a ``want`` cache: (its 3-D view, block_size)."""
    kind, block_size = kv_cache_layout(cache, op=op)
    if kind != want:
        what = "an fp8_ds_mla (uint8)" if want == "fp8_ds_mla" else "a bf16"
        raise C.error(op, f"cache must be {what} cache, got {kind}")
    return _as_3d(cache), block_size


def _check_rows(op: str, rows, n: int) -> None:
    C.floating(op, "rows", rows)
    C.shape(op, "rows", rows, (n, KV_DIM), " to match slots")


def _quantize_fp8_ds_mla_rows(rows: torch.Tensor):
    """Returns (data bytes uint8 [n, 576], scale bytes uint8 [n, 8])."""
    n = rows.shape[0]
    x_bf16 = rows.to(torch.bfloat16)
    x = x_bf16.float()
    nope = x[:, :NOPE_DIM].reshape(n, FP8_NUM_GROUPS, FP8_GROUP)
    fp8_max = torch.tensor(E4M3_MAX, dtype=torch.float32, device=rows.device)

    amax = nope.abs().amax(dim=-1, keepdim=True).clamp(min=_FP8_AMAX_FLOOR)
    # float32 log2 is exact at powers of two, and amax / 448 is either an exact power
    # of two or (bf16 amax, or the 1e-4 floor) far from one, so this ceil is the exact
    # ceil(log2) on every device.
    e = torch.ceil(torch.log2(amax / fp8_max)).to(torch.int32)
    q = torch.clamp(nope * _pow2(-e), -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    exp_bytes = torch.clamp(e.squeeze(-1) + _UE8M0_BIAS, 0, 255).to(torch.uint8)

    data = torch.cat(
        [q.reshape(n, NOPE_DIM).view(torch.uint8), x_bf16[:, NOPE_DIM:].contiguous().view(torch.uint8)],
        dim=1,
    )
    pad = torch.zeros(n, 1, dtype=torch.uint8, device=rows.device)
    return data, torch.cat([exp_bytes, pad], dim=1)


def write_fp8_ds_mla(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Quantizes rows into an fp8_ds_mla cache, in place, the way vLLM does.

    ``x = rows -> bf16 -> float32``; per 64-dim group of dims 0..447::

        amax = max(max|x|, 1e-4)
        e    = ceil(log2(amax / 448))          # float32 log2
        q    = clamp(x * 2**-e, -448, 448).to(float8_e4m3fn)
        byte = clamp(e + 127, 0, 255)

    Dims 448..511 are stored as raw bf16; the pad byte is 0.

    Args:
        cache: uint8 fp8_ds_mla cache ``[num_blocks, B, 584]`` (or ``[.., B, 1, 584]``).
        slots: int32/int64 ``[n]``; negative slots are skipped, slots
            ``>= num_blocks * B`` raise.  Slots should be unique.
        rows: float ``[n, 512]`` (any float dtype; rounded to bf16 first).
    """
    op = "write_fp8_ds_mla"
    cache, block_size = _cache_of_kind(op, cache, "fp8_ds_mla")
    slots = _check_slots(op, slots, cache.shape[0] * block_size, cache.device, allow_negative=True)
    _check_rows(op, rows, slots.shape[0])
    keep = slots >= 0
    slots, rows = slots[keep], rows.to(cache.device)[keep]
    data, scales = _quantize_fp8_ds_mla_rows(rows)
    data_view, scale_view = _fp8_ds_mla_regions(cache)
    block, offset = slots // block_size, slots % block_size
    data_view[block, offset] = data
    scale_view[block, offset] = scales


def _read_fp8_ds_mla_slots(cache: torch.Tensor, block_size: int, slots: torch.Tensor):
    data_view, scale_view = _fp8_ds_mla_regions(cache)
    block, offset = slots // block_size, slots % block_size
    data = data_view[block, offset]  # [n, 576]
    exp_bytes = scale_view[block, offset][:, :FP8_NUM_GROUPS]  # [n, 7]
    n = slots.shape[0]
    q = data[:, :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float()
    scale = _pow2(exp_bytes.to(torch.int32) - _UE8M0_BIAS)
    nope = (q.reshape(n, FP8_NUM_GROUPS, FP8_GROUP) * scale.unsqueeze(-1)).reshape(n, NOPE_DIM)
    rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16)
    return torch.cat([nope.to(torch.bfloat16), rope], dim=1)


def read_fp8_ds_mla(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Reads and dequantizes tokens from an fp8_ds_mla cache.

    Dims 0..447 are ``float(fp8) * 2**(byte - 127)`` (exact in bf16 for bytes written
    by :func:`write_fp8_ds_mla`); dims 448..511 are the raw bf16.

    Args:
        cache: uint8 fp8_ds_mla cache ``[num_blocks, B, 584]`` (or ``[.., B, 1, 584]``).
        slots: int32/int64 ``[n]``, each in ``[0, num_blocks * B)`` (else ValueError).

    Returns:
        bfloat16 ``[n, 512]``.
    """
    op = "read_fp8_ds_mla"
    cache, block_size = _cache_of_kind(op, cache, "fp8_ds_mla")
    slots = _check_slots(op, slots, cache.shape[0] * block_size, cache.device, allow_negative=False)
    return _read_fp8_ds_mla_slots(cache, block_size, slots)


def dequantize_fp8_ds_mla_cache(cache: torch.Tensor) -> torch.Tensor:
    """Dequantizes every slot of an fp8_ds_mla cache.

    Args:
        cache: uint8 fp8_ds_mla cache ``[num_blocks, B, 584]`` (or ``[.., B, 1, 584]``).

    Returns:
        bfloat16 ``[num_blocks * B, 512]``, row = slot id.
    """
    cache, block_size = _cache_of_kind("dequantize_fp8_ds_mla_cache", cache, "fp8_ds_mla")
    slots = torch.arange(cache.shape[0] * block_size, device=cache.device)
    return _read_fp8_ds_mla_slots(cache, block_size, slots)


def new_bf16_cache(
    num_blocks: int,
    block_size: int,
    *,
    device="cpu",
    fill: str = "zeros",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Allocates a contiguous bf16 paged cache.

    Args:
        num_blocks: number of blocks (>= 0).
        block_size: tokens per block B (> 0).
        device: device of the cache.
        fill: ``"zeros"`` or ``"random"`` (standard normal values).
        generator: optional ``torch.Generator`` for ``fill="random"``.

    Returns:
        bfloat16 ``[num_blocks, B, 512]``.
    """
    op = "new_bf16_cache"
    C.host_int(op, "num_blocks", num_blocks, lo=0)
    C.host_int(op, "block_size", block_size, lo=1)
    C.one_of(op, "fill", fill, ("zeros", "random"))
    shape = (num_blocks, block_size, KV_DIM)
    if fill == "zeros":
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    gen_device = generator.device if generator is not None else torch.device("cpu")
    return torch.randn(shape, generator=generator, device=gen_device).to(
        device=device, dtype=torch.bfloat16
    )


def write_bf16_cache(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Writes rows (rounded to bf16) into a bf16 paged cache, in place.

    Args:
        cache: bfloat16 ``[num_blocks, B, 512]`` (or ``[num_blocks, B, 1, 512]``).
        slots: int32/int64 ``[n]``; negative slots are skipped, slots
            ``>= num_blocks * B`` raise.  Slots should be unique.
        rows: float ``[n, 512]``.
    """
    op = "write_bf16_cache"
    cache, block_size = _cache_of_kind(op, cache, "bf16")
    slots = _check_slots(op, slots, cache.shape[0] * block_size, cache.device, allow_negative=True)
    _check_rows(op, rows, slots.shape[0])
    keep = slots >= 0
    slots, rows = slots[keep], rows.to(cache.device)[keep]
    cache[slots // block_size, slots % block_size] = rows.to(torch.bfloat16)


def read_bf16_cache(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Reads tokens from a bf16 paged cache.

    Args:
        cache: bfloat16 ``[num_blocks, B, 512]`` (or ``[num_blocks, B, 1, 512]``).
        slots: int32/int64 ``[n]``, each in ``[0, num_blocks * B)`` (else ValueError).

    Returns:
        bfloat16 ``[n, 512]``.
    """
    op = "read_bf16_cache"
    cache, block_size = _cache_of_kind(op, cache, "bf16")
    slots = _check_slots(op, slots, cache.shape[0] * block_size, cache.device, allow_negative=False)
    return cache[slots // block_size, slots % block_size]
