"""NVFP4: the e2m1 element format (shared with MXFP4), NVFP4 blocks and the stacked
MoE layouts of ModelOpt checkpoints and vLLM, as plain torch code (CPU or GPU).

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
  (``dsv4.reference.quantize_nvfp4``, docs/design.md section 2), weights with ModelOpt's
  (:func:`quantize_nvfp4_weight`, to make test weights).
* ModelOpt checkpoint, per expert and per projection (w1 = gate, w3 = up, w2 = down):
  ``weight`` uint8 ``[N, K/2]``, ``weight_scale`` float8_e4m3fn ``[N, K/16]``,
  ``weight_scale_2`` float32 scalar (= g), ``input_scale`` float32 scalar
  (the activation's global scale).
* vLLM stacked MoE layout: ``w13`` uint8 ``[E, 2N, K/2]`` (rows ``0..N-1`` are w1/gate,
  rows ``N..2N-1`` are w3/up), ``w13_scale`` fp8 ``[E, 2N, K/16]``, ``w13_scale_2``
  float32 ``[E]`` or ``[E, 2]`` (gate, up); ``w2`` uint8 ``[E, K, N/2]``,
  ``w2_scale`` fp8 ``[E, K, N/16]``, ``w2_scale_2`` float32 ``[E]``.

Divisions are always between two tensors on the same device (on CUDA, ``tensor /
python_scalar`` is computed as ``tensor * (1 / scalar)``, not the correctly rounded quotient).
"""

from __future__ import annotations

import numbers

import torch

from .. import _checks as C
from ._float import E4M3_MAX


E2M1_VALUES: list[float] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
]


NVFP4_BLOCK = 16
E2M1_MAX = 6.0


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


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def _dequantize_nvfp4_blocks(packed, scales, g, dtype):
    codes = unpack_fp4(packed)
    K = codes.shape[-1]
    vals = e2m1_to_float(codes).reshape(*codes.shape[:-1], K // NVFP4_BLOCK, NVFP4_BLOCK)
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


def pad_gate_up_rows(t: torch.Tensor, N: int, Np: int) -> torch.Tensor:
    """The stacked experts' w13 layout [E, 2N, c] (gate rows 0..N-1, then up rows) ->
    [E, 2Np, c] with each half padded at its end by zero bytes (vLLM's padded
    parameters; used by the NVFP4 and MXFP4 padding steps)."""
    E, c = t.shape[0], t.shape[2]
    out = t.new_zeros(E, 2, Np, c)
    out[:, :, :N] = t.reshape(E, 2, N, c)
    return out.reshape(E, 2 * Np, c)


def pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    """[..., c] -> [..., width], zero bytes after column c - 1 (w2's padded N)."""
    out = t.new_zeros(*t.shape[:-1], width)
    out[..., : t.shape[-1]] = t
    return out


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
