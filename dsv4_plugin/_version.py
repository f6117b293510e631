"""The one vLLM version this plugin is written and tested against."""

from __future__ import annotations

SUPPORTED_VLLM = "0.33.0"


def installed_vllm_version() -> str | None:
    """vLLM's distribution version, read without importing vllm (None if absent)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def version_problem() -> str | None:
    """None if the installed vLLM is supported, else a one-line explanation."""
    found = installed_vllm_version()
    if found is None:
        return "vllm is not installed (pip install 'dsv4[vllm]')"
    # Local/build suffixes (0.33.0+cu129) ship the same Python sources.
    base = found.split("+", 1)[0]
    if base != SUPPORTED_VLLM:
        return (
            f"vllm {found} is installed but the dsv4 plugin supports only "
            f"vllm=={SUPPORTED_VLLM} (pip install 'dsv4[vllm]'); the DSV4 attention "
            "backend and NVFP4 MoE are NOT registered"
        )
    return None
