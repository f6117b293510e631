"""CPU tests of the decode-step routine (python -m dsv4.bench decode-step, the README's
main job, also run as scripts/decode_latency.py): argument parsing, the tiny
--cpu-reference run end to end, its honest output, the step sum, tables and plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dsv4.bench import cases as C
from dsv4.bench import cli
from dsv4.bench.models import MODELS, tiny_shape
from dsv4.bench.report import fmt_ratio
from dsv4.bench.routines import decode_step_tables as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "decode_latency.py")
OUTPUTS = ("decode_latency.json", "decode_latency.txt", "decode_latency.md", "latency_vs_batch.png",
           "step_breakdown.png")


@pytest.fixture
def bench_extra():
    """The routine writes rich tables and matplotlib plots (the bench extra)."""
    pytest.importorskip("rich", reason="the decode-step routine's tables need rich (the bench extra)")
    pytest.importorskip("matplotlib", reason="the decode-step routine's plots need matplotlib (the bench extra)")


def main(*argv) -> int:
    return cli.main(["decode-step", *argv])


def parse(*argv):
    return cli.parse_args(["decode-step", *argv])


def run_script(*args, env=None):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, **(env or {})), timeout=300)


def check_outputs(out_dir):
    for name in OUTPUTS:
        path = os.path.join(out_dir, name)
        assert os.path.getsize(path) > 0, name
    for name in OUTPUTS[3:]:
        with open(os.path.join(out_dir, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    with open(os.path.join(out_dir, "decode_latency.json")) as f:
        return json.load(f)


def test_cpu_reference_default_run(bench_extra, tmp_path):
    """The documented no-GPU command, through the README's script: tiny shapes, both
    models, all outputs written, and the output says what the numbers are not."""
    r = run_script("--cpu-reference", "--out-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "decode step estimate" in r.stdout and "not performance" in r.stdout
    data = check_outputs(tmp_path)
    assert data["meta"]["mode"] == "cpu-reference"
    assert set(data["models"]) == {"flash", "pro"}
    # per model: (1 SWA + 2 contexts x (CSA, HCA) + 1 MoE) x 2 batches
    assert len(data["components"]) == 2 * 2 * (1 + 2 * 2 + 1)
    for row in data["components"]:
        assert row["dsv4_us"] > 0 and row["torch_us"] > 0, row
        # the torch baselines compute the same thing as the float32 reference kernels
        if row["component"] == "moe":
            assert row["rel_diff"] < 0.05, row
        else:
            assert row["max_abs_diff"] < 0.05, row
    assert len(data["steps"]) == 2 * 2 * 2
    assert all(s["dsv4"]["total_us"] > 0 and s["torch"]["total_us"] > 0 for s in data["steps"])
    assert data["meta"]["not_included"]


def test_cpu_reference_output_is_honest(bench_extra, tmp_path, capsys):
    """Reference kernels in float32 against torch's bf16 ops on the CPU: no speedup is
    shown anywhere (tables, markdown, text, JSON), every output says the times are not
    performance."""
    assert main("--cpu-reference", "--model", "flash", "--batch", "1", "--context", "1K", "--iters", "1",
                "--out-dir", str(tmp_path)) == 0
    out = capsys.readouterr().out
    data = check_outputs(tmp_path)
    md, txt = (tmp_path / "decode_latency.md").read_text(), (tmp_path / "decode_latency.txt").read_text()
    for text in (out, md, txt):
        assert "speedup" not in text.replace("no speedups are shown", "")
        assert "not performance" in text
        assert "TFLOP/s" not in text and "% copy" not in text
    assert all(s["speedup"] is None for s in data["steps"])
    assert "not performance" in data["meta"]["notes"][0]


def test_cpu_reference_step_is_the_schedule_sum(bench_extra, tmp_path):
    rc = main("--cpu-reference", "--model", "pro", "--batch", "2", "--context", "1K", "--iters", "1",
              "--activation", "both", "--layers", "pro=1,2,3", "--out-dir", str(tmp_path))
    assert rc == 0
    data = check_outputs(tmp_path)
    assert data["models"]["pro"]["layers"] == {"swa": 1, "csa": 2, "hca": 3}
    comp = {(r["component"], r.get("format"), r.get("activation")): r for r in data["components"]}
    assert len(comp) == 5  # SWA, CSA, HCA, MoE W4A16, MoE W4A4
    assert len(data["steps"]) == 2
    for step in data["steps"]:
        moe = comp[("moe", step["format"], step["activation"])]
        for impl in ("dsv4", "torch"):
            want = (comp[("attn_swa", None, None)][impl + "_us"] + 2 * comp[("attn_csa", None, None)][impl + "_us"]
                    + 3 * comp[("attn_hca", None, None)][impl + "_us"] + 6 * moe[impl + "_us"])
            assert step[impl]["total_us"] == pytest.approx(want)


def test_without_gpu_one_line_and_nonzero_exit(bench_extra, tmp_path):
    r = run_script("--out-dir", str(tmp_path / "out"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode != 0
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "GPU" in lines[0] and "--cpu-reference" in lines[0], r.stderr
    assert lines[0].startswith("dsv4: ")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [
    ["--ep", "3"], ["--ep", "0"], ["--batch", "0"], ["--batch", "a,b"], ["--context", "64"], ["--context", "2M"],
    ["--context", "4G"], ["--iters", "0"], ["--layers", "pro=1,2"], ["--layers", "qwen=1,2,3"],
    ["--layers", "pro=0,0,0"], ["--layers", "v41flash=1,1,1"], ["--model", "v3"], ["--model", "v41flash"],
    ["--activation", "fp8"], ["--moe-format", "fp8"], ["--moe-format", "nvfp4,"], ["--moe-format", "mxfp4"],
    ["--moe-format", "mxfp4-w4a8", "--activation", "nvfp4"], ["--batch", "1,,2"], ["--batch", "1,2,"],
    ["--batch", ",1"], ["--batch", ""], ["--batch", "1;2"], ["--batch", "1.5"], ["--batch", "-1"], ["--batch", "1_0"],
    ["--context", "4K,,32K"], ["--context", "4K,"],
])
def test_argument_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv, "--cpu-reference")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err
    assert "Traceback" not in err
    if argv[0] == "--batch":  # the message quotes what was given
        assert repr(argv[1]) in err, err


def test_unusable_out_dir(bench_extra, tmp_path, capsys):
    """An --out-dir that cannot hold the results: one dsv4-style line, status 2, before the sweep."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for bad in (a_file, a_file / "sub"):
        rc = main("--cpu-reference", "--out-dir", str(bad))
        assert rc == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and "--out-dir" in lines[0] and str(bad) in lines[0], captured.err
        assert "decode latency" not in captured.out  # nothing was measured


