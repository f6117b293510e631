"""CPU tests of scripts/decode_latency.py (the decode-latency main job) and dsv4.latency."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from dsv4 import latency as L

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "decode_latency.py")
OUTPUTS = ("decode_latency.json", "decode_latency.txt", "decode_latency.md", "latency_vs_batch.png",
           "step_breakdown.png")


def load_script():
    spec = importlib.util.spec_from_file_location("decode_latency", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def test_cpu_reference_default_run(tmp_path):
    """The documented no-GPU command: tiny shapes, both models, all outputs written."""
    r = run_script("--cpu-reference", "--out-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "decode step estimate" in r.stdout
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


def test_cpu_reference_step_is_the_schedule_sum(tmp_path):
    dl = load_script()
    rc = dl.main(["--cpu-reference", "--model", "pro", "--batch", "2", "--context", "1K", "--iters", "1",
                  "--activation", "both", "--layers", "pro=1,2,3", "--out-dir", str(tmp_path)])
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


def test_without_gpu_one_line_and_nonzero_exit(tmp_path):
    r = run_script("--out-dir", str(tmp_path / "out"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode != 0
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "GPU" in lines[0] and "--cpu-reference" in lines[0], r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [
    ["--ep", "3"], ["--ep", "0"], ["--batch", "0"], ["--batch", "a,b"], ["--context", "64"], ["--context", "2M"],
    ["--context", "4G"], ["--iters", "0"], ["--layers", "pro=1,2"], ["--layers", "qwen=1,2,3"],
    ["--layers", "pro=0,0,0"], ["--model", "v3"], ["--activation", "fp8"], ["--moe-format", "fp8"],
    ["--moe-format", "nvfp4,"], ["--moe-format", "mxfp4"], ["--moe-format", "mxfp4-w4a8", "--activation", "nvfp4"],
    ["--batch", "1,,2"], ["--batch", "1,2,"], ["--batch", ",1"], ["--batch", ""], ["--batch", "1;2"],
    ["--batch", "1.5"], ["--batch", "-1"], ["--batch", "1_0"], ["--context", "4K,,32K"], ["--context", "4K,"],
])
def test_argument_errors(argv, capsys):
    dl = load_script()
    with pytest.raises(SystemExit) as e:
        dl.parse_args(argv + ["--cpu-reference"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err
    assert "Traceback" not in err
    if argv[0] == "--batch":  # the message quotes what was given
        assert repr(argv[1]) in err, err


def test_unusable_out_dir(tmp_path, capsys):
    """An --out-dir that cannot hold the results: one dsv4-style line, status 2, before the sweep."""
    dl = load_script()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for bad in (a_file, a_file / "sub"):
        rc = dl.main(["--cpu-reference", "--out-dir", str(bad)])
        assert rc == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and "--out-dir" in lines[0] and str(bad) in lines[0], captured.err
        assert "decode latency" not in captured.out  # nothing was measured


def test_default_out_dir_is_gitignored():
    dl = load_script()
    default = dl.build_parser().get_default("out_dir")
    if subprocess.run(["git", "-C", ROOT, "rev-parse"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    r = subprocess.run(["git", "-C", ROOT, "check-ignore", "-q", os.path.join(default, "decode_latency.json")])
    assert r.returncode == 0, f"{default}/ is not in .gitignore"


def test_speedup_labels_keep_two_digits():
    dl = load_script()
    assert dl.fmt_ratio(3.14159) == "3.1x"
    assert dl.fmt_ratio(1.0) == "1.0x"
    assert dl.fmt_ratio(0.5) == "0.5x"
    assert dl.fmt_ratio(0.0071) == "0.0071x"  # a CPU reference run: never "0.0x"


def test_step_plot_bars_visible(tmp_path, monkeypatch):
    """In a CPU reference run the references are ~100x slower than torch: on a linear axis
    the torch bars would be a few pixels. Every bar's top must sit well inside its axis."""
    import matplotlib.pyplot as plt

    figs, close = [], plt.close
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figures to look at them
    dl = load_script()
    rc = dl.main(["--cpu-reference", "--model", "pro", "--batch", "1,2", "--context", "1K", "--iters", "1",
                  "--out-dir", str(tmp_path)])
    assert rc == 0
    step_fig = figs[-1]  # plot_steps runs last
    (ax,) = step_fig.axes
    assert ax.get_yscale() == "log"
    tops = [t.get_position() for t in ax.texts]  # one total label per bar
    assert len(tops) == 2 * 2  # (dsv4, torch) x 2 batches
    for x, y in tops:
        frac = ax.transAxes.inverted().transform(ax.transData.transform((x, y)))[1]
        assert 0.1 < frac < 1.0, (x, y, frac)
    for fig in figs:
        close(fig)
    assert "0.0x" not in (tmp_path / "decode_latency.md").read_text()


