"""The prefix index: which stream (engine x DP rank) holds which prompt prefix, and in which
tier, kept current by the subscriber's deliveries (see docs/prefix-index.md)."""

from .keys import block_keys, root_seed
from .prefix import (
    DEFAULT_TIER_ALIASES,
    DEFAULT_TIER_CREDITS,
    PrefixIndex,
    StreamIndexStats,
    StreamMatch,
)

__all__ = [
    "DEFAULT_TIER_ALIASES", "DEFAULT_TIER_CREDITS", "PrefixIndex", "StreamIndexStats",
    "StreamMatch", "block_keys", "root_seed",
]
