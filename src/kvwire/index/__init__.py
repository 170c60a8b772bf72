"""The prefix index: which stream (engine x DP rank) holds which prompt prefix, and in which
tier, kept current by the subscriber's deliveries (see docs/prefix-index.md); and the block cache
(:mod:`.cache`), an engine's cache rebuilt from its events.

The names below load on first use (``from kvwire.index import PrefixIndex`` works as
always): the publisher imports :mod:`.cache` alone, and importing this package for it must
not load the index with it.
"""

TYPE_CHECKING = False  # as in kvwire/__init__.py: importing typing would cost more

#: name -> the module of this package that defines it
_NAMES = {
    "block_keys": "keys", "root_seed": "keys", "DEFAULT_TIER_ALIASES": "prefix",
    "DEFAULT_TIER_CREDITS": "prefix", "PrefixIndex": "prefix", "StreamIndexStats": "prefix",
    "StreamMatch": "prefix",
}

__all__ = [
    "DEFAULT_TIER_ALIASES", "DEFAULT_TIER_CREDITS", "PrefixIndex", "StreamIndexStats",
    "StreamMatch", "block_keys", "root_seed",
]

if TYPE_CHECKING:
    from typing import Any

    from .keys import block_keys, root_seed
    from .prefix import (
        DEFAULT_TIER_ALIASES,
        DEFAULT_TIER_CREDITS,
        PrefixIndex,
        StreamIndexStats,
        StreamMatch,
    )


def __getattr__(name: str) -> "Any":
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