def test_step_yscale():
    dl = load_script()
    assert dl.step_yscale([100.0, 140.0, 90.0]) == "linear"
    assert dl.step_yscale([7000.0, 60.0]) == "log"
    assert dl.step_yscale([]) == "linear"


def test_argument_parsing():
    dl = load_script()
    a = dl.parse_args(["--context", "4K,32k,128K,1M", "--batch", "8,1,8", "--ep", "128"])
    assert a.context == [4096, 32768, 131072, 1 << 20]
    assert a.batch == [1, 8]
    assert a.models == ["flash", "pro"] and a.moe == [("nvfp4", "bf16")] and a.iters == 50
    a = dl.parse_args(["--cpu-reference", "--model", "flash"])
    assert (a.batch, a.context, a.iters, a.models) == ([1, 2], [512, 2048], 3, ["flash"])
    a = dl.parse_args(["--moe-format", "mxfp4-w4a8"])
    assert a.moe == [("mxfp4", "fp8")]
    a = dl.parse_args(["--moe-format", "nvfp4,mxfp4-w4a16,mxfp4-w4a8", "--activation", "both"])
    assert a.moe == [("nvfp4", "bf16"), ("nvfp4", "nvfp4"), ("mxfp4", "bf16"), ("mxfp4", "fp8")]


def test_layer_schedules_match_the_models():
    assert L.MODELS["flash"].n_layers == 43 and L.MODELS["pro"].n_layers == 61
    assert L.MODELS["flash"].layers == {"swa": 2, "csa": 21, "hca": 20}
    assert L.MODELS["pro"].layers == {"swa": 0, "csa": 30, "hca": 31}


def test_attention_keys():
    flash, pro = L.MODELS["flash"], L.MODELS["pro"]
    assert L.attention_keys("swa", flash, 4096) == (128, 0)
    assert L.attention_keys("csa", flash, 4096) == (128, 512)
    assert L.attention_keys("csa", pro, 2048) == (128, 512)  # fewer visible entries than top-k
    assert L.attention_keys("hca", pro, 131072) == (128, 1024)


def test_step_estimate():
    layers = {"swa": 2, "csa": 21, "hca": 20}
    est = L.step_estimate(layers, {"swa": 1.0, "csa": 2.0, "hca": 3.0}, 10.0)
    assert est == {"swa_us": 2.0, "csa_us": 42.0, "hca_us": 60.0, "moe_us": 430.0, "total_us": 534.0}
    assert L.step_estimate(layers, {"swa": 1.0, "csa": None, "hca": 3.0}, 10.0) is None
    assert L.step_estimate(layers, {"swa": 1.0, "csa": 2.0, "hca": 3.0}, None) is None
    # a layer type the model does not have needs no measurement
    assert L.step_estimate({"swa": 0, "csa": 1, "hca": 1}, {"csa": 1.0, "hca": 1.0}, 1.0)["total_us"] == 4.0


def test_vs_vllm_on_cpu_says_why_and_keeps_dsv4(tmp_path):
    """--vs vllm in a CPU reference run: one line says the comparison needs the CUDA
    incumbents; dsv4's and torch's numbers are all there, no vLLM column values."""
    dl = load_script()
    rc = dl.main(["--cpu-reference", "--vs", "vllm", "--model", "flash", "--batch", "1", "--context", "1K",
                  "--iters", "1", "--out-dir", str(tmp_path)])
    assert rc == 0
    data = check_outputs(tmp_path)
    assert any("--vs vllm: no comparison in a CPU reference run" in n for n in data["meta"]["notes"])
    assert all(r["dsv4_us"] > 0 and r.get("vllm_us") is None for r in data["components"])
    assert all(s["vllm"] is None and s["vllm_ratio"] is None for s in data["steps"])
    assert not (tmp_path / "ratio_vs_vllm.png").exists()


