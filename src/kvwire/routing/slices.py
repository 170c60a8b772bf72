"""How the router cuts what its subscriber delivers into pieces it applies under one short
lock hold each, so a routing decision never waits behind a long burst or a restarted
engine's whole snapshot (pure: no I/O, no lock)."""

from __future__ import annotations

from ..consume.stream import Batch, Snapshot
from ..wire.events import KVEventBatch

__all__ = ["APPLY_SLICE", "SNAPSHOT_SLICE", "pieces"]

#: Deliveries applied per lock hold, so a route never waits behind a long burst.
APPLY_SLICE = 64
#: Snapshot blocks applied per lock hold (a restart's snapshot can hold a million blocks).
SNAPSHOT_SLICE = 2048


def pieces(items: list) -> list[list]:
    """Deliveries cut into pieces of at most ``APPLY_SLICE`` deliveries, and so that no piece
    applies more than about ``SNAPSHOT_SLICE`` snapshot blocks: a big Snapshot becomes a
    Snapshot of its first events followed by Batches of the rest (same resulting state), so
    rebuilding an engine never holds the index for long. (A snapshot event can be a chain of
    many blocks, so the cut counts blocks, not events; one event is never split.)"""
    out: list[list] = [[]]
    for it in items:
        if type(it) is not Snapshot or _blocks(it.blocks) <= SNAPSHOT_SLICE:
            if len(out[-1]) >= APPLY_SLICE:
                out.append([])
            out[-1].append(it)
            continue
        first = True
        for chunk in _chunks(it.blocks):
            if first:
                out.append([Snapshot(it.stream, it.seq, chunk, it.epoch, it.exact)])
                first = False
            else:
                out.append([Batch(it.stream, it.seq, KVEventBatch(0.0, chunk, 0), it.epoch)])
        out.append([])
    return [p for p in out if p]


def _blocks(events: list) -> int:
    return sum(len(getattr(e, "block_hashes", ())) or 1 for e in events)


def _chunks(events: list) -> list[list]:
    chunks: list[list] = [[]]
    n = 0
    for e in events:
        k = len(getattr(e, "block_hashes", ())) or 1
        if n and n + k > SNAPSHOT_SLICE:
            chunks.append([])
            n = 0
        chunks[-1].append(e)
        n += k
    return chunks
