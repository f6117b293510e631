"""The MoE launchers' host side (csrc/moe/nvfp4_moe.cu, mxfp4_moe.cu): the kernel choice
(get_best_config, csrc/moe/config.h), its environment variables (csrc/common/env.h: read
once per process, validated), the workspace (one layout that counts, then carves) and the
test-only op kept out of the public schema.

CPU: the variable lists of env.h and README.md agree, nothing else in csrc reads the
environment, the debug op is not a dsv4 op, the moe benchmark's variants map to the variables.
dsv4._C, no GPU needed: get_best_config of both ops through the test-only ops
dsv4_testing::nvfp4_moe_config / mxfp4_moe_config, on made-up shapes, device facts and
overrides, against the documented rules.
GPU (and dsv4._C): the parser and the read-once rule through test-only ops; in child
processes (the variables are read once per process), the configuration printed under
DSV4_PRINT_CONFIG=1 against the same rules with the device's real facts, and every
override against the reference on the cases of tests/test_moe.py.
"""

from __future__ import annotations

import math
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsv4
import dsv4._ops

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
OVERRIDES = ("DSV4_MOE_WS", "DSV4_MOE_SPLITK", "DSV4_MOE_DIRECT_X", "DSV4_MOE_PDL", "DSV4_MOE_GEMM2_RESIDENT",
             "DSV4_MOE_FUSED_ROUTE", "DSV4_MOE_GEMM1_PAIRS", "DSV4_MOE_GEMM2_PAIRS", "DSV4_MOE_LATE_ZERO")
CHOICES = {"DSV4_MOE_BLOCK_N": "`8`, `16`, `64`", "DSV4_MOE_GEMM2_ROWS": "`1`, `2`, `4`, `8`"}  # -> README's values
ATTN_OVERRIDES = ("DSV4_ATTN_PRICED_SPLITS", "DSV4_ATTN_PDL", "DSV4_ATTN_SPECIALIZE", "DSV4_ATTN_MAIN_PDL",
                  "DSV4_ATTN_COOP_ROUND", "DSV4_ATTN_PRODUCER_AHEAD", "DSV4_ATTN_COOP_PREFETCH",
                  "DSV4_ATTN_FIRST_PV_INIT", "DSV4_ATTN_CROSSOVER",
                  "DSV4_ATTN_ROW_PREFETCH", "DSV4_ATTN_TILE_SPLITS")  # csrc/attention (tests/test_attention.py)
ATTN_CHOICES = {"DSV4_ATTN_SPLITS": "`1`, `2`, `3`, `4`, `5`, `6`, `7`, `8`, `9`, `10`, `12`, `16`",
                "DSV4_ATTN_RING32": "`0`, `1`, `2`"}
VARIABLES = OVERRIDES + tuple(CHOICES) + ("DSV4_PRINT_CONFIG",) + ATTN_OVERRIDES + tuple(ATTN_CHOICES)


# ---------------------------------------------------------------- CPU ---------


def _readme_variables() -> dict[str, list[str]]:
    """Rows of README.md's 'Environment variables' table: name -> [values, default, effect]."""
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Environment variables\n")
    section = text[start + 1:text.index("\n## ", start + 1)]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `(DSV4_[A-Z0-9_]+)` \|(.*)\|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def test_env_h_and_readme_list_the_same_variables():
    env_h = (ROOT / "csrc/common/env.h").read_text()
    read = re.findall(r'(?:get|parse_int_choice)\("(DSV4_[A-Z0-9_]+)"', env_h)
    assert sorted(read) == sorted(VARIABLES)
    rows = _readme_variables()
    assert sorted(rows) == sorted(VARIABLES)
    for name, cells in rows.items():
        assert len(cells) == 3 and all(cells), f"README row {name}: values | default | effect, got {cells}"
        values = {**CHOICES, **ATTN_CHOICES}.get(name, "`0`, `1`")
        assert cells[0] == values, f"README row {name}: env.h takes {values}, the row says {cells[0]}"
    for name, values in {**CHOICES, **ATTN_CHOICES}.items():  # env.h's list of values is the README's
        listed = re.search(rf'parse_int_choice\("{name}", [^{{]*\{{([^}}]*)\}}', env_h).group(1)
        assert ", ".join(f"`{v.strip()}`" for v in listed.split(",")) == values


def test_python_switches_follow_env_h(monkeypatch):
    """dsv4._env.switch: env.h's rule (unset or empty -> default, "0", "1", anything else
    an error naming the variable) and env.h's message, word for word."""
    from dsv4 import _env

    env_h = (ROOT / "csrc/common/env.h").read_text()
    assert '"dsv4: environment variable ", name,\n              " must be 0 or 1 (or unset), got \\"", value, "\\""' in env_h
    name = "DSV4_MOE_MXFP4"
    monkeypatch.delenv(name, raising=False)
    assert _env.switch(name, True) is True and _env.switch(name, False) is False
    for value, want in (("", None), ("0", False), ("1", True)):
        monkeypatch.setenv(name, value)
        assert _env.switch(name, True) is (True if want is None else want)
    for bad in ("yes", "2", " 1", "1 ", "01", "true", "-1", "on"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError) as ei:
            _env.switch(name, False)
        assert str(ei.value) == f'dsv4: environment variable {name} must be 0 or 1 (or unset), got "{bad}"'
    with pytest.raises(KeyError, match="DSV4_NOT_LISTED is not in dsv4._env.VARIABLES"):
        _env.switch("DSV4_NOT_LISTED", False)


def test_python_choice(monkeypatch):
    from dsv4 import _env

    name = "DSV4_MOE_ACTIVATION"
    monkeypatch.delenv(name, raising=False)
    assert _env.choice(name, ("a", "b", "c"), "b") == "b"
    monkeypatch.setenv(name, "")
    assert _env.choice(name, ("a", "b", "c"), "b") == "b"
    monkeypatch.setenv(name, "c")
    assert _env.choice(name, ("a", "b", "c"), "b") == "c"
    for bad in ("C", " c", "d"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError) as ei:
            _env.choice(name, ("a", "b", "c"), "b", " here")
        assert str(ei.value) == f'dsv4: environment variable {name} must be a, b or c here (or unset: b), got "{bad}"'
    with pytest.raises(ValueError, match="the default 'x' of DSV4_MOE_ACTIVATION is not one of"):
        _env.choice(name, ("a", "b"), "x")


# Reads of a literal DSV4_* name: _env.switch("X" / _env.choice("X", os.environ.get("X" /
# os.environ["X"] / os.getenv("X"), or a module constant ENV_VAR = "X" (dsv4.bench.anchors).
_ENV_READ = re.compile(r'(?:_env\.switch\(|_env\.choice\(|environ\.get\(|environ\[|getenv\(|ENV_VAR = )'
                       r'\s*["\'](DSV4_[A-Z0-9_]+)["\']')


def test_python_variables_are_listed():
    """Every DSV4_* variable Python code reads (outside the tests, which set them for
    children) is in dsv4._env.VARIABLES with a meaning, and every listed one is read."""
    from dsv4 import _env

    read: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", "build") or any(p.startswith(".") for p in rel.parts):
            continue
        for name in _ENV_READ.findall(path.read_text()):
            read.setdefault(name, set()).add(str(rel))
    assert read, "the pattern found no environment read at all"
    assert sorted(read) == sorted(_env.VARIABLES), read
    for name, (who, meaning) in _env.VARIABLES.items():
        assert who and meaning, name
    # the plugin's switches go through dsv4._env, not os.environ
    plugin = (ROOT / "dsv4_plugin/moe.py").read_text()
    assert "os.environ" not in plugin and "getenv" not in plugin
    for name in ("DSV4_MOE", "DSV4_MOE_MXFP4", "DSV4_MOE_ACTIVATION"):
        assert read[name] == {"dsv4_plugin/moe.py"}


