"""BlockCache: the prefix-cache model rebuilt from event batches."""

from __future__ import annotations

from kvwire.index.cache import BlockCache, CachedBlock, medium_key
from kvwire.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

D1 = bytes(range(32))
D2 = bytes(range(32, 64))


def stored(hashes, parent=None, bs=2, medium=None, lora_id=None, **kw) -> BlockStored:
    tokens = [h if isinstance(h, int) else h[0] for h in hashes for _ in range(bs)]
    return BlockStored(list(hashes), parent, tokens, bs, lora_id, medium, **kw)


def batch(*events) -> KVEventBatch:
    return KVEventBatch(0.0, list(events), None)


def test_medium_key() -> None:
    assert medium_key(None) == "GPU"
    assert medium_key("CPU") == "CPU"


def test_apply_stores_chain_with_parents_and_tokens() -> None:
    c = BlockCache()
    ev = BlockStored([10, 11, 12], 9, [1, 2, 3, 4, 5, 6], 2, 5, "GPU", lora_name="ad")
    c.apply(batch(ev))
    assert len(c) == 3
    assert c.as_dict() == {
        ("GPU", 10): (9, (1, 2), 2, 5, "ad", "GPU"),
        ("GPU", 11): (10, (3, 4), 2, 5, "ad", "GPU"),
        ("GPU", 12): (11, (5, 6), 2, 5, "ad", "GPU"),
    }
    blocks = c.blocks()
    assert [b.hash for b in blocks] == [10, 11, 12]
    assert [b.parent for b in blocks] == [9, 10, 11]
    assert blocks[1].token_ids == [3, 4]
    assert blocks[0].event is ev


def test_media_are_separate_and_none_means_gpu() -> None:
    c = BlockCache()
    c.apply(batch(stored([1, 2]), stored([1], medium="CPU"), stored([3], medium="GPU")))
    assert set(c.as_dict()) == {("GPU", 1), ("GPU", 2), ("CPU", 1), ("GPU", 3)}
    assert ("GPU", 1) in c and ("CPU", 2) not in c
    # removing from CPU leaves the GPU copy; removing with medium None removes from GPU
    c.apply(batch(BlockRemoved([1], "CPU")))
    assert set(c.as_dict()) == {("GPU", 1), ("GPU", 2), ("GPU", 3)}
    c.apply(batch(BlockRemoved([1, 3], None)))
    assert set(c.as_dict()) == {("GPU", 2)}
    # removing something unknown is harmless
    c.apply(batch(BlockRemoved([99], "DISK"), BlockRemoved([2], "CPU")))
    assert set(c.as_dict()) == {("GPU", 2)}


def test_all_hash_kinds_are_distinct_keys() -> None:
    c = BlockCache()
    c.apply(batch(stored([2**64 - 1, -(2**63)], parent=D2), stored([D1], parent=None)))
    d = c.as_dict()
    assert set(d) == {("GPU", 2**64 - 1), ("GPU", -(2**63)), ("GPU", D1)}
    assert d[("GPU", 2**64 - 1)][0] == D2
    assert d[("GPU", -(2**63))][0] == 2**64 - 1
    c.apply(batch(BlockRemoved([D1])))
    assert ("GPU", D1) not in c


def test_clear_event_and_clear_method() -> None:
    c = BlockCache()
    c.apply(batch(stored([1]), stored([2], medium="CPU"), AllBlocksCleared(), stored([3])))
    assert set(c.as_dict()) == {("GPU", 3)}  # cleared every tier, then stored 3
    c.clear()
    assert len(c) == 0 and c.as_dict() == {} and c.blocks() == []


def test_events_apply_in_order_last_one_wins() -> None:
    c = BlockCache()
    c.apply(batch(stored([1], lora_id=1), BlockRemoved([1]), stored([1], lora_id=2)))
    assert c.as_dict() == {("GPU", 1): (None, (1, 1), 2, 2, None, "GPU")}
    c.apply(batch(stored([1], lora_id=3), BlockRemoved([1])))
    assert len(c) == 0
    # idempotent per key: applying the same batch twice gives the same cache
    b = batch(stored([4, 5], parent=3), BlockRemoved([4]))
    c.apply(b)
    once = c.as_dict()
    c.apply(b)
    assert c.as_dict() == once


