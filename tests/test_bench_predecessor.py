"""CPU tests of the compare routine's --predecessor mode (dsv4.bench.routines.compare,
dsv4.bench.cases.QProjection): argument parsing, the GEMM's shape and in-place write, the
timed variants (the GEMM captured before every attention call, and alone), the row fields
(pair times, pair minus the GEMM alone), the tables and the dry run."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.bench import anchors as A
from dsv4.bench import cases as C
from dsv4.bench import cli
from dsv4.bench.models import HEAD_DIM, MODELS, SCHEDULED
from dsv4.bench.routines import compare as R
from dsv4.bench.timing import Timing


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(A.ENV_VAR, raising=False)


@pytest.fixture
def rich_extra():
    pytest.importorskip("rich", reason="the routines' tables need rich (the bench extra)")


def _args(*argv):
    import argparse

    ap = argparse.ArgumentParser()
    R.add_arguments(ap)
    return ap.parse_args(list(argv))


def test_predecessor_flag_parses_and_defaults_to_none():
    assert _args().predecessor == "none"
    assert _args("--predecessor", "gemm").predecessor == "gemm"
    assert R.PREDECESSORS == ("none", "gemm")


def test_predecessor_flag_rejects_other_names(capsys):
    with pytest.raises(SystemExit) as e:
        _args("--predecessor", "rope")
    assert e.value.code == 2
    assert "argument --predecessor: invalid choice: 'rope'" in capsys.readouterr().err


def test_q_lora_rank_of_every_attention_model():
    # the checkpoints' config.json: V4-Flash 1024, V4-Pro 1536
    assert set(C.Q_LORA_RANK) == set(SCHEDULED)
    assert C.Q_LORA_RANK["flash"] == 1024 and C.Q_LORA_RANK["pro"] == 1536
    assert C.QProjection.shape_text(MODELS["flash"]) == "[T, 1024] x [1024, 32768]"
    assert C.QProjection.shape_text(MODELS["pro"]) == "[T, 1536] x [1536, 65536]"


@pytest.mark.parametrize("model", SCHEDULED)
def test_q_projection_writes_q_in_place(model):
    m = MODELS[model]
    proj = C.QProjection.build(m, "cpu", torch.Generator().manual_seed(0))
    assert proj.weight.shape == (C.Q_LORA_RANK[model], m.heads * HEAD_DIM)
    assert proj.weight.dtype == torch.bfloat16
    q = torch.zeros(3, 1, m.heads, HEAD_DIM, dtype=torch.bfloat16)  # a decode case's q [B, s_q, H, 512]
    ptr = q.data_ptr()
    call = proj.writer(q, torch.Generator().manual_seed(1))
    first = q.clone()
    assert first.abs().sum() > 0  # written at once: the cases' q is the GEMM's output from the start
    q.zero_()
    out = call()
    assert q.data_ptr() == ptr and out.data_ptr() == ptr  # in place: attention reads what the GEMM wrote
    assert torch.equal(q, first)  # the same values on every call
    std = q.float().std().item()
    assert 0.8 < std < 1.2, std  # q ~ N(0, 1) like the cases' own q


def test_q_projection_prefill_q_and_bad_q():
    m = MODELS["flash"]
    proj = C.QProjection.build(m, "cpu", torch.Generator().manual_seed(0))
    q = torch.zeros(5, m.heads, HEAD_DIM, dtype=torch.bfloat16)  # a prefill case's q [T, H, 512]
    proj.writer(q, torch.Generator().manual_seed(1))
    assert (q != 0).any()
    with pytest.raises(ValueError, match="dsv4: q must be a contiguous bf16 tensor"):
        proj.writer(torch.zeros(5, m.heads, HEAD_DIM), torch.Generator())
    with pytest.raises(ValueError, match="dsv4: q must be a contiguous bf16 tensor"):
        proj.writer(torch.zeros(5, m.heads, 2 * HEAD_DIM, dtype=torch.bfloat16)[..., ::2], torch.Generator())


def test_with_predecessor_runs_the_gemm_first_and_alone():
    log = []
    calls = {"dsv4": [lambda i=i: log.append(("dsv4", i)) or "d" for i in range(2)],
             "flashmla": [lambda i=i: log.append(("flashmla", i)) or "f" for i in range(2)]}
    pre = [lambda i=i: log.append(("gemm", i)) for i in range(2)]
    assert R.with_predecessor(calls, None) is calls
    v = R.with_predecessor(calls, pre)
    assert list(v) == ["dsv4", "flashmla", "gemm"]
    assert v["dsv4"][1]() == "d" and log == [("gemm", 1), ("dsv4", 1)]
    log.clear()
    assert v["flashmla"][0]() == "f" and log == [("gemm", 0), ("flashmla", 0)]
    log.clear()
    v["gemm"][1]()
    assert log == [("gemm", 1)]
    with pytest.raises(ValueError, match="dsv4: 1 predecessor calls for 2 dsv4 calls"):
        R.with_predecessor(calls, pre[:1])


def test_attention_fields_without_and_with_the_predecessor():
    t = {"dsv4": Timing(20.0, "cuda-graph"), "flashmla": Timing(25.0, "cuda-graph")}
    assert R.attention_fields(t) == dict(dsv4_us=20.0, method="cuda-graph", incumbent="FlashMLA",
                                         incumbent_us=25.0, ratio=1.25)
    assert R.attention_fields({"dsv4": Timing(20.0, "eager")}) == dict(dsv4_us=20.0, method="eager")
    t["dsv4"], t["flashmla"], t["gemm"] = Timing(50.0, "cuda-graph"), Timing(57.0, "cuda-graph"), \
        Timing(35.0, "cuda-graph")
    f = R.attention_fields(t)
    assert f["dsv4_us"] == 15.0 and f["incumbent_us"] == 22.0 and f["ratio"] == pytest.approx(22 / 15)
    assert f["pair_us"] == 50.0 and f["incumbent_pair_us"] == 57.0 and f["ratio_pair"] == pytest.approx(57 / 50)
    assert f["predecessor"] == "gemm" and f["predecessor_us"] == 35.0
    f = R.attention_fields({"dsv4": Timing(30.0, "g"), "flashmla": Timing(40.0, "g"), "gemm": Timing(31.0, "g")})
    assert math.isnan(f["ratio"])  # a pair faster than its GEMM alone: noise, no ratio


def test_tables_and_progress_line_of_predecessor_rows(rich_extra):
    from dsv4.bench.routines.compare_tables import line, markdown

    row = dict(op="decode", model="V4-Flash", kind="swa", context=None, batch=1, keys=128, dsv4_us=15.0,
               method="cuda-graph", predecessor="gemm", predecessor_us=35.0, pair_us=50.0, incumbent="FlashMLA",
               incumbent_us=22.0, ratio=22 / 15, incumbent_pair_us=57.0, ratio_pair=57 / 50, tflops=1.0,
               tbps=0.1, maxdiff=0.0)
    text = line(row)
    assert "GEMM alone 35.0 us" in text and "pairs: dsv4 50.0 us, FlashMLA 57.0 us, ratio 1.14x" in text
    md = markdown([row])
    assert "after V4's q-projection GEMM" in md and "dsv4 pair us" in md and "| 57.0 |" in md
    plain = dict(row)
    for k in ("predecessor", "predecessor_us", "pair_us", "incumbent_pair_us", "ratio_pair"):
        del plain[k]
    assert "pair" not in markdown([plain]) and "GEMM" not in line(plain)


def test_compare_dry_run_names_the_predecessor_gemm(rich_extra, no_env, capsys):
    assert cli.main(["compare", "--dry-run", "--only", "decode", "--batch", "1", "--context", "4K",
                     "--predecessor", "gemm"]) == 0
    out = capsys.readouterr().out
    assert "predecessor: V4's q projection" in out
    assert "V4-Flash [T, 1024] x [1024, 32768]" in out and "V4-Pro [T, 1536] x [1536, 65536]" in out
    assert "V4-Pro CSA 4K B=1" in out
    assert cli.main(["compare", "--dry-run", "--only", "decode", "--batch", "1", "--context", "4K"]) == 0
    assert "predecessor" not in capsys.readouterr().out
    assert cli.main(["compare", "--dry-run", "--only", "moe", "--moe-m", "1", "--predecessor", "gemm"]) == 0
    assert "predecessor" not in capsys.readouterr().out  # no attention rows: nothing to precede
