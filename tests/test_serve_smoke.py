"""scripts/gpu_serve_smoke.py's CPU-side parts: the staging a GPU-machine call runs once
(a bug there costs a device call), the configuration list and the comparison."""

import hashlib
import io
import json
import lzma
import os
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_serve_smoke as smoke  # noqa: E402


def _tar_xz(path, files):
    with lzma.open(path, "wb") as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """Three calls' folders as pack_vllm_for_device.py lays them out, on tiny stand-in files."""
    monkeypatch.setattr(smoke, "STAGE", str(tmp_path / "stage"))
    monkeypatch.setattr(smoke, "SITE", str(tmp_path / "stage" / "site"))
    monkeypatch.setattr(smoke, "_installed", lambda wheel: False)  # as on the GPU machine's image
    build = tmp_path / "build"
    build.mkdir()
    _tar_xz(build / "vtree.tar.xz", {"vllm/__init__.py": b"X = 1\n", "vllm-0.33.0.dist-info/METADATA": b"m\n"})
    with zipfile.ZipFile(build / "msgspec-0.23.0-cp312-cp312-manylinux_2_28_x86_64.whl", "w") as z:
        z.writestr("msgspec/__init__.py", "Y = 2\n")
    _tar_xz(build / "libs.tar.xz", {"vllm/_C_stable_libtorch.abi3.so": os.urandom(300_000)})
    blob = (build / "libs.tar.xz").read_bytes()
    third = len(blob) // 3 + 1
    chunks = []
    for i in range(3):
        (build / f"libs.tar.xz.part{i:02d}").write_bytes(blob[i * third:(i + 1) * third])
        chunks.append(f"libs.tar.xz.part{i:02d}")
    wheel = "msgspec-0.23.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    calls = [["vtree.tar.xz", wheel, chunks[0]], [chunks[1]], [chunks[2]]]
    man = {"vllm": "0.33.0", "calls": 3, "wheels": [wheel], "lib_chunks": chunks,
           "parts": {n: {"sha256": _sha(build / n), "call": k + 1} for k, c in enumerate(calls) for n in c}}
    dirs = []
    for k, c in enumerate(calls):
        d = tmp_path / f"p{k + 1}"
        d.mkdir()
        for n in c:
            (d / n).write_bytes((build / n).read_bytes())
        (d / "parts.json").write_text(json.dumps(man))
        dirs.append(d)
    return dirs, blob


def _stage(d):
    return smoke.main(["stage", str(d)])


def test_stage_unpacks_python_after_call_1_and_libraries_after_the_last(parts, capsys):
    dirs, blob = parts
    site = smoke.SITE
    assert _stage(dirs[0]) == 0
    out = capsys.readouterr().out
    assert "still to carry: calls [2, 3]" in out and "python ready, libraries not ready" in out
    assert open(os.path.join(site, "vllm", "__init__.py")).read() == "X = 1\n"
    assert os.path.exists(os.path.join(site, "msgspec", "__init__.py"))
    eps = open(os.path.join(site, "dsv4-0.0.0+smoke.dist-info", "entry_points.txt")).read()
    assert "[vllm.general_plugins]\ndsv4 = dsv4_plugin:register\ndsv4_smoke = gpu_serve_smoke:vllm_plugin" in eps
    assert _stage(dirs[1]) == 0 and not os.path.exists(os.path.join(site, "vllm", "_C_stable_libtorch.abi3.so"))
    assert _stage(dirs[2]) == 0
    assert "python ready, libraries ready" in capsys.readouterr().out
    # the staged tree is an anchor folder of the benchmarks: vLLM's kernel library found there
    from dsv4.bench.anchors import find_anchors

    a = find_anchors([site], load=False)
    assert a.vllm_c and a.sources["vllm_c"] == os.path.join(site, "vllm", "_C_stable_libtorch.abi3.so")
    lib = os.path.join(site, "vllm", "_C_stable_libtorch.abi3.so")
    assert os.path.getsize(lib) == 300_000
    assert _stage(dirs[2]) == 0  # again: idempotent, nothing re-unpacked
    assert os.path.exists(lib)


def test_stage_refuses_a_corrupt_part(parts, capsys):
    dirs, _ = parts
    (dirs[1] / "libs.tar.xz.part01").write_bytes(b"garbage")
    assert _stage(dirs[1]) == 1
    assert "corrupt" in capsys.readouterr().out


def test_configurations_eager_first_vllm_moe_last():
    names = [c["name"] for c in smoke.configs()]
    assert len(names) == len(set(names)) == 12
    assert names[:2] == ["v4-dsv4-eager", "v4-flashmla-eager"]
    assert names[-4:] == ["v4-dsv4-eager-vllmmoe", "v41-dsv4-eager-vllmmoe", "v4mx-dsv4-eager-dsv4moe",
                          "v4mx-dsv4-eager-vllmmoe"]
    backends = {c["backend"] for c in smoke.configs()}
    assert backends == {"dsv4", "FLASHMLA_SPARSE_DSV4", "FLASHMLA_SPARSE_DSV41"}
    for c in smoke.configs():
        assert smoke._compilation(c["graphs"], False) == (
            {"cudagraph_capture_sizes": [1, 2, 4]} if c["graphs"] else None)


def test_agreement():
    a = {"tokens": [[1, 2, 3], [4, 5, 6]], "first_logprobs": [{"1": -0.1, "7": -2.0}, {"4": -0.5}]}
    b = {"tokens": [[1, 2, 9], [4, 5, 6]], "first_logprobs": [{"1": -0.12, "8": -2.0}, {"4": -0.45}]}
    assert smoke.agreement(a, b) == {"same_tokens": 0.833, "first_divergence": [2, None],
                                     "first_step_logprob_maxdiff": 0.05}


def test_stage_keeps_the_image_s_own_distributions(parts, capsys, monkeypatch):
    """A wheel whose distribution the machine's Python already has is not unpacked: the
    carried copy would shadow the one the image's packages were built with."""
    dirs, _ = parts
    monkeypatch.setattr(smoke, "_installed", lambda wheel: wheel.startswith("msgspec-"))
    assert _stage(dirs[0]) == 0
    assert "the image already has ['msgspec']" in capsys.readouterr().out
    assert not os.path.exists(os.path.join(smoke.SITE, "msgspec"))


def test_every_vllm_process_gets_the_smoke_plugin():
    """The registry's inspection subprocess imports the model without the engine's patches:
    the staged entry point and the children's path must reach gpu_serve_smoke.vllm_plugin."""
    env = smoke.child_env()
    assert os.path.join(smoke.ROOT, "scripts") in env["PYTHONPATH"].split(os.pathsep)
    assert callable(smoke.vllm_plugin)


def test_mxfp4_example_is_the_v4_example_without_moe_quant_algo(tmp_path, monkeypatch):
    """DeepSeek's native checkpoints: expert_dtype fp4 and no moe_quant_algo (vLLM then
    builds its Mxfp4MoEMethod; tests/plugin/test_mxfp4_plugin.py), all else the V4 example."""
    monkeypatch.setitem(smoke.EXAMPLES, "v4mx", str(tmp_path / "mx"))
    path = smoke.example_dir("v4mx")
    mx = json.load(open(os.path.join(path, "config.json")))
    v4 = json.load(open(os.path.join(smoke.EXAMPLES["v4"], "config.json")))
    assert "moe_quant_algo" in v4["quantization_config"] and mx["expert_dtype"] == "fp4"
    v4["quantization_config"].pop("moe_quant_algo")
    assert mx == v4
    assert smoke.example_dir("v4") == smoke.EXAMPLES["v4"]
