"""The publisher as vLLM's own kv_events tests use it, on real ZeroMQ sockets.

vLLM's tests publish their own tagged, array-like event type inside an ``EventBatch``
subclass and decode it with a strict msgspec decoder; they publish batches without a rank
and expect the publisher's; they read the resolved per-rank config. Engines that keep
their own event classes must get exactly the bytes their own encoder produces (the plain
msgspec encoding of the object), and the snapshot model must follow those classes by tag
and shape, or say that it cannot.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
import pytest
import zmq
from waiting import wait_for  # noqa: E402

from kvwire.index.cache import BlockCache
from kvwire.publish.config import KVEventsConfig
from kvwire.publish.publisher import EventPublisherFactory, NullEventPublisher, ZmqEventPublisher
from kvwire.wire import protocol
from kvwire.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventBatch,
    decode_batch,
)

TIMEOUT = 15.0


class EventSample(msgspec.Struct, tag=True, array_like=True):
    """vLLM's test event: tagged and array-like, nothing like a KV cache event."""

    id: int
    value: str


class SampleBatch(EventBatch, frozen=True):
    events: list[EventSample]


# An engine's own KV event classes (as an engine that keeps its own would have them):
# tagged by name, different classes from kvwire's.
class EngineEvent(msgspec.Struct, tag_field="type", omit_defaults=True):
    pass


