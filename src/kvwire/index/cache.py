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

from ..wire.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEventBatch

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
            and ev.cache_salt is None and ev.rfc1527 is None
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
            rfc1527=_rfc_from(ev.rfc1527, i),
        )

    def record(self) -> tuple[Any, ...]:
        """A plain comparable value of everything known about the block."""
        e = self.as_event()
        return (
            e.parent_block_hash, tuple(e.token_ids), e.block_size, e.lora_id, e.lora_name,
            medium_key(e.medium),
        )


def chain_events(
    records: list[tuple[BlockHash, BlockStored]],
    positions: dict[int, dict[BlockHash, int]] | None = None,
) -> list[BlockStored]:
    """``(hash, event)`` records (see :meth:`BlockCache.raw_copy`) as few ``BlockStored``
    events as possible.

    Blocks a single event stored together sit next to each other in the cache (insertion
    order), so runs of consecutive blocks of one event go back out as one chain: a
    snapshot of long prompts costs about as much as replaying the batches that built it.
    ``positions`` caches each event's hash -> index map across calls (one snapshot sent in
    chunks passes the same dict to every chunk).
    """
    if positions is None:
        positions = {}
    out: list[BlockStored] = []
    i, n = 0, len(records)
    while i < n:
        h, ev = records[i]
        hs = ev.block_hashes
        size = len(hs)
        if size == 1:
            start = 0
        else:
            pos = positions.get(id(ev))
            if pos is None:
                pos = positions[id(ev)] = {x: k for k, x in enumerate(hs)}
            start = pos[h]
        # The run goes on while the next record is the next block of the same event.
        j, end = i + 1, start + 1
        while j < n and end < size:
            h2, ev2 = records[j]
            if ev2 is not ev or hs[end] != h2:
                break
            j += 1
            end += 1
        out.append(ev if start == 0 and end == size else _sub_chain(ev, start, end))
        i = j
    return out


def _indexed(records: list[tuple[BlockHash, BlockStored]],
             positions: dict[int, dict[BlockHash, int]]) -> list[tuple[BlockStored, int]]:
    """``(event, index of the block in the event)`` for each ``(hash, event)`` record."""
    out = []
    for h, ev in records:
        hs = ev.block_hashes
        if len(hs) == 1:
            out.append((ev, 0))
            continue
        pos = positions.get(id(ev))
        if pos is None:
            pos = positions[id(ev)] = {x: k for k, x in enumerate(hs)}
        out.append((ev, pos[h]))
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
        rfc1527=_rfc_from(ev.rfc1527, start),
    )


def _rfc_from(rfc: Any, k: int) -> Any:
    """An event's rfc1527 fields for its blocks from the ``k``-th on: their depth moves."""
    if rfc is None or not k or rfc.base_block_idx is None:
        return rfc
    return msgspec.structs.replace(rfc, base_block_idx=rfc.base_block_idx + k)


def _slice(per_block: list[Any] | None, start: int, end: int, n: int) -> list[Any] | None:
    if per_block is None or len(per_block) != n:
        return None
    return per_block[start:end]


def _nth(per_block: list[Any] | None, i: int, n: int) -> list[Any] | None:
    if per_block is None or len(per_block) != n:
        return per_block if per_block is None else None
    return [per_block[i]]


class BlockCache:
    """Live blocks keyed by ``(tier, hash)``; bounded by the engine's own cache size.

    Stored as one dict per tier, ``{hash: the BlockStored event that stored it}``: applying
    a batch allocates nothing (no key or value tuples), which keeps the publisher's sender
    thread cheap and the garbage collector quiet. A block's index in its event is looked up
    only when it is read (snapshots, comparisons).
    """

    __slots__ = ("_tiers",)

    def __init__(self) -> None:
        self._tiers: dict[str, dict[BlockHash, BlockStored]] = {}

    def __len__(self) -> int:
        return sum(len(d) for d in self._tiers.values())

    def __contains__(self, key: tuple[str, BlockHash]) -> bool:
        d = self._tiers.get(key[0])
        return d is not None and key[1] in d

    def apply(self, batch: KVEventBatch) -> None:
        """Apply one batch's events in order."""
        self.apply_events(batch.events)

    def apply_events(self, events: Iterable[Any]) -> None:
        """Apply events in order; events of other kinds are skipped."""
        it = iter(events)
        while self.apply_known(it) is not None:
            pass

    def apply_known(self, events: Iterable[Any]) -> Any:
        """Apply kvwire's own events in order; stop at the first other one and return it
        (None when all were applied). Given an iterator, it resumes after that event on the
        next call. The publisher's snapshot model runs this per batch: no allocation."""
        tiers = self._tiers
        for ev in events:
            t = type(ev)
            if t is BlockStored:
                m = "GPU" if ev.medium is None else ev.medium
                d = tiers.get(m)
                if d is None:
                    d = tiers[m] = {}
                for h in ev.block_hashes:
                    d[h] = ev
            elif t is BlockRemoved:
                d = tiers.get("GPU" if ev.medium is None else ev.medium)
                if d:
                    pop = d.pop
                    for h in ev.block_hashes:
                        pop(h, None)
            elif t is AllBlocksCleared:
                tiers.clear()
            else:
                return ev
        return None

    def clear(self) -> None:
        self._tiers.clear()

    def raw_copy(self) -> list[tuple[BlockHash, BlockStored]]:
        """Every live block as ``(hash, event)``, oldest stored first within each tier.

        A C-level copy per tier (tens of milliseconds for 1M blocks), so a snapshot can be
        taken on a thread that also serves live traffic; :func:`chain_events` turns slices
        of it into events. Exact when taken on the thread that applies (the publisher's)."""
        out: list[tuple[BlockHash, BlockStored]] = []
        for d in list(self._tiers.values()):
            out += d.items()
        return out

    def blocks(self) -> list[CachedBlock]:
        """A point-in-time copy of the live blocks, oldest stored first within each tier."""
        return [CachedBlock(v) for v in _indexed(self.raw_copy(), {})]

    def items(self) -> Iterator[tuple[tuple[str, BlockHash], CachedBlock]]:
        positions: dict[int, dict[BlockHash, int]] = {}
        for m, d in list(self._tiers.items()):
            records = list(d.items())
            for (h, _), v in zip(records, _indexed(records, positions)):
                yield (m, h), CachedBlock(v)

    def as_dict(self) -> dict[tuple[str, BlockHash], tuple[Any, ...]]:
        """Comparable view: ``{(tier, hash): (parent, tokens, block_size, lora_id, lora_name, tier)}``."""
        return {k: v.record() for k, v in self.items()}
