"""CPU tests of the benchmark package (dsv4.bench): the incumbents' finder degrades
cleanly, the fetch script's extraction, the one model table, the case builders' shapes
and strides against what FlashMLA's interface and vLLM's MoE layouts document, the traffic
counts, the report, the MoE format cases (NVFP4, MXFP4 W4A8 / W4A16) on the CPU reference
path, the compare and moe routines' dry runs."""

from __future__ import annotations

import json
import os
import stat
import sys
import zipfile

import pytest
import torch

from dataclasses import replace

from dsv4 import formats
from dsv4.formats import mxfp4
from dsv4.bench import anchors as A
from dsv4.bench import cases as C
from dsv4.bench import cli
from dsv4.bench import experts as X
from dsv4.bench import traffic
from dsv4.bench.models import MODELS


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


@pytest.fixture
def rich_extra():
    pytest.importorskip("rich", reason="the routines' tables need rich (the bench extra)")


# --------------------------------------------------------------------------------------
# the model table (docs/design.md section 1)
# --------------------------------------------------------------------------------------


def test_model_table_has_the_design_facts():
    facts = {"flash": (4096, 43, 64, 512, 256, 2048), "pro": (7168, 61, 128, 1024, 384, 3072),
             "v41flash": (5120, 40, 64, 512, 384, 2304)}
    for key, (hidden, layers, heads, topk, experts, inter) in facts.items():
        m = MODELS[key]
        assert (m.hidden, m.n_layers, m.heads, m.index_topk, m.n_experts, m.moe_inter) == \
            (hidden, layers, heads, topk, experts, inter), key
        assert (m.experts_per_token, m.swiglu_limit, m.window, m.key) == (6, 10.0, 128, key)
    assert MODELS["flash"].layers == {"swa": 2, "csa": 21, "hca": 20}
    assert MODELS["pro"].layers == {"swa": 0, "csa": 30, "hca": 31}
    for m in MODELS.values():  # every layer of a scheduled model is counted once
        assert m.layers is None or sum(m.layers.values()) == m.n_layers
    assert [m.moe_name() for m in MODELS.values()] == ["V4-Flash local-32", "V4-Pro local-48",
                                                       "V4.1-Flash local-48"]
    assert (MODELS["flash"].prefill_topk, MODELS["pro"].prefill_topk) == (640, 1152)
    # the MoE shapes: the models' EP8 ranks, and V4.1-Flash's TP8 rank (every expert, N / 8)
    from dsv4.bench.models import MOE_MODELS
    tp8 = MOE_MODELS["v41flash-tp8"]
    assert {k: MOE_MODELS[k] for k in MODELS} == MODELS
    assert (tp8.hidden, tp8.n_experts, tp8.moe_inter, tp8.local_experts(), tp8.local_experts(4)) == \
        (5120, 384, 288, 384, 384)
    assert tp8.moe_name() == "V4.1-Flash TP8 N=288"


def test_nvfp4_experts_prepare_and_run_at_v41flash_tp8():
    """The compare routine's NVFP4 path at V4.1-Flash TP8 (N = 288, K = 5120): prepare
    pads N to the kernels' 320 (it raised 'needs N and K multiples of 64' before) and
    dsv4_moe on the prepared experts (the CPU op here) is the float32 reference on the
    unpadded ones. 8 experts stand in for the 384 (a TP rank holds them all)."""
    from dsv4 import reference
    from dsv4.bench.models import MOE_MODELS
    from dsv4.formats.nvfp4_moe_layout import check_prepared

    m = replace(MOE_MODELS["v41flash-tp8"], n_experts=8)
    E, N, K = m.local_experts(), m.moe_inter, m.hidden
    assert (E, N, K) == (8, 288, 5120)
    w = X.random_experts("nvfp4", E, N, K, "cpu")
    prepared = X.prepare(w, "nvfp4", "bf16")
    assert check_prepared("t", prepared) == (E, 320, K)
    inp = X.moe_routing(m, 3, torch.Generator().manual_seed(5))
    out = torch.empty(3, K, dtype=torch.bfloat16)
    got = X.dsv4_moe(inp, "nvfp4", "bf16", prepared, out, swiglu_limit=m.swiglu_limit)
    ref = reference.nvfp4_moe(inp["x"], inp["ids"], inp["tw"], *(w[k] for k in X.NVFP4_KEYS),
                              swiglu_limit=m.swiglu_limit, expert_map=inp["emap"])
    assert ref.abs().amax() > 0 and ((got.float() - ref).norm() / ref.norm()).item() <= 4e-3

def test_one_room_for_head_dim_and_window():
    """HEAD_DIM is dsv4.formats.kv_cache's KV_DIM; no benchmark file declares its own
    HEAD_DIM, WINDOW or model numbers."""
    import pathlib
    import re

    from dsv4.bench import models
    from dsv4.formats import kv_cache

    assert models.HEAD_DIM is kv_cache.KV_DIM
    bench = pathlib.Path(models.__file__).parent
    for path in bench.rglob("*.py"):
        text = path.read_text()
        if path.name != "models.py":
            assert not re.search(r"^(HEAD_DIM|WINDOW|MODELS|LAYER_SCHEDULE)\s*=", text, re.M), path
        assert len(text.splitlines()) <= 450, f"{path} has {len(text.splitlines())} lines"


# --------------------------------------------------------------------------------------
# attention cases
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pools():
    return C.DecodePools.build(4 * 128, 2048, 512, "cpu", seed=3)


def test_pools_have_vllm_block_sizes_and_576_byte_padded_strides(pools):
    assert C.BLOCK == {"swa": 64, "csa": 64, "hca": 2}
    for kind, cache in (("swa", pools.swa), ("csa", pools.c4a), ("hca", pools.c128a)):
        block = C.BLOCK[kind]
        assert cache is pools.cache(kind)
        assert cache.dtype == torch.uint8 and cache.shape[1:] == (block, 584)
        assert cache.stride(0) % 576 == 0 and cache.stride(0) >= block * 584 and cache.stride(1) == 584
        assert formats.kv_cache_layout(cache.unsqueeze(-2)) == ("fp8_ds_mla", block)
    assert pools.c128a.stride(0) == 1728  # 2 * 584 = 1168 bytes padded to 3 * 576
    assert pools.rows_bf16 is None


