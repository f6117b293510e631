"""scripts/gpu_serve_smoke.py's CPU-side parts: the staging a GPU-machine call runs once
(a bug there costs a device call), the configuration list and the comparison."""

import hashlib
import io
import json
import lzma
import os
import sys
import tarfile
import time
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_serve_smoke as smoke  # noqa: E402
import pack_vllm_for_device as pack  # noqa: E402

# The CuTe DSL's .pth line, as nvidia_cutlass_dsl-4.8.0-py3-none-any.whl ships it
DSL_PTH = ("import sys, os, nvidia_cutlass_dsl; "
           "sys.path.insert(0, os.path.join(nvidia_cutlass_dsl.__path__[0], 'dsl_packages'))\n")
DSL_WHEELS = ("nvidia_cutlass_dsl-4.8.0-py3-none-any.whl",
              "nvidia_cutlass_dsl_libs_base-4.8.0-cp312-cp312-manylinux_2_28_x86_64.whl")


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
    # stand-ins of the CuTe DSL's wheels: the .pth (meta wheel) and the namespace-packaged
    # cutlass package under nvidia_cutlass_dsl/dsl_packages (libs-base)
    with zipfile.ZipFile(build / DSL_WHEELS[0], "w") as z:
        z.writestr("nvidia_cutlass_dsl_packages.pth", DSL_PTH)
    with zipfile.ZipFile(build / DSL_WHEELS[1], "w") as z:
        z.writestr("nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py", "STAND_IN = True\n")
    _tar_xz(build / "libs.tar.xz", {"vllm/_C_stable_libtorch.abi3.so": os.urandom(300_000)})
    blob = (build / "libs.tar.xz").read_bytes()
    third = len(blob) // 3 + 1
    chunks = []
    for i in range(3):
        (build / f"libs.tar.xz.part{i:02d}").write_bytes(blob[i * third:(i + 1) * third])
        chunks.append(f"libs.tar.xz.part{i:02d}")
    wheels = ["msgspec-0.23.0-cp312-cp312-manylinux_2_28_x86_64.whl", *DSL_WHEELS]
    calls = [["vtree.tar.xz", *wheels, chunks[0]], [chunks[1]], [chunks[2]]]
    man = {"vllm": "0.33.0", "calls": 3, "wheels": wheels, "lib_chunks": chunks,
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
    assert "[vllm.general_plugins]\ndsv4 = gpu_serve_smoke:vllm_plugin\n" == eps
    assert _stage(dirs[1]) == 0 and not os.path.exists(os.path.join(site, "vllm", "_C_stable_libtorch.abi3.so"))
    assert _stage(dirs[2]) == 0
    assert "python ready, libraries ready" in capsys.readouterr().out
    # the staged tree is an anchor folder of the benchmarks: vLLM's kernel library found there
    from dsv4.bench.anchors import find_anchors

    a = find_anchors([site], load=False)
    assert a.vllm_c and a.sources["vllm_c"] == os.path.join(site, "vllm", "_C_stable_libtorch.abi3.so")
    assert a.vllm_py == os.path.join(site, "vllm")  # and vLLM's Python modules (the MoE incumbent's sum)
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
                                     "first_step_logprob_maxdiff": 0.05, "divergence_margins": []}
    # with every step's top logprobs: the margin of each run's own token over the other's at the divergence
    a["step_logprobs"] = [[{"1": -0.1}, {"2": -0.2}, {"3": -1.0, "9": -1.004}], [{"4": -0.5}, {"5": -1}, {"6": -1}]]
    b["step_logprobs"] = [[{"1": -0.1}, {"2": -0.2}, {"9": -1.001, "3": -1.003}], [{"4": -0.5}, {"5": -1}, {"6": -1}]]
    assert smoke.agreement(a, b)["divergence_margins"] == [
        {"prompt": 0, "step": 2, "tokens": [3, 9], "margin_a": 0.004, "margin_b": 0.002}]
    b["step_logprobs"][0][2] = {"9": -1.0}  # a's token not among b's top logprobs
    assert smoke.agreement(a, b)["divergence_margins"][0]["margin_b"] is None


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
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"  # FlashInfer is not carried
    assert env["VLLM_DEEP_GEMM_WARMUP"] == "skip"  # its JIT warmup took a whole configuration's time on the H200


