"""kvwire: KV-cache event streams of LLM inference engines."""

__version__ = "0.1.0"
