"""The publisher's snapshot model under overload: it says when it cannot be exact."""

from __future__ import annotations

import time

import zmq

from kvwire import wire
from kvwire.consume.cache import BlockCache
from kvwire.publish.publisher import ZmqEventPublisher
from kvwire.wire.events import AllBlocksCleared, BlockStored, KVEventBatch, decode_batch


def stored(i: int) -> KVEventBatch:
    return KVEventBatch(time.time(), [BlockStored([i], None, [i] * 4, 4, None, "GPU")], 0)


def ask_snapshot(ctx: zmq.Context, endpoint: str) -> tuple[str, object]:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    d.send_multipart([b"", wire.MAGIC, wire.OP_SNAPSHOT])
    cache = BlockCache()
    while True:
        assert d.poll(10_000), "no snapshot reply"
        f = d.recv_multipart()
        if f[2] == wire.REPLY_ERR:
            d.close()
            return "err", f[3].decode()
        header = wire.decode_map(f[3])
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
