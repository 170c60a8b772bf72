"""Streams that come and go at run time: ``Subscriber.add`` / ``remove`` from another thread
while one thread polls (real publishers on ipc), and ``RouterCore.add_stream`` /
``remove_stream`` (the indexer API's registrations) dropping a stream's blocks exactly."""

from __future__ import annotations

import threading
import time

import pytest
from waiting import wait_for  # noqa: E402

from kvwire.consume.stream import Batch, StreamConfig
from kvwire.consume.subscriber import StreamSpec, Subscriber
from kvwire.publish.publisher import ZmqEventPublisher
from kvwire.routing.core import EngineSpec, RouteError, RouterCore
from kvwire.wire.endpoint import EndpointError
from kvwire.wire.events import BlockStored, KVEventBatch

BS = 16
FAST = StreamConfig(request_timeout=0.5, dead_after=2.0)


def pub(where, name: str) -> ZmqEventPublisher:
    return ZmqEventPublisher(endpoint=f"ipc://{where}/{name}.live",
                             replay_endpoint=f"ipc://{where}/{name}.replay",
                             heartbeat_interval=0.1)


def spec(p: ZmqEventPublisher, name: str) -> StreamSpec:
    return StreamSpec(name, p.endpoint, "", p.replay_endpoint)


def batch(first: int, blocks: int = 1) -> KVEventBatch:
    toks = [(first * 31 + i) % 50_000 for i in range(blocks * BS)]
    return KVEventBatch(time.time(), [BlockStored(list(range(first, first + blocks)), None,
                                                  toks, BS, None, "GPU")], 0)



def test_add_and_remove_from_another_thread_while_polling(tmp_path) -> None:
    """The polling thread applies the changes (sockets stay its own); after ``then`` ran,
    nothing of the removed stream is handed out, though its publisher goes on."""
    a, b = pub(tmp_path, "a"), pub(tmp_path, "b")
    sub = Subscriber([spec(a, "a")], config=FAST)
    got: list = []
    removed_at: list[int] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            got.extend(sub.poll_many(0.05))

    t = threading.Thread(target=poll)
    t.start()
    try:
        sub.add(spec(b, "b"))
        n = 0
        while not any(isinstance(i, Batch) and i.stream == "b" and i.batch.events
                      for i in list(got)):
            b.publish(batch(n))
            n += 1
            time.sleep(0.01)
            assert n < 3000, "stream b never delivered"
        sub.add(spec(b, "b"))  # already followed: refused in the polling thread, counted
        wait_for(lambda: sub.change_errors == 1, "the duplicate counted")
        assert "already followed" in sub.last_change_error
        sub.remove("b", then=lambda name: removed_at.append(len(got)))
        while not removed_at:
            b.publish(batch(n))  # keeps publishing through the removal
            n += 1
            time.sleep(0.005)
        for _ in range(20):
            b.publish(batch(n))
            n += 1
        a.publish(batch(10_000))
        wait_for(lambda: any(isinstance(i, Batch) and i.stream == "a" and i.batch.events
                             for i in list(got)), "stream a still delivered")
        assert not [i for i in got[removed_at[0]:] if i.stream == "b"]
        assert sub.names() == ["a"] and set(sub.stats()) == {"a"}
    finally:
        stop.set()
        t.join(10)
        sub.close()
        a.shutdown(timeout=1)
        b.shutdown(timeout=1)
    with pytest.raises(RuntimeError, match="closed"):
        sub.add(spec(a, "c"))


def test_add_checks_endpoints_in_the_calling_thread(tmp_path) -> None:
    sub = Subscriber([], config=FAST)
    try:
        with pytest.raises(EndpointError, match="x.endpoint"):
            sub.add(StreamSpec("x", "tcp//nope"))
        assert sub.poll(0.01) is None and sub.change_errors == 0
    finally:
        sub.close()


def test_router_core_streams_at_run_time(tmp_path) -> None:
    """An added stream is indexed (not a routing target); removed, its blocks leave the
    index; added again under the same name it is indexed afresh."""
    e, x = pub(tmp_path, "e"), pub(tmp_path, "x")
    core = RouterCore([EngineSpec("e", e.endpoint, e.replay_endpoint)], block_size=BS,
                      stream_config=FAST)
    core.start()
    try:
        core.add_stream(spec(x, "x"))
        with pytest.raises(ValueError, match="already followed"):
            core.add_stream(spec(x, "x"))
        with pytest.raises(ValueError, match="already followed"):
            core.add_stream(spec(x, "e/dp0"))  # an engine's stream
        x.publish(batch(1, 3))
        wait_for(lambda: core.index.streams().get("x") is not None
                 and core.index.streams()["x"].blocks == 3, "x indexed")
        assert [t.stream for t in core.targets] == ["e/dp0"]
        assert core.remove_stream("x") and not core.remove_stream("x")
        wait_for(lambda: "x" not in core.index.streams(), "x dropped from the index")
        core.add_stream(spec(x, "x"))  # the snapshot brings its blocks back
        wait_for(lambda: core.index.streams().get("x") is not None
                 and core.index.streams()["x"].blocks == 3, "x indexed again")
    finally:
        core.close()
        e.shutdown(timeout=1)
        x.shutdown(timeout=1)


def test_router_core_without_engines_answers_503_to_route() -> None:
    core = RouterCore([])
    with pytest.raises(RouteError, match="no engine to route to") as err:
        core.route([1] * BS)
    assert err.value.status == 503


def test_the_asyncio_front_picks_up_added_streams(tmp_path) -> None:
    import asyncio

    a = pub(tmp_path, "a")
    a.publish(batch(1, 2))  # before anyone listens: the snapshot brings it

    async def main() -> list:
        sub = Subscriber([], config=FAST)
        try:
            threading.Thread(target=sub.add, args=(spec(a, "a"),)).start()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                for item in await sub.apoll_many(0.1):
                    if getattr(item, "blocks", None):
                        return item.blocks
            return []
        finally:
            sub.close()

    try:
        blocks = asyncio.run(main())
    finally:
        a.shutdown(timeout=1)
    assert [e.block_hashes for e in blocks] == [[1, 2]]
