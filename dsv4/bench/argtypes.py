"""argparse types and checks the benchmark routines share (:mod:`dsv4.bench.cli`)."""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from typing import Optional

import torch

from .models import WINDOW

__all__ = ["int_list", "context_list", "name_list", "anchor_paths", "out_dir_problem", "gpu_problem"]


def int_list(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]; every item a positive decimal integer (no empty items)."""
    items = [v.strip() for v in text.split(",")]
    if not all(re.fullmatch(r"\d+", v) for v in items) or any(int(v) == 0 for v in items):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of positive integers like 1,8,32, got {text!r}")
    return [int(v) for v in items]


def context_list(text: str) -> list[int]:
    """'4K,32K,128K' or '4096,32768' -> token counts (K = 1024, M = 1024^2), each in
    [window, 1M]."""
    values = []
    for v in (s.strip() for s in text.split(",")):
        m = re.fullmatch(r"(\d+)([kKmM]?)", v)
        if not m:
            raise argparse.ArgumentTypeError(f"expected context lengths like 4K,32K,128K or 4096, got {text!r}")
        values.append(int(m.group(1)) * {"": 1, "k": 1024, "m": 1 << 20}[m.group(2).lower()])
    for v in values:
        if not WINDOW <= v <= 1 << 20:
            raise argparse.ArgumentTypeError(f"context lengths must lie in [{WINDOW}, 1M] tokens, got {v}")
    return values


def name_list(choices):
    """argparse type: a comma-separated list of names, each one of ``choices`` (order
    kept, repeats dropped)."""
    choices = tuple(choices)

    def parse(text: str) -> list[str]:
        items = [v.strip() for v in text.split(",")]
        bad = [v for v in items if v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"takes a comma-separated list of {', '.join(choices)}; got "
                                             f"{', '.join(repr(b) for b in bad)}")
        return list(dict.fromkeys(items))

    parse.__name__ = "name list"
    return parse


def anchor_paths(text: Optional[str]) -> Optional[list[str]]:
    """--anchors DIR[:DIR] (os.pathsep-separated) -> the folders, or None."""
    return [p for p in text.split(os.pathsep) if p] if text else None


def out_dir_problem(path: str) -> Optional[str]:
    """Creates an output folder; why it cannot hold the results, in one line, or None."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as ex:
        return f"--out-dir {path!r} cannot hold the results: {ex.strerror or ex}"
    return None


def gpu_problem() -> Optional[str]:
    """Why the dsv4 kernels cannot be timed here, in one line, or None."""
    import dsv4._ops

    if not torch.cuda.is_available():
        return "no CUDA GPU available (torch.cuda.is_available() is False)"
    if not dsv4._ops.HAS_CUDA_EXTENSION:
        return f"the dsv4 CUDA extension is not built ({dsv4._ops.EXTENSION_ERROR})"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"the dsv4 kernels target sm_90a (Hopper), this GPU is sm_{major}{minor}"
    return None