def test_only_env_h_reads_the_environment():
    readers = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "csrc").rglob("*"))
               if p.suffix in (".cu", ".cuh", ".cpp", ".h") and "getenv" in p.read_text()]
    assert readers == ["csrc/common/env.h"]


def test_debug_op_is_not_in_the_public_schema():
    name = "nvfp4_moe_gemm1_debug"
    assert name not in dsv4._ops.SCHEMAS
    registration = (ROOT / "csrc/registration.cpp").read_text()
    assert name not in registration
    assert not hasattr(torch.ops.dsv4, name)  # with or without the extension loaded
    testing = (ROOT / "csrc/testing/testing_ops.cpp").read_text()
    assert "TORCH_LIBRARY_FRAGMENT(dsv4_testing, m)" in testing and f'"{name}(Tensor x' in testing
    launcher = (ROOT / "csrc/moe/nvfp4_moe.cu").read_text()
    binds = re.findall(r"TORCH_LIBRARY_IMPL\((\w+), CUDA, m\) \{([^}]*)\}", launcher)
    assert [(lib, name in body) for lib, body in binds] == [("dsv4", False), ("dsv4_testing", True)]
    assert not hasattr(dsv4.moe, "_gemm1_debug")


def test_bench_moe_variants_map_to_the_overrides():
    from dsv4.bench.routines import moe as b

    assert sorted(b.SWITCHES.values()) == sorted(OVERRIDES + tuple(CHOICES))
    assert b.variant_env("") == {}
    assert b.variant_env("bn=64,sk=1") == {"DSV4_MOE_BLOCK_N": "64", "DSV4_MOE_SPLITK": "1"}
    assert b.variant_env(" sk=1, pdl=0 ") == {"DSV4_MOE_SPLITK": "1", "DSV4_MOE_PDL": "0"}
    assert b.variant_env("dx=0,ws=1") == {"DSV4_MOE_DIRECT_X": "0", "DSV4_MOE_WS": "1"}
    for bad in ("sk=2", "sk", "xx=1", "pdl=", "sk=yes", "bn=1", "bn=32"):
        with pytest.raises(ValueError, match="moe --variants item"):
            b.variant_env(bad)
    argv = ["--quick", "--variants", "sk=0;sk=1", "--json", "a.json", "--decode=1,64", "--variants=x"]
    assert b.child_argv(argv, "sk=1", "/t/v.json") == ["--quick", "--decode=1,64", "--variants", "sk=1",
                                                        "--json", "/t/v.json"]


# ------------------------------------ get_best_config (dsv4._C, no GPU needed) ---------

needs_extension = pytest.mark.skipif(not dsv4._ops.HAS_CUDA_EXTENSION,
                                     reason="needs dsv4._C (the test-only config ops); no GPU needed")

# dsv4_testing::nvfp4_moe_config's result, in order (Nvfp4MoeConfig's fields, config.h)
NVFP4_CONFIG_FIELDS = ("block_n", "max_tiles", "multi_cta_route", "splitk", "gemm1_ctas", "gemm2_ctas", "sk_ctas",
                       "direct_x", "ws", "cluster", "ws_ctas", "pdl", "gather_ctas", "combine_ctas", "gemm2_rows")
OVERRIDE_KEYS = ("ws", "splitk", "direct_x", "pdl", "block_n", "gemm2_rows")  # the op's override order (DSV4_MOE_WS, ...)
# Device facts: SMs, per token tile (split-K GEMM1, split-K GEMM2, classic GEMM1) CTAs
# per SM, CTAs of the 2-CTA prefill grid. Made up, near what an H200 reports, plus a
# device where no 2-CTA cluster fits.
DEVICE = dict(sms=132, occ={8: (4, 4, 7), 16: (3, 3, 5), 64: (2, 2, 2)}, ws_grid2=128)
SMALL_DEVICE = dict(sms=20, occ={8: (2, 3, 4), 16: (2, 2, 3), 64: (1, 1, 2)}, ws_grid2=0)


def _nvfp4_config(M, K, N, E, E_global, topk, activation="bf16", cta_mode=0, device=DEVICE, **overrides):
    facts = [device["sms"], *device["occ"][8], *device["occ"][16], *device["occ"][64], device["ws_grid2"]]
    ov = [-1 if overrides.get(k) is None else int(overrides[k]) for k in OVERRIDE_KEYS]
    got = torch.ops.dsv4_testing.nvfp4_moe_config([M, K, N, E, E_global, topk], activation == "nvfp4", cta_mode,
                                                  facts, ov)
    return dict(zip(NVFP4_CONFIG_FIELDS, got))


def _block_n(per_expert: float, max16: float) -> int:
    """config.h pick_block_n: 8 up to 4 tokens per expert, 16 up to the op's max16, 64 above."""
    return 8 if per_expert <= 4 else 16 if per_expert <= max16 else 64


def _nvfp4_block_n(per_expert: float) -> int:
    """pick_block_n with kNvfp4Max16: 16-token tiles up to 20 tokens per expert."""
    return _block_n(per_expert, 20)


def _direct_x_rule(bn: int, N: int) -> bool:
    """config.h pick_direct_x: bf16 GEMM1 reads x rows itself at decode tiles and where N <= 512."""
    return bn <= 16 or N <= 512


def _expected_full(M, K, N, E, E_global, topk, activation, cta_mode, device, **overrides) -> dict:
    """Every field of the config by the rules written out (config.h), overrides applied."""
    S = M * topk
    bn = overrides.get("block_n") or _nvfp4_block_n(S / E_global)
    occ = device["occ"][bn]
    c = dict(M=M, topk=topk, E=E, E_global=E_global, K=K, N=N, activation=activation, cta_mode=cta_mode,
             classic1=occ[2], sms=device["sms"])
    e = _expected_config(c, overrides.get("block_n"))
    if overrides.get("splitk") is not None:
        e["splitk"] = int(overrides["splitk"])
    auto_ws = cta_mode != 0 or S / E_global >= (76 if N <= 512 else 60)  # config.h ws_min_tokens_per_expert
    e["ws"] = int(bn == 64 and not e["splitk"] and (auto_ws if overrides.get("ws") is None else overrides["ws"]))
    e["cluster"] = (cta_mode if cta_mode else 1) if e["ws"] else 1
    # bf16 mode may read x rows in GEMM1 (no gather) but for the 2-CTA prefill kernel's
    # multicast and the split-K grid at 64-token tiles, and the prefill kernel only where its
    # 32-bit row offsets hold M * K
    possible = (activation == "bf16" and e["cluster"] == 1 and (not e["ws"] or M * K < 2**31)
                and (bn <= 16 or not e["splitk"]))
    want = overrides["direct_x"] if overrides.get("direct_x") is not None else _direct_x_rule(bn, N)
    e["direct_x"] = int(possible and want)
    if overrides.get("pdl") is not None:
        e["pdl"] = int(overrides["pdl"])
    sms = device["sms"]
    e["gemm1_ctas"], e["gemm2_ctas"] = (occ[0] * sms, occ[1] * sms) if e["splitk"] else (0, 0)
    e["sk_ctas"] = max(e["gemm1_ctas"], e["gemm2_ctas"])
    e["ws_ctas"] = 0 if not e["ws"] else device["ws_grid2"] if e["cluster"] == 2 else sms
    e["gather_ctas"] = min(e["max_tiles"] * bn, sms * 8)
    e["combine_ctas"] = min(M, sms * 16)
    e["gemm2_rows"] = _nvfp4_gemm2_rows(bn, e["ws"], e["splitk"], N, K, overrides.get("gemm2_rows"))
    return e


