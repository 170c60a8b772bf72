"""The simulator's ``fifo`` engine model (``--engine-model fifo``): an LRU prefix cache that
publishes every store and eviction; the fleet loop (fleet.py) serves its requests one at a
time.

The cache holds ``capacity`` blocks of ``block_tokens`` tokens. Its block hashes are opaque
ids (as real engines' are): engine block ``j`` of a request ends at token ``(j+1)*B``; that
prefix is identified by the Mooncake hash id of the 512-token block holding its last token
plus the offset of that token, so equal ids mean equal prefixes for any block size. Changes
go out through a real :class:`~kvwire.publish.publisher.ZmqEventPublisher` (vLLM dialect),
one batch per committed prefill, exactly like an engine step.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict

from ..publish.publisher import ZmqEventPublisher
from ..wire.events import BlockRemoved, BlockStored, KVEventBatch
from .trace import MOONCAKE_BLOCK_TOKENS, Request, block_tokens

__all__ = ["FifoSim", "engine_keys", "token_range"]


def engine_keys(req: Request, block_size: int) -> list[int]:
    """Opaque block hashes of the request's full ``block_size``-token blocks."""
    mb = MOONCAKE_BLOCK_TOKENS
    ids = req.hash_ids
    n = req.cacheable_tokens // block_size
    if block_size == mb:
        return [h * mb + (mb - 1) for h in ids[:n]]
    keys = []
    for j in range(n):
        last = (j + 1) * block_size - 1
        keys.append(ids[last // mb] * mb + last % mb)
    return keys


def token_range(req: Request, start: int, end: int) -> list[int]:
    """Token ids ``start:end`` of the request's prompt (only the blocks needed are made)."""
    mb = MOONCAKE_BLOCK_TOKENS
    b0, b1 = start // mb, -(-end // mb)
    arr = array("H", b"".join(block_tokens(h) for h in req.hash_ids[b0:b1]))
    off = b0 * mb
    return arr[start - off : end - off].tolist()


class FifoSim:
    """One engine's prefix cache (LRU, prefix-closed) and its event publisher."""

    def __init__(self, name: str, capacity: int, block_size: int,
                 publisher: ZmqEventPublisher | None) -> None:
        if capacity < 1 or block_size < 1:
            raise ValueError(f"capacity ({capacity}) and block_size ({block_size}) must be >= 1")
        self.name = name
        self.capacity = capacity
        self.block_size = block_size
        self.publisher = publisher
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.batches = 0  # batches published; the last one's seq is batches - 1
        self.events = 0
        self.stored = 0
        self.removed = 0

    def prefix_hits(self, keys: list[int]) -> int:
        """Leading blocks of ``keys`` present in the cache now."""
        lru = self.lru
        n = 0
        for k in keys:
            if k not in lru:
                break
            n += 1
        return n

    def commit(self, req: Request, keys: list[int], now: float) -> KVEventBatch | None:
        """The request's prefill completed: its blocks become cached (evicting the least
        recently used), and the changes are published as one batch (also returned; None
        when nothing changed)."""
        keys = keys[: self.capacity]
        lru = self.lru
        new_idx = [i for i, k in enumerate(keys) if k not in lru]
        victims: list[int] = []
        evict = len(lru) + len(new_idx) - self.capacity
        if evict > 0:
            protect = set(keys)
            it = iter(lru)
            while len(victims) < evict:
                k = next(it)
                if k not in protect:
                    victims.append(k)
            for k in victims:
                del lru[k]
        # Parents end up more recent than children, so eviction keeps the cache prefix-closed.
        for k in reversed(keys):
            lru[k] = None
            lru.move_to_end(k)
        events: list = []
        if victims:
            events.append(BlockRemoved(victims, "GPU"))
            self.removed += len(victims)
        bs = self.block_size
        i = 0
        while i < len(new_idx):  # one BlockStored per run of consecutive new blocks
            j = i
            while j + 1 < len(new_idx) and new_idx[j + 1] == new_idx[j] + 1:
                j += 1
            a, b = new_idx[i], new_idx[j] + 1
            events.append(BlockStored(
                keys[a:b], keys[a - 1] if a else None, token_range(req, a * bs, b * bs),
                bs, None, "GPU",
            ))
            self.stored += b - a
            i = j + 1
        if not events:
            return None
        self.events += len(events)
        self.batches += 1
        batch = KVEventBatch(time.time(), events, None)
        if self.publisher is not None:
            self.publisher.publish(batch)
        return batch
