"""Deprecated path: :mod:`kvwire.plugins.vllm` (the engine plugins are ``kvwire.plugins`` now);
this name goes in the next release."""

from .._moved import moved

__getattr__ = moved(__name__, "kvwire.plugins.vllm")
