"""What ``kvwire listen`` shows: per-stream live statistics and output records.

Kept apart from the CLI's argument handling so the numbers (rates, block counts, ages)
can be tested without a terminal.
"""

from __future__ import annotations

import time
from collections import deque
from datetime import datetime, timezone
from typing import Any

from ..consume.stream import Batch, Liveness, Reset, Snapshot
from ..consume.subscriber import SubscriberStats
from ..wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    to_jsonable,
)

__all__ = ["StreamTally", "format_batch", "record"]


def counter_text(v: int | None) -> str:
    """A counter, or ``n/a`` where it does not apply (None: e.g. replays of a NATS stream)."""
    return "n/a" if v is None else str(v)


def _short(h: object) -> str:
    if isinstance(h, bytes):
        return h[:6].hex() + ".."
    return str(h)


def _hashes(hs: list[Any]) -> str:
    shown = ", ".join(_short(h) for h in hs[:4])
    return f"[{shown}{', ...' if len(hs) > 4 else ''}]"


def format_batch(stream: str, seq: int, batch: KVEventBatch) -> str:
    """Human-readable lines for one batch."""
    ts = datetime.fromtimestamp(batch.ts, timezone.utc).strftime("%H:%M:%S.%f")[:-3]
    lines = [f"{stream}  seq {seq}  rank {batch.data_parallel_rank}  {ts}Z  "
             f"{len(batch.events)} events"]
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            lora = f"  lora {ev.lora_name or ev.lora_id}" if ev.lora_id or ev.lora_name else ""
            lines.append(
                f"  BlockStored   {len(ev.block_hashes)} blocks {_hashes(ev.block_hashes)} "
                f"parent {_short(ev.parent_block_hash)}  {len(ev.token_ids)} tokens  "
                f"block_size {ev.block_size}  medium {ev.medium}{lora}"
            )
        elif isinstance(ev, BlockRemoved):
            lines.append(
                f"  BlockRemoved  {len(ev.block_hashes)} blocks {_hashes(ev.block_hashes)} "
                f"medium {ev.medium}"
            )
        elif isinstance(ev, AllBlocksCleared):
            lines.append("  AllBlocksCleared")
    return "\n".join(lines)


def record(item: Batch | Reset | Snapshot | Liveness) -> dict[str, Any]:
    """One JSON object per delivered item; ``kind`` tells which.

    Applying them in order (reset: clear; snapshot: replace with ``blocks``; batch: apply
    ``events``) rebuilds every engine's cache from the output alone.
    """
    if isinstance(item, Batch):
        return {"kind": "batch", "stream": item.stream, "seq": item.seq, "epoch": item.epoch,
                **to_jsonable(item.batch)}
    if isinstance(item, Reset):
        return {"kind": "reset", "stream": item.stream, "reason": item.reason,
                "epoch": item.epoch}
    if isinstance(item, Snapshot):
        blocks = to_jsonable(KVEventBatch(0.0, item.blocks))["events"]
        return {"kind": "snapshot", "stream": item.stream, "seq": item.seq, "epoch": item.epoch,
                "exact": item.exact, "blocks": blocks}
    return {"kind": "liveness", "stream": item.stream, "alive": item.alive,
            "reason": item.reason}


class StreamTally:
    """What the view shows of one stream beyond the subscriber's own counters."""

    WINDOW = 5.0

    def __init__(self, name: str) -> None:
        self.name = name
        self.stored = 0
        self.removed = 0
        self.cleared = 0
        self.snapshot_blocks = 0
        self.last_message: float | None = None
        self.last_heartbeat: float | None = None
        self._times: deque[float] = deque()

    def add(self, item: Batch | Reset | Snapshot | Liveness, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if isinstance(item, Batch):
            self.last_message = now
            if not item.batch.events:
                self.last_heartbeat = now
            self._times.append(now)
            for ev in item.batch.events:
                t = type(ev)
                if t is BlockStored:
                    self.stored += len(ev.block_hashes)
                elif t is BlockRemoved:
                    self.removed += len(ev.block_hashes)
                elif t is AllBlocksCleared:
                    self.cleared += 1
        elif isinstance(item, Snapshot):
            self.snapshot_blocks = item.block_count

    def rate(self, now: float | None = None) -> float:
        """Batches per second over the last few seconds."""
        now = time.monotonic() if now is None else now
        while self._times and self._times[0] < now - self.WINDOW:
            self._times.popleft()
        return len(self._times) / self.WINDOW

    def row(self, stats: SubscriberStats | None, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        s = stats.stream if stats is not None else None
        age = "-" if self.last_message is None else f"{now - self.last_message:.1f}s"
        hb = "-" if self.last_heartbeat is None else f"{now - self.last_heartbeat:.1f}s"
        if s is None:
            return [self.name, "-", "-", "-", f"{self.rate(now):.0f}", str(self.stored),
                    str(self.removed), "-", "-", "-", age, hb]
        state = (f"{s.mode}/{s.phase}" + ("" if s.alive else " DEAD")
                 + (" UNCONFIRMED" if s.unconfirmed else ""))
        return [
            self.name, state, "-" if s.last_seq is None else str(s.last_seq),
            f"{s.epoch:016x}" if s.epoch is not None else "-",
            f"{self.rate(now):.0f}", str(self.stored), str(self.removed),
            f"{s.gaps}/{counter_text(s.lost)}", counter_text(s.replays),
            f"{s.resyncs}/{counter_text(s.restarts)}", age, hb,
        ]


COLUMNS = ["stream", "state", "seq", "epoch", "batches/s", "stored", "removed",
           "gaps/lost", "replays", "resyncs/restarts", "last msg", "last heartbeat"]
