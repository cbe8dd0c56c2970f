"""aotx: a local LLM inference service (device runtime, broker, HTTP gateway)."""

__version__ = "0.1.0"
