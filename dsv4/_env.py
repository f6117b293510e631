"""The environment variables dsv4's Python code reads, and the one rule it reads them by.

The rule is the one of the CUDA entries (csrc/common/env.h):

* a switch (:func:`switch`): unset or empty -> its default; ``"0"`` -> False, ``"1"`` ->
  True; any other value (``"yes"``, ``" 1"``, ``"true"``) is a ValueError naming the
  variable: ``dsv4: environment variable DSV4_MOE must be 0 or 1 (or unset), got "yes"``
  (env.h's message, word for word);
* a choice (:func:`choice`): unset or empty -> its default; else exactly one of the
  allowed values, or a ValueError naming the variable, the allowed values and the
  default.

No value is stripped, lower-cased or guessed at: a typo stops the program with one line
instead of silently selecting the default.

:data:`VARIABLES` lists every ``DSV4_*`` variable that Python code in this repository
reads, with what it means (tests/test_moe_config.py checks the list against the code).
The variables of the CUDA entries are listed in csrc/common/env.h and README.md
("Environment variables"); the plugin's in README.md's plugin section.
"""

from __future__ import annotations

import os
from typing import Sequence

__all__ = ["VARIABLES", "switch", "choice"]

# name -> (who reads it, what it means)
VARIABLES: dict[str, tuple[str, str]] = {
    "DSV4_MOE": ("dsv4_plugin.moe",
                 "switch, default 1: 0 keeps vLLM's own routed-expert kernels (the plugin still serves attention)"),
    "DSV4_MOE_MXFP4": ("dsv4_plugin.moe",
                       "switch, default 0: 1 claims MXFP4 routed experts (DeepSeek's own checkpoints) for dsv4"),
    "DSV4_MOE_ACTIVATION": ("dsv4_plugin.moe",
                            "choice per expert format, dsv4.moe.modes.ACTIVATIONS (default: the format's first): "
                            "the routed experts' activation mode"),
    "DSV4_ANCHORS": ("dsv4.bench.anchors",
                     "os.pathsep-separated folders searched for the incumbents' libraries (benchmarks only)"),
    "DSV4_FUZZ_DEVICE": ("scripts/gpu_fuzz.py", "the device the fuzzer runs the ops on: cuda (default) or cpu"),
    "DSV4_CUDA": ("setup.py", "build: 0 forces the pure-Python install, 1 requires the CUDA extension"),
    "DSV4_CUDA_ARCHS": ("setup.py", "build: semicolon list of CUDA targets (default 90a)"),
    "DSV4_PTXAS_VERBOSE": ("setup.py", "build: 1 prints ptxas' registers and spills per kernel"),
    "DSV4_BUILD_ONLY": ("setup.py", "build, development: compile only these csrc/ families"),
}


def _known(name: str) -> None:
    if name not in VARIABLES:
        raise KeyError(f"dsv4: {name} is not in dsv4._env.VARIABLES; list it there with its meaning")


def switch(name: str, default: bool) -> bool:
    """The switch ``name``: unset or empty -> ``default``, "0" -> False, "1" -> True, any
    other value a ValueError naming the variable (csrc/common/env.h's rule and message).
    Read on every call."""
    _known(name)
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f'dsv4: environment variable {name} must be 0 or 1 (or unset), got "{value}"')
    return value == "1"


def choice(name: str, allowed: Sequence[str], default: str, context: str = "") -> str:
    """The choice ``name``: unset or empty -> ``default``, else exactly one of ``allowed``,
    or a ValueError naming the variable, the allowed values (``context`` after them, e.g.
    " for MXFP4 routed experts") and the default. Read on every call."""
    _known(name)
    if default not in allowed:
        raise ValueError(f"dsv4: the default {default!r} of {name} is not one of {tuple(allowed)}")
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value not in allowed:
        want = " or ".join(allowed) if len(allowed) <= 2 else ", ".join(allowed[:-1]) + " or " + allowed[-1]
        raise ValueError(f'dsv4: environment variable {name} must be {want}{context} (or unset: {default}), '
                         f'got "{value}"')
    return value
