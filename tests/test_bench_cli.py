"""The benchmarks' one command line, python -m dsv4.bench <routine> (dsv4.bench.cli): the
routines and their flags are all in --help, the README's script and the old module paths
run the same routines, and without the bench extra the command says so in one line."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from dsv4.bench import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUTINES = ["decode-step", "compare", "profile", "attention", "moe", "quantize"]


def run(*argv, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env=dict(os.environ, **(env or {})))


def test_help_lists_every_routine():
    r = run("-m", "dsv4.bench", "--help")
    assert r.returncode == 0, r.stderr
    for name in ROUTINES:
        assert f"    {name}" in r.stdout, name
    assert list(cli.ROUTINES) == ROUTINES


def test_no_routine_is_an_argument_error():
    r = run("-m", "dsv4.bench")
    assert r.returncode == 2 and "<routine>" in r.stderr


@pytest.mark.parametrize("routine", ROUTINES)
def test_each_routine_help_documents_every_flag(routine, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([routine, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    parser = cli.build_parser().routine_parsers[routine]
    flags = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert flags
    for a in flags:
        assert a.help and a.help.strip(), f"{routine} {a.option_strings} has no help"
        assert a.option_strings[0] in out


def test_the_readme_script_and_the_old_module_paths_run_the_routines():
    r = run("scripts/decode_latency.py", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: scripts/decode_latency.py")
    for flag in ("--model", "--batch", "--context", "--ep", "--moe-format", "--activation", "--out-dir", "--iters",
                 "--layers", "--vs", "--anchors", "--cpu-reference"):
        assert flag in r.stdout, flag
    for alias, routine in (("dsv4.bench.compare", "compare"), ("dsv4.bench.profile", "profile")):
        r = run("-m", alias, "--help")
        assert r.returncode == 0 and r.stdout.startswith(f"usage: python -m {alias}"), r.stderr
        assert r.stdout.split("\n\n", 1)[1] == run("-m", "dsv4.bench", routine, "--help").stdout.split("\n\n", 1)[1]


def test_scripts_holds_only_tools():
    assert sorted(n for n in os.listdir(os.path.join(ROOT, "scripts")) if n != "__pycache__") == [
        "attn_ab.sh", "attn_prefill_ncu.py", "attn_splits_sweep.py", "attn_splits_sweep.sh", "decode_latency.py",
        "device_check.py", "device_moe_stage.sh", "fetch_anchors.py", "gpu_fuzz.py", "gpu_serve_smoke.py", "install.sh",
        "moe_ab.sh", "moe_x_feed_probe.cu", "mxfp4_breakdown.sh", "pack_moe_anchors.py", "pack_vllm_for_device.py",
        "racecheck_named_barrier.cu", "sass_cold_path.py", "sass_diff.py", "w4a8_loop_probe.cu"]


@pytest.fixture
def no_rich(tmp_path):
    """A PYTHONPATH entry that makes `import rich` fail, as in an install without the
    bench extra."""
    (tmp_path / "rich").mkdir()
    (tmp_path / "rich" / "__init__.py").write_text('raise ModuleNotFoundError("No module named rich", name="rich")\n')
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("argv", [["-m", "dsv4.bench", "compare", "--dry-run"],
                                  ["-m", "dsv4.bench", "decode-step", "--cpu-reference"],
                                  ["scripts/decode_latency.py", "--cpu-reference"],
                                  ["-m", "dsv4.bench.profile"]])
def test_without_the_bench_extra_one_line_and_nonzero_exit(no_rich, argv, tmp_path):
    r = run(*argv, env=no_rich, cwd=tmp_path if argv[0] == "-m" else ROOT)
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("dsv4: ") and lines[0].endswith('pip install "dsv4[bench]"') and "rich" in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_help_works_without_the_bench_extra(no_rich):
    r = run("-m", "dsv4.bench", "decode-step", "--help", env=no_rich)
    assert r.returncode == 0 and "--cpu-reference" in r.stdout, r.stderr


def test_missing_matplotlib_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    why = cli.missing_dependency("decode-step")
    if cli.missing_dependency("compare"):
        pytest.skip("rich is not installed here")
    assert why.startswith("dsv4: python -m dsv4.bench decode-step needs rich and matplotlib")
    assert "matplotlib" in why and why.endswith('pip install "dsv4[bench]"')
    assert cli.missing_dependency("compare") is None  # the tables alone need rich only
