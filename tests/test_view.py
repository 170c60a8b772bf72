"""What `kvwire listen` shows and prints, without a terminal."""

from __future__ import annotations

import json

from kvwire.cli.view import COLUMNS, StreamTally, format_batch, record
from kvwire.consume.stream import Batch, Liveness, Reset, Snapshot
from kvwire.index.cache import BlockCache
from kvwire.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def stored(h: int, parent: int | None = None) -> BlockStored:
    return BlockStored([h], parent, list(range(16)), 16, None, "GPU")


def test_tally_counts_blocks_rate_and_heartbeats() -> None:
    t = StreamTally("e0")
    t.add(Batch("e0", 0, KVEventBatch(1.0, [stored(1), BlockRemoved([7, 8], "GPU")])), now=10.0)
    t.add(Batch("e0", 1, KVEventBatch(1.0, [AllBlocksCleared()])), now=11.0)
    t.add(Batch("e0", 2, KVEventBatch(1.0, [])), now=12.0)
    assert (t.stored, t.removed, t.cleared) == (1, 2, 1)
    assert t.rate(now=12.0) == 3 / StreamTally.WINDOW
    assert t.rate(now=100.0) == 0.0  # the window forgets
    row = t.row(None, now=13.0)
    assert len(row) == len(COLUMNS)
    assert row[-2:] == ["1.0s", "1.0s"]  # last message and last heartbeat ages


def test_json_records_rebuild_the_cache() -> None:
    """reset / snapshot / batch records are enough to rebuild an engine's cache."""
    items = [
        Reset("e0", "bootstrap"),
        Snapshot("e0", 4, [stored(1), stored(2, 1)], epoch=9),
        Batch("e0", 5, KVEventBatch(1.0, [BlockRemoved([2], "GPU"), stored(3, 1)]), epoch=9),
        Liveness("e0", False, "silent for 3s"),
    ]
    lines = [json.dumps(record(i)) for i in items]
    assert [json.loads(x)["kind"] for x in lines] == ["reset", "snapshot", "batch", "liveness"]
    rebuilt: dict = {}
    for line in lines:
        r = json.loads(line)
        if r["kind"] == "reset":
            rebuilt.clear()
        elif r["kind"] == "snapshot":
            rebuilt = {b["block_hashes"][0]: b for b in r["blocks"]}
        elif r["kind"] == "batch":
            for ev in r["events"]:
                if ev["type"] == "BlockStored":
                    rebuilt.update({h: ev for h in ev["block_hashes"]})
                elif ev["type"] == "BlockRemoved":
                    for h in ev["block_hashes"]:
                        rebuilt.pop(h, None)
    truth = BlockCache()
    truth.apply_events(items[1].blocks)
    truth.apply(items[2].batch)
    assert set(rebuilt) == {h for _, h in truth.as_dict()}


def test_format_batch_is_readable() -> None:
    text = format_batch("e0", 7, KVEventBatch(0.0, [stored(b"\xab" * 32), AllBlocksCleared()], 3))
    assert text.startswith("e0  seq 7  rank 3")
    assert "BlockStored   1 blocks [abababababab..]" in text
    assert "AllBlocksCleared" in text