def test_default_out_dir_is_gitignored():
    default = parse().out_dir
    if subprocess.run(["git", "-C", ROOT, "rev-parse"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    r = subprocess.run(["git", "-C", ROOT, "check-ignore", "-q", os.path.join(default, "decode_latency.json")])
    assert r.returncode == 0, f"{default}/ is not in .gitignore"


def test_ratio_labels_keep_two_digits():
    assert fmt_ratio(3.14159) == "3.1x"
    assert fmt_ratio(1.0) == "1.0x"
    assert fmt_ratio(0.5) == "0.5x"
    assert fmt_ratio(0.0071) == "0.0071x"  # never "0.0x"
    assert fmt_ratio(None) == "-"


def test_step_plot_bars_visible(bench_extra, tmp_path, monkeypatch):
    """In a CPU reference run the references are ~100x slower than torch: on a linear axis
    the torch bars would be a few pixels. Every bar's top must sit well inside its axis."""
    import matplotlib.pyplot as plt

    figs, close = [], plt.close
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figures to look at them
    rc = main("--cpu-reference", "--model", "pro", "--batch", "1,2", "--context", "1K", "--iters", "1",
              "--out-dir", str(tmp_path))
    assert rc == 0
    step_fig = figs[-1]  # plot_steps runs last
    (ax,) = step_fig.axes
    assert ax.get_yscale() == "log"
    assert "not performance" in ax.get_title()
    tops = [t.get_position() for t in ax.texts]  # one total label per bar
    assert len(tops) == 2 * 2  # (reference, torch) x 2 batches
    for x, y in tops:
        frac = ax.transAxes.inverted().transform(ax.transData.transform((x, y)))[1]
        assert 0.1 < frac < 1.0, (x, y, frac)
    for fig in figs:
        close(fig)
    assert "0.0x" not in (tmp_path / "decode_latency.md").read_text()


def test_step_yscale(bench_extra):
    from dsv4.bench.routines.decode_step_plots import step_yscale

    assert step_yscale([100.0, 140.0, 90.0]) == "linear"
    assert step_yscale([7000.0, 60.0]) == "log"
    assert step_yscale([]) == "linear"


def test_argument_parsing():
    a = parse("--context", "4K,32k,128K,1M", "--batch", "8,1,8", "--ep", "128")
    assert a.context == [4096, 32768, 131072, 1 << 20]
    assert a.batch == [1, 8]
    assert a.models == ["flash", "pro"] and a.moe == [("nvfp4", "bf16")] and a.iters == 50
    assert a.argv == ["--context", "4K,32k,128K,1M", "--batch", "8,1,8", "--ep", "128"]
    a = parse("--cpu-reference", "--model", "flash")
    assert (a.batch, a.context, a.iters, a.models) == ([1, 2], [512, 2048], 3, ["flash"])
    a = parse("--moe-format", "mxfp4-w4a8")
    assert a.moe == [("mxfp4", "fp8")]
    a = parse("--moe-format", "nvfp4,mxfp4-w4a16,mxfp4-w4a8", "--activation", "both")
    assert a.moe == [("nvfp4", "bf16"), ("nvfp4", "nvfp4"), ("mxfp4", "bf16"), ("mxfp4", "fp8")]
    a = parse("--layers", "pro=1,2,3", "--layers", "flash=0,1,0")
    assert dict(a.layers) == {"pro": {"swa": 1, "csa": 2, "hca": 3}, "flash": {"swa": 0, "csa": 1, "hca": 0}}


def test_step_estimate():
    layers = {"swa": 2, "csa": 21, "hca": 20}
    est = T.step_estimate(layers, {"swa": 1.0, "csa": 2.0, "hca": 3.0}, 10.0)
    assert est == {"swa_us": 2.0, "csa_us": 42.0, "hca_us": 60.0, "moe_us": 430.0, "total_us": 534.0}
    assert T.step_estimate(layers, {"swa": 1.0, "csa": None, "hca": 3.0}, 10.0) is None
    assert T.step_estimate(layers, {"swa": 1.0, "csa": 2.0, "hca": 3.0}, None) is None
    # a layer type the model does not have needs no measurement
    assert T.step_estimate({"swa": 0, "csa": 1, "hca": 1}, {"csa": 1.0, "hca": 1.0}, 1.0)["total_us"] == 4.0


def test_vs_vllm_on_cpu_says_why_and_keeps_dsv4(bench_extra, tmp_path):
    """--vs vllm in a CPU reference run: one line says the comparison needs the CUDA
    incumbents; dsv4's and torch's numbers are all there, no vLLM column values."""
    rc = main("--cpu-reference", "--vs", "vllm", "--model", "flash", "--batch", "1", "--context", "1K",
              "--iters", "1", "--out-dir", str(tmp_path))
    assert rc == 0
    data = check_outputs(tmp_path)
    assert any("--vs vllm: no comparison in a CPU reference run" in n for n in data["meta"]["notes"])
    assert all(r["dsv4_us"] > 0 and r.get("vllm_us") is None for r in data["components"])
    assert all(s["vllm"] is None and s["vllm_ratio"] is None for s in data["steps"])
    assert not (tmp_path / "ratio_vs_vllm.png").exists()


def test_gpu_tables_and_ratio_plot_with_fake_numbers(bench_extra, tmp_path):
    """The GPU run's tables (speedup, rates, vLLM columns) and the ratio plot, from rows
    carrying made-up numbers as a GPU run records them."""
    from dsv4.bench.report import to_markdown
    from dsv4.bench.routines.decode_step_plots import plot_vllm_ratio
    from dsv4.bench.routines.decode_step_sweep import Sweep

    args = parse("--vs", "vllm", "--model", "flash", "--batch", "1,8", "--context", "4K")
    sweep = Sweep.__new__(Sweep)  # no anchors search, no device: the report side only
    sweep.args, sweep.cpu, sweep.shapes, sweep.rows = args, False, {"flash": MODELS["flash"]}, []
    for b in (1, 8):
        for kind, ctx in (("swa", None), ("csa", 4096), ("hca", 4096)):
            sweep.rows.append(dict(model="flash", component="attn_" + kind, batch=b, context=ctx, dsv4_us=20.0,
                                   torch_us=40.0, vllm_us=15.0, tbps=1.0, tflops=100.0, max_abs_diff=1e-3))
        sweep.rows.append(dict(model="flash", component="moe", format="nvfp4", activation="bf16", batch=b,
                               context=None, dsv4_us=30.0, torch_us=150.0, vllm_us=45.0, tbps=3.0, tflops=5.0,
                               rel_diff=1e-3))
    steps = T.step_rows(sweep)
    assert steps[0]["speedup"] == pytest.approx((2 * 40 + 21 * 40 + 20 * 40 + 43 * 150) / (43 * 20 + 43 * 30))
    summary, detail = T.build_tables(sweep, steps, 4.2)
    md = to_markdown(summary + detail)
    assert "dsv4 / torch baseline (speedup)" in md and "20.0 / 40.0 (2.0x)" in md
    assert "dsv4 / vLLM 0.33 kernels" in md and "20.0 / 15.0 (0.75x)" in md and "| 24% |" in md
    path = tmp_path / "r.png"
    assert plot_vllm_ratio(sweep, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep.rows = [dict(r, vllm_us=None) for r in sweep.rows]
    assert not plot_vllm_ratio(sweep, str(tmp_path / "none.png"))


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_decode_step_cases_are_vllm_shaped_and_the_baseline_matches(kind):
    """decode-step times the cases compare and profile time (dsv4.bench.cases): HCA rows
    as wide as vLLM's (>= 128, -1 padded) over the 2-entry-block C128A pool, CSA over the
    64-entry C4A pool; the torch baseline reads only the visible entries of the right pool
    and equals the reference kernel."""
    shape = tiny_shape(MODELS["flash"])
    pools = C.DecodePools.for_cases(2, 4096, "cpu", above_l2=False, bf16_rows=True)
    assert pools.c128a.shape[1] == 2 and pools.c4a.shape[1] == 64 and pools.swa.shape[1] == 64
    inp = C.decode_case(kind, shape, 2, 4096, pools, torch.Generator().manual_seed(0))
    n = 32 if kind == "csa" else 4096 // 128
    width = shape.index_topk if kind == "csa" else 128
    assert inp["extra_cache"] is pools.cache(kind)
    assert inp["extra_idx"].shape == (2, 1, width) and inp["extra_len"].tolist() == [n, n]
    assert bool((inp["extra_idx"][..., n:] == -1).all()) and bool((inp["extra_idx"][..., :n] >= 0).all())
    out = torch.empty_like(inp["q"])
    C.dsv4_decode(inp, out)
    assert float((C.torch_decode(inp, pools).float() - out.float()).abs().max()) < 0.05


def test_cpu_reference_mxfp4_cases(bench_extra, tmp_path):
    """--moe-format with the MXFP4 cases beside NVFP4 on the CPU reference path: one MoE
    row per case, each against the bf16 baseline on its own dequantized weights, the
    weight bytes of its format, a step estimate per case."""
    from dsv4.bench import traffic

    rc = main("--cpu-reference", "--model", "flash", "--batch", "2", "--context", "1K", "--iters", "1",
              "--ep", "1", "--moe-format", "nvfp4,mxfp4-w4a8,mxfp4-w4a16", "--out-dir", str(tmp_path))
    assert rc == 0
    data = check_outputs(tmp_path)
    assert [(c["format"], c["activation"]) for c in data["meta"]["moe_cases"]] == [
        ("nvfp4", "bf16"), ("mxfp4", "fp8"), ("mxfp4", "bf16")]
    moe = {(r["format"], r["activation"]): r for r in data["components"] if r["component"] == "moe"}
    assert set(moe) == {("nvfp4", "bf16"), ("mxfp4", "fp8"), ("mxfp4", "bf16")}
    shape = tiny_shape(MODELS["flash"])
    for (fmt, act), r in moe.items():
        assert r["dsv4_us"] > 0 and r["torch_us"] > 0 and not r.get("error"), r
        assert r["local_slots"] == 12  # EP1: every route local
        assert r["bytes"] == pytest.approx(r["touched_experts"]
                                           * traffic.moe_expert_bytes(shape.hidden, shape.moe_inter, fmt))
    # W4A16: bf16 rounding of the baseline only; W4A8: FP8 (e4m3) activations at GEMM1's
    # and GEMM2's inputs, up to 2^-4 relative per element, well above the W4A16 difference
    assert moe[("nvfp4", "bf16")]["rel_diff"] < 0.05 and moe[("mxfp4", "bf16")]["rel_diff"] < 0.05
    assert 2 * moe[("mxfp4", "bf16")]["rel_diff"] < moe[("mxfp4", "fp8")]["rel_diff"] < 0.1
    attn = sum(r["dsv4_us"] * shape.layers[r["component"][5:]] for r in data["components"]
               if r["component"] != "moe")
    assert len(data["steps"]) == 3
    for st in data["steps"]:
        want = attn + shape.n_layers * moe[(st["format"], st["activation"])]["dsv4_us"]
        assert st["dsv4"]["total_us"] == pytest.approx(want)
    md = (tmp_path / "decode_latency.md").read_text()
    assert "MoE MXFP4 W4A8, EP1" in md and "MoE MXFP4 W4A16, EP1" in md and "MoE NVFP4 W4A16, EP1" in md
    assert any("MXFP4 experts" in n for n in data["meta"]["notes"])
