"""The routing arguments of the MoE ops, shared by dsv4::nvfp4_moe and dsv4::mxfp4_moe:
the rules their CPU and fake kernels check (as the C++ entries csrc/moe/nvfp4_moe.cu and
mxfp4_moe.cu do, same messages), and the one normalisation that both wrappers
(:func:`dsv4.nvfp4_moe`, :func:`dsv4.mxfp4_moe`, and so :func:`dsv4.routed_moe`) run
before calling their op.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _checks as C


def check_tokens(op: str, x, topk_ids, topk_weights) -> tuple[int, int, int]:
    """Token and routing rules of both ops' kernels: (M, K, k)."""
    C.dtype(op, "x", x, torch.bfloat16)
    C.ndim(op, "x", x, 2, "[M, K]")
    M, K = x.shape
    C.same_device(op, "topk_ids", topk_ids, "x", x)
    C.dtype(op, "topk_ids", topk_ids, torch.int32)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != M or topk_ids.shape[1] < 1:
        raise C.error(op, f"topk_ids must have shape [M={M}, k], got {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    C.same_device(op, "topk_weights", topk_weights, "x", x)
    C.dtype(op, "topk_weights", topk_weights, torch.float32)
    if tuple(topk_weights.shape) != (M, k):
        raise C.error(op, f"topk_weights must have shape [M={M}, k={k}] like topk_ids, got "
                          f"{tuple(topk_weights.shape)}")
    return M, K, k


def check_map_and_out(op: str, x, expert_map, out, M: int, K: int) -> None:
    """expert_map and out: the rules of both ops' kernels."""
    if expert_map is not None:
        C.same_device(op, "expert_map", expert_map, "x", x)
        if expert_map.dtype != torch.int32 or expert_map.dim() != 1 or expert_map.numel() == 0:
            raise C.error(op, f"expert_map must be a non-empty 1-D torch.int32 tensor [E_global], got "
                              f"{expert_map.dtype} {tuple(expert_map.shape)}")
    C.same_device(op, "out", out, "x", x)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (M, K):
        raise C.error(op, f"out must be torch.bfloat16 [M={M}, K={K}], got {out.dtype} {tuple(out.shape)}")


def may_sync(x: torch.Tensor) -> bool:
    """Whether a host check may read device values now (not while compiling or capturing)."""
    if torch.compiler.is_compiling():
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def check_ids(op: str, topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor], E: int) -> None:
    """Host check of expert ids (one device sync); the kernels drop bad ids safely."""
    if topk_ids.numel() == 0:
        return
    bound = expert_map.numel() if expert_map is not None else E
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < 0 or hi >= bound:
        what = "expert_map size" if expert_map is not None else "number of local experts"
        raise C.error(op, f"topk_ids must lie in [0, {bound}) ({what}), got values in [{lo}, {hi}]")
    if expert_map is not None and expert_map.numel():
        lo, hi = int(expert_map.min()), int(expert_map.max())
        if lo < -1 or hi >= E:
            raise C.error(op, f"expert_map values must lie in [-1, {E}), got values in [{lo}, {hi}]")


class Routing(NamedTuple):
    """Routing arguments as the ops take them: topk_ids int32 [M, k] and topk_weights
    float32 [M, k], both contiguous; expert_map int32 [E_global] contiguous or None; out
    bf16 [M, K] (allocated when none was given)."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    expert_map: Optional[torch.Tensor]
    out: torch.Tensor


def normalize(op: str, x: torch.Tensor, topk_ids, topk_weights, expert_map, out, E: int,
              check: bool) -> Routing:
    """The wrappers' one normalisation of the routing arguments: integer ids and maps to
    contiguous int32, float weights to contiguous float32, ``out`` allocated (bf16, x's
    shape) when None; with ``check`` (and when a sync is allowed, :func:`may_sync`) the
    id ranges against E local experts or the map, on the values as given (before the
    narrowing to int32, which would wrap an int64 id past 2^31). Shapes, devices and the
    rest are the op's checks (:func:`check_tokens`, :func:`check_map_and_out`), which
    then name the argument."""
    C.tensor(op, "x", x)
    C.integer(op, "topk_ids", topk_ids)
    C.floating(op, "topk_weights", topk_weights)
    if expert_map is not None:
        C.integer(op, "expert_map", expert_map)
    if check and may_sync(x):
        check_ids(op, topk_ids, expert_map, E)
    ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
    weights = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
    if expert_map is not None:
        expert_map = (expert_map if expert_map.dtype == torch.int32 else expert_map.to(torch.int32)).contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    return Routing(ids.contiguous(), weights.contiguous(), expert_map, out)