def test_vllm_ratio_plot(tmp_path):
    """The ratio plot from rows that carry incumbent times (as a GPU run records them)."""
    dl = load_script()
    args = dl.parse_args(["--cpu-reference", "--vs", "vllm", "--model", "flash", "--batch", "1,8", "--context", "4K"])
    sweep = dl.Sweep(args, "cpu")
    for b in (1, 8):
        sweep.rows.append(dict(model="flash", component="attn_swa", batch=b, context=None, dsv4_us=20.0, vllm_us=15.0))
        sweep.rows.append(dict(model="flash", component="moe", format="nvfp4", activation="bf16", batch=b,
                               context=None, dsv4_us=30.0, vllm_us=45.0))
    path = tmp_path / "r.png"
    assert dl.plot_vllm_ratio(sweep, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep.rows = [dict(r, vllm_us=None) for r in sweep.rows]
    assert not dl.plot_vllm_ratio(sweep, str(tmp_path / "none.png"))


def test_hca_rows_are_vllm_width_with_padding():
    """HCA index rows are as wide as vLLM's (>= 128, -1 padded past the visible entries)."""
    import torch

    shape = L.tiny_shape(L.MODELS["flash"])
    pools = L.KvPools.build(256, 4096, "cpu")
    inp = L.attention_inputs("hca", shape, 2, 4096, pools, torch.Generator().manual_seed(0))
    assert inp["comp_idx"].shape == (2, 1, 128) and inp["comp_len"].tolist() == [32, 32]
    assert bool((inp["comp_idx"][..., 32:] == -1).all()) and bool((inp["comp_idx"][..., :32] >= 0).all())
    # the torch baseline reads only the visible entries: it equals the reference kernel
    out = torch.empty_like(inp["q"])
    L.dsv4_attention(inp, pools, out)
    assert float((L.torch_attention(inp, pools).float() - out.float()).abs().max()) < 0.05


def test_cpu_reference_mxfp4_cases(tmp_path):
    """--moe-format with the MXFP4 cases beside NVFP4 on the CPU reference path: one MoE
    row per case, each against the bf16 baseline on its own dequantized weights, the
    weight bytes of its format, a step estimate per case."""
    dl = load_script()
    rc = dl.main(["--cpu-reference", "--model", "flash", "--batch", "2", "--context", "1K", "--iters", "1",
                  "--ep", "1", "--moe-format", "nvfp4,mxfp4-w4a8,mxfp4-w4a16", "--out-dir", str(tmp_path)])
    assert rc == 0
    data = check_outputs(tmp_path)
    assert [(c["format"], c["activation"]) for c in data["meta"]["moe_cases"]] == [
        ("nvfp4", "bf16"), ("mxfp4", "fp8"), ("mxfp4", "bf16")]
    moe = {(r["format"], r["activation"]): r for r in data["components"] if r["component"] == "moe"}
    assert set(moe) == {("nvfp4", "bf16"), ("mxfp4", "fp8"), ("mxfp4", "bf16")}
    shape = L.tiny_shape(L.MODELS["flash"])
    for (fmt, act), r in moe.items():
        assert r["dsv4_us"] > 0 and r["torch_us"] > 0 and not r.get("error"), r
        assert r["local_slots"] == 12  # EP1: every route local
        assert r["bytes"] == pytest.approx(r["touched_experts"] * L.moe_expert_bytes(shape, fmt))
    # W4A16: bf16 rounding of the baseline only; W4A8: FP8 (e4m3) activations at GEMM1's
    # and GEMM2's inputs, up to 2^-4 relative per element, well above the W4A16 difference
    assert moe[("nvfp4", "bf16")]["rel_diff"] < 0.05 and moe[("mxfp4", "bf16")]["rel_diff"] < 0.05
    assert 2 * moe[("mxfp4", "bf16")]["rel_diff"] < moe[("mxfp4", "fp8")]["rel_diff"] < 0.1
    assert L.moe_expert_bytes(shape, "mxfp4") / L.moe_expert_bytes(shape, "nvfp4") == pytest.approx(17 / 18)
    attn = sum(r["dsv4_us"] * shape.layers[r["component"][5:]] for r in data["components"]
               if r["component"] != "moe")
    assert len(data["steps"]) == 3
    for st in data["steps"]:
        want = attn + shape.n_layers * moe[(st["format"], st["activation"])]["dsv4_us"]
        assert st["dsv4"]["total_us"] == pytest.approx(want)
    md = (tmp_path / "decode_latency.md").read_text()
    assert "MoE MXFP4 W4A8, EP1" in md and "MoE MXFP4 W4A16, EP1" in md and "MoE NVFP4 W4A16, EP1" in md
    assert any("MXFP4 experts" in n for n in data["meta"]["notes"])
