"""vLLM plugin for dsv4 (entry point ``vllm.general_plugins: dsv4 = dsv4_plugin:register``).

``register()`` (vLLM calls it in every process: API server, engine core, workers):

1. checks that vllm==0.33.0 is installed; any other version gets one clear log
   line and nothing is registered (``--attention-backend dsv4`` then fails with
   vLLM's "Unknown attention backend" error);
2. registers the attention backend name ``DSV4`` in vLLM's AttentionBackendEnum
   (so ``--attention-backend dsv4`` and ``--attention-config '{"backend": "dsv4"}'``
   parse) and makes that member pickle by name into fresh interpreters;
3. installs the one seam, vLLM's DeepSeek V4 attention-class selection
   (see :mod:`dsv4_plugin.attention`);
4. registers the NVFP4 MoE quantization config (see :mod:`dsv4_plugin.moe`).

Importing this package does not import vLLM.
"""

from __future__ import annotations

import logging

from ._version import SUPPORTED_VLLM, version_problem

__all__ = ["SUPPORTED_VLLM", "register"]

logger = logging.getLogger("dsv4_plugin")

_registered = False
_warned_version = False


def _reduce_dsv4_member(proto=None):
    return (_dsv4_backend, ())


def _dsv4_backend():
    """Unpickling target for AttentionBackendEnum.DSV4 (runs in a fresh interpreter
    before vLLM has loaded any plugin, e.g. a spawned worker receiving VllmConfig)."""
    problem = version_problem()
    if problem:
        raise RuntimeError(f"dsv4 plugin: cannot restore the DSV4 attention backend: {problem}")
    return _register_backend()


def _register_backend():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from ._backend import BACKEND_CLASS_PATH, BACKEND_NAME

    member = AttentionBackendEnum.__members__.get(BACKEND_NAME)
    if member is None:
        register_backend(BACKEND_NAME, BACKEND_CLASS_PATH)
        member = AttentionBackendEnum[BACKEND_NAME]
    # Enum members pickle as "AttentionBackendEnum(<value>)", which a fresh
    # interpreter cannot resolve before this plugin runs (vLLM unpickles the
    # config of a spawned worker before it loads plugins). Pickle our member
    # as a call that registers it first.
    if member.__dict__.get("__reduce_ex__") is not _reduce_dsv4_member:
        member.__reduce_ex__ = _reduce_dsv4_member
    return member


def _platform_has_seam() -> bool:
    from vllm.platforms import current_platform

    return not (current_platform.is_rocm() or current_platform.is_xpu())


def register() -> None:
    """vLLM general-plugin entry point. Idempotent."""
    global _registered, _warned_version
    if _registered:
        return
    problem = version_problem()
    if problem:
        if not _warned_version:
            logger.error("dsv4 plugin disabled: %s", problem)
            _warned_version = True
        return

    _register_backend()
    if _platform_has_seam():
        from .attention import install_attention_seam

        install_attention_seam()  # raises SeamChangedError with a clear message
    else:
        logger.warning(
            "dsv4 plugin: the DSV4 attention backend is NVIDIA-only; not installed on this platform"
        )
    from .moe import register_moe

    register_moe()
    _registered = True
