"""CPU checks of the profile routine (python -m dsv4.bench profile; the GPU part runs on
the H200)."""

from __future__ import annotations

import pytest
import torch

from dsv4.bench import cli


def test_profile_without_a_gpu_says_so(monkeypatch, capsys):
    pytest.importorskip("rich", reason="the routines need rich (the bench extra)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["profile", "--model", "pro", "--kind", "csa", "--batch", "2"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_profile_alias_module(monkeypatch, capsys):
    pytest.importorskip("rich", reason="the routines need rich (the bench extra)")
    from dsv4.bench import profile

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profile.main(["--kind", "hca"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--kind", "mla"], ["--model", "v3"], ["--model", "v41flash"], ["--batch", "x"]])
def test_profile_rejects_bad_arguments(bad, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["profile", *bad])
    assert "invalid" in capsys.readouterr().err


def test_profile_table_with_fake_numbers():
    from dsv4.bench.report import to_markdown
    from dsv4.bench.routines.profile import table

    rows = [("dsv4/warm", "dsv4::sparse_mqa_decode_kernel<...>", 20, 21.5), ("flashmla/cold", "flash_fwd", 20, 19.25)]
    md = to_markdown([table("V4-Flash swa ctx=4096 B=1", rows, 20)])
    assert "**V4-Flash swa ctx=4096 B=1: median GPU time per kernel (20 calls each, warm and cold L2)**" in md
    assert "| dsv4/warm | 21.50 | 20 | dsv4::sparse_mqa_decode_kernel<...> |" in md
    assert "|---|---:|---:|---|" in md


def test_split_replays_lead_span_and_kernels():
    """Each replay is the kernels between two flushes: lead from the flush's last kernel
    end, span over its kernels (overlapping under PDL), kernels summed; the kernels before
    the first flush are left out."""
    from dsv4.bench.routines.profile import split_replays

    ks = [("warmup_kernel", 0.0, 5.0),
          ("reduce_kernel", 10.0, 40.0), ("Memset (Device)", 40.5, 41.0),
          ("sparse_mqa_fwd_kernel", 44.0, 64.0), ("sparse_mqa_combine_kernel", 62.0, 66.0),
          ("reduce_kernel", 70.0, 100.0),
          ("sparse_mqa_fwd_kernel", 101.0, 121.5)]
    reps = split_replays(list(reversed(ks)))  # any order: sorted by start
    assert reps == [dict(lead=3.0, span=22.0, kernels=24.0), dict(lead=1.0, span=20.5, kernels=20.5)]
    assert split_replays([("reduce_kernel", 0.0, 1.0)]) == []


def test_profile_ncu_and_graph_are_exclusive(monkeypatch, capsys):
    pytest.importorskip("rich", reason="the routines need rich (the bench extra)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.main(["profile", "--ncu", "--graph"]) == 2
    assert "--ncu and --graph" in capsys.readouterr().err


def test_profile_replay_table_with_fake_numbers():
    from dsv4.bench.report import to_markdown
    from dsv4.bench.routines.profile import replay_table

    md = to_markdown([replay_table("V4-Pro hca ctx=4096 B=32", [("dsv4", 24.5, 0.9, 20.7, 2.9, 20.7)], 30)])
    assert "| dsv4 | 24.50 | 0.90 | 20.70 | 2.90 | 20.70 |" in md
