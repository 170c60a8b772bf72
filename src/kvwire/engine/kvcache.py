"""A paged KV cache with prefix caching, as vLLM V1's block pool behaves (pure, no I/O).

``num_blocks`` physical blocks. A block held by a request has a reference count > 0 and is
pinned; a block with count 0 sits in the free queue and can be handed out again. A full
block gets its content hash (see :mod:`.request`) and is then *cached*: a later request
whose prompt starts with the same blocks takes them (``touch``) instead of recomputing.

The free queue is the eviction order. Allocation takes from its head; if the block taken is
cached, it is evicted (``BlockRemoved``). Freed blocks go to the tail if cached (so cached
blocks leave in LRU order) and to the head if not (nothing is lost reusing them first); a
finished request frees its blocks last-first, so a prefix's tail leaves before its root.

Two physical blocks may carry the same hash (two requests computed the same prefix at
once, neither a hit for the other): vLLM caches both and emits ``BlockStored`` for each and
``BlockRemoved`` for each, and so does this model; the stream is exact as a multiset.

An optional CPU tier of ``cpu_blocks`` entries receives each evicted GPU block (a one-block
``BlockStored`` with medium ``CPU``) and drops its own least recently stored one when full
(``BlockRemoved``, medium ``CPU``). It only publishes; lookups read the GPU tier alone.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

from ..wire.events import AllBlocksCleared, BlockRemoved, BlockStored, Event

__all__ = ["PagedPrefixCache"]


def _ints(x: Sequence[int]) -> list[int]:
    return x.tolist() if isinstance(x, array) else list(x)

GPU, CPU = "GPU", "CPU"


class PagedPrefixCache:
    """The block pool: reference counts, the free (eviction) queue, the hash -> blocks map,
    and the events its changes produce (taken by :meth:`take_events`)."""

    def __init__(self, num_blocks: int, block_size: int, cpu_blocks: int = 0,
                 lora_names: Sequence[str] = ()) -> None:
        if num_blocks < 1 or block_size < 1 or cpu_blocks < 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be "
                             f">= 1, cpu_blocks ({cpu_blocks}) >= 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        #: parent hash, token ids and LoRA of each cached block (for the CPU tier's event)
        self._meta: list[tuple[int | None, Sequence[int], int | None] | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, dict[int, None]] = {}  # hash -> physical blocks holding it
        self.cpu_blocks = cpu_blocks
        self.cpu: OrderedDict[int, None] = OrderedDict()
        self.events: list[Event] = []
        self.evictions = 0
        self._lora_names = {i + 1: name for i, name in enumerate(lora_names)}

    # ------------------------------------------------------------------ reading

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, cached or not)."""
        return len(self.free)

    def longest_hit(self, hashes: Sequence[int]) -> list[int]:
        """Physical blocks of the longest cached prefix of ``hashes`` (no state change)."""
        out = []
        cached = self.cached
        for h in hashes:
            blocks = cached.get(h)
            if not blocks:
                break
            out.append(next(iter(blocks)))
        return out

    # ------------------------------------------------------------------ changing

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on hit blocks (pinning them: out of the free queue)."""
        ref, free = self.ref, self.free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the head of the free queue, evicting cached ones; the caller
        checks :attr:`num_free` first (asking for more is a bug: ValueError)."""
        if n > len(self.free):
            raise ValueError(f"cannot allocate {n} blocks: {len(self.free)} free")
        out = []
        free, ref = self.free, self.ref
        for _ in range(n):
            b, _ = free.popitem(last=False)
            if self.hash[b] is not None:
                self._evict(b)
            ref[b] = 1
            out.append(b)
        return out

    def _evict(self, b: int) -> None:
        h = self.hash[b]
        assert h is not None and self.ref[b] == 0, "only a free cached block is evicted"
        holders = self.cached[h]
        del holders[b]
        if not holders:
            del self.cached[h]
        self.hash[b] = None
        meta = self._meta[b]
        self._meta[b] = None
        self.evictions += 1
        self.events.append(BlockRemoved([h], GPU))  # one hash per event, as vLLM emits them
        if self.cpu_blocks and meta is not None:
            self._offload(h, meta)

    def _offload(self, h: int, meta: tuple[int | None, Sequence[int], int | None]) -> None:
        cpu = self.cpu
        if h in cpu:
            cpu.move_to_end(h)
            return
        if len(cpu) >= self.cpu_blocks:
            old, _ = cpu.popitem(last=False)
            self.events.append(BlockRemoved([old], CPU))
        cpu[h] = None
        parent, tokens, lora = meta
        self.events.append(BlockStored([h], parent, _ints(tokens), self.block_size, lora, CPU,
                                       self._lora_names.get(lora)))

    def cache_full(self, blocks: Sequence[int], hashes: Sequence[int], start: int, end: int,
                   tokens: Sequence[int], lora_id: int | None) -> None:
        """Blocks ``start:end`` of a request (``blocks``) just became full: give them their
        hashes and publish them as one ``BlockStored`` (parent: block ``start - 1``'s hash)."""
        if start >= end:
            return
        bs = self.block_size
        keep = self.cpu_blocks > 0
        for i in range(start, end):
            b, h = blocks[i], hashes[i]
            self.hash[b] = h
            self.cached.setdefault(h, {})[b] = None
            if keep:
                self._meta[b] = (hashes[i - 1] if i else None, tokens[i * bs:(i + 1) * bs],
                                 lora_id)
            else:
                self._meta[b] = (hashes[i - 1] if i else None, (), lora_id)
        self.events.append(BlockStored(
            list(hashes[start:end]), hashes[start - 1] if start else None,
            _ints(tokens[start * bs:end * bs]), bs, lora_id, GPU, self._lora_names.get(lora_id),
        ))

    def free_blocks(self, blocks: Sequence[int]) -> None:
        """Drop a request's references, its last block first: cached blocks join the tail
        of the free queue (LRU), uncached ones its head (reused first)."""
        ref, free, hashes = self.ref, self.free, self.hash
        front: list[int] = []
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                if hashes[b] is None:
                    front.append(b)
                else:
                    free[b] = None
        for b in reversed(front):  # front[0] ends up at the head
            free[b] = None
            free.move_to_end(b, last=False)

    def reset(self) -> bool:
        """Forget every cached hash (``AllBlocksCleared``), only when no block is held, as
        vLLM's ``reset_prefix_cache``; False (and nothing done) otherwise. The CPU tier is
        cleared with it: a consumer clears every tier on that event."""
        if len(self.free) != self.num_blocks:
            return False
        self.cached.clear()
        self.hash = [None] * self.num_blocks
        self._meta = [None] * self.num_blocks
        self.cpu.clear()
        self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[Event]:
        """The events since the last call, in order."""
        ev, self.events = self.events, []
        return ev
