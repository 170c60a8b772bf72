"""Deprecated path: kvwire.proxy.decisions (the router's rooms are proxy/, indexer/ and serve/ now); this name
goes in the next release."""

from .._moved import moved

__getattr__ = moved(__name__, "kvwire.proxy.decisions")
