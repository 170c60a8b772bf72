"""Deprecated path: the block cache is :mod:`kvwire.index.cache` now (the publisher keeps its
snapshots in one, and the publisher does not depend on the consumer side); this name goes in
the next release."""

from .._moved import moved

__getattr__ = moved(__name__, "kvwire.index.cache",
                    ["BlockCache", "CachedBlock", "chain_events", "medium_key"])
