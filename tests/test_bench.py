"""CPU tests of the benchmark package (dsv4.bench) and scripts/bench_moe.py: the
incumbents' finder degrades cleanly, the fetch script's extraction, the input builders'
shapes and strides against what FlashMLA's interface and vLLM's MoE layouts document, the
MoE format cases (NVFP4, MXFP4 W4A8 / W4A16) on the CPU reference path, the comparison
CLI's dry run."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import zipfile

import pytest
import torch

from dsv4 import formats
from dsv4.formats import mxfp4
from dsv4.bench import anchors as A
from dsv4.bench import compare
from dsv4.bench import inputs as I


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(A.ENV_VAR, raising=False)


def test_find_anchors_without_anything_names_every_missing_incumbent(no_env, tmp_path):
    a = A.find_anchors([str(tmp_path)], load=False)
    assert not a.flashmla and a.humming is None
    if A._installed_version("vllm") != A.VLLM_VERSION:
        assert set(a.missing) >= {"flashmla", "moe_c", "vllm_c"}
        assert "flashmla" in a.summary() and "missing" in a.summary()
    if A._installed_version("humming-kernels") != A.HUMMING_VERSION:
        assert "humming" in a.missing


def test_find_anchors_rejects_a_folder_of_another_version(no_env, tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "_flashmla_C.abi3.so").write_bytes(b"\x7fELF not really")
    (tmp_path / A.MANIFEST).write_text(json.dumps({"versions": {"vllm": "0.32.0"}}))
    a = A.find_anchors([str(tmp_path)], load=False)
    assert not a.flashmla
    assert "0.32.0" in a.missing["flashmla"] and A.VLLM_VERSION in a.missing["flashmla"]


def test_find_anchors_reports_a_library_that_does_not_load(no_env, tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "_flashmla_C.abi3.so").write_bytes(b"not a shared object")
    (tmp_path / A.MANIFEST).write_text(json.dumps({"versions": {"vllm": A.VLLM_VERSION}}))
    a = A.find_anchors([str(tmp_path)], load=True)  # must not raise
    assert not a.flashmla and "failed to load" in a.missing["flashmla"]


def test_env_var_folders_are_searched(monkeypatch, tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "_flashmla_C.abi3.so").write_bytes(b"x")
    (tmp_path / A.MANIFEST).write_text(json.dumps({"versions": {"vllm": A.VLLM_VERSION}}))
    monkeypatch.setenv(A.ENV_VAR, os.pathsep.join(["/nonexistent", str(tmp_path)]))
    a = A.find_anchors(load=False)
    assert a.flashmla and a.sources["flashmla"].startswith(str(tmp_path))


def _fake_wheel(path, members: dict, modes: dict = {}):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (modes.get(name, 0o644) | stat.S_IFREG) << 16
            z.writestr(info, data)
    return str(path)


def test_extract_wheel_takes_named_files_and_prefixes_and_keeps_modes(tmp_path):
    whl = _fake_wheel(tmp_path / "w.whl", {"vllm/_flashmla_C.abi3.so": b"lib", "vllm/other.py": b"no",
                                           "humming/__init__.py": b"", "humming/_native/tool": b"#!"},
                      {"humming/_native/tool": 0o755})
    dest = tmp_path / "out"
    taken = A.extract_wheel(whl, str(dest), files=("vllm/_flashmla_C.abi3.so",), prefixes=("humming/",))
    assert sorted(n for n, _ in taken) == ["humming/__init__.py", "humming/_native/tool", "vllm/_flashmla_C.abi3.so"]
    assert not (dest / "vllm" / "other.py").exists()
    assert os.stat(dest / "humming" / "_native" / "tool").st_mode & 0o111
    with pytest.raises(ValueError, match="lacks vllm/missing.so"):
        A.extract_wheel(whl, str(dest), files=("vllm/missing.so",))


def test_extract_wheel_refuses_members_outside_the_folder(tmp_path):
    whl = _fake_wheel(tmp_path / "w.whl", {"humming/../../evil": b"x"})
    with pytest.raises(ValueError, match="outside the folder"):
        A.extract_wheel(whl, str(tmp_path / "out"), prefixes=("humming/",))


def test_fetch_from_a_wheel_folder_writes_manifests(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels / f"vllm-{A.VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl",
                {f: b"x" * 10 for f in A.FLASHMLA_FILES + A.MOE_C_FILES + A.VLLM_C_FILES})
    _fake_wheel(wheels / f"humming_kernels-{A.HUMMING_VERSION}-cp310-abi3-manylinux_2_28_x86_64.whl",
                {"humming/__init__.py": b"", "humming/forward.py": b"y" * 3})
    taken = A.fetch(str(tmp_path / "a"), moe_c_dest=str(tmp_path / "m"), vllm_c_dest=str(tmp_path / "c"),
                    wheel_dir=str(wheels))
    assert {(os.path.basename(d), n) for d, n, _ in taken} >= {("a", A.FLASHMLA_FILES[0]), ("m", A.MOE_C_FILES[0]),
                                                              ("c", A.VLLM_C_FILES[0]), ("a", "humming/forward.py")}
    man = json.loads((tmp_path / "a" / A.MANIFEST).read_text())
    assert man["versions"] == {"vllm": A.VLLM_VERSION, "humming-kernels": A.HUMMING_VERSION}
    for big in A.MOE_C_FILES + A.VLLM_C_FILES:  # the 46 MB and 92 MB libraries go to folders of their own
        assert not (tmp_path / "a" / big).exists()
    assert json.loads((tmp_path / "c" / A.MANIFEST).read_text())["versions"] == {"vllm": A.VLLM_VERSION}
    found = A.find_anchors([str(tmp_path / "a"), str(tmp_path / "c")], load=False)
    assert found.sources.get("flashmla") and found.vllm_c and found.sources["vllm_c"].startswith(str(tmp_path / "c"))
    with pytest.raises(ValueError, match="must hold"):
        A.fetch(str(tmp_path / "b"), wheel_dir=str(tmp_path / "a"))


@pytest.fixture(scope="module")
def pools():
    return I.DecodePools.build(4 * 128, 2048, 512, "cpu", seed=3)


def test_pools_have_vllm_block_sizes_and_576_byte_padded_strides(pools):
    for cache, block in ((pools.swa, I.SWA_BLOCK), (pools.c4a, I.C4A_BLOCK), (pools.c128a, I.C128A_BLOCK)):
        assert cache.dtype == torch.uint8 and cache.shape[1:] == (block, 584)
        assert cache.stride(0) % 576 == 0 and cache.stride(0) >= block * 584 and cache.stride(1) == 584
        assert formats.kv_cache_layout(cache.unsqueeze(-2)) == ("fp8_ds_mla", block)
    assert pools.c128a.stride(0) == 1728  # 2 * 584 = 1168 bytes padded to 3 * 576


@pytest.mark.parametrize("kind,context", [("swa", 4096), ("swa", 50), ("csa", 4096), ("csa", 1000), ("hca", 4096),
                                          ("hca", 40000)])
def test_decode_case_matches_flashmla_interface_shapes(pools, kind, context):
    m = I.ATTN_MODELS["pro"]
    b = 3
    c = I.decode_case(kind, m, b, context, pools, torch.Generator().manual_seed(0))
    # flash_mla_with_kvcache: q (b, s_q, h_q, d), indices (b, s_q, topk) int32, topk_length (b,) int32
    assert c["q"].shape == (b, 1, 128, 512) and c["q"].dtype == torch.bfloat16
    assert c["swa_idx"].shape == (b, 1, 128) and c["swa_idx"].dtype == torch.int32
    assert c["swa_len"].tolist() == [min(128, context)] * b
    assert c["sink"].shape == (128,) and c["sink"].dtype == torch.float32
    assert bool((c["swa_idx"][..., min(128, context):] == -1).all())
    n_slots = pools.slots("swa")
    valid = c["swa_idx"][..., : min(128, context)]
    assert bool(((valid >= 0) & (valid < n_slots)).all())
    if kind == "swa":
        assert c["extra_cache"] is None and c["extra_idx"] is None
        return
    width = m.index_topk if kind == "csa" else I.c128a_width(context)
    visible = min(context // 4, m.index_topk) if kind == "csa" else context // 128
    assert c["extra_idx"].shape == (b, 1, width) and width % 64 == 0
    assert c["extra_len"].tolist() == [visible] * b
    assert bool((c["extra_idx"][..., visible:] == -1).all())
    ids = c["extra_idx"][..., :visible]
    assert bool(((ids >= 0) & (ids < pools.slots(kind))).all())
    assert all(len(set(r.tolist())) == visible for r in ids.view(b, -1))  # distinct entries
    assert c["keys"] == min(128, context) + visible


def test_c128a_width_is_vllms_active_topk_width():
    assert I.c128a_width(4096) == 128 and I.c128a_width(32768) == 256 and I.c128a_width(131072) == 1024
    assert I.c128a_width(100) == 128 and I.c128a_width(131072, max_compressed=512) == 512


def test_prefill_case_and_moe_builders():
    g = torch.Generator().manual_seed(1)
    p = I.prefill_case(I.ATTN_MODELS["flash"], 5, 1000, g, "cpu")
    assert p["q"].shape == (5, 64, 512) and p["kv"].shape == (1000, 512) and p["idx"].shape == (5, 640)
    assert p["lens"].tolist() == [640] * 5 and int(p["idx"].max()) < 1000
    m = I.MoeModel("tiny", 64, 64, 16, 4)
    w = I.moe_experts(m, "cpu")
    assert w["w13"].shape == (4, 128, 32) and w["w13_scale"].dtype == torch.float8_e4m3fn and w["w2"].shape == (4, 64, 32)
    r = I.moe_routing(m, 7, "cpu", 0)
    assert r["ids"].shape == (7, 6) and r["ids"].dtype == torch.int32 and torch.allclose(r["tw"].sum(1), torch.ones(7))
    assert all(len(set(row.tolist())) == 6 for row in r["ids"])
    assert r["emap"].tolist() == [0, 1, 2, 3] + [-1] * 12
    assert r["n_local"] == int((r["ids"] < 4).sum())


def test_align_routes_semantics():
    from dsv4.bench.incumbents import align_routes

    ids = torch.tensor([[0, 5], [2, 0], [1, 2]], dtype=torch.int32)
    emap = torch.tensor([0, 1, 2, -1, -1, -1], dtype=torch.int32)
    s, e, n = align_routes(ids, emap, 3, 4)
    sentinel = ids.numel()
    assert s.tolist() == [0, 3, sentinel, sentinel, 4, sentinel, sentinel, sentinel, 2, 5, sentinel, sentinel]
    assert e.tolist() == [0, 1, 2] and n.tolist() == [12]


def test_compare_dry_run_prints_cases_and_the_missing_incumbents(no_env, capsys):
    assert compare.main(["--dry-run", "--batch", "1,4", "--context", "4K", "--moe-m", "1", "--tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "V4-Pro CSA 4K B=4" in out and "V4.1-Flash local-48 NVFP4 W4A16 M=1" in out and "prefill" in out
    if A._installed_version("vllm") != A.VLLM_VERSION:
        assert "missing" in out and "flashmla" in out


@pytest.mark.parametrize("bad", [["--batch", "1,,2"], ["--batch", "0"], ["--context", "4Q"], ["--moe-m", ""]])
def test_compare_rejects_bad_lists(no_env, bad, capsys):
    with pytest.raises(SystemExit) as e:
        compare.main(["--dry-run", *bad])
    assert e.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_compare_rejects_unknown_names(no_env, capsys):
    assert compare.main(["--dry-run", "--models", "flash,nope"]) == 2
    assert "--models takes flash, pro; got nope" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# MoE formats: NVFP4, MXFP4 W4A8 / W4A16
# --------------------------------------------------------------------------------------


def test_random_mxfp4_experts_are_vllms_deepseek_v4_layout():
    m = I.MoeModel("tiny", 128, 96, 16, 3)
    w = I.moe_experts(m, "cpu", fmt="mxfp4")
    assert set(w) == {"w13", "w13_scale", "w2", "w2_scale"}
    shapes = {"w13": (3, 192, 64), "w13_scale": (3, 192, 4), "w2": (3, 128, 48), "w2_scale": (3, 128, 3)}
    for k, shape in shapes.items():
        assert w[k].dtype == torch.uint8 and tuple(w[k].shape) == shape, (k, w[k].dtype, w[k].shape)
    assert 118 <= int(w["w13_scale"].min()) and int(w["w2_scale"].max()) <= 122
    vals = mxfp4.dequantize_mxfp4_experts(w["w13"], w["w13_scale"])
    assert bool(torch.isfinite(vals).all()) and 0.005 < float(vals.abs().mean()) < 0.1  # O(0.02), like real weights
    again = I.moe_experts(m, "cpu", fmt="mxfp4")
    assert all(torch.equal(w[k], again[k]) for k in w)  # seeded
    assert not torch.equal(w["w13"], I.moe_experts(m, "cpu", seed=2, fmt="mxfp4")["w13"])
    with pytest.raises(ValueError, match="fmt must be one of nvfp4, mxfp4"):
        I.moe_experts(m, "cpu", fmt="mxfp8")
    assert I.MOE_FORMATS["nvfp4"][1] == 9 / 16 and I.MOE_FORMATS["mxfp4"][1] == 17 / 32


def test_moe_format_names_and_cases():
    assert I.moe_format_list("mxfp4-w4a8, nvfp4,mxfp4-w4a8") == ["mxfp4-w4a8", "nvfp4"]
    for bad in ("fp8", "nvfp4,", "mxfp4"):
        with pytest.raises(Exception, match="nvfp4, mxfp4-w4a8, mxfp4-w4a16"):
            I.moe_format_list(bad)
    assert I.moe_cases(["nvfp4", "mxfp4-w4a8", "mxfp4-w4a16"]) == [("nvfp4", "bf16"), ("mxfp4", "fp8"),
                                                                   ("mxfp4", "bf16")]
    assert I.moe_cases(["mxfp4-w4a16", "nvfp4"], ["bf16", "nvfp4"]) == [("mxfp4", "bf16"), ("nvfp4", "bf16"),
                                                                         ("nvfp4", "nvfp4")]
    assert {I.MOE_LABELS[c] for c in I.moe_cases(["mxfp4-w4a8", "mxfp4-w4a16"])} == {"MXFP4 W4A8", "MXFP4 W4A16"}


def test_compare_dry_run_lists_the_w4a8_row_set(no_env, capsys):
    argv = ["--dry-run", "--only", "moe", "--moe-models", "flash,v41flash", "--moe-m", "1,64"]
    assert compare.main(argv) == 0
    out = capsys.readouterr().out
    for model in ("V4-Flash local-32", "V4.1-Flash local-48"):
        for M in (1, 64):  # the W4A8 rows at the same models and M as the W4A16 ones
            assert f"{model} NVFP4 W4A16 M={M}" in out and f"{model} MXFP4 W4A8 M={M}" in out
    assert "Humming W4A8" in out and "8 cases listed" in out
    assert compare.main(argv + ["--moe-format", "nvfp4"]) == 0
    out = capsys.readouterr().out
    assert "MXFP4" not in out and "4 cases listed" in out
    assert compare.main(argv + ["--moe-format", "mxfp4-w4a8"]) == 0
    assert "NVFP4" not in capsys.readouterr().out


def test_compare_mxfp4_w4a16_is_measured_against_what_vllm_runs_for_mxfp4(no_env, capsys):
    # vLLM serves MXFP4 checkpoints on Hopper only with Humming W4A8: that is the incumbent
    # of dsv4's MXFP4 W4A16 path too.
    assert compare.main(["--dry-run", "--only", "moe", "--moe-models", "flash", "--moe-m", "64",
                         "--moe-format", "mxfp4-w4a16"]) == 0
    out = capsys.readouterr().out
    assert "V4-Flash local-32 MXFP4 W4A16 M=64" in out and "Humming W4A8" in out and "1 cases listed" in out


def test_compare_rejects_unknown_moe_formats(no_env, capsys):
    with pytest.raises(SystemExit) as e:
        compare.main(["--dry-run", "--moe-format", "w4a8"])
    assert e.value.code == 2


def test_markdown_has_one_moe_table_per_format():
    rows = [dict(op="moe", model="V4-Flash local-32", kind=kind, batch=1, dsv4_us=10.0, tflops=1.0, tbps=1.0,
                 incumbent=inc, incumbent_us=12.0, ratio=1.2, rel_l2=1e-2)
            for kind, inc in (("NVFP4 W4A16", "Humming W4A16"), ("MXFP4 W4A8", "Humming W4A8"))]
    md = compare.markdown(rows)
    assert "Routed-expert MoE (NVFP4 W4A16), dsv4 vs Humming W4A16" in md
    assert "Routed-expert MoE (MXFP4 W4A8), dsv4 vs Humming W4A8" in md
    assert md.count("| V4-Flash local-32 | 1 | 10.0 | 12.0 | 1.20x |") == 2


def test_humming_w4a8_needs_vllms_quantizer():
    from dsv4.bench.incumbents import HummingW4A8

    if hasattr(torch.ops._C, "per_token_group_fp8_quant"):
        pytest.skip("vLLM's kernel library is loaded in this process")
    with pytest.raises(RuntimeError, match="per_token_group_fp8_quant.*vllm_c"):
        HummingW4A8({}, 256, 10.0)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench_moe():
    spec = importlib.util.spec_from_file_location("bench_moe", os.path.join(ROOT, "scripts", "bench_moe.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_moe_vs_vllm_passes_the_formats_to_compare(no_env, bench_moe, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # compare lists the cases, times nothing
    base = ["--vs", "vllm", "--models", "flash", "--decode", "1", "--prefill", ""]
    assert bench_moe.main(base) == 0
    out = capsys.readouterr().out
    assert "V4-Flash local-32 NVFP4 W4A16 M=1" in out and "V4-Flash local-32 MXFP4 W4A8 M=1" in out
    assert "2 cases listed" in out  # --prefill '' adds none
    assert bench_moe.main(base + ["--moe-format", "mxfp4-w4a8"]) == 0
    out = capsys.readouterr().out
    assert "MXFP4 W4A8 M=1" in out and "NVFP4" not in out


@pytest.mark.parametrize("argv", [["--moe-format", "mxfp4-w4a8", "--activation", "nvfp4"],
                                  ["--moe-format", "nvfp4,fp8"]])
def test_bench_moe_rejects_bad_formats(bench_moe, argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench_moe.main(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("fmt,act,tol", [("nvfp4", "bf16", 0.02), ("mxfp4", "bf16", 0.02), ("mxfp4", "fp8", 0.1)])
def test_bench_moe_cases_on_the_cpu_reference_path(bench_moe, fmt, act, tol):
    """make_weights + moe_call of every MoE case (the CPU kernels are the float32
    references) against the script's bf16 baseline on the same dequantized weights:
    W4A16 within bf16 rounding, W4A8 within its FP8 activation rounding (e4m3, up to
    2^-4 relative per element at GEMM1's and GEMM2's inputs) and visibly above W4A16's
    difference (the FP8 mode really ran)."""
    m = dict(K=256, N=128, E_global=16, E_local=10)  # two chunks of the 8-expert builder
    w, prepared, w13, w2 = bench_moe.make_weights(m, fmt, [act], device="cpu")
    assert w13.shape == (10, 256, 256) and w2.shape == (10, 256, 128) and w13.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(12, 256, generator=gen).to(torch.bfloat16)
    tw, ids = torch.rand(12, 16, generator=gen).topk(6, dim=1)
    emap = torch.full((16,), -1, dtype=torch.int32)
    emap[:10] = torch.arange(10, dtype=torch.int32)
    s = dict(x=x, ids=ids.to(torch.int32), tw=(tw / tw.sum(1, keepdim=True)).float(), emap=emap)
    out = torch.full((12, 256), float("nan"), dtype=torch.bfloat16)
    bench_moe.moe_call(fmt, act, prepared[act], s, out)
    ref = bench_moe.baseline(s, w13, w2, 10, 128).float()
    diff = float((out.float() - ref).abs().max() / ref.abs().max())
    assert diff < tol, diff
    if act == "fp8":
        w16, p16, _, _ = bench_moe.make_weights(m, fmt, ["bf16"], device="cpu")
        out16 = torch.empty_like(out)
        bench_moe.moe_call(fmt, "bf16", p16["bf16"], s, out16)
        assert float((out.float() - out16.float()).abs().max() / ref.abs().max()) > 0.02


def test_moe_incumbent_missing_names_what_each_case_needs():
    from dsv4.bench.incumbents import MOE_INCUMBENTS, moe_incumbent_missing

    assert MOE_INCUMBENTS == {("nvfp4", "bf16"): "Humming W4A16", ("mxfp4", "fp8"): "Humming W4A8",
                              ("mxfp4", "bf16"): "Humming W4A8"}
    everything = A.Anchors(flashmla=True, humming=object(), vllm_c=True)
    assert moe_incumbent_missing(everything, ("nvfp4", "bf16")) is None
    assert moe_incumbent_missing(everything, ("mxfp4", "fp8")) is None
    no_c = A.Anchors(missing={"vllm_c": "not in .anchors"})
    assert moe_incumbent_missing(no_c, ("nvfp4", "bf16")) is None  # W4A16 does not need it
    assert moe_incumbent_missing(no_c, ("mxfp4", "fp8")) == "vllm_c: not in .anchors"
    neither = A.Anchors(missing={"humming": "h", "vllm_c": "c"})
    assert moe_incumbent_missing(neither, ("mxfp4", "fp8")) == "humming: h; vllm_c: c"
    assert moe_incumbent_missing(no_c, ("mxfp4", "bf16")) == "vllm_c: not in .anchors"  # Humming W4A8 too
    assert "no incumbent" in moe_incumbent_missing(everything, ("nvfp4", "nvfp4"))


def test_decode_pools_for_cases_are_sized_from_the_largest_case(monkeypatch):
    sizes = []
    monkeypatch.setattr(I.DecodePools, "build", staticmethod(lambda *a, **k: sizes.append(a[:3])))
    I.DecodePools.for_cases(256, 1 << 17, "cpu")
    I.DecodePools.for_cases(1, 4096, "cpu")
    # above L2 at any size; growing with the batch (window pool) and the context (compressed pools)
    assert sizes == [(1 << 18, 1 << 20, 1 << 16), (1 << 18, 1 << 20, 1 << 16)]
    I.DecodePools.for_cases(1024, 1 << 23, "cpu")
    assert sizes[-1] == (4 * 128 * 1024, 2 * (1 << 23) // 4, 4 * (1 << 23) // 128)
