"""Runs in a fresh interpreter started with multiprocessing's spawn method."""


def worker_main(vllm_config, conn):
    # By the time this runs, multiprocessing has unpickled vllm_config in this
    # new interpreter, before vLLM loaded any plugin (as for vLLM's spawned
    # engine-core and worker processes).
    import sys

    import vllm.plugins

    out = {
        "plugins_loaded_before": vllm.plugins.plugins_loaded,
        "backend": repr(vllm_config.attention_config.backend),
    }
    # as conftest.py does, for this fresh interpreter (a CPU test machine)
    from _stand_ins import stand_in_for_cuda

    stand_in_for_cuda()
    # What vLLM's worker does next (WorkerWrapperBase.init_worker).
    vllm.plugins.load_general_plugins()
    import vllm.models.deepseek_v4.nvidia.model as model

    cls = model._select_dsv4_attn_cls(vllm_config)
    out["attn_cls"] = f"{cls.__module__}.{cls.__qualname__}"
    out["quant_config"] = type(vllm_config.quant_config).__name__
    out["dsv4_plugin_imported"] = "dsv4_plugin" in sys.modules
    conn.send(out)
    conn.close()
