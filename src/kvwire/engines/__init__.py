"""Deprecated path: the vLLM and SGLang plugins are :mod:`kvwire.plugins` now (``engine``
names the model engine, :mod:`kvwire.engine`); ``kvwire.engines`` and its modules (``vllm``,
``sglang``, ``vllm_shm``) go in the next release. An installation whose entry points still
name ``kvwire.engines.vllm:register`` keeps working through them."""

from .._moved import moved

__getattr__ = moved(__name__, "kvwire.plugins")