def test_pools_bf16_rows_are_the_cached_rows():
    p = C.DecodePools.build(100, 70, 9, "cpu", seed=4, bf16_rows=True)
    assert p.rows_bf16.shape == (128 + 128 + 10, 512)
    for kind in ("swa", "csa", "hca"):
        slots = torch.arange(p.slots(kind))
        rows = p.rows_bf16[p.row_offset(kind):p.row_offset(kind) + p.slots(kind)]
        assert torch.equal(formats.read_fp8_ds_mla(p.cache(kind), slots), rows), kind


@pytest.mark.parametrize("kind,context", [("swa", 4096), ("swa", 50), ("csa", 4096), ("csa", 1000), ("hca", 4096),
                                          ("hca", 40000)])
def test_decode_case_matches_flashmla_interface_shapes(pools, kind, context):
    m = MODELS["pro"]
    b = 3
    c = C.decode_case(kind, m, b, context, pools, torch.Generator().manual_seed(0))
    # flash_mla_with_kvcache: q (b, s_q, h_q, d), indices (b, s_q, topk) int32, topk_length (b,) int32
    assert c["q"].shape == (b, 1, 128, 512) and c["q"].dtype == torch.bfloat16
    assert c["swa_idx"].shape == (b, 1, 128) and c["swa_idx"].dtype == torch.int32
    assert c["swa_len"].tolist() == [min(128, context)] * b
    assert c["sink"].shape == (128,) and c["sink"].dtype == torch.float32
    assert bool((c["swa_idx"][..., min(128, context):] == -1).all())
    n_slots = pools.slots("swa")
    valid = c["swa_idx"][..., : min(128, context)]
    assert bool(((valid >= 0) & (valid < n_slots)).all())
    assert (c["window_keys"], c["compressed_keys"]) == C.attention_keys(kind, m, context)
    if kind == "swa":
        assert c["extra_cache"] is None and c["extra_idx"] is None
        return
    width = m.index_topk if kind == "csa" else C.c128a_width(context)
    visible = min(context // 4, m.index_topk) if kind == "csa" else context // 128
    assert c["extra_cache"] is pools.cache(kind)
    assert c["extra_idx"].shape == (b, 1, width) and width % 64 == 0
    assert c["extra_len"].tolist() == [visible] * b
    assert bool((c["extra_idx"][..., visible:] == -1).all())
    ids = c["extra_idx"][..., :visible]
    assert bool(((ids >= 0) & (ids < pools.slots(kind))).all())
    assert all(len(set(r.tolist())) == visible for r in ids.view(b, -1))  # distinct entries
    assert c["keys"] == min(128, context) + visible


def test_attention_keys():
    flash, pro = MODELS["flash"], MODELS["pro"]
    assert C.attention_keys("swa", flash, 4096) == (128, 0)
    assert C.attention_keys("csa", flash, 4096) == (128, 512)
    assert C.attention_keys("csa", pro, 2048) == (128, 512)  # fewer visible entries than top-k
    assert C.attention_keys("hca", pro, 131072) == (128, 1024)
    assert C.attention_keys("swa", pro, 50) == (50, 0)
    with pytest.raises(ValueError, match="kind must be"):
        C.attention_keys("mla", pro, 4096)


def test_c128a_width_is_vllms_active_topk_width():
    assert C.c128a_width(4096) == 128 and C.c128a_width(32768) == 256 and C.c128a_width(131072) == 1024
    assert C.c128a_width(100) == 128 and C.c128a_width(131072, max_compressed=512) == 512


def test_decode_pools_for_cases_are_sized_from_the_largest_case(monkeypatch):
    sizes = []
    monkeypatch.setattr(C.DecodePools, "build", staticmethod(lambda *a, **k: sizes.append(a[:3])))
    C.DecodePools.for_cases(256, 1 << 17, "cpu")
    C.DecodePools.for_cases(1, 4096, "cpu")
    # above L2 at any size; growing with the batch (window pool) and the context (compressed pools)
    assert sizes == [(1 << 18, 1 << 20, 1 << 16), (1 << 18, 1 << 20, 1 << 16)]
    C.DecodePools.for_cases(1024, 1 << 23, "cpu")
    assert sizes[-1] == (4 * 128 * 1024, 2 * (1 << 23) // 4, 4 * (1 << 23) // 128)
    C.DecodePools.for_cases(2, 2048, "cpu", above_l2=False)  # the CPU reference run's small pools
    assert sizes[-1] == (1024, 4096, 512)


def test_prefill_case_and_moe_builders():
    g = torch.Generator().manual_seed(1)
    p = C.prefill_case(MODELS["flash"], 5, 1000, g, "cpu")
    assert p["q"].shape == (5, 64, 512) and p["kv"].shape == (1000, 512) and p["idx"].shape == (5, 640)
    assert p["lens"].tolist() == [640] * 5 and int(p["idx"].max()) < 1000
    m = replace(MODELS["flash"], hidden=64, moe_inter=64, n_experts=16)
    w = X.random_experts("nvfp4", m.local_experts(4), m.moe_inter, m.hidden, "cpu")
    assert w["w13"].shape == (4, 128, 32) and w["w2"].shape == (4, 64, 32)
    assert w["w13_scale"].dtype == torch.float8_e4m3fn
    r = X.moe_routing(m, 7, torch.Generator().manual_seed(0), ep=4)
    assert r["ids"].shape == (7, 6) and r["ids"].dtype == torch.int32 and torch.allclose(r["tw"].sum(1), torch.ones(7))
    assert all(len(set(row.tolist())) == 6 for row in r["ids"])
    assert r["emap"].tolist() == [0, 1, 2, 3] + [-1] * 12
    assert r["n_local"] == int((r["ids"] < 4).sum())
    assert r["touched"] == len(set(r["ids"][r["ids"] < 4].tolist()))


def test_moe_routing_balanced_gives_every_expert_the_same_slots():
    """--routing balanced: each token's k experts distinct, every global expert M * k /
    E_global slots when E_global divides M * k (within one otherwise), x and the weights
    drawn as the uniform routing draws them; an unknown routing is refused."""
    m = replace(MODELS["pro"], hidden=64, moe_inter=64)  # 384 experts, top 6
    for M, per in ((8192, 128), (8256, 129)):
        r = X.moe_routing(m, M, torch.Generator().manual_seed(0), "cpu", ep=8, routing="balanced")
        counts = torch.bincount(r["ids"].flatten().long(), minlength=384)
        assert counts.min() == counts.max() == per
        assert all(len(set(row.tolist())) == 6 for row in r["ids"][:64])
        assert r["n_local"] == 48 * per and r["touched"] == 48
        u = X.moe_routing(m, M, torch.Generator().manual_seed(0), "cpu", ep=8)
        assert torch.equal(r["x"], u["x"]) and torch.equal(r["tw"], u["tw"])
    r = X.moe_routing(m, 100, torch.Generator().manual_seed(0), "cpu", ep=8, routing="balanced")
    counts = torch.bincount(r["ids"].flatten().long(), minlength=384)
    assert counts.max() - counts.min() <= 1
    with pytest.raises(ValueError, match="dsv4: routing must be one of uniform, balanced"):
        X.moe_routing(m, 4, torch.Generator().manual_seed(0), "cpu", routing="zipf")


def test_moe_routing_drawn_on_the_host_equals_drawn_on_the_device():
    """The moe routine draws its routing with a CPU generator and moves it; the values are
    those a CPU run of the same draw gives (x, then the scores)."""
    m = replace(MODELS["flash"], hidden=64, moe_inter=64, n_experts=16)
    a = X.moe_routing(m, 5, torch.Generator().manual_seed(3), "cpu", ep=4)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    tw, ids = torch.rand(5, 16, generator=gen).topk(6, dim=1)
    assert torch.equal(a["x"], x) and torch.equal(a["ids"], ids.to(torch.int32))
    assert torch.equal(a["tw"], (tw / tw.sum(1, keepdim=True)).float())


def test_align_routes_semantics():
    from dsv4.bench.incumbents import align_routes

    ids = torch.tensor([[0, 5], [2, 0], [1, 2]], dtype=torch.int32)
    emap = torch.tensor([0, 1, 2, -1, -1, -1], dtype=torch.int32)
    s, e, n = align_routes(ids, emap, 3, 4)
    sentinel = ids.numel()
    assert s.tolist() == [0, 3, sentinel, sentinel, 4, sentinel, sentinel, sentinel, 2, 5, sentinel, sentinel]
    assert e.tolist() == [0, 1, 2] and n.tolist() == [12]


# --------------------------------------------------------------------------------------
# traffic: one count per op family
# --------------------------------------------------------------------------------------


def test_traffic_counts():
    t = traffic.decode_attention(2, 64, 640)
    assert t.flops == 2 * 64 * 2 * 512 * 640 * 2
    assert t.bytes == 2 * (640 * (584 + 4) + 2 * 64 * 512 * 2 + 64 * 4)
    assert t.tflops(1.0) == pytest.approx(t.flops / 1e6) and t.tbps(2.0) == pytest.approx(t.bytes / 2e6)
    t = traffic.prefill_attention(4096, 128, 1152)
    assert t.flops == 2 * 128 * 1024 * 1152 * 4096 and t.bytes == 4096 * (2 * 128 * 512 * 2 + 128 * 4 + 1152 * 1028)
    t = traffic.dense_fmha(16384, 32, 128, 1000, 20480, 8, shared_kv=False)
    assert t.flops == 4 * 128 * 32 * 1000
    assert t.bytes == 2 * 16384 * 32 * 128 * 2 + 16384 * 32 * 4 + 20480 * 8 * 128 * 2 * 2
    assert traffic.dense_fmha(1, 1, 512, 1, 10, 1, shared_kv=True).bytes == 2 * 512 * 2 + 4 + 10 * 512 * 2
    t = traffic.moe(12, 3, 4096, 2048, "nvfp4")
    assert t.flops == 12 * 6 * 4096 * 2048 and t.bytes == 3 * 3 * 2048 * 4096 * 9 / 16
    assert traffic.moe_expert_bytes(256, 128, "mxfp4") / traffic.moe_expert_bytes(256, 128, "nvfp4") == \
        pytest.approx(17 / 18)
    assert traffic.moe_expert_bytes(256, 128, "bf16") == 3 * 256 * 128 * 2
    assert traffic.quantize_nvfp4(128, 7168) == traffic.Traffic(0, 128 * 7168 * 2 + 128 * 7168 // 2 + 128 * 7168 // 16)


# --------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------


def test_markdown_tables():
    from dsv4.bench.report import Table, fmt_ctx, fmt_ms, fmt_us, to_markdown

    t = Table("A title", ["case", "us", "note"], [["a|b", "1.0", "x"]], caption="a caption")
    md = to_markdown([t], notes=["n1"])
    assert md == "**A title**\n\n| case | us | note |\n|---|---:|---|\n| a/b | 1.0 | x |\n\na caption\n\n- n1\n"
    assert to_markdown([t], heading="h4", preamble=["P."]).startswith("P.\n\n#### A title\n")
    assert to_markdown([Table("t", ["a", "b"], align="rl")]).splitlines()[3] == "|---:|---|"
    assert (fmt_us(123.4), fmt_us(12.34), fmt_us(None), fmt_ms(1234.0)) == ("123", "12.3", "-", "1.23")
    assert (fmt_ctx(None), fmt_ctx(4096), fmt_ctx(1 << 20), fmt_ctx(1000)) == ("any ctx", "4K", "1M", "1000")


def test_text_tables(rich_extra):
    from dsv4.bench.report import Table, to_text

    text = to_text([Table("Title", ["case", "us"], [["x", "1.0"]], caption="cap")], 80, lines=["first"],
                   notes=["a note"])
    lines = text.splitlines()
    assert lines[0] == "first" and "Title" in text and "cap" in text and lines[-1] == "- a note"
    assert "\x1b[" not in text  # no colour codes in files


# --------------------------------------------------------------------------------------
# the compare routine (CPU: dry runs, argument errors, report)
# --------------------------------------------------------------------------------------


def compare(*argv):
    return cli.main(["compare", *argv])


def test_compare_dry_run_prints_cases_and_the_missing_incumbents(rich_extra, no_env, capsys):
    assert compare("--dry-run", "--batch", "1,4", "--context", "4K", "--moe-m", "1", "--tokens", "16") == 0
    out = capsys.readouterr().out
    assert "V4-Pro CSA 4K B=4" in out and "V4.1-Flash local-48 NVFP4 W4A16 M=1" in out and "prefill topk 1152" in out
    if A._installed_version("vllm") != A.VLLM_VERSION:
        assert "missing" in out and "flashmla" in out


def test_compare_alias_module(rich_extra, no_env, capsys):
    from dsv4.bench import compare as alias

    assert alias.main(["--dry-run", "--only", "prefill", "--models", "flash", "--tokens", "16"]) == 0
    assert "V4-Flash prefill topk 640 T=16" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--batch", "1,,2"], ["--batch", "0"], ["--context", "4Q"], ["--moe-m", ""],
                                 ["--only", "decode,train"], ["--kinds", "mla"], ["--moe-format", "w4a8"],
                                 ["--moe-weights", "gaussian"]])
def test_compare_rejects_bad_lists(no_env, bad, capsys):
    with pytest.raises(SystemExit) as e:
        compare("--dry-run", *bad)
    assert e.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_compare_rejects_unknown_names(no_env, capsys):
    with pytest.raises(SystemExit) as e:
        compare("--dry-run", "--models", "flash,nope")
    assert e.value.code == 2
    assert "--models: takes a comma-separated list of flash, pro; got 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare("--dry-run", "--models", "v41flash")  # no V4 layer schedule: attention rows need one


# --------------------------------------------------------------------------------------
# MoE formats: NVFP4, MXFP4 W4A8 / W4A16
# --------------------------------------------------------------------------------------


def test_random_mxfp4_experts_are_vllms_deepseek_v4_layout():
    w = X.random_experts("mxfp4", 3, 96, 128, "cpu")
    assert set(w) == {"w13", "w13_scale", "w2", "w2_scale"}
    shapes = {"w13": (3, 192, 64), "w13_scale": (3, 192, 4), "w2": (3, 128, 48), "w2_scale": (3, 128, 3)}
    for k, shape in shapes.items():
        assert w[k].dtype == torch.uint8 and tuple(w[k].shape) == shape, (k, w[k].dtype, w[k].shape)
    assert 118 <= int(w["w13_scale"].min()) and int(w["w2_scale"].max()) <= 122
    vals = mxfp4.dequantize_mxfp4_experts(w["w13"], w["w13_scale"])
    assert bool(torch.isfinite(vals).all()) and 0.005 < float(vals.abs().mean()) < 0.1  # O(0.02), like real weights
    again = X.random_experts("mxfp4", 3, 96, 128, "cpu")
    assert all(torch.equal(w[k], again[k]) for k in w)  # seeded
    assert not torch.equal(w["w13"], X.random_experts("mxfp4", 3, 96, 128, "cpu", seed=2)["w13"])
    with pytest.raises(ValueError, match="fmt must be one of nvfp4, mxfp4"):
        X.random_experts("mxfp8", 3, 96, 128, "cpu")
    assert traffic.WEIGHT_BYTES == {"bf16": 2.0, "nvfp4": 9 / 16, "mxfp4": 17 / 32}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_moe_weights_kinds_give_the_same_layout(fmt):
    """compare --moe-weights: both kinds give the experts in the same layout (the quantized
    ones may carry more, such as NVFP4's activation input scales); the codes are the
    random_experts draw, the quantized ones quantized_experts'."""
    codes = X.moe_weights("codes", fmt, 2, 64, 128, "cpu")
    quantized = X.moe_weights("quantized", fmt, 2, 64, 128, "cpu")
    assert set(codes) <= set(quantized)
    for k, v in codes.items():
        assert quantized[k].dtype == v.dtype and quantized[k].shape == v.shape, k
    assert all(torch.equal(v, X.random_experts(fmt, 2, 64, 128, "cpu")[k]) for k, v in codes.items())
    assert all(torch.equal(v, X.quantized_experts(fmt, 2, 64, 128, "cpu")[k]) for k, v in quantized.items())
    assert X.MOE_WEIGHTS == ("codes", "quantized")
    with pytest.raises(ValueError, match="kind must be one of codes, quantized"):
        X.moe_weights("gaussian", fmt, 2, 64, 128, "cpu")


def test_moe_format_names_and_cases():
    from dsv4.moe import modes

    assert X.moe_format_list("mxfp4-w4a8, nvfp4,mxfp4-w4a8") == ["mxfp4-w4a8", "nvfp4"]
    for bad in ("fp8", "nvfp4,", "mxfp4"):
        with pytest.raises(Exception, match="nvfp4, mxfp4-w4a8, mxfp4-w4a16"):
            X.moe_format_list(bad)
    assert X.moe_cases(["nvfp4", "mxfp4-w4a8", "mxfp4-w4a16"]) == [("nvfp4", "bf16"), ("mxfp4", "fp8"),
                                                                   ("mxfp4", "bf16")]
    assert X.moe_cases(["mxfp4-w4a16", "nvfp4"], ["bf16", "nvfp4"]) == [("mxfp4", "bf16"), ("nvfp4", "bf16"),
                                                                         ("nvfp4", "nvfp4")]
    assert {X.MOE_LABELS[c] for c in X.moe_cases(["mxfp4-w4a8", "mxfp4-w4a16"])} == {"MXFP4 W4A8", "MXFP4 W4A16"}
    # the labels are dsv4.moe.modes'
    assert X.MOE_LABELS == {(f, a): modes.label(f, a) for f, acts in modes.ACTIVATIONS.items() for a in acts}


def test_compare_dry_run_lists_the_w4a8_row_set(rich_extra, no_env, capsys):
    argv = ["--dry-run", "--only", "moe", "--moe-models", "flash,v41flash", "--moe-m", "1,64"]
    assert compare(*argv) == 0
    out = capsys.readouterr().out
    for model in ("V4-Flash local-32", "V4.1-Flash local-48"):
        for M in (1, 64):  # the W4A8 rows at the same models and M as the W4A16 ones
            assert f"{model} NVFP4 W4A16 M={M}" in out and f"{model} MXFP4 W4A8 M={M}" in out
    assert "Humming W4A8" in out and "8 cases listed" in out
    assert "MoE experts: codes (--moe-weights), the same for both sides" in out
    assert compare(*argv, "--moe-weights", "quantized") == 0
    assert "MoE experts: quantized (--moe-weights)" in capsys.readouterr().out
    assert compare(*argv, "--moe-format", "nvfp4") == 0
    out = capsys.readouterr().out
    assert "MXFP4" not in out and "4 cases listed" in out
    assert compare(*argv, "--moe-format", "mxfp4-w4a8") == 0
    assert "NVFP4" not in capsys.readouterr().out
    assert compare("--dry-run", "--only", "moe", "--moe-models", "v41flash-tp8", "--moe-m", "1",
                   "--moe-format", "mxfp4-w4a8") == 0
    assert "V4.1-Flash TP8 N=288 MXFP4 W4A8 M=1" in capsys.readouterr().out


def test_compare_mxfp4_w4a16_is_measured_against_what_vllm_runs_for_mxfp4(rich_extra, no_env, capsys):
    # vLLM serves MXFP4 checkpoints on Hopper only with Humming W4A8: that is the incumbent
    # of dsv4's MXFP4 W4A16 path too.
    assert compare("--dry-run", "--only", "moe", "--moe-models", "flash", "--moe-m", "64",
                   "--moe-format", "mxfp4-w4a16") == 0
    out = capsys.readouterr().out
    assert "V4-Flash local-32 MXFP4 W4A16 M=64" in out and "Humming W4A8" in out and "1 cases listed" in out


def test_markdown_has_one_moe_table_per_format():
    from dsv4.bench.routines.compare_tables import line, markdown

    rows = [dict(op="moe", model="V4-Flash local-32", kind=kind, batch=1, dsv4_us=10.0, tflops=1.0, tbps=1.0,
                 incumbent=inc, incumbent_us=12.0, ratio=1.2, rel_l2=1e-2)
            for kind, inc in (("NVFP4 W4A16", "Humming W4A16"), ("MXFP4 W4A8", "Humming W4A8"))]
    md = markdown(rows)
    assert "#### Routed-expert MoE (NVFP4 W4A16), dsv4 vs Humming W4A16" in md
    assert "#### Routed-expert MoE (MXFP4 W4A8), dsv4 vs Humming W4A8" in md
    assert md.count("| V4-Flash local-32 | 1 | 10.0 | 12.0 | 1.20x |") == 2
    # the whole-call incumbent with its GEMMs alone beside it, and the W4A8 rows' fp8 ceiling
    whole = dict(rows[1], incumbent_experts_us=8.0, ratio_experts=0.8, incumbent_path="vLLM grouped apply",
                 activation="fp8", pct_gemm=50.0, pct_gemm_of="fp8")
    md = markdown([whole])
    assert "| GEMMs alone us | ratio to them |" in md and "| % fp8 peak |" in md
    assert "| V4-Flash local-32 | 1 | 10.0 | 12.0 | 1.20x | 8.0 | 0.80x | 1 | 50 |" in md
    assert "its GEMMs alone 8.0 us: 0.80x" in line(dict(whole, op="moe", maxdiff=0.1))
    dec = [dict(op="decode", model="V4-Pro", kind="csa", context=4096, batch=128, dsv4_us=134.5, tflops=287.0,
                incumbent_us=125.8, ratio=0.935, pct_gemm=36.6)]
    md = markdown(dec, {"copy TB/s": 4.25})
    assert md.startswith("Ceilings measured in the same process: copy TB/s 4.25.\n\n#### Decode attention")
    assert "|---|---|---|---:|" in md and "| V4-Pro | CSA | 4K | 128 | 134.5 | 125.8 | **0.94x** | 287 | 37 |" in md


def test_humming_w4a8_needs_vllms_quantizer():
    from dsv4.bench.incumbents import HummingW4A8

    if hasattr(torch.ops._C, "per_token_group_fp8_quant"):
        pytest.skip("vLLM's kernel library is loaded in this process")
    with pytest.raises(RuntimeError, match="per_token_group_fp8_quant.*vllm_c"):
        HummingW4A8({}, 256, 10.0)


def test_moe_incumbent_missing_names_what_each_case_needs():
    from dsv4.bench.incumbents import MOE_INCUMBENTS, moe_incumbent_missing

    assert MOE_INCUMBENTS == {("nvfp4", "bf16"): "Humming W4A16", ("mxfp4", "fp8"): "Humming W4A8",
                              ("mxfp4", "bf16"): "Humming W4A8"}
    everything = A.Anchors(flashmla=True, humming=object(), moe_c=True, vllm_c=True, vllm_py="/x/vllm")
    for ep in (True, False):
        assert moe_incumbent_missing(everything, ("nvfp4", "bf16"), ep=ep) is None
        assert moe_incumbent_missing(everything, ("mxfp4", "fp8"), ep=ep) is None
    no_c = A.Anchors(missing={"vllm_c": "not in .anchors"})
    assert moe_incumbent_missing(no_c, ("nvfp4", "bf16")) is None  # W4A16 does not need it
    assert moe_incumbent_missing(no_c, ("mxfp4", "fp8")) == "vllm_c: not in .anchors"
    neither = A.Anchors(missing={"humming": "h", "vllm_c": "c"})
    assert moe_incumbent_missing(neither, ("mxfp4", "fp8")) == "humming: h; vllm_c: c"
    assert moe_incumbent_missing(no_c, ("mxfp4", "bf16")) == "vllm_c: not in .anchors"  # Humming W4A8 too
    assert "no incumbent" in moe_incumbent_missing(everything, ("nvfp4", "nvfp4"))
    # vLLM's routing / permute kernels for every Humming case; its Python weighted sum only
    # without expert parallelism (the indexed apply)
    no_moe_c = A.Anchors(missing={"moe_c": "m"})
    assert moe_incumbent_missing(no_moe_c, ("nvfp4", "bf16")) == "moe_c: m"
    no_py = A.Anchors(missing={"vllm_py": "p"})
    assert moe_incumbent_missing(no_py, ("mxfp4", "fp8"), ep=True) is None
    assert moe_incumbent_missing(no_py, ("mxfp4", "fp8"), ep=False) == "vllm_py: p"


def test_vllm_python_anchor_is_a_whole_tree_of_the_right_version(no_env, tmp_path, monkeypatch):
    """A folder with vllm/__init__.py and a manifest naming vLLM 0.33.0 is the vllm_py
    anchor; vllm_module loads one of its modules by path without running the package's
    __init__; another version or no tree is reported."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # find_anchors appends the folder
    monkeypatch.setattr(sys, "modules", dict(sys.modules))  # vllm_module registers what it loads
    site = tmp_path / "site"
    (site / "vllm" / "sub").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("raise ImportError('the package __init__ must not run')\n")
    (site / "vllm" / "sub" / "mod.py").write_text("import math\nVALUE = math.sqrt(49)\n")
    A.write_manifest(str(site), {"vllm": A.VLLM_VERSION}, [])
    a = A.find_anchors([str(site)], load=False)
    assert a.vllm_py == str(site / "vllm") and "vllm_py" not in a.missing
    mod = A.vllm_module(a, "sub/mod.py", "_dsv4_test_vllm_sub_mod")
    assert mod.VALUE == 7.0 and A.vllm_module(a, "sub/mod.py", "_dsv4_test_vllm_sub_mod") is mod
    with pytest.raises(RuntimeError, match="loading vLLM's .*nope.py failed"):
        A.vllm_module(a, "sub/nope.py", "_dsv4_test_vllm_sub_nope")
    A.write_manifest(str(site), {"vllm": "0.1.0"}, [])
    b = A.find_anchors([str(site)], load=False)
    if A._installed_version("vllm") != A.VLLM_VERSION:
        assert b.vllm_py is None and "names vllm 0.1.0" in b.missing["vllm_py"]
        with pytest.raises(RuntimeError, match="vLLM's Python package is needed"):
            A.vllm_module(b, "sub/mod.py", "_dsv4_test_vllm_other")


# --------------------------------------------------------------------------------------
# the moe routine
# --------------------------------------------------------------------------------------


def test_moe_vs_vllm_passes_the_formats_to_compare(rich_extra, no_env, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # compare lists the cases, times nothing
    base = ["moe", "--vs", "vllm", "--models", "flash", "--decode", "1", "--prefill", ""]
    assert cli.main(base) == 0
    out = capsys.readouterr().out
    assert "V4-Flash local-32 NVFP4 W4A16 M=1" in out and "V4-Flash local-32 MXFP4 W4A8 M=1" in out
    assert "2 cases listed" in out  # --prefill '' adds none
    assert cli.main(base + ["--moe-format", "mxfp4-w4a8"]) == 0
    out = capsys.readouterr().out
    assert "MXFP4 W4A8 M=1" in out and "NVFP4" not in out
    assert "MoE experts: codes" in out  # compare's default
    assert cli.main(base + ["--moe-weights", "quantized"]) == 0
    assert "MoE experts: quantized" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--moe-format", "mxfp4-w4a8", "--activation", "nvfp4"],
                                  ["--moe-format", "nvfp4,fp8"], ["--variants", "sk=2"], ["--variants", "bn=48"],
                                  ["--decode", "1,x"], ["--moe-weights", "normal"],
                                  ["--models", "flash,v5"]])
def test_moe_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["moe", *argv])
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_moe_table_with_fake_numbers():
    from dsv4.bench.report import to_markdown
    from dsv4.bench.routines.moe import table

    row = dict(model="V4-Flash local-32", M=64, experts="NVFP4 W4A16", variant="", cta="auto", us=120.0,
               graph_us=105.6, tbps=3.52, pct_copy=82.0, tflops=5.0, pct_gemm=1.0, base_us=600.0, base_tbps=1.2,
               speedup=5.68, speedup_eager=5.0, two_vs_one=None)
    md = to_markdown([table([row], 4.28, 790.0)])
    assert "| V4-Flash local-32 | 64 | NVFP4 W4A16 | default | auto | 120.0 | 105.6 | 3.52 | 82% |" in md


@pytest.mark.parametrize("fmt,act,tol", [("nvfp4", "bf16", 0.02), ("mxfp4", "bf16", 0.02), ("mxfp4", "fp8", 0.1)])
def test_moe_cases_on_the_cpu_reference_path(fmt, act, tol):
    """The moe routine's experts (quantized_experts) prepared by MoeSetup and called by
    dsv4_moe (the CPU kernels are the float32 references) against the bf16 baseline on the
    same dequantized weights: W4A16 within bf16 rounding, W4A8 within its FP8 activation
    rounding (e4m3, up to 2^-4 relative per element at GEMM1's and GEMM2's inputs) and
    visibly above W4A16's difference (the FP8 mode really ran)."""
    w = X.quantized_experts(fmt, 10, 128, 256, "cpu")  # two chunks of the 8-expert builder
    setup = X.MoeSetup.build(w, fmt, [act])
    assert setup.w13_bf16.shape == (10, 256, 256) and setup.w2_bf16.shape == (10, 256, 128)
    assert setup.w13_bf16.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(12, 256, generator=gen).to(torch.bfloat16)
    tw, ids = torch.rand(12, 16, generator=gen).topk(6, dim=1)
    emap = torch.full((16,), -1, dtype=torch.int32)
    emap[:10] = torch.arange(10, dtype=torch.int32)
    s = dict(x=x, ids=ids.to(torch.int32), tw=(tw / tw.sum(1, keepdim=True)).float(), emap=emap)
    out = torch.full((12, 256), float("nan"), dtype=torch.bfloat16)
    X.dsv4_moe(s, fmt, act, setup.weights[act], out, swiglu_limit=10.0, scales=setup.scales)
    ref = X.moe_bf16_baseline(x, s["ids"], s["tw"], emap, setup.w13_bf16, setup.w2_bf16, 10.0).float()
    diff = float((out.float() - ref).abs().max() / ref.abs().max())
    assert diff < tol, diff
    if act == "fp8":
        s16 = X.MoeSetup.build(w, fmt, ["bf16"], bf16=False)
        out16 = torch.empty_like(out)
        X.dsv4_moe(s, fmt, "bf16", s16.weights["bf16"], out16, swiglu_limit=10.0)
        assert float((out.float() - out16.float()).abs().max() / ref.abs().max()) > 0.02


def test_act_scales_are_the_experts_own_when_they_carry_them():
    w = X.quantized_experts("nvfp4", 2, 64, 64, "cpu")
    a13, a2 = X.act_scales(w, "cpu")
    assert a13 is w["w13_input_scale"] and a2 is w["w2_input_scale"]
    a13, a2 = X.act_scales(X.random_experts("nvfp4", 2, 64, 64, "cpu"), "cpu")
    assert float(a13) == pytest.approx(5 / 2688) and float(a2) == pytest.approx(20 / 2688)


# --------------------------------------------------------------------------------------
# the MoE incumbent's whole call (dsv4.bench.incumbents_moe apply), against stub kernels
# --------------------------------------------------------------------------------------


class _Recorder:
    """Stub kernels that record their calls (name, the keyword or positional facts the
    test checks) in the order vLLM's apply launches them."""

    def __init__(self):
        self.calls = []

    def op(self, name):
        def f(*a, **kw):
            self.calls.append((name, a, kw))
            return 16 if name == "moe_permute_sort_workspace_size" else None
        return f


def _stub_humming(monkeypatch, rec, incumbent_cls, *, ep, quantized):
    """A Humming MoE object with stub configs and kernels (no GPU): what apply reads."""
    import types

    from dsv4.bench import incumbents_moe as IM

    fwd = types.ModuleType("humming.forward")

    def humming_forward(cfg, **kw):
        rec.calls.append(("humming_forward", (cfg.name,), kw))

    def may_process_input(cfg, **kw):
        rec.calls.append(("may_process_input", (cfg.name,), kw))
        gs = torch.ones(kw["inputs"].shape[0], 1) if cfg.input_quant_mode.has_group_scale else None
        return kw.get("outputs", kw["inputs"]), gs, None

    fwd.humming_forward, fwd.may_process_input = humming_forward, may_process_input
    hum_mod = types.ModuleType("humming")
    hum_mod.forward = fwd
    monkeypatch.setitem(sys.modules, "humming", hum_mod)
    monkeypatch.setitem(sys.modules, "humming.forward", fwd)
    for name in ("moe_align_block_size", "moe_permute_with_scratch", "moe_prepare_scatter", "moe_unpermute",
                 "moe_permute_sort_workspace_size"):
        monkeypatch.setattr(torch.ops._moe_C, name, rec.op(name), raising=False)
    monkeypatch.setattr(torch.ops._C, "per_token_group_fp8_quant", rec.op("per_token_group_fp8_quant"),
                        raising=False)
    h = object.__new__(incumbent_cls)
    E_global = 64
    h.E, h.N, h.K, h.E_global = (8 if ep else E_global), 128, 256, E_global
    h.ep = ep
    mode = types.SimpleNamespace(has_group_scale=quantized)
    h.cfg = {n: types.SimpleNamespace(name=n, input_quant_mode=mode) for n in ("w13", "w2")}
    h.t = {n: {"weight": torch.zeros(1)} for n in ("w13", "w2")}
    h.locks = torch.zeros(1)
    h.activation = {"activation_type": "binary_split"}
    h.apply_compute_config = "cc"
    # GEMM2's tuned block size differs from GEMM1's: vLLM aligns the routes a second time
    h.apply_tuning = {"w13": [(0, 1 << 30, {"block_shape": [64, 128]})],
                      "w2": [(0, 1 << 30, {"block_shape": [32, 128]})]}
    h.apply_tuning_str = {n: n + "-tuning" for n in ("w13", "w2")}
    h._mul_sum = rec.op("moe_fused_mul_sum")
    h.ue8m0 = True
    return h


@pytest.mark.parametrize("ep", [False, True], ids=["indexed", "grouped"])
@pytest.mark.parametrize("fmt", ["w4a8", "w4a16"])
def test_humming_apply_launches_what_vllms_apply_launches(monkeypatch, ep, fmt):
    """HummingIndexedExperts.apply (no expert parallelism) and HummingGroupedExperts.apply
    (with it) of vLLM 0.33.0, as apply replays them: the kernels in vLLM's order with
    vLLM's routing arguments (checked against stubs; the GPU parity test runs the real ones)."""
    from dsv4.bench.incumbents_moe import HummingW4A8, HummingW4A16

    rec = _Recorder()
    h = _stub_humming(monkeypatch, rec, HummingW4A8 if fmt == "w4a8" else HummingW4A16, ep=ep,
                      quantized=fmt == "w4a8")
    M, k = 5, 6
    ids = torch.randint(0, h.E_global, (M, k), dtype=torch.int32)
    emap = torch.full((h.E_global,), -1, dtype=torch.int32)
    emap[:h.E] = torch.arange(h.E, dtype=torch.int32)
    p = h.apply_plan(ids, emap, anchors=None)
    rec.calls.clear()
    out = h.apply(torch.zeros(M, h.K, dtype=torch.bfloat16), torch.rand(M, k), p)
    assert out is p["out"] and out.shape == (M, h.K)
    names = [c[0] for c in rec.calls]
    quant = ["per_token_group_fp8_quant"] if fmt == "w4a8" else []
    if not ep:
        assert names == quant + ["moe_align_block_size", "moe_align_block_size", "humming_forward",
                                 "may_process_input", "humming_forward", "moe_fused_mul_sum"]
        align = [c for c in rec.calls if c[0] == "moe_align_block_size"]
        # (ids, global experts, block size, ..., expert map None: vLLM has none without EP)
        assert [(a[1], a[2], a[6]) for _, a, _ in align] == [(64, 64, None), (64, 32, None)]
        g1, g2 = [c for c in rec.calls if c[0] == "humming_forward"]
        assert g1[2]["top_k"] == k and g2[2]["top_k"] == 1 and g1[2]["sorted_ids"] is align[0][1][3]
        assert g2[2]["sorted_ids"] is align[1][1][3] and g1[2]["tuning_config"] == "w13-tuning"
        assert rec.calls[-1][2]["expert_map"] is None and rec.calls[-1][2]["outputs"] is p["out"]
    else:
        first = ["moe_permute_with_scratch"] if fmt == "w4a8" else ["moe_prepare_scatter", "may_process_input"]
        assert names == quant + first + ["humming_forward", "may_process_input", "humming_forward", "moe_unpermute"]
        g1, g2 = [c for c in rec.calls if c[0] == "humming_forward"]
        assert g1[2]["expert_layout"] is p["offsets"] and g2[2]["expert_layout"] is p["offsets"]
        assert "sorted_ids" not in g1[2] and g1[2]["inputs"] is p["a1_perm"]
        acts = [c for c in rec.calls if c[0] == "may_process_input"]
        assert acts[-1][2]["num_valid_tokens"].data_ptr() == p["offsets"][-1:].data_ptr()
        if fmt == "w4a16":  # the bf16 input scattered into expert order by Humming's input processing
            assert acts[0][2]["layout"] == "scatter" and acts[0][2]["scatter_idx"] is p["inv"]
        else:  # the FP8 input permuted with its scales (vLLM gathers the scales by torch indexing)
            permute = rec.calls[1]
            assert permute[1][3] is p["emap"] and permute[1][4:7] == (64, 8, k)
            assert g1[2]["input_scale"].shape == (M * k, h.K // 128)
        unperm = rec.calls[-1][1]
        assert unperm[3] is p["offsets"] and unperm[4] == k and unperm[5] is p["out"]


def test_rotation_us_is_the_mean_of_the_per_set_medians():
    """time_us rotates calls over input sets (call i ran set i % n): the time is the mean of
    each set's median, so two sets of different cost give their average, not whichever set
    the middle call belongs to (docs/perf-history/2026-12-06-timer-per-set-medians.md)."""
    from dsv4.bench.timing import rotation_us

    calls = [10.0, 30.0, 11.0, 31.0, 12.0, 29.0]  # set 0: 10, 11, 12; set 1: 30, 31, 29
    assert rotation_us(calls, 2) == pytest.approx((11.0 + 30.0) / 2)
    assert rotation_us(calls, 1) == pytest.approx(20.5)  # one set: the median of all
    assert rotation_us([5.0], 4) == 5.0  # sets no call ran are left out
    with pytest.raises(ValueError, match="dsv4: need timed calls"):
        rotation_us([], 2)


def test_records_are_json_with_one_row_per_line(tmp_path):
    """dsv4.bench.report.dump_record: the same data as json.dump, one top-level key per line
    and each row of ``rows`` on one line (diffs per case; docs/compare/*.json are written so)."""
    from dsv4.bench.report import dump_record

    record = {"commit": "abc1234", "ceilings": {"copy TB/s": 4.25}, "rows": [
        {"case": "a", "dsv4_us": 1.5, "ratio": None}, {"case": "b", "nested": [1, 2], "ok": True}], "empty": []}
    path = tmp_path / "r.json"
    dump_record(record, str(path))
    text = path.read_text()
    assert json.loads(text) == record
    lines = text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}" and text.endswith("}\n")
    assert sum(line.lstrip().startswith('{"case"') for line in lines) == 2
    assert len(lines) == 2 + 1 + 1 + 4 + 1  # braces, commit, ceilings, rows' [ + 2 rows + ], empty


def test_records_of_record_are_written_by_dump_record():
    """docs/compare/*.json as dump_record writes them (so that a rerun diffs per row)."""
    from pathlib import Path

    from dsv4.bench.report import dumps_record

    files = sorted((Path(__file__).resolve().parents[1] / "docs" / "compare").glob("*.json"))
    if not files:
        pytest.skip("no docs/compare in this checkout")
    for f in files:
        assert f.read_text() == dumps_record(json.loads(f.read_text())), f.name