def test_v41_example_meets_vllm_s_decoder_replay_rule():
    """vLLM's V4.1 CUDA model (vllm/models/deepseek_v41/nvidia/model.py, DeepseekV41Model:
    the decoder SWA bounded replay of eager prefill) asserts that the last KV-source layer
    has compress ratio <= 1 when layers follow it; on the H200 the example's first topology
    (ratios 0, 1, 1, 2, 2, last source layer 3 at ratio 2) failed that assertion at model
    build. The CPU platform never builds the replay, so only this check catches it here.
    Consumers share their source's ratio (vllm/models/deepseek_v41/attention.py: a layer
    reads the latest source at or below it)."""
    cfg = json.load(open(os.path.join(smoke.ROOT, "examples", "dsv41-tiny-nvfp4", "config.json")))["text_config"]
    ratios, sources, n = cfg["compress_ratios"], cfg["kv_source_layer_ids"], cfg["num_hidden_layers"]
    cut = max(sources)
    assert cut == n - 1 or ratios[cut] <= 1, (ratios, sources)
    for layer in range(n):
        if ratios[layer] > 0:
            src = max(s for s in sources if s <= layer)
            assert ratios[src] == ratios[layer], (layer, src, ratios)
    assert {1, 2} <= set(ratios[:n])  # both compressed-cache kinds stay covered


def test_smoke_plugin_patches_before_dsv4_registers(monkeypatch):
    """On the H200, two staged entry points (dsv4's, then the smoke's) ran in that order and
    dsv4's model import failed in the registry subprocess on ``vllm.vllm_flash_attn``: the one
    staged plugin applies the workaround first, then calls dsv4's registration."""
    import types

    calls = []
    monkeypatch.setattr(smoke, "flash_attn_without_kernels", lambda: calls.append("flash_attn"))
    monkeypatch.setitem(sys.modules, "dsv4_plugin", types.SimpleNamespace(register=lambda: calls.append("dsv4")))
    smoke.vllm_plugin()
    assert calls == ["flash_attn", "dsv4"]


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


