"""Names shared by the plugin modules (kept free of vLLM imports)."""

BACKEND_NAME = "DSV4"
BACKEND_CLASS_PATH = "dsv4_plugin.attention_v4.DSV4AttentionBackend"
