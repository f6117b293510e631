"""The DSV4 selection survives pickling into a fresh (spawned) interpreter."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "dsv4-tiny-nvfp4")


def _engine_config():
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=EXAMPLE,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=4096,
        attention_backend="dsv4",
    ).create_engine_config()


def test_vllm_config_round_trips_through_spawn(plugin):
    sys.path.insert(0, os.path.dirname(__file__))
    try:
        from _spawn_child import worker_main
    finally:
        sys.path.pop(0)

    cfg = _engine_config()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=worker_main, args=(cfg, child), daemon=True)
    proc.start()
    child.close()
    try:
        assert parent.poll(600), "spawned interpreter sent nothing within 600 s"
        out = parent.recv()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert out["plugins_loaded_before"] is False
    assert out["backend"].startswith("<AttentionBackendEnum.DSV4:")
    assert out["attn_cls"] == "dsv4_plugin.attention_v4.DSV4FlashMLAAttention"
    assert out["quant_config"] == "DSV4DeepseekV4Config"
    assert out["dsv4_plugin_imported"]
    assert proc.exitcode == 0


def test_backend_member_unpickles_in_a_fresh_interpreter(plugin):
    """Plain pickle (no multiprocessing): a new python process with only vllm and
    the plugin installed resolves the pickled member without loading plugins."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    blob = pickle.dumps(AttentionBackendEnum.DSV4)
    code = (
        "import pickle, sys; m = pickle.loads(sys.stdin.buffer.read()); "
        "import vllm.plugins; assert not vllm.plugins.plugins_loaded; "
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E; "
        "assert m is E.DSV4 and m is E['DSV4']; "
        "assert pickle.loads(pickle.dumps(E.FLASHMLA_SPARSE_DSV4)) is E.FLASHMLA_SPARSE_DSV4; "
        "print('ok')"
    )
    res = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=600)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert res.stdout.decode().strip().endswith("ok")
