"""vLLM plugin for dsv4 (entry point ``vllm.general_plugins: dsv4 = dsv4_plugin:register``).

``register()`` (vLLM calls it in every process: API server, engine core, workers):

1. checks that vllm==0.33.0 is installed; any other version gets one clear log
   line and nothing is registered (``--attention-backend dsv4`` then fails with
   vLLM's "Unknown attention backend" error);
2. on any platform but CUDA, logs one line and registers nothing;
3. registers the attention backend name ``DSV4`` in vLLM's AttentionBackendEnum
   (so ``--attention-backend dsv4`` and ``--attention-config '{"backend": "dsv4"}'``
   parse) and makes that member pickle by name into fresh interpreters;
4. installs the two seams, vLLM's DeepSeek V4 and V4.1 attention-class selection
   (see :mod:`dsv4_plugin.attention`);
5. registers the MoE quantization config (see :mod:`dsv4_plugin.moe`).

Nothing of this changes vLLM's behaviour unless ``--attention-backend dsv4`` is given.

Importing this package does not import vLLM.
"""

from __future__ import annotations

import logging

from ._version import SUPPORTED_VLLM, version_problem

__all__ = ["SUPPORTED_VLLM", "register"]

logger = logging.getLogger("dsv4_plugin")

_registered = False
_warned_version = False
_warned_platform = False


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


def _platform_problem() -> str | None:
    """None on CUDA, else why the plugin stays out (tests stand in for CUDA here)."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return None
    return f"vLLM's platform is {current_platform.device_name!r}, dsv4 serves NVIDIA GPUs only"


def register() -> None:
    """vLLM general-plugin entry point. Idempotent."""
    global _registered, _warned_version, _warned_platform
    if _registered:
        return
    problem = version_problem()
    if problem:
        if not _warned_version:
            logger.error("dsv4 plugin disabled: %s", problem)
            _warned_version = True
        return

    problem = _platform_problem()
    if problem:
        if not _warned_platform:
            logger.info("dsv4 plugin inactive: %s; nothing registered", problem)
            _warned_platform = True
        return  # not marked registered: the platform is checked again next call

    _register_backend()
    from .attention import install_attention_seams

    install_attention_seams()  # a changed seam refuses DSV4 only where it is selected
    from .moe import register_moe

    register_moe()
    _registered = True