def test_snapshot_records_rebuild_the_same_cache() -> None:
    ev = BlockStored(
        [7, 8], 6, [1, 2, 3, 4], 2, 1, "CPU", lora_name="l",
        extra_keys=[["a"], None], lookahead_token_ids=[[9], [10]], group_idx=2,
        locality="LOCAL", ownership="o", session_id="s", cache_salt="salt",
        kv_cache_spec_kind="full", kv_cache_spec_sliding_window=None,
    )
    c = BlockCache()
    c.apply(batch(ev, stored([20, 21], parent=8, medium="CPU")))
    records = [b.as_event() for b in c.blocks()]
    assert records[0] == BlockStored(
        [7], 6, [1, 2], 2, 1, "CPU", lora_name="l", extra_keys=[["a"]],
        lookahead_token_ids=[[9]], group_idx=2, locality="LOCAL", ownership="o",
        session_id="s", cache_salt="salt", kv_cache_spec_kind="full",
    )
    assert records[1].block_hashes == [8] and records[1].parent_block_hash == 7
    assert records[1].extra_keys == [None] and records[1].token_ids == [3, 4]
    assert all(len(r.block_hashes) == 1 for r in records)
    rebuilt = BlockCache()
    rebuilt.apply(batch(*records))
    assert rebuilt.as_dict() == c.as_dict()


def test_per_block_lists_with_wrong_length_are_dropped() -> None:
    ev = BlockStored([1, 2], None, [0, 0, 0, 0], 2, None, extra_keys=[["only one"]])
    c = BlockCache()
    c.apply(batch(ev))
    assert [b.as_event().extra_keys for b in c.blocks()] == [None, None]


def test_cached_block_is_a_cheap_reference() -> None:
    ev = stored([1, 2])
    b = CachedBlock((ev, 1))
    assert b.event is ev and b.hash == 2 and b.parent == 1
    assert b.record() == (1, (2, 2), 2, None, None, "GPU")


def test_items_and_blocks_are_point_in_time_copies() -> None:
    c = BlockCache()
    c.apply(batch(stored([1, 2, 3])))
    snap = c.blocks()
    keys = [k for k, _ in c.items()]
    c.apply(batch(BlockRemoved([1, 2, 3])))
    assert [b.hash for b in snap] == [1, 2, 3]
    assert keys == [("GPU", 1), ("GPU", 2), ("GPU", 3)]


def test_chain_events_regroups_runs_and_rebuilds_exactly() -> None:
    from kvwire.index.cache import chain_events

    c = BlockCache()
    a = BlockStored([1, 2, 3, 4], None, list(range(16)), 4, None, "GPU",
                    extra_keys=[["x"], None, ["y"], None])
    b = BlockStored([10, 11], 4, list(range(8)), 4, None, "GPU")
    c.apply_events([a, b, BlockRemoved([2], "GPU")])  # splits a's run: [1], [3, 4]
    events = chain_events(c.raw_copy())
    assert [e.block_hashes for e in events] == [[1], [3, 4], [10, 11]]
    assert events[1].parent_block_hash == 2 and events[1].token_ids == list(range(8, 16))
    assert events[1].extra_keys == [["y"], None]
    assert events[2] is b  # a whole event goes out as itself
    rebuilt = BlockCache()
    rebuilt.apply_events(events)
    assert rebuilt.as_dict() == c.as_dict()


def test_chunked_snapshot_of_tiers_and_restored_blocks_rebuilds_exactly() -> None:
    """raw_copy() cut into chunks, each through chain_events with one shared positions
    cache (as the publisher sends a snapshot): several tiers, an event split across chunks,
    and a block re-stored by a later event."""
    from kvwire.index.cache import chain_events

    c = BlockCache()
    long = BlockStored(list(range(100, 130)), None, list(range(60)), 2, None, None)
    cpu = BlockStored([1, 2, 3], None, list(range(6)), 2, None, "CPU")
    again = BlockStored([105, 200], 104, [7, 7, 8, 8], 2, None, None)  # re-stores 105
    c.apply_events([long, cpu, again, BlockRemoved([110], None), BlockRemoved([2], "CPU")])
    assert len(c) == 30 - 1 + 3 - 1 + 1
    assert ("GPU", 105) in c and ("CPU", 2) not in c
    assert c.blocks()[5].event is again  # the last store of a block decides
    records = c.raw_copy()
    positions: dict = {}
    events = []
    for i in range(0, len(records), 7):
        events += chain_events(records[i : i + 7], positions)
    rebuilt = BlockCache()
    rebuilt.apply_events(events)
    assert rebuilt.as_dict() == c.as_dict()
    assert {k[0] for k in c.as_dict()} == {"GPU", "CPU"}
