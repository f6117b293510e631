"""vLLM plugin for dsv4 (entry point ``vllm.general_plugins: dsv4``)."""


def register() -> None:
    """Called by vLLM in every process; idempotent. (Adapters arrive with the plugin issue.)"""
