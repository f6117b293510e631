"""CPU checks of python -m dsv4.bench.profile (the GPU part runs on the H200)."""

from __future__ import annotations

import pytest
import torch

from dsv4.bench import profile


def test_profile_without_a_gpu_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profile.main(["--model", "pro", "--kind", "csa", "--batch", "2"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--kind", "mla"], ["--model", "v3"], ["--batch", "x"]])
def test_profile_rejects_bad_arguments(bad, capsys):
    with pytest.raises(SystemExit):
        profile.main(bad)
    assert "invalid" in capsys.readouterr().err
