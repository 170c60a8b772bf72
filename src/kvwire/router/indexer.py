"""Deprecated path: kvwire.indexer.indexer (the router's rooms are proxy/, indexer/ and serve/ now); this name
goes in the next release."""

from .._moved import moved

__getattr__ = moved(__name__, "kvwire.indexer.indexer")