class EngineStored(EngineEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class EngineRemoved(EngineEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class EngineCleared(EngineEvent, tag="AllBlocksCleared"):
    pass


class EngineBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """Not kvwire's EventBatch at all: mutable, its own class."""

    ts: float
    events: list[EngineStored | EngineRemoved | EngineCleared]
    data_parallel_rank: int | None = None


def make(pubs: list[ZmqEventPublisher], ctx: zmq.Context, rank: int = 0,
         **kw: Any) -> ZmqEventPublisher:
    name = f"inproc://vllm-{uuid.uuid4().hex}"
    p = ZmqEventPublisher(data_parallel_rank=rank, endpoint=name, replay_endpoint=name + "-r",
                          heartbeat_interval=None, context=ctx, **kw)
    pubs.append(p)
    return p


def subscribe(ctx: zmq.Context, pub: ZmqEventPublisher, publish: Any) -> zmq.Socket:
    """A SUB socket that receives: publish ``publish()`` until one arrives (slow joiner)."""
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(pub.endpoint)
    deadline = time.monotonic() + TIMEOUT
    while not s.poll(10):
        assert time.monotonic() < deadline, "subscriber never received anything"
        publish()
    return s


def frames_until(sock: zmq.Socket, seq: int) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    while seq not in out:
        assert sock.poll(int(TIMEOUT * 1000)), f"seq {seq} never arrived"
        _, seq_b, payload = sock.recv_multipart()
        out[int.from_bytes(seq_b, "big")] = payload
    return out


def replayed(ctx: zmq.Context, pub: ZmqEventPublisher, start: int) -> dict[int, bytes]:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(pub.replay_endpoint)
    d.send_multipart([b"", start.to_bytes(8, "big")])
    out = {}
    while True:
        assert d.poll(int(TIMEOUT * 1000)), "replay never ended"
        f = d.recv_multipart()
        if f[2] == protocol.END_SEQ:
            d.close()
            return out
        out[int.from_bytes(f[2], "big")] = f[3]


def ask_snapshot(ctx: zmq.Context, pub: ZmqEventPublisher) -> tuple[str, Any]:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(pub.replay_endpoint)
    d.send_multipart([b"", protocol.MAGIC, protocol.OP_SNAPSHOT])
    cache = BlockCache()
    while True:
        assert d.poll(int(TIMEOUT * 1000)), "no snapshot reply"
        f = d.recv_multipart()
        if f[2] == protocol.REPLY_ERR:
            d.close()
            return "err", f[3].decode()
        header = protocol.decode_map(f[3])
        cache.apply(decode_batch(f[4]))
        if header["chunk"] == header["chunks"] - 1:
            d.close()
            return "ok", cache



# --------------------------------------------------------------------------- custom events


def sample_batch(i: int, rank: int | None = None) -> SampleBatch:
    return SampleBatch(float(i), [EventSample(i, f"v{i}"), EventSample(-i, "")], rank)


def test_custom_tagged_array_like_events_go_out_as_given(pubs, ctx) -> None:
    """vLLM's test_basic_publishing: its own event type, decoded by a strict decoder."""
    rank = 2
    pub = make(pubs, ctx, rank=rank)
    sent: list[SampleBatch] = []

    def publish() -> None:
        sent.append(sample_batch(len(sent)))  # no rank: the publisher's goes on the wire
        pub.publish(sent[-1])

    sub = subscribe(ctx, pub, publish)
    for _ in range(20):
        publish()
    got = frames_until(sub, len(sent) - 1)
    strict = msgspec.msgpack.Decoder(type=SampleBatch)
    for seq, payload in got.items():
        want = msgspec.structs.replace(sent[seq], data_parallel_rank=rank)
        assert payload == msgspec.msgpack.encode(want)  # byte-exact: the engine's encoder
        assert strict.decode(payload) == want
    assert replayed(ctx, pub, 0) == {
        s: msgspec.msgpack.encode(msgspec.structs.replace(b, data_parallel_rank=rank))
        for s, b in enumerate(sent)
    }
    st = pub.stats()
    assert st.encode_errors == 0 and st.foreign_batches == len(sent) and st.sent == len(sent)


def engine_history() -> tuple[list[EngineBatch], BlockCache]:
    """Batches of an engine's own classes, and the cache they describe (kvwire's classes)."""
    batches, truth = [], BlockCache()
    for i in range(40):
        h = [i, i.to_bytes(32, "big")][i % 2]
        evs: list[Any] = [EngineStored([h, i + 1000], None, [i] * 8, 4, None, "GPU")]
        kv: list[Any] = [BlockStored([h, i + 1000], None, [i] * 8, 4, None, "GPU")]
        if i % 3 == 2:
            evs.append(EngineRemoved([i + 999], None))
            kv.append(BlockRemoved([i + 999], None))
        batches.append(EngineBatch(float(i), evs, 0 if i % 2 else None))
        truth.apply(KVEventBatch(float(i), kv, 0))
    return batches, truth


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_engine_own_classes_get_their_own_bytes_and_are_followed(pubs, ctx, dialect) -> None:
    pub = make(pubs, ctx, rank=1, dialect=dialect)
    batches, truth = engine_history()
    for b in batches:
        pub.publish(b)
    wait_for(lambda: pub.stats().sent == len(batches), "all sent")
    for seq, payload in replayed(ctx, pub, 0).items():
        b = batches[seq]
        if b.data_parallel_rank is None:
            b = msgspec.structs.replace(b, data_parallel_rank=1)
        assert payload == msgspec.msgpack.encode(b), seq  # the engine's own bytes
        assert decode_batch(payload).data_parallel_rank == b.data_parallel_rank
    kind, cache = ask_snapshot(ctx, pub)
    assert kind == "ok", cache
    assert cache.as_dict() == truth.as_dict() and len(truth) > 0
    st = pub.stats()
    assert (st.model_unknown_events, st.model_errors, st.snapshot_exact) == (0, 0, True)


def test_events_the_model_cannot_follow_make_snapshots_unavailable(pubs, ctx, caplog) -> None:
    pub = make(pubs, ctx)
    pub.publish(KVEventBatch(0.0, [BlockStored([1], None, [1] * 4, 4, None)], 0))
    pub.publish(sample_batch(1))  # EventSample: not a cache event the model can follow
    pub.publish(EngineBatch(2.0, [EngineStored([2], 1, [2] * 4, 4, None, None)], 0))
    wait_for(lambda: pub.stats().sent == 3, "sent")
    kind, msg = ask_snapshot(ctx, pub)
    assert kind == "err" and "cannot follow event EventSample" in msg, msg
    st = pub.stats()
    assert (st.model_unknown_events, st.snapshot_exact, st.snapshots_unavailable) == (1, False, 1)
    assert any("snapshot model inexact from seq 1" in r.message for r in caplog.records)
    # The engine clears its cache (with its own class): the model is exact from there.
    pub.publish(EngineBatch(3.0, [EngineCleared(), EngineStored([9], None, [9] * 4, 4, 7, None)]))
    wait_for(lambda: pub.stats().sent == 4, "sent")
    kind, cache = ask_snapshot(ctx, pub)
    assert kind == "ok", cache
    assert set(cache.as_dict()) == {("GPU", 9)}
    assert pub.stats().snapshot_exact


def test_a_bad_shape_is_not_followed(pubs, ctx) -> None:
    """Tagged BlockStored, but not the shape of one (no token_ids): refused, not guessed."""

    class OddStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
        block_hashes: list[int]

    pub = make(pubs, ctx)
    pub.publish(EngineBatch(0.0, [OddStored([1])], 0))  # type: ignore[list-item]
    wait_for(lambda: pub.stats().sent == 1, "sent")
    kind, msg = ask_snapshot(ctx, pub)
    assert kind == "err" and "OddStored" in msg
    assert pub.stats().model_unknown_events == 1


# --------------------------------------------------------------------------- ranks, config


def test_rank_none_goes_out_with_each_publishers_rank(pubs, ctx) -> None:
    """vLLM's DP tagging test: two ranks, batches without a rank, each tagged with its own."""
    for rank in (0, 1):
        pub = make(pubs, ctx, rank=rank)
        n = [0]

        def publish(pub: ZmqEventPublisher = pub, n: list[int] = n) -> None:
            pub.publish(KVEventBatch(float(n[0]), [BlockRemoved([n[0]], None)]))
            n[0] += 1

        sub = subscribe(ctx, pub, publish)
        pub.publish(KVEventBatch(0.5, [AllBlocksCleared()], 7))  # an explicit rank is kept
        got = frames_until(sub, n[0])
        ranks = {decode_batch(p).data_parallel_rank for s, p in got.items() if s < n[0]}
        assert ranks == {rank}
        assert decode_batch(got[n[0]]).data_parallel_rank == 7


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_get_publisher_config_offsets_ports_by_rank(rank: int) -> None:
    # Host without '*' means connect: no port has to be free for this test.
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:5557",
                         replay_endpoint="tcp://127.0.0.1:5600", topic="kv", buffer_steps=77,
                         heartbeat_interval=None)
    pub = EventPublisherFactory.create(cfg, data_parallel_rank=rank)
    try:
        got = pub.get_publisher_config()
        assert got.endpoint == f"tcp://127.0.0.1:{5557 + rank}"
        assert got.replay_endpoint == f"tcp://127.0.0.1:{5600 + rank}"
        assert msgspec.structs.replace(got, endpoint=cfg.endpoint,
                                       replay_endpoint=cfg.replay_endpoint) == cfg
        got.topic = "changed"  # a copy: the publisher's own stays as it is
        assert pub.get_publisher_config().topic == "kv"
    finally:
        pub.shutdown(timeout=1.0)


def test_get_publisher_config_inproc_and_null(ctx) -> None:
    name = f"inproc://cfg-{uuid.uuid4().hex}"
    pub = ZmqEventPublisher(data_parallel_rank=2, endpoint=name, replay_endpoint=None,
                            context=ctx, heartbeat_interval=None)
    try:
        got = pub.get_publisher_config()
        assert (got.endpoint, got.replay_endpoint, got.publisher) == (name + "_dp2", None, "zmq")
        assert got.enable_kv_cache_events
    finally:
        pub.shutdown(timeout=1.0)
    off = KVEventsConfig(enable_kv_cache_events=False)
    null = EventPublisherFactory.create(off, data_parallel_rank=1)
    assert isinstance(null, NullEventPublisher)
    assert null.get_publisher_config() == off
    assert NullEventPublisher().get_publisher_config().publisher == "null"
