"""CPU tests of the benchmark package (dsv4.bench): the incumbents' finder degrades
cleanly, the fetch script's extraction, the input builder's shapes and strides against
what FlashMLA's interface documents, the comparison CLI's dry run."""

from __future__ import annotations

import json
import os
import stat
import zipfile

import pytest
import torch

from dsv4 import formats
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
        assert set(a.missing) >= {"flashmla", "moe_c"}
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
                {f: b"x" * 10 for f in A.FLASHMLA_FILES + A.MOE_C_FILES})
    _fake_wheel(wheels / f"humming_kernels-{A.HUMMING_VERSION}-cp310-abi3-manylinux_2_28_x86_64.whl",
                {"humming/__init__.py": b"", "humming/forward.py": b"y" * 3})
    taken = A.fetch(str(tmp_path / "a"), moe_c_dest=str(tmp_path / "m"), wheel_dir=str(wheels))
    assert {(os.path.basename(d), n) for d, n, _ in taken} >= {("a", A.FLASHMLA_FILES[0]), ("m", A.MOE_C_FILES[0]),
                                                              ("a", "humming/forward.py")}
    man = json.loads((tmp_path / "a" / A.MANIFEST).read_text())
    assert man["versions"] == {"vllm": A.VLLM_VERSION, "humming-kernels": A.HUMMING_VERSION}
    assert not (tmp_path / "a" / A.MOE_C_FILES[0]).exists()  # the 46 MB library goes to its own folder
    assert A.find_anchors([str(tmp_path / "a")], load=False).sources.get("flashmla")
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
    assert "V4-Pro CSA 4K B=4" in out and "V4.1-Flash local-48 M=1" in out and "prefill" in out
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
