"""Integrations with inference engines (vLLM, SGLang), each opt-in; see docs/engines.md."""
