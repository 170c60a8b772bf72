"""The publisher's snapshot model under overload: it says when it cannot be exact."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.index.cache import BlockCache
from kvwire.publish.publisher import PublisherStats, ZmqEventPublisher
from kvwire.publish.snapshot import SnapshotModel, follow_event
from kvwire.wire import protocol
from kvwire.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    _SglangStored,
    _VllmRemoved,
    _VllmStored,
    decode_batch,
)


def stored(i: int) -> KVEventBatch:
    return KVEventBatch(time.time(), [BlockStored([i], None, [i] * 4, 4, None, "GPU")], 0)


def ask_snapshot(ctx: zmq.Context, endpoint: str) -> tuple[str, object]:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    d.send_multipart([b"", protocol.MAGIC, protocol.OP_SNAPSHOT])
    cache = BlockCache()
    while True:
        assert d.poll(10_000), "no snapshot reply"
        f = d.recv_multipart()
        if f[2] == protocol.REPLY_ERR:
            d.close()
            return "err", f[3].decode()
        header = protocol.decode_map(f[3])
        cache.apply(decode_batch(f[4]))
        if header["chunk"] == header["chunks"] - 1:
            d.close()
            return "ok", (header["seq"], cache)


def wait_drained(pub: ZmqEventPublisher) -> None:
    deadline = time.monotonic() + 20
    while pub.stats().queue_depth and time.monotonic() < deadline:
        time.sleep(0.005)


def test_overflow_makes_snapshots_unavailable_until_a_clear(tmp_path) -> None:
    ctx = zmq.Context()
    pub = ZmqEventPublisher(endpoint=f"ipc://{tmp_path}/l", replay_endpoint=f"ipc://{tmp_path}/r",
                            heartbeat_interval=None, max_queue_size=4, buffer_steps=100_000)
    try:
        truth = BlockCache()
        for i in range(20_000):  # a flood: the 4-batch queue overflows
            b = stored(i)
            pub.publish(b)
            truth.apply(b)
        wait_drained(pub)
        st = pub.stats()
        assert st.dropped > 0
        kind, msg = ask_snapshot(ctx, pub.replay_endpoint)
        assert kind == "err" and "overflowed" in str(msg)
        assert pub.stats().snapshots_unavailable == 1
        # The engine clears its cache: from there the model is exact again.
        pub.publish(KVEventBatch(time.time(), [AllBlocksCleared()], 0))
        truth.clear()
        for i in range(3):
            b = stored(10**6 + i)
            pub.publish(b)
            truth.apply(b)
        wait_drained(pub)
        kind, res = ask_snapshot(ctx, pub.replay_endpoint)
        assert kind == "ok"
        seq, cache = res
        assert seq == pub.stats().last_seq
        assert cache.as_dict() == truth.as_dict()
    finally:
        pub.shutdown(timeout=1)
        ctx.destroy(linger=0)


def test_snapshot_is_exact_without_overflow(tmp_path) -> None:
    ctx = zmq.Context()
    pub = ZmqEventPublisher(endpoint=f"ipc://{tmp_path}/l", replay_endpoint=f"ipc://{tmp_path}/r",
                            heartbeat_interval=None)
    try:
        truth = BlockCache()
        for i in range(2000):
            b = stored(i)
            pub.publish(b)
            truth.apply(b)
        wait_drained(pub)
        kind, res = ask_snapshot(ctx, pub.replay_endpoint)
        assert kind == "ok"
        seq, cache = res
        assert seq == 1999 and cache.as_dict() == truth.as_dict()
    finally:
        pub.shutdown(timeout=1)
        ctx.destroy(linger=0)


# --------------------------------------------------------------------------- the model alone

hashes = st.lists(st.integers(0, 12), min_size=1, max_size=3, unique=True)
stored_ev = st.builds(lambda hs, m: BlockStored(hs, None, [1] * (2 * len(hs)), 2, None, m),
                      hashes, st.sampled_from([None, "GPU", "CPU"]))
removed_ev = st.builds(lambda hs, m: BlockRemoved(hs, m), hashes, st.sampled_from([None, "CPU"]))
event = st.one_of(stored_ev, removed_ev, st.just(AllBlocksCleared()))
#: What happens to one batch: applied, dropped from the live queue, an event the model cannot
#: follow, or a batch that fails half way.
fate = st.sampled_from(["ok", "ok", "ok", "drop", "unknown", "half"])


def engine_class(ev: Any) -> Any:
    """The same event as an engine's own class (vLLM's or SGLang's shape, as their tags)."""
    if type(ev) is BlockStored:
        if ev.medium == "CPU":
            return _SglangStored(ev.block_hashes, None, ev.token_ids, ev.block_size, None, "CPU")
        return _VllmStored(ev.block_hashes, None, ev.token_ids, ev.block_size, None, ev.medium,
                           None)
    if type(ev) is BlockRemoved:
        return _VllmRemoved(ev.block_hashes, ev.medium)
    return {"type": "AllBlocksCleared"}