def _nvfp4_gemm2_rows(bn, ws, splitk, N, K, override=None) -> int:
    """config.h: where N <= 512 at 64-token tiles on the classic grid, 8 weight-row tiles per
    GEMM2 CTA halved until it divides K / 64 (or the override); else 1."""
    if bn != 64 or ws or splitk or N > 512:
        return 1
    r = 8
    while (K // 64) % r:
        r //= 2
    return override or r


def _grid_tiles(M, topk, E, E_global, bn, max_tiles):
    """config.h pick_grid_tiles: the classic grids' rows at 64-row tiles, the tiles expected under
    uniform routing (full tiles of the local slots plus one per touched expert), a quarter more."""
    local = M * topk * E / E_global
    touched = E * (1 - (1 - 1 / E) ** local)
    return min(max_tiles, math.ceil(1.25 * (math.ceil(local / bn) + touched)) + 1)


CONFIG_SHAPES = [  # (K, N, E, E_global, topk): V4-Flash / V4-Pro local shards, one expert, no map
    (4096, 2048, 32, 256, 6), (7168, 3072, 48, 384, 6), (4096, 256, 256, 256, 6), (128, 64, 1, 1, 1),
    (5120, 320, 48, 384, 6), (5120, 320, 384, 384, 6),
]


@needs_extension
@pytest.mark.parametrize("shape", CONFIG_SHAPES, ids=lambda s: "K{}-N{}-E{}of{}-k{}".format(*s))
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
@pytest.mark.parametrize("cta_mode", [0, 1, 2])
def test_nvfp4_config_follows_the_rules(shape, activation, cta_mode):
    K, N, E, E_global, topk = shape
    for M in (1, 2, 3, 7, 16, 33, 64, 100, 512, 1024, 1365, 2048, 2731, 4096, 16384):
        got = _nvfp4_config(M, K, N, E, E_global, topk, activation, cta_mode)
        assert got == _expected_full(M, K, N, E, E_global, topk, activation, cta_mode, DEVICE), (M, shape)


@needs_extension
@pytest.mark.parametrize("override", [dict(splitk=True), dict(splitk=False), dict(ws=True), dict(ws=False),
                                      dict(direct_x=False), dict(direct_x=True), dict(pdl=False), dict(pdl=True),
                                      dict(ws=True, splitk=True, pdl=False), dict(block_n=8), dict(block_n=16),
                                      dict(block_n=64), dict(block_n=16, splitk=False), dict(block_n=64, ws=True),
                                      dict(gemm2_rows=1), dict(gemm2_rows=2), dict(gemm2_rows=8, block_n=64)],
                         ids=str)
def test_nvfp4_config_overrides(override):
    for M in (1, 7, 64, 512, 2048, 4096, 16384):
        for activation in ("bf16", "nvfp4"):
            for cta_mode in (0, 1):
                got = _nvfp4_config(M, 4096, 2048, 32, 256, 6, activation, cta_mode, **override)
                want = _expected_full(M, 4096, 2048, 32, 256, 6, activation, cta_mode, DEVICE, **override)
                assert got == want, (M, activation, cta_mode)


@needs_extension
def test_nvfp4_config_plain_cases():
    """The rules' plain cases on the V4-Flash local shard (32 of 256 experts), stated outright."""
    flash = (4096, 2048, 32, 256, 6)
    c = _nvfp4_config(1, *flash)
    assert (c["block_n"], c["splitk"], c["direct_x"], c["pdl"], c["ws"]) == (8, 1, 1, 1, 0)
    assert (c["gemm1_ctas"], c["gemm2_ctas"], c["sk_ctas"]) == (4 * 132, 4 * 132, 4 * 132)
    assert _nvfp4_config(1, *flash, activation="nvfp4")["direct_x"] == 0
    assert _nvfp4_config(512, *flash)["block_n"] == 16  # 12 expected tokens per expert
    c = _nvfp4_config(2048, *flash)  # 48 expected tokens per expert: below the prefill kernel's 60
    assert (c["block_n"], c["ws"], c["pdl"]) == (64, 0, 0)
    assert _nvfp4_config(2048, *flash, cta_mode=1)["ws"] == 1
    c = _nvfp4_config(4096, *flash)
    assert (c["ws"], c["cluster"], c["ws_ctas"]) == (1, 1, 132)
    c = _nvfp4_config(4096, *flash, cta_mode=2)
    assert (c["ws"], c["cluster"], c["ws_ctas"]) == (1, 2, 128)
    assert _nvfp4_config(16384, *flash)["multi_cta_route"] == 1
    assert _nvfp4_config(1365, *flash)["multi_cta_route"] == 0  # 8190 slots
    assert _nvfp4_config(1366, *flash)["multi_cta_route"] == 1  # 8196 slots
    # the 16-token tile up to 20 expected tokens per expert, at every N
    assert [_nvfp4_config(M, *flash)["block_n"] for M in (853, 854)] == [16, 64]  # 19.99, 20.02
    tp8 = (5120, 320, 384, 384, 6)  # V4.1-Flash at tensor parallel 8, N = 288 padded to 320
    assert [_nvfp4_config(M, *tp8)["block_n"] for M in (1280, 1281, 2048)] == [16, 64, 64]  # 20, 20.02, 32
    # GEMM2 over a resident token tile, 8 weight-row tiles per CTA, where N <= 512 at 64-token
    # tiles on the classic grid (K / 64 = 80); not on the warp-specialized kernel (76 and more)
    assert [_nvfp4_config(M, *tp8)["gemm2_rows"] for M in (1280, 1281, 3839, 4863, 4864)] == [1, 8, 8, 8, 1]
    assert [_nvfp4_config(M, *tp8)["ws"] for M in (4863, 4864)] == [0, 1]  # 75.98, 76 tokens per expert
    assert _nvfp4_config(2560, *tp8, gemm2_rows=2)["gemm2_rows"] == 2
    assert _nvfp4_config(2048, *flash, gemm2_rows=2)["gemm2_rows"] == 1  # N = 2048: no effect
    assert _nvfp4_config(2560, 4160, 320, 384, 384, 6)["gemm2_rows"] == 1  # K / 64 = 65: odd, 8 -> 1


@needs_extension
def test_nvfp4_config_refusals():
    flash = (4096, 2048, 32, 256, 6)
    with pytest.raises(RuntimeError, match=r"dsv4: nvfp4_moe's 2-CTA prefill kernel does not fit on this device "
                                           r"\(cta_mode=2\)"):
        _nvfp4_config(4096, *flash, cta_mode=2, device=SMALL_DEVICE)
    assert _nvfp4_config(4096, *flash, cta_mode=1, device=SMALL_DEVICE)["ws_ctas"] == 20
    # the one-warpgroup grid's y dimension: at most 65535 token tiles (64 each here)
    M = 65535 * 64 + 1
    with pytest.raises(RuntimeError, match="dsv4: nvfp4_moe's one-warpgroup GEMM grid takes at most 65535 token "
                                           "tiles, got 65536"):
        _nvfp4_config(M, 128, 64, 1, 1, 1, ws=False)
    assert _nvfp4_config(M, 128, 64, 1, 1, 1)["ws"] == 1  # the persistent grid has no such bound
    with pytest.raises(RuntimeError, match="dsv4_testing::nvfp4_moe_config: the block_n override is 8, 16, 64 or -1, "
                                           "got 32"):
        _nvfp4_config(2048, 4096, 2048, 32, 256, 6, block_n=32)
    with pytest.raises(RuntimeError, match="dsv4: DSV4_MOE_GEMM2_ROWS=8 must divide nvfp4_moe's K / 64 = 65 GEMM2 "
                                           "weight tiles"):
        _nvfp4_config(2560, 4160, 320, 384, 384, 6, gemm2_rows=8)


# sms; split-K GEMM1, GEMM2, classic GEMM1 CTAs per SM at 8, 16, 64 tokens
MX_DEVICE = [132, 5, 5, 9, 4, 4, 8, 3, 3, 4]
MX_BLOCK_NS = (8, 16, 64)


def _mxfp4_expected(M, K, N, E, Eg, topk, device=MX_DEVICE, splitk=None, pdl=None, block_n=None, rows=None,
                    resident=None, fused=None, pairs=None, pairs2=None, late_zero=None):
    """mxfp4_moe's get_best_config, written out (csrc/moe/config.h)."""
    S, per_expert = M * topk, M * topk / Eg
    bn = block_n or _block_n(per_expert, 16)  # config.h kMxfp4Max16
    i = MX_BLOCK_NS.index(bn)
    occ = device[1 + 3 * i:4 + 3 * i]
    touched = E * (1 - (1 - 1 / E) ** (S * E / Eg))
    sk = bn <= 16 and touched * (2 * N // 64) < occ[2] * device[0] if splitk is None else splitk
    g1, g2 = (occ[0] * device[0], occ[1] * device[0]) if sk else (0, 0)
    r = 1
    if bn == 64 and not sk:  # GEMM2 CTAs of 8 weight tiles at <= 4 K chunks, else 4, dividing K / 64
        r = 8 if -(-N // 128) <= 4 else 4
        while (K // 64) % r:
            r //= 2
        r = rows or r
    G2 = -(-N // 128)
    res = int(r > 1 and 2 <= G2 <= 4 and (resident is None or bool(resident)))
    tiles = max(1, (S + min(E, S) * (bn - 1)) // bn)
    # routing and GEMM1's input in one kernel at <= 128 slots on 8- / 16-row tiles (<= 2048 padded rows)
    fr = int(S <= 128 and bn <= 16 and tiles * bn <= 2048 and (fused is None or bool(fused)))
    # GEMM1's input: fused, a warp per 128-group (8 CTAs per SM); else a warp per 8 groups (3 per SM)
    units = M * (K // 128 if fr else -(-(K // 128) // 8))
    qctas = max(1, min((units + 7) // 8, device[0] * (8 if fr else 3)))  # 3: params.cuh's kQuantXCtasPerSm
    # the classic GEMM grids' rows at 64-row tiles: expected tiles under uniform routing (full
    # tiles of the local slots plus one per touched expert) with a quarter more, at most the bound
    grid = _grid_tiles(M, topk, E, Eg, bn, tiles) if bn == 64 else tiles
    # GEMM1 on pairs of an expert's tiles from 128 expected tokens per local expert (classic
    # grid, 64-row tiles): each busy expert may add an empty tile, the bound rounded up to
    # even; the pairs' grid as the tiles' (pairs of 128 local slots plus one per touched expert)
    pr = int(bn == 64 and not sk and (S / Eg >= 128 if pairs is None else bool(pairs)))
    gp = 0
    if pr:
        tiles += min(E, S)
        tiles += tiles & 1
        gp = min(tiles // 2, math.ceil(1.25 * (math.ceil(S * E / Eg / 128) + touched)) + 1)
    # GEMM2 on GEMM1's pairs where GEMM2 CTAs take several weight tiles; by default not where
    # the token tile is resident (2 <= G2 <= 4), in place of the resident kernel when forced on
    p2 = int(bool(pr) and r > 1 and (not 2 <= G2 <= 4 if pairs2 is None else bool(pairs2)))
    res = 0 if p2 else res
    # the zero rows of all-remote tokens by GEMM1's pair kernel: wherever it runs, unless switched off
    lz = int(bool(pr) and (late_zero is None or bool(late_zero)))
    return [bn, tiles, int(S > 8192), int(sk), g1, g2, max(g1, g2),
            1 if pdl is None else int(pdl), qctas, r, res, fr, grid, pr, gp, p2, lz]


@needs_extension
def test_mxfp4_config():
    def config(shape, device, overrides):  # overrides not given are unset (the last three: DSV4_MOE_GEMM1_PAIRS,
        # _GEMM2_PAIRS, _LATE_ZERO)
        return torch.ops.dsv4_testing.mxfp4_moe_config(shape, device, list(overrides) + [-1] * (9 - len(overrides)))

    shapes = [(9, 256, 128, 4, 4, 2), (1, 4096, 2048, 32, 256, 6), (1, 7168, 3072, 48, 384, 6),
              (64, 4096, 2048, 32, 256, 6), (512, 5120, 2304, 48, 384, 6), (512, 5120, 320, 384, 384, 6),
              (4096, 4096, 2048, 32, 256, 6), (5000, 128, 64, 1, 1, 1), (1536, 4096, 2048, 32, 256, 6),
              (2048, 4096, 2048, 32, 256, 6), (16384, 7168, 3072, 48, 384, 6), (8192, 4096, 320, 384, 384, 6)]
    for shape in shapes:
        assert config(list(shape), MX_DEVICE, [-1, -1, -1, -1, -1]) == _mxfp4_expected(*shape), shape
        for sk, pdl in ((0, 1), (1, 0)):
            assert config(list(shape), MX_DEVICE, [sk, pdl, -1, -1, -1]) == _mxfp4_expected(*shape, splitk=bool(sk), pdl=pdl)
        for bn in MX_BLOCK_NS:
            assert config(list(shape), MX_DEVICE, [-1, -1, bn, -1, -1]) == _mxfp4_expected(*shape, block_n=bn), (shape, bn)
    # the rules' plain cases, stated outright: decode sizes split K, the rest run the classic grid,
    # the token tile grows with the expected tokens per local expert (M * 6 / 256 here)
    assert config([1, 4096, 2048, 32, 256, 6], MX_DEVICE, [-1, -1, -1, -1, -1])[3] == 1
    assert [config([M, 4096, 2048, 32, 256, 6], MX_DEVICE, [-1, -1, -1, -1, -1])[0]
            for M in (170, 171, 682, 683, 16384)] == [8, 16, 16, 64, 64]
    assert config([4096, 4096, 2048, 32, 256, 6], MX_DEVICE, [-1, -1, -1, -1, -1])[:4] == [64, 415, 1, 0]
    with pytest.raises(RuntimeError, match="dsv4: mxfp4_moe's GEMM grid takes at most 65535 token tiles, got 65536"):
        config([65535 * 16 + 1, 128, 64, 1, 1, 1], MX_DEVICE, [0, -1, 16, -1, -1])
    # the persistent grid has no such bound
    assert config([65535 * 16 + 1, 128, 64, 1, 1, 1], MX_DEVICE, [1, -1, 16, -1, -1])[3] == 1
    # GEMM2 weight tiles per CTA: only on the classic grid at 64-token tiles; 8 where G2 = 3
    # (N = 288 at tensor parallel 8), 4 at the expert-parallel shapes (G2 = 16-24)
    tp8, ep8 = [8192, 5120, 288, 384, 384, 6], [8192, 5120, 2304, 48, 384, 6]
    assert config(tp8, MX_DEVICE, [-1, -1, -1, -1, -1])[9] == 8 and config(ep8, MX_DEVICE, [-1, -1, -1, -1, -1])[9] == 4
    assert config([2048, 7168, 3072, 48, 384, 6], MX_DEVICE, [-1, -1, -1, -1, -1])[9] == 4  # V4-Pro: K / 64 = 112
    for rows in (1, 2, 4, 8):
        for shape in (tp8, ep8):
            assert config(shape, MX_DEVICE, [-1, -1, -1, rows, -1]) == _mxfp4_expected(*shape, rows=rows)
        assert config(tp8, MX_DEVICE, [-1, -1, 16, rows, -1])[9] == 1  # not at 16-token tiles
        assert config(tp8, MX_DEVICE, [1, -1, 64, rows, -1])[9] == 1  # nor on the split-K grid
    assert config([8192, 384, 320, 384, 384, 6], MX_DEVICE, [-1, -1, -1, -1, -1])[9] == 2  # K / 64 = 6: not 8, 4
    # the token tile resident in GEMM2 CTAs of several weight tiles where 2 <= G2 <= 4
    assert config(tp8, MX_DEVICE, [-1, -1, -1, -1, -1])[10] == 1 and config(ep8, MX_DEVICE, [-1, -1, -1, -1, -1])[10] == 0
    assert config(tp8, MX_DEVICE, [-1, -1, -1, -1, 0])[10] == 0
    assert config(tp8, MX_DEVICE, [-1, -1, -1, 1, 1])[10] == 0  # one tile per CTA: the classic kernel
    assert config([8192, 5120, 128, 384, 384, 6], MX_DEVICE, [-1, -1, -1, -1, 1])[10] == 0  # G2 = 1
    for shape in (tp8, ep8, [8192, 4096, 256, 384, 384, 6]):
        for res in (0, 1):
            assert config(shape, MX_DEVICE, [-1, -1, -1, -1, res]) == _mxfp4_expected(*shape, resident=res)
    with pytest.raises(RuntimeError, match="dsv4: DSV4_MOE_GEMM2_ROWS=4 must divide mxfp4_moe's K / 64 = 6 GEMM2"):
        config([8192, 384, 320, 384, 384, 6], MX_DEVICE, [-1, -1, -1, 4, -1])
    with pytest.raises(RuntimeError, match="the block_n override is 8, 16, 64 or -1, got 48"):
        config([64, 128, 64, 1, 1, 1], MX_DEVICE, [-1, -1, 48, -1, -1])
    with pytest.raises(RuntimeError, match="the gemm2_rows override is 1, 2, 4, 8 or -1, got 3"):
        config([64, 128, 64, 1, 1, 1], MX_DEVICE, [-1, -1, -1, 3, -1])
    # the fused routing at decode sizes: M * k <= 128 slots on 8- / 16-row tiles
    v41 = [1, 5120, 2304, 48, 384, 6]
    for M in (1, 8, 16, 21, 22, 64):
        shape = [M] + v41[1:]
        for fused in (None, 0, 1):
            ov = [-1, -1, -1, -1, -1, -1 if fused is None else fused]
            assert config(shape, MX_DEVICE, ov) == _mxfp4_expected(*shape, fused=fused), (M, fused)
    assert [config([M] + v41[1:], MX_DEVICE, [])[11] for M in (1, 21, 22)] == [1, 1, 0]
    # the classic grids' rows at V4-Flash EP8, M = 8192: 6144 local slots, 96 full tiles + 32
    # touched experts, a quarter more: 161 rows, against the bound's 799 (without pairs)
    flash8k = [8192, 4096, 2048, 32, 256, 6]
    no_pairs = config(flash8k, MX_DEVICE, [-1] * 6 + [0])
    assert no_pairs[1:2] + no_pairs[12:] == [799, 161, 0, 0, 0, 0]
    # with pairs (192 tokens per local expert: the rule's default): the bound 799 + 32 (+1 to
    # even), the pairs' grid: 48 pairs of full tiles + 32 touched experts, a quarter more: 101
    pairs = config(flash8k, MX_DEVICE, [])
    assert pairs[1:2] + pairs[12:] == [832, 161, 1, 101, 1, 1]
    # the rule: from 128 tokens per local expert (V4-Pro EP8 and TP8 at M = 8192), not at 2048
    for shape, want in (([8192, 7168, 3072, 48, 384, 6], 1), ([8191, 7168, 3072, 48, 384, 6], 0),
                        ([2048, 4096, 2048, 32, 256, 6], 0), ([8192, 5120, 288, 384, 384, 6], 1)):
        assert config(shape, MX_DEVICE, [])[13] == want, shape
        for pairs in (0, 1):
            assert config(shape, MX_DEVICE, [-1] * 6 + [pairs]) == _mxfp4_expected(*shape, pairs=pairs), (shape, pairs)
    assert config(flash8k, MX_DEVICE, [1, -1, -1, -1, -1, -1, 1])[13] == 0  # not on the split-K grid
    assert config(flash8k, MX_DEVICE, [-1, -1, 16, -1, -1, -1, 1])[13] == 0  # nor at 16-token tiles
    assert config([16, 5120, 2304, 48, 384, 6], MX_DEVICE, [-1, -1, 64])[11] == 0  # not on 64-row tiles
    assert config([1, 4096, 2048, 32, 256, 6], MX_DEVICE, [-1, -1, -1, -1, -1, 0])[11] == 0
    # GEMM2 on GEMM1's pairs: on by default where GEMM1's pairs run and GEMM2 CTAs take several
    # weight tiles, but not where the token tile is resident (TP8, G2 = 3: that kernel stays)
    pro8k, tp8 = [8192, 7168, 3072, 48, 384, 6], [8192, 5120, 288, 384, 384, 6]
    assert [config(s, MX_DEVICE, [])[13:16:2] for s in (pro8k, flash8k, tp8)] == [[1, 1], [1, 1], [1, 0]]
    assert config(tp8, MX_DEVICE, [])[10] == 1  # the resident kernel
    assert config(tp8, MX_DEVICE, [-1] * 7 + [1])[10:16:5] == [0, 1]  # forced on: in its place
    assert config(pro8k, MX_DEVICE, [-1] * 7 + [0])[15] == 0
    assert config(pro8k, MX_DEVICE, [-1] * 6 + [0, 1])[15] == 0  # needs GEMM1's pairs
    assert config(pro8k, MX_DEVICE, [-1, -1, -1, 1, -1, -1, -1, 1])[15] == 0  # and several weight tiles
    assert config([2048, 7168, 3072, 48, 384, 6], MX_DEVICE, [])[15] == 0  # no pairs at M = 2048
    for shape in (pro8k, flash8k, tp8, [16384, 4096, 2048, 32, 256, 6], [2048, 4096, 2048, 32, 256, 6]):
        for rows in (None, 1, 2, 8):
            for p2 in (None, 0, 1):
                ov = [-1, -1, -1, -1 if rows is None else rows, -1, -1, -1, -1 if p2 is None else p2]
                assert config(shape, MX_DEVICE, ov) == _mxfp4_expected(*shape, rows=rows, pairs2=p2), (shape, rows, p2)
    # the all-remote tokens' zero rows by GEMM1's pair kernel: by default wherever the pairs run
    # (M >= 8192 at V4-Pro EP8), off where switched off, never without the pairs
    assert [config(s, MX_DEVICE, [])[16] for s in (pro8k, flash8k, tp8)] == [1, 1, 1]
    assert [config(s, MX_DEVICE, [-1] * 8 + [0])[16] for s in (pro8k, flash8k, tp8)] == [0, 0, 0]
    assert config(pro8k, MX_DEVICE, [-1] * 6 + [0, -1, 1])[16] == 0  # no pairs: the quantization writes them
    assert config([2048, 7168, 3072, 48, 384, 6], MX_DEVICE, [-1] * 8 + [1])[16] == 0
    for shape in (pro8k, flash8k, [2048, 4096, 2048, 32, 256, 6], [512, 7168, 3072, 48, 384, 6]):
        for lz in (None, 0, 1):
            for pr in (None, 0, 1):
                ov = [-1] * 6 + [-1 if pr is None else pr, -1, -1 if lz is None else lz]
                assert config(shape, MX_DEVICE, ov) == _mxfp4_expected(*shape, pairs=pr, late_zero=lz), (shape, pr, lz)


# ---------------------------------------------------- GPU / extension ---------


def _child(env: dict[str, str], fn: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """Runs test_moe_config.<fn>(*args) in a fresh interpreter with exactly these dsv4
    variables set (others removed), importing the dsv4 this process imported."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_moe_config as c; "
            "getattr(c, sys.argv[2])(*sys.argv[3:])")
    full = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(dsv4.__file__).parent.parent),
                                                       os.environ.get("PYTHONPATH")]))
    full.update(env)
    proc = subprocess.run([sys.executable, "-c", code, str(TESTS), fn, *args], env=full, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{fn}{args} under {env} failed (rc {proc.returncode}):\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
    return proc


def _configs(stderr: str) -> list[dict]:
    """The DSV4_PRINT_CONFIG lines: op name, then key=value fields (ints where numeric)."""
    out = []
    for m in re.finditer(r"^dsv4 config (\w+): (.*)$", stderr, re.M):
        fields = dict(kv.split("=", 1) for kv in m.group(2).replace(" -> ", " ").split())
        out.append({"op": m.group(1), **{k: int(v) if re.fullmatch(r"-?\d+", v) else v for k, v in fields.items()}})
    return out


@pytest.mark.gpu
def test_parse_env_switch():
    parse = torch.ops.dsv4_testing.parse_env_switch
    assert parse("DSV4_MOE_PDL", None) == -1
    assert parse("DSV4_MOE_PDL", "") == -1
    assert parse("DSV4_MOE_PDL", "0") == 0
    assert parse("DSV4_MOE_PDL", "1") == 1
    for bad in ("yes", "2", " 1", "1 ", "01", "true", "-1"):
        with pytest.raises(RuntimeError, match=f'dsv4: environment variable DSV4_MOE_PDL must be 0 or 1 '
                                               f'\\(or unset\\), got "{re.escape(bad)}"'):
            parse("DSV4_MOE_PDL", bad)


def child_read_once() -> None:
    first = torch.ops.dsv4_testing.env_switches()
    os.environ["DSV4_MOE_PDL"] = "1"  # the process already read its switches: no effect
    os.environ["DSV4_MOE_SPLITK"] = "1"
    print(json.dumps([first, torch.ops.dsv4_testing.env_switches()]))


@pytest.mark.gpu
def test_switches_are_read_once_per_process():
    out = _child({"DSV4_MOE_WS": "1", "DSV4_MOE_PDL": "0", "DSV4_PRINT_CONFIG": "1"}, "child_read_once")
    first, again = json.loads(out.stdout.strip().splitlines()[-1])
    # ..., PRINT_CONFIG, BLOCK_N, GEMM2_ROWS, GEMM2_RESIDENT, FUSED_ROUTE
    assert first == again == [1, -1, -1, 0, 1, -1, -1, -1, -1]


def child_bad_value() -> None:
    import test_moe as t

    w = t._weights(2, 64, 128, seed=1, device="cuda")
    p = t.prepare_nvfp4_moe_weights(*(w[k] for k in t.KEYS))
    x = torch.randn(3, 128, device="cuda").to(torch.bfloat16)
    ids = torch.zeros(3, 1, dtype=torch.int32, device="cuda")
    for _ in range(2):  # an error on every call, not only the first
        try:
            t.nvfp4_moe(x, ids, torch.ones(3, 1, device="cuda"), p)
        except RuntimeError as e:
            print("ERROR:", str(e).splitlines()[0])
        else:
            print("no error")


@pytest.mark.gpu
@pytest.mark.parametrize("name", OVERRIDES + ("DSV4_PRINT_CONFIG",) + ATTN_OVERRIDES)
def test_bad_value_is_an_error(name):
    out = _child({name: "yes"}, "child_bad_value")
    msg = f'ERROR: dsv4: environment variable {name} must be 0 or 1 (or unset), got "yes"'
    assert out.stdout.strip().splitlines()[-2:] == [msg, msg]


@pytest.mark.gpu
@pytest.mark.parametrize("name,allowed,bad", [("DSV4_MOE_BLOCK_N", "8, 16, 64", b) for b in ("yes", "32", "064", " 64", "-1")]
                         + [("DSV4_MOE_GEMM2_ROWS", "1, 2, 4, 8", b) for b in ("3", "16", "0")]
                         + [("DSV4_ATTN_SPLITS", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16", b)
                            for b in ("0", "11", "32", "08", " 4", "auto")]
                         + [("DSV4_ATTN_RING32", "0, 1, 2", b) for b in ("3", "yes", "01", "-1")])
def test_bad_choice_is_an_error(name, allowed, bad):
    out = _child({name: bad}, "child_bad_value")
    msg = f'ERROR: dsv4: environment variable {name} must be one of {allowed} (or unset), got "{bad}"'
    assert out.stdout.strip().splitlines()[-2:] == [msg, msg]


# The kernel choice printed under DSV4_PRINT_CONFIG=1, against the rules documented in
# csrc/moe/config.h, evaluated here on the printed device facts (SMs, resident
# classic GEMM1 CTAs per SM), and the workspace size against the layout written out
# (ints | xg | h | [hq | hs] | [y] | [split-K partials], each part 256-byte aligned).
PRINT_CASES = [  # (model, M, activation, cta_mode, expert_map?)
    ("FLASH", 1, "bf16", "auto", True),
    ("FLASH", 1, "nvfp4", "auto", True),
    ("FLASH", 7, "bf16", "auto", False),
    ("FLASH", 64, "bf16", "auto", True),
    ("FLASH", 512, "bf16", "auto", True),
    ("FLASH", 1024, "nvfp4", "auto", True),
    ("FLASH", 2048, "bf16", "auto", True),
    ("FLASH", 2048, "bf16", 1, True),
    ("FLASH", 2048, "nvfp4", 2, True),
    ("FLASH", 4096, "bf16", "auto", True),
    ("PRO", 1, "nvfp4", "auto", True),
    ("PRO", 16384, "bf16", "auto", True),
]


def _expected_config(c: dict, block_n: int | None = None) -> dict:
    M, topk, E, Eg, N = c["M"], c["topk"], c["E"], c["E_global"], c["N"]
    S, per_expert = M * topk, M * topk / Eg
    bn = block_n or _nvfp4_block_n(per_expert)
    touched = E * (1 - (1 - 1 / E) ** (S * E / Eg))
    splitk = bn <= 16 and touched * (2 * N // 64) < c["classic1"] * c["sms"]
    ws = bn == 64 and not splitk and (c["cta_mode"] != 0 or per_expert >= (76 if N <= 512 else 60))
    return dict(block_n=bn, max_tiles=max(1, (S + min(E, S) * (bn - 1)) // bn), multi_cta_route=int(S > 8192),
                splitk=int(splitk),
                direct_x=int(c["activation"] == "bf16" and not (ws and c["cta_mode"] == 2) and _direct_x_rule(bn, N)),
                ws=int(ws),
                cluster=c["cta_mode"] if ws and c["cta_mode"] else 1, pdl=int(bn <= 16),
                gemm2_rows=_nvfp4_gemm2_rows(bn, ws, splitk, N, c["K"]))


def _expected_workspace(c: dict, full: bool = True) -> int:
    up = lambda b: (b + 255) // 256 * 256  # noqa: E731
    S, rows, tiles, E = c["M"] * c["topk"], c["max_tiles"] * c["block_n"], c["max_tiles"], c["E"]
    n_ints = S + rows + tiles + 2 + (2 * E + 1 if c["multi_cta_route"] else 0) + 2 * c["sk_ctas"] + 2 * tiles + 1
    nvfp4 = c["activation"] == "nvfp4"
    return (up(4 * n_ints) + (0 if c["direct_x"] else up(rows * c["K"] * 2)) + up(rows * c["N"] * 2)
            + (up(rows * c["N"] // 2) + up(rows * c["N"] // 16) if nvfp4 else 0)
            + (up(rows * c["K"] * 2) if full else 0)
            + up(2 * c["sk_ctas"] * 64 * c["block_n"] * 4))  # split-K partials: a half per GEMM


def child_print_cases() -> None:
    import test_moe as t

    for model, M, activation, cta, use_map in PRINT_CASES:
        shape = getattr(t, model)
        w, p = t._gpu_model(shape)
        x, ids, tw, emap = t._case(shape, M, "uniform", use_map, seed=M)
        t.nvfp4_moe(x, ids, tw, p, cta_mode=cta, **t._call_kwargs(w, activation, 10.0, emap))
    w, p = t._gpu_model(t.FLASH)  # the debug op prints its (GEMM1-only) config too
    x, ids, _, emap = t._case(t.FLASH, 300, "uniform", True, seed=3)
    t._gemm1_debug(x, ids, p, activation="nvfp4", a13_scale=w["w13_input_scale"], a2_scale=w["w2_input_scale"],
                   expert_map=emap)
    import test_mxfp4 as mx  # and the MXFP4 W4A8 op

    wm = mx._weights(4, 128, 256, seed=5, device="cuda")
    pm = mx.prepare_moe_weights(*(wm[k] for k in mx.MX), activation="fp8")
    gen = torch.Generator().manual_seed(5)
    ids, tw = mx._routing(9, 2, 4, gen, "cuda")
    mx.routed_moe(torch.randn(9, 256, generator=gen).to(torch.bfloat16).cuda(), ids, tw, pm)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_printed_config_follows_the_rules():
    configs = _configs(_child({"DSV4_PRINT_CONFIG": "1"}, "child_print_cases").stderr)
    assert [c["op"] for c in configs] == ["nvfp4_moe"] * len(PRINT_CASES) + ["nvfp4_moe_gemm1_debug", "mxfp4_moe"]
    for (model, M, activation, cta, use_map), c in zip(PRINT_CASES, configs):
        assert (c["M"], c["activation"], c["cta_mode"]) == (M, activation, 0 if cta == "auto" else cta)
        got = {k: c[k] for k in _expected_config(c)}
        assert got == _expected_config(c), f"{model} M={M} {activation} cta={cta}: {c}"
        assert c["workspace_bytes"] == _expected_workspace(c), f"{model} M={M}: {c}"
        assert c["sk_ctas"] > 0 if c["splitk"] else c["sk_ctas"] == 0
        if c["ws"] and c["cluster"] == 1:
            assert c["ws_ctas"] == c["sms"]
        elif c["ws"]:  # the 2-CTA clusters that fit at once
            assert c["ws_ctas"] % 2 == 0 and 0 < c["ws_ctas"] <= c["sms"]
    by_case = {(model, M, activation, cta): c for (model, M, activation, cta, _), c in zip(PRINT_CASES, configs)}
    # the rules' plain cases, stated outright
    assert by_case["FLASH", 1, "bf16", "auto"]["splitk"] == 1 and by_case["FLASH", 1, "bf16", "auto"]["direct_x"] == 1
    assert by_case["FLASH", 1, "nvfp4", "auto"]["direct_x"] == 0
    assert by_case["FLASH", 2048, "bf16", "auto"]["ws"] == 0  # 48 expected tokens per expert < 60
    assert (by_case["FLASH", 2048, "bf16", 1]["ws"], by_case["FLASH", 2048, "bf16", 1]["cluster"]) == (1, 1)
    assert (by_case["FLASH", 2048, "nvfp4", 2]["ws"], by_case["FLASH", 2048, "nvfp4", 2]["cluster"]) == (1, 2)
    assert by_case["FLASH", 4096, "bf16", "auto"]["ws"] == 1
    assert by_case["PRO", 16384, "bf16", "auto"]["multi_cta_route"] == 1
    debug, mx = configs[-2], configs[-1]
    assert {k: debug[k] for k in _expected_config(debug)} == _expected_config(debug)
    assert debug["workspace_bytes"] == _expected_workspace(debug, full=False)
    up = lambda b: (b + 255) // 256 * 256  # noqa: E731
    # M = 9, K = 256, N = 128, 4 experts, top-2: 4.5 expected tokens per expert -> 16-row tiles
    S, bn, G1, G2 = 9 * 2, 16, 2, 1
    tiles = max(1, (S + min(4, S) * (bn - 1)) // bn)
    rows, sk = tiles * bn, mx["sk_ctas"]
    assert (mx["block_n"], mx["max_tiles"], mx["N"], mx["K"]) == (bn, tiles, 128, 256)
    # mxfp4_moe.cu's layout_workspace: ints (slot_pos, row_slot, tile_expert, num_tiles,
    # error_flag, sk_count, group_ready, group_left, combine_left) | xg | xgs | hf | hq | hs | y |
    # [split-K partials]
    n_ints = S + rows + tiles + 2 + 2 * sk + tiles + tiles * G2 + 9 * (256 // 64)
    assert mx["workspace_bytes"] == (up(4 * n_ints) + up(rows * 256) + up(rows * G1 * 4) + up(rows * 128 * 4)
                                     + up(rows * G2 * 128) + up(rows * G2 * 4) + up(rows * 256 * 2)
                                     + (up(2 * sk * 64 * bn * 4) if mx["splitk"] else 0))


# Every override on the cases it changes, against the reference (the test functions of
# tests/test_moe.py), in a child process with that one variable set; every printed
# config shows the override in effect.
def _splitk_cases(t):
    """Split-K (persistent grid, items cut into K chunks, the last-arriving chunk's CTA
    adds the partials in chunk order) or the classic grid, forced at every token tile:
    decode tiles of 8 and 16 tokens (M=512: 16), the prefill tiles (one chunk per item,
    persistent), items split 6-8 ways (M=1, 2: chunks of odd length at M=2). The
    determinism check of test_gpu_vs_reference matters here: routing places rows in
    tiles in atomics order, and a row's sums must not depend on it."""
    F, P = t.FLASH, t.PRO
    return [(F, 1, "uniform", True, 10.0, "bf16", "auto"), (F, 2, "uniform", True, 10.0, "nvfp4", "auto"),
            (F, 64, "uniform", True, 10.0, "nvfp4", "auto"), (F, 512, "uniform", True, 10.0, "bf16", "auto"),
            (F, 3, "skewed", False, None, "bf16", "auto"), (F, 2048, "uniform", False, 10.0, "nvfp4", 1),
            (F, 4096, "uniform", False, 10.0, "bf16", 2), (P, 64, "uniform", True, 10.0, "nvfp4", "auto")]


def child_override(which: str) -> None:
    import test_moe as t

    F, P = t.FLASH, t.PRO
    vs_ref = t.test_gpu_vs_reference
    if which == "splitk":  # forced either way
        for case in _splitk_cases(t):
            vs_ref(*case)
        for activation in ("bf16", "nvfp4"):
            for M in (5, 20, 200):  # odd K-step counts, every token tile
                t.test_gpu_odd_k_steps(activation, M)
    elif which == "ws1":  # the warp-specialized kernel below its auto threshold (48 tokens per expert)
        vs_ref(F, 2048, "uniform", True, 10.0, "bf16", "auto")
        vs_ref(F, 2048, "uniform", True, None, "nvfp4", "auto")
        vs_ref(P, 2048, "uniform", True, 10.0, "bf16", "auto")
    elif which == "pdl0":
        vs_ref(F, 64, "uniform", True, 10.0, "bf16", "auto")
        vs_ref(F, 4096, "uniform", False, 10.0, "nvfp4", 1)
        t.test_gpu_cuda_graph_replay("bf16")
    elif which == "pdl1":  # also at prefill, where it is off by default
        vs_ref(F, 2048, "uniform", True, 10.0, "bf16", "auto")
        vs_ref(F, 4096, "uniform", False, 10.0, "nvfp4", 2)
        t.test_gpu_prefill_cuda_graph_replay(1)
    elif which == "direct_x":  # bf16 mode: decode tiles, 64-token tiles, the prefill kernel
        vs_ref(F, 64, "uniform", True, 10.0, "bf16", "auto")
        vs_ref(F, 1, "uniform", True, None, "bf16", "auto")
        vs_ref(F, 2048, "uniform", True, 10.0, "bf16", "auto")
        vs_ref(F, 4096, "uniform", False, 10.0, "bf16", 1)
        t.test_gpu_odd_k_steps("bf16", 5)
    elif which == "bn16":  # the 16-token tile at prefill sizes (48 and 32 tokens per expert)
        vs_ref(F, 2048, "uniform", True, 10.0, "bf16", "auto")
        vs_ref(F, 2048, "uniform", True, None, "nvfp4", "auto")
        vs_ref(P, 2048, "uniform", True, 10.0, "bf16", "auto")
    elif which == "bn64":  # the 64-token tile at decode sizes (1.5 tokens per expert)
        vs_ref(F, 64, "uniform", True, 10.0, "bf16", "auto")
        vs_ref(F, 64, "uniform", True, None, "nvfp4", "auto")
    else:
        raise ValueError(which)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("env,which,expect", [
    ({"DSV4_MOE_SPLITK": "1"}, "splitk", {"splitk": 1}),
    ({"DSV4_MOE_SPLITK": "0"}, "splitk", {"splitk": 0}),
    ({"DSV4_MOE_WS": "1"}, "ws1", {"ws": 1, "block_n": 64}),
    ({"DSV4_MOE_PDL": "0"}, "pdl0", {"pdl": 0}),
    ({"DSV4_MOE_PDL": "1"}, "pdl1", {"pdl": 1}),
    ({"DSV4_MOE_DIRECT_X": "0"}, "direct_x", {"direct_x": 0}),
    ({"DSV4_MOE_DIRECT_X": "1"}, "direct_x", {"direct_x": 1}),
    ({"DSV4_MOE_BLOCK_N": "16"}, "bn16", {"block_n": 16, "ws": 0}),
    ({"DSV4_MOE_BLOCK_N": "64"}, "bn64", {"block_n": 64, "splitk": 0}),
], ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else None)
def test_override_vs_reference(env, which, expect):
    configs = _configs(_child({**env, "DSV4_PRINT_CONFIG": "1"}, "child_override", which).stderr)
    assert configs
    for c in configs:
        assert {k: c[k] for k in expect} == expect, c


def child_ws_off(path: str) -> None:
    """WS_CASES of tests/test_moe.py on the one-warpgroup GEMMs, against the reference;
    the outputs go to `path` for the comparison with the warp-specialized kernel."""
    import test_moe as t

    outs = []
    for case in t.WS_CASES:
        args, kw, ref, tol = t._prefill_case(*case)
        out = t.nvfp4_moe(*args, **kw)
        assert t._rel_l2(out, ref) <= tol
        outs.append(out.cpu())
    torch.save(outs, path)


def child_gemm2_rows(path: str) -> None:
    """V4.1-Flash tensor-parallel cases (N = 288 padded to 320) at 64-token tiles on the
    one-warpgroup GEMMs, against the reference; the outputs go to `path`."""
    import test_moe as t

    outs = []
    for activation in ("bf16", "nvfp4"):
        for M in (2500, 3000):
            w, m, x, ids, tw, kw, call = t._tp8_inputs(activation, M)
            got, ref = t.routed_moe(x, ids, tw, m, **call), t._ref(x, ids, tw, w, **kw)
            assert t._rel_l2(got, ref) <= (5e-3 if activation == "bf16" else 2e-2), (activation, M)
            outs.append(got.cpu())
    torch.save(outs, path)


@pytest.mark.gpu
def test_gemm2_rows_keep_results(tmp_path):
    """nvfp4_moe's GEMM2 over a resident token tile (N <= 512 at 64-token tiles), 2 and 8
    weight-row tiles per CTA: bitwise the classic kernel's outputs (DSV4_MOE_GEMM2_ROWS=1)."""
    outs = {}
    for rows in ("1", "2", "8"):
        path = tmp_path / f"rows{rows}.pt"
        proc = _child({"DSV4_MOE_GEMM2_ROWS": rows, "DSV4_PRINT_CONFIG": "1"}, "child_gemm2_rows", str(path))
        configs = [c for c in _configs(proc.stderr) if c["op"] == "nvfp4_moe"]
        assert configs and all(c["block_n"] == 64 and c["gemm2_rows"] == int(rows) for c in configs), configs
        outs[rows] = torch.load(path)
    for rows in ("2", "8"):
        assert all(torch.equal(a, b) for a, b in zip(outs["1"], outs[rows])), rows


def child_direct_x(path: str) -> None:
    """bf16 cases at every kernel that can read x rows itself (decode tiles, the one-warpgroup
    64-token tiles, the prefill kernel at one CTA per cluster, tensor parallel 8 on both),
    against the reference; the outputs go to `path`."""
    import test_moe as t

    F, P = t.FLASH, t.PRO
    outs = []
    for shape, M, routing, use_map, cta in ((F, 5, "uniform", True, "auto"), (F, 1500, "uniform", True, "auto"),
                                            (P, 2048, "uniform", True, "auto"), (F, 4096, "uniform", False, 1),
                                            (F, 2048, "skewed", False, 1), (F, 1024, "ladder", False, 1),
                                            (P, 4096, "uniform", True, 1)):
        w, p = t._gpu_model(shape)
        x, ids, tw, emap = t._case(shape, M, routing, use_map, seed=M + 37)
        kw = t._call_kwargs(w, "bf16", 10.0, emap)
        got = t.nvfp4_moe(x, ids, tw, p, cta_mode=cta, **kw)
        assert t._rel_l2(got, t._ref(x, ids, tw, w, **kw)) <= 5e-3, (shape["K"], M, routing)
        outs.append(got.cpu())
    for M in (2048, 2500, 8192):
        w, m, x, ids, tw, kw, call = t._tp8_inputs("bf16", M)
        got = t.routed_moe(x, ids, tw, m, **call)
        assert t._rel_l2(got, t._ref(x, ids, tw, w, **kw)) <= 5e-3, ("TP8", M)
        outs.append(got.cpu())
    torch.save(outs, path)


@pytest.mark.gpu
def test_direct_x_keeps_results(tmp_path):
    """GEMM1 reading x rows itself (DSV4_MOE_DIRECT_X=1: forced wherever it can run; by default
    at decode tiles and N <= 512) against the gather kernel's copy (=0): the same bytes reach
    the same shared-memory places, so every output is bitwise the same."""
    outs = {}
    for v in ("0", "1"):
        path = tmp_path / f"dx{v}.pt"
        proc = _child({"DSV4_MOE_DIRECT_X": v, "DSV4_PRINT_CONFIG": "1"}, "child_direct_x", str(path))
        configs = [c for c in _configs(proc.stderr) if c["op"] == "nvfp4_moe"]
        assert configs and all(c["direct_x"] == int(v) for c in configs), configs
        assert {(c["block_n"], c["ws"]) for c in configs} >= {(8, 0), (64, 0), (64, 1)}, configs
        outs[v] = torch.load(path)
    assert all(torch.equal(a, b) for a, b in zip(outs["0"], outs["1"]))


@pytest.mark.gpu
def test_ws_off_matches_the_prefill_kernel(tmp_path):
    import test_moe as t

    path = tmp_path / "ws0.pt"
    configs = _configs(_child({"DSV4_MOE_WS": "0", "DSV4_PRINT_CONFIG": "1"}, "child_ws_off", str(path)).stderr)
    assert len(configs) == len(t.WS_CASES) and all(c["ws"] == 0 and c["block_n"] == 64 for c in configs)
    for case, old in zip(t.WS_CASES, torch.load(path)):
        args, kw, ref, tol = t._prefill_case(*case)
        new = t.nvfp4_moe(*args, cta_mode=2, **kw)
        assert t._rel_l2(new, ref) <= tol, case
        assert t._rel_l2(old.cuda(), new) <= 1e-2, case  # same math, different fp32 summation order only
