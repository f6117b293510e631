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
