"""Argument checks: one vocabulary for the op wrappers, the fake and CPU kernels and the
format helpers.

Every op checks its arguments once in C++ (the CUDA entry, ``csrc/common/checks.h``) and
once in Python (the fake and CPU kernels, with these functions, one rule set per op in the
op's module), with the same rules and the same wording; tests/test_value_checks.py and the
``*_bad_inputs`` tests run each bad call on CPU and on CUDA. The float32 references in
``dsv4.reference`` assume checked inputs and check nothing.

A message reads ``dsv4: <op>: <argument> <what was expected>, got <what came>``. ``op`` is
the function or op that refused the call (``"nvfp4_moe"``, ``"pack_fp4"``). The C++ entries
do not name the op yet (``dsv4: <argument> ...``); the rest of each message is theirs.

Argument errors are ValueError; an argument that is not a tensor at all is a TypeError.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

__all__ = [
    "error", "type_error", "tensor", "dtype", "floating", "integer", "ndim", "shape", "same_device", "contiguous",
    "finite_positive", "finite_positive_values", "host_int", "one_of",
]

# floating-point dtypes whose values can be computed with (the fp8 ones only store)
_COMPUTE_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def error(op: str, msg: str) -> ValueError:
    """The ValueError for a refused call: ``raise error(op, "x must ...")``."""
    return ValueError(f"dsv4: {op}: {msg}")


def type_error(op: str, msg: str) -> TypeError:
    """The TypeError for an argument of the wrong Python type (not a tensor, not a dict)."""
    return TypeError(f"dsv4: {op}: {msg}")


def tensor(op: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise type_error(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")


def dtype(op: str, name: str, t: torch.Tensor, *expected: torch.dtype, note: str = "") -> None:
    """``t.dtype`` is one of ``expected``; ``note`` follows the expectation (a hint)."""
    tensor(op, name, t)
    if t.dtype not in expected:
        want = " or ".join(str(d) for d in expected)
        raise error(op, f"{name} must have dtype {want}{note}, got {t.dtype}")


def floating(op: str, name: str, t: torch.Tensor) -> None:
    """A float dtype that can be computed with (float64/32/16, bfloat16; not the fp8 ones)."""
    tensor(op, name, t)
    if t.dtype not in _COMPUTE_FLOATS:
        raise error(op, f"{name} must be a float32/float16/bfloat16/float64 tensor, got {t.dtype}")


def integer(op: str, name: str, t: torch.Tensor) -> None:
    tensor(op, name, t)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise error(op, f"{name} must be an integer tensor, got {t.dtype}")


def ndim(op: str, name: str, t: torch.Tensor, n: int, layout: str = "") -> None:
    """``t`` has ``n`` dims; ``layout`` names them (``"[M, K]"``)."""
    if t.dim() != n:
        what = f"{n}-D {layout}" if layout else f"{n}-D"
        raise error(op, f"{name} must be {what}, got shape {tuple(t.shape)}")


def shape(op: str, name: str, t: torch.Tensor, expected: Sequence[int], note: str = "") -> None:
    """``t.shape == expected``; ``note`` says why (``" to match w13"``)."""
    if tuple(t.shape) != tuple(expected):
        raise error(op, f"{name} must have shape {list(expected)}{note}, got {list(t.shape)}")


def same_device(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise error(op, f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must be on the same "
                        "device")


def contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise error(op, f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")


def finite_positive(op: str, name: str, value: float) -> None:
    """A host number that must be finite and > 0 (NaN fails)."""
    if not (math.isfinite(value) and value > 0):
        raise error(op, f"{name} must be finite and > 0, got {value}")


def finite_positive_values(op: str, name: str, t: torch.Tensor) -> None:
    """Every value of ``t`` finite and > 0. Reads the values: CPU tensors only (on CUDA this
    would be a device sync)."""
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        raise error(op, f"{name} must be finite and > 0, got {t[bad].flatten()[0].item()}")


def host_int(op: str, name: str, value, lo: Optional[int] = None, hi: Optional[int] = None,
             note: str = "") -> None:
    """A Python int (not a bool) in ``[lo, hi]`` (either bound may be None)."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok and (lo is None or value >= lo) and (hi is None or value <= hi)
    if not ok:
        if lo is not None and hi is not None:
            want = f"an int in [{lo}, {hi}]"
        elif lo == 0:
            want = "a non-negative int"
        elif lo == 1:
            want = "a positive int"
        elif lo is not None:
            want = f"an int >= {lo}"
        else:
            want = "an int"
        raise error(op, f"{name} must be {want}{note}, got {value!r}")


def one_of(op: str, name: str, value, choices: Sequence, note: str = "") -> None:
    """``value`` is one of ``choices`` (strings are shown in double quotes)."""
    if value not in choices:
        def show(v):
            return f'"{v}"' if isinstance(v, str) else repr(v)

        want = " or ".join(show(c) for c in choices) if len(choices) <= 2 else \
            ", ".join(show(c) for c in choices[:-1]) + " or " + show(choices[-1])
        raise error(op, f"{name} must be {want}{note}, got {show(value)}")