def test_stage_puts_the_pth_paths_on_every_vllm_process_path(parts, monkeypatch):
    """Python reads .pth files only in site folders, not in PYTHONPATH entries: stage runs
    the staged ones (the CuTe DSL's inserts nvidia_cutlass_dsl/dsl_packages) and child_env
    and the staged vLLM plugin put what they add on the path."""
    dirs, _ = parts
    assert _stage(dirs[0]) == 0
    dsl = os.path.join(smoke.SITE, "nvidia_cutlass_dsl", "dsl_packages")
    assert smoke.site_paths() == [smoke.SITE, dsl]
    env = smoke.child_env()
    path = env["PYTHONPATH"].split(os.pathsep)
    assert path[:2] == [smoke.SITE, dsl] and os.path.join(smoke.ROOT, "scripts") in path
    # a child with that environment (the engine's, the model registry's subprocess) imports cutlass
    import subprocess

    out = subprocess.run([sys.executable, "-c", "import cutlass; print(cutlass.__file__)"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == os.path.join(dsl, "cutlass", "__init__.py")
    # the plugin adds them in a process started without that PYTHONPATH, after the site folder
    monkeypatch.setattr(sys, "path", ["/x", smoke.SITE, "/y"])
    assert smoke.add_site_paths() == [dsl]
    assert sys.path == ["/x", smoke.SITE, dsl, "/y"]
    assert smoke.add_site_paths() == []  # idempotent


def test_site_paths_before_stage_is_the_site_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(smoke, "SITE", str(tmp_path / "site"))
    assert smoke.site_paths() == [str(tmp_path / "site")]


def test_smoke_plugin_adds_the_site_paths_first(monkeypatch):
    import types

    calls = []
    monkeypatch.setattr(smoke, "add_site_paths", lambda: calls.append("paths"))
    monkeypatch.setattr(smoke, "flash_attn_without_kernels", lambda: calls.append("flash_attn"))
    monkeypatch.setitem(sys.modules, "dsv4_plugin", types.SimpleNamespace(register=lambda: calls.append("dsv4")))
    smoke.vllm_plugin()
    assert calls == ["paths", "flash_attn", "dsv4"]


def test_probe_imports_the_cute_dsl_and_the_kernels_vllm_reaches():
    """vLLM imports these lazily (the compressor at the first forward): the probe imports
    them, so a missing piece shows there and costs no engine run."""
    need = {"cutlass", "cutlass.cute", "quack.compile_utils", "cuda.bindings.driver",
            "vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl",
            "vllm.models.deepseek_v4.nvidia.ops.dequant_gather_k_cutedsl",
            "vllm.models.deepseek_v4.nvidia.ops.fused_indexer_q_cutedsl"}
    assert need <= set(smoke.PROBE_MODULES)
    assert len(set(smoke.PROBE_MODULES)) == len(smoke.PROBE_MODULES)
    assert "_SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL" in smoke._PROBE_CHILD  # one of vLLM's, compiled
    assert "cute_dsl_check()" in smoke._PROBE_CHILD and callable(smoke.cute_dsl_check)  # one compiled and run
    assert smoke.child_env()["CUTE_DSL_CACHE_DIR"].startswith(smoke.STAGE)


def test_pack_carries_the_cute_dsl():
    reqs = {r.split("==")[0] for r in pack.EXTRA_WHEELS}
    assert {"nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
            "quack-kernels"} <= reqs
    assert pack.LIB_WHEELS == ("nvidia-cutlass-dsl-libs-cu13==4.8.0",)
    assert not any("cu12" in r for r in pack.EXTRA_WHEELS + pack.LIB_WHEELS)  # the loader takes cu13 alone


MiB = 2**20


@pytest.mark.parametrize("small,libs", [
    (int(38.2e6), int(174.4e6)),   # this pack: vtree + 55 wheels, vLLM's and the CuTe DSL's libraries
    (int(33.0e6), int(110.7e6)),   # before the CuTe DSL
    (10 * MiB, 1 * MiB),           # everything in one call, extension included
    (40 * MiB, 15 * MiB),          # all but the extension fit call 1
    (55 * MiB, 300 * MiB),         # call 1 full of small files
])
def test_layout_keeps_every_call_within_64_mib(small, libs):
    sizes = pack.layout(small, libs)
    assert sum(sizes) == libs and all(n > 0 for n in sizes)
    calls = [small + sizes[0]] + sizes[1:]
    calls[-1] += pack.SO_BUDGET  # the last call carries the dsv4 extension
    assert all(c <= pack.PART_BUDGET for c in calls), [c / MiB for c in calls]
    assert pack.PART_BUDGET + pack.TREE_BUDGET <= 64 * MiB
    # no call fewer would do
    room = len(sizes) * pack.PART_BUDGET - pack.SO_BUDGET
    assert small + libs > room - pack.PART_BUDGET


def test_the_working_tree_fits_its_budget():
    """Each device call carries the working tree besides the parts: tracked files under
    TREE_BUDGET (the .so and .devbuild are ignored, carried only where named)."""
    import subprocess

    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    size = sum(os.path.getsize(os.path.join(ROOT, f)) for f in files.decode().split("\0") if f
               and os.path.exists(os.path.join(ROOT, f)))
    assert size < pack.TREE_BUDGET / 2
    so = os.path.join(ROOT, "dsv4", "_C.abi3.so")  # the lead's build for torch 2.11: 14.3 MB
    assert (os.path.getsize(so) if os.path.exists(so) else 14_312_968) < pack.SO_BUDGET


def test_stage_redoes_what_another_pack_staged(parts, capsys):
    """A machine still warm from another pack's staging: parts of the same names but other
    contents are not taken for this pack's, and the stamps do not claim its unpacking."""
    dirs, _ = parts
    for d in dirs:
        assert _stage(d) == 0
    capsys.readouterr()
    # another pack: same part names, a new wheel set (as when the CuTe DSL was added)
    man = json.loads((dirs[0] / "parts.json").read_text())
    with zipfile.ZipFile(dirs[0] / DSL_WHEELS[1], "w") as z:
        z.writestr("nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py", "STAND_IN = 2\n")
    man["parts"][DSL_WHEELS[1]]["sha256"] = _sha(dirs[0] / DSL_WHEELS[1])
    for d in dirs:
        (d / "parts.json").write_text(json.dumps(man))
    stale = os.path.join(smoke.STAGE, "parts", "libs.tar.xz.part02")
    with open(stale, "wb") as f:
        f.write(b"another pack's chunk")
    assert _stage(dirs[1]) == 0  # call 2 again: the stale chunk 2 does not count
    out = capsys.readouterr().out
    assert "still to carry: calls [1, 3]" in out and "python not ready, libraries not ready" in out
    assert _stage(dirs[0]) == 0 and _stage(dirs[2]) == 0
    assert "python ready, libraries ready" in capsys.readouterr().out
    cutlass = os.path.join(smoke.SITE, "nvidia_cutlass_dsl", "dsl_packages", "cutlass", "__init__.py")
    assert open(cutlass).read() == "STAND_IN = 2\n"


@pytest.mark.parametrize("jobs", [1, 2])
def test_run_collects_every_configuration_in_order(tmp_path, monkeypatch, capsys, jobs):
    """cmd_run with the engine stubbed: each configuration's result lands under its name, in
    configs() order whatever the order they finish in (--jobs 2 runs two at once), the
    comparisons pair dsv4 with FlashMLA, and a crash without a result line is reported."""
    import threading
    import types

    names = [c["name"] for c in smoke.configs()]
    running, peak, lock = [0], [0], threading.Lock()

    def fake_run_config(c, args, left):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05 if c["name"].endswith("eager") else 0.01)
        with lock:
            running[0] -= 1
        if c["name"] == "v41-dsv4-graphs":
            return {"name": c["name"], "stage": "crashed", "error": "boom", "wall_s": 0.0}, "", "boom"
        steps = [[{"5": -1.0, "6": -1.2}] * 2] * 3
        r = {"name": c["name"], "stage": "done", "tokens": [[5, 5]] * 3, "step_logprobs": steps,
             "first_logprobs": [st[0] for st in steps], "wall_s": 0.0}
        return r, "SMOKE_JSON " + json.dumps(r), ""

    monkeypatch.setattr(smoke, "_run_config", fake_run_config)
    args = types.SimpleNamespace(out=str(tmp_path), only="", budget=600, per_config=100, no_compile=False, jobs=jobs)
    smoke.cmd_run(args)
    data = json.load(open(tmp_path / "serve_smoke.json"))
    assert list(data["results"]) == names
    assert data["results"]["v41-dsv4-graphs"]["stage"] == "crashed"
    assert data["comparisons"]["v4: dsv4-eager vs flashmla-eager"]["same_tokens"] == 1.0
    assert "v41: dsv4-graphs vs flashmla-graphs" not in data["comparisons"]
    assert peak[0] == jobs
    assert "FAILED at crashed: boom" in capsys.readouterr().out


def test_run_retries_alone_what_the_shared_gpu_broke(tmp_path, monkeypatch, capsys):
    """With --jobs 2 an engine that fails at start from the other engine's memory traffic
    (SHARED_GPU_ERRORS: seen on an H100, 2026-12-05) runs again alone after the others, its
    first error kept; any other failure is final, and with --jobs 1 nothing is retried."""
    import types

    calls = []

    def fake_run_config(c, args, left):
        calls.append(c["name"])
        first = calls.count(c["name"]) == 1
        if c["name"] == "v4-flashmla-eager" and first:
            err = "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"
            return {"name": c["name"], "stage": "engine", "error": err, "wall_s": 0.0}, "", ""
        if c["name"] == "v41-flashmla-eager":  # the same words at another stage: its own failure
            return {"name": c["name"], "stage": "generate", "error": "Error in memory profiling", "wall_s": 0.0}, "", ""
        steps = [[{"5": -1.0}] * 2] * 3
        r = {"name": c["name"], "stage": "done", "tokens": [[5, 5]] * 3, "step_logprobs": steps,
             "first_logprobs": [st[0] for st in steps], "wall_s": 0.0}
        return r, "", ""

    monkeypatch.setattr(smoke, "_run_config", fake_run_config)
    only = "v4-dsv4-eager,v4-flashmla-eager,v41-flashmla-eager"
    args = types.SimpleNamespace(out=str(tmp_path), only=only, budget=600, per_config=100, no_compile=False, jobs=2)
    assert smoke.cmd_run(args) == 1  # v41-flashmla-eager failed for good
    assert calls.count("v4-flashmla-eager") == 2 and calls[-1] == "v4-flashmla-eager"
    assert calls.count("v41-flashmla-eager") == 1
    data = json.load(open(tmp_path / "serve_smoke.json"))
    assert list(data["results"]) == only.split(",")
    r = data["results"]["v4-flashmla-eager"]
    assert r["stage"] == "done" and "No available memory" in r["shared_gpu_error"]
    assert "run again alone at the end" in capsys.readouterr().out
    calls.clear()
    args.jobs = 1
    smoke.cmd_run(args)
    assert calls.count("v4-flashmla-eager") == 1
    assert json.load(open(tmp_path / "serve_smoke.json"))["results"]["v4-flashmla-eager"]["stage"] == "engine"