@given(st.lists(event, max_size=8))
def test_engine_classes_are_followed_as_kvwire_events(events: list[Any]) -> None:
    for ev in events:
        assert follow_event(engine_class(ev)) == ev


class _Evict(msgspec.Struct, tag=True):
    """A real eviction in a shape the model does not know: it cannot follow it."""

    hashes: list[int]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(event, max_size=4), fate, st.booleans(), st.booleans(),
                          hashes), max_size=30))
def test_model_never_claims_exact_when_it_is_not(steps: list[Any]) -> None:
    """Against the engine's cache (every event, whatever reached the model): a model that
    serves snapshots equals it as of the model's seq; and it is exact again after a clear
    past its last fault. The sender lags the engine (a queue): drops are noted on the
    engine's side before the sender applies the batches queued ahead of them."""
    counters = dict.fromkeys(PublisherStats.__struct_fields__, 0)
    model = SnapshotModel(threading.Lock(), counters)
    truth = BlockCache()
    truth_at: dict[int, Any] = {-1: {}}  # the engine's cache as of each seq
    queue: list[tuple[int, KVEventBatch]] = []
    faults: list[int] = []  # seqs dropped or not followable, as the engine side knows them
    cleared: list[int] = []  # seqs of good batches holding a clear

    def send(upto: int) -> None:
        while queue and queue[0][0] <= upto:
            seq, batch = queue.pop(0)
            model.apply(seq, batch)
            if model.unavailable() is None:  # a snapshot is labelled "as of model.seq"
                assert model.cache.as_dict() == truth_at[model.seq]
            if all(f > seq for f in faults):  # no fault up to here
                assert model.exact
            last_fault = max(faults, default=-1)
            if any(last_fault < c <= seq for c in cleared):  # cleared after every fault
                assert model.exact

    for seq, (events, what, foreign, flush, evict) in enumerate(steps):
        evs: list[Any] = [engine_class(e) if foreign else e for e in events]
        truth.apply_events(events)
        if what == "drop":
            model.note_drop(seq)  # engine thread: the batch never reaches the model
        elif what == "unknown":
            truth.apply_events([BlockRemoved(evict, None)])
            queue.append((seq, KVEventBatch(0.0, [*evs, _Evict(evict)], 0)))
        elif what == "half":  # an unhashable tier: raises before storing block 7
            truth.apply_events([BlockStored([7], None, [1, 1], 2, None)])
            queue.append((seq, KVEventBatch(0.0, [*evs, BlockStored([7], None, [1, 1], 2, None,
                                                                     [])], 0)))  # type: ignore[arg-type]
        else:
            queue.append((seq, KVEventBatch(0.0, evs, 0)))
        truth_at[seq] = truth.as_dict()
        if what != "ok":
            faults.append(seq)
        elif any(type(e) is AllBlocksCleared for e in events):
            cleared.append(seq)
        if flush:
            send(seq)
    send(len(steps))
