"""A model of one engine's prefix cache, rebuilt by applying its event batches.

The publisher keeps one to serve snapshots; consumers and tests use it to reconstruct an
engine's cache from a stream. Applying a batch is idempotent per key (the last store or
remove of a block decides), which is what lets a snapshot labelled "as of seq N" that
already contains some effects of N+1 be followed by N+1 again and still be exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

from .events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEventBatch

__all__ = ["BlockCache", "CachedBlock", "chain_events", "medium_key"]


def medium_key(medium: str | None) -> str:
    """Tier used as a key: nil means unspecified, which the engines define as GPU."""
    return "GPU" if medium is None else medium


class CachedBlock(tuple):
    """``(event, index)``: block ``index`` of a ``BlockStored`` event, kept without copying.

    Storing a reference instead of slicing tokens keeps ``apply`` cheap on the engine's
    thread; the per-block view is built only when asked for (snapshots, comparisons).
    """

    __slots__ = ()

    @property
    def event(self) -> BlockStored:
        return self[0]

    @property
    def hash(self) -> BlockHash:
        return self[0].block_hashes[self[1]]

    @property
    def parent(self) -> BlockHash | None:
        ev, i = self
        return ev.block_hashes[i - 1] if i else ev.parent_block_hash

    @property
    def token_ids(self) -> list[int]:
        ev, i = self
        bs = ev.block_size
        return ev.token_ids[i * bs : (i + 1) * bs]

    def as_event(self) -> BlockStored:
        """This block alone, as a one-block ``BlockStored`` (the snapshot record)."""
        ev, i = self
        n = len(ev.block_hashes)
        if n == 1:
            return ev  # already a one-block event (e.g. loaded from a snapshot)
        if (
            ev.extra_keys is None and ev.lookahead_token_ids is None and ev.group_idx is None
            and ev.kv_cache_spec_kind is None and ev.kv_cache_spec_sliding_window is None
            and ev.locality is None and ev.ownership is None and ev.session_id is None
            and ev.cache_salt is None
        ):  # the common case, positional: several times cheaper than keywords
            return BlockStored(
                [ev.block_hashes[i]], self.parent, self.token_ids, ev.block_size, ev.lora_id,
                ev.medium, ev.lora_name,
            )
        return BlockStored(
            [ev.block_hashes[i]],
            self.parent,
            self.token_ids,
            ev.block_size,
            ev.lora_id,
            ev.medium,
            lora_name=ev.lora_name,
            extra_keys=_nth(ev.extra_keys, i, n),
            group_idx=ev.group_idx,
            kv_cache_spec_kind=ev.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=ev.kv_cache_spec_sliding_window,
            locality=ev.locality,
            ownership=ev.ownership,
            session_id=ev.session_id,
            lookahead_token_ids=_nth(ev.lookahead_token_ids, i, n),
            cache_salt=ev.cache_salt,
        )

    def record(self) -> tuple[Any, ...]:
        """A plain comparable value of everything known about the block."""
        e = self.as_event()
        return (
            e.parent_block_hash, tuple(e.token_ids), e.block_size, e.lora_id, e.lora_name,
            medium_key(e.medium),
        )


def chain_events(values: list[tuple[BlockStored, int]]) -> list[BlockStored]:
    """``(event, index)`` records as few ``BlockStored`` events as possible.

    Blocks a single event stored together sit next to each other in the cache (insertion
    order), so runs of consecutive indexes of one event go back out as one chain: a
    snapshot of long prompts costs about as much as replaying the batches that built it.
    """
    out: list[BlockStored] = []
    i, n = 0, len(values)
    while i < n:
        ev, start = values[i]
        j = i + 1
        while j < n and values[j][0] is ev and values[j][1] == start + (j - i):
            j += 1
        end = start + (j - i)  # exclusive
        out.append(ev if start == 0 and end == len(ev.block_hashes)
                   else _sub_chain(ev, start, end))
        i = j
    return out


def _sub_chain(ev: BlockStored, start: int, end: int) -> BlockStored:
    n, bs = len(ev.block_hashes), ev.block_size
    return msgspec.structs.replace(
        ev,
        block_hashes=ev.block_hashes[start:end],
        parent_block_hash=ev.block_hashes[start - 1] if start else ev.parent_block_hash,
        token_ids=ev.token_ids[start * bs : end * bs],
        extra_keys=_slice(ev.extra_keys, start, end, n),
        lookahead_token_ids=_slice(ev.lookahead_token_ids, start, end, n),
    )


def _slice(per_block: list[Any] | None, start: int, end: int, n: int) -> list[Any] | None:
    if per_block is None or len(per_block) != n:
        return None
    return per_block[start:end]


def _nth(per_block: list[Any] | None, i: int, n: int) -> list[Any] | None:
    if per_block is None or len(per_block) != n:
        return per_block if per_block is None else None
    return [per_block[i]]


class BlockCache:
    """Live blocks keyed by ``(tier, hash)``; bounded by the engine's own cache size."""

    __slots__ = ("_blocks",)

    def __init__(self) -> None:
        self._blocks: dict[tuple[str, BlockHash], tuple[BlockStored, int]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: tuple[str, BlockHash]) -> bool:
        return key in self._blocks

    def apply(self, batch: KVEventBatch) -> None:
        """Apply one batch's events in order."""
        self.apply_events(batch.events)

    def apply_events(self, events: Iterable[Any]) -> None:
        # Hot path on the engine thread: plain tuples, no per-block objects.
        blocks = self._blocks
        for ev in events:
            t = type(ev)
            if t is BlockStored:
                m = "GPU" if ev.medium is None else ev.medium
                for i, h in enumerate(ev.block_hashes):
                    blocks[(m, h)] = (ev, i)
            elif t is BlockRemoved:
                m = "GPU" if ev.medium is None else ev.medium
                pop = blocks.pop
                for h in ev.block_hashes:
                    pop((m, h), None)
            elif t is AllBlocksCleared:
                blocks.clear()

    def clear(self) -> None:
        self._blocks.clear()

    def blocks(self) -> list[CachedBlock]:
        """A point-in-time copy of the live blocks, oldest stored first.

        One C-level copy under the GIL: consistent even while another thread applies.
        """
        values = list(self._blocks.values())
        return [CachedBlock(v) for v in values]

    def raw_copy(self) -> list[tuple[BlockStored, int]]:
        """Like :meth:`blocks` without wrapping: one C-level list copy (milliseconds for 1M
        blocks), so a snapshot can be taken on a thread that also serves live traffic."""
        return list(self._blocks.values())

    def items(self) -> Iterator[tuple[tuple[str, BlockHash], CachedBlock]]:
        for k, v in self._blocks.items():
            yield k, CachedBlock(v)

    def as_dict(self) -> dict[tuple[str, BlockHash], tuple[Any, ...]]:
        """Comparable view: ``{(tier, hash): (parent, tokens, block_size, lora_id, lora_name, tier)}``."""
        return {k: CachedBlock(v).record() for k, v in self._blocks.items()}
