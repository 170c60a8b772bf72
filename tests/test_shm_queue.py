"""MessageQueue API and guarantees that one process can check (readers in the same process)."""

from __future__ import annotations

import logging
import os
import pickle
import stat
import threading
import time
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest

from kvwire.shm import (
    Handle,
    MessageQueue,
    MsgspecSerializer,
    ShmCapacityError,
    ShmRingBuffer,
    shm_free_bytes,
)

pytestmark = pytest.mark.timeout(180)  # fail fast instead of the global 300 s

def pair(n: int = 1, **kw):
    kw.setdefault("max_chunk_bytes", 1024)
    kw.setdefault("max_chunks", 4)
    w = MessageQueue(n, n, **kw)
    h = pickle.loads(pickle.dumps(w.export_handle()))  # the Handle travels pickled
    rs = [MessageQueue.create_from_handle(h, r, serializer=kw.get("serializer"))
          for r in range(n)]
    w.wait_until_ready(timeout=5)
    for r in rs:
        r.wait_until_ready(timeout=5)
    return w, rs


def test_public_api_names() -> None:
    from kvwire.shm import Handle as H
    from kvwire.shm import MessageQueue as M
    from kvwire.shm import ShmRingBuffer as S

    assert H is Handle and M is MessageQueue and S is ShmRingBuffer
    for name in ("export_handle", "create_from_handle", "wait_until_ready", "acquire_write",
                 "acquire_read", "enqueue", "dequeue", "broadcast_object", "shutdown",
                 "create_from_process_group", "create_from_process_group_single_reader"):
        assert callable(getattr(MessageQueue, name))


def test_segment_is_0600_and_never_named_in_dev_shm() -> None:
    def ours() -> set[str]:  # other suites may use /dev/shm concurrently
        return {e for e in os.listdir("/dev/shm") if e.startswith("kvwire")}

    before = ours()
    buf = ShmRingBuffer(2, 4096, 4)
    assert stat.S_IMODE(os.fstat(buf.fd).st_mode) == 0o600
    assert ours() == before  # unlinked right after creation
    other = pickle.loads(pickle.dumps(buf))  # attaches like vLLM's ShmRingBuffer
    with buf.get_data(1) as d:
        d[:5] = b"hello"
    with other.get_data(1) as d:
        assert bytes(d[:5]) == b"hello"
    other.close()
    buf.close()


def test_capacity_is_checked_with_an_actionable_error() -> None:
    free = shm_free_bytes()
    with pytest.raises(ShmCapacityError) as ei:
        ShmRingBuffer(1, free // 2 + 1, 4)
    assert "--shm-size" in str(ei.value) and "MiB" in str(ei.value)


def test_types_roundtrip_and_in_place_views() -> None:
    w, (r,) = pair(max_chunk_bytes=1 << 16)
    arr = np.arange(1000, dtype=np.float32)
    for obj in [None, 1, "s", b"", b"raw", {"k": [1, 2]}, arr, bytearray(b"ba")]:
        w.enqueue(obj)
        got = r.dequeue(timeout=1)
        assert (got == obj).all() if isinstance(obj, np.ndarray) else got == obj
        assert type(got) is type(obj)
    w.enqueue(arr)
    with r.dequeue_inplace(timeout=1) as view:
        assert np.array_equal(view, arr)
        assert not view.flags.owndata  # a view of the ring, not a copy
    w.enqueue(b"x" * 5000)
    with r.dequeue_inplace(timeout=1) as mv:
        assert isinstance(mv, memoryview) and mv == b"x" * 5000
    w.close()
    r.close()


def test_overflow_larger_than_whole_ring_needs_a_concurrent_reader() -> None:
    """2 chunks of 1 KiB, a 5 KiB message streams through while the reader thread reads."""
    import threading

    w, (r,) = pair(max_chunk_bytes=1024, max_chunks=2)
    big = os.urandom(5000)
    got = []
    t = threading.Thread(target=lambda: got.append(r.dequeue(timeout=10)))
    t.start()
    w.enqueue({"big": big}, timeout=10)
    t.join(10)
    assert got == [{"big": big}]
    w.close()
    r.close()


def test_acquire_write_and_acquire_read_raw_chunks() -> None:
    w, (r,) = pair()
    with w.acquire_write(timeout=1) as buf:
        buf[:3] = b"abc"
    with r.acquire_read(timeout=1) as buf:
        assert len(buf) == 1024 and bytes(buf[:3]) == b"abc"
    w.close()
    r.close()


def test_broadcast_object_two_readers() -> None:
    w, rs = pair(2)
    assert w.broadcast_object({"a": 1}) == {"a": 1}
    assert [r.broadcast_object() for r in rs] == [{"a": 1}, {"a": 1}]
    w.close()
    for r in rs:
        r.close()


def test_timeouts_on_both_sides() -> None:
    w, (r,) = pair(max_chunks=2)
    with pytest.raises(TimeoutError):
        r.dequeue(timeout=0.01)
    w.enqueue(1)
    w.enqueue(2)
    with pytest.raises(TimeoutError):
        w.enqueue(3, timeout=0.01)
    with pytest.raises(TimeoutError):
        with w.acquire_write(timeout=0):
            pass
    assert r.dequeue(timeout=1) == 1
    w.enqueue(3, timeout=1)
    assert [r.dequeue(timeout=1), r.dequeue(timeout=1)] == [2, 3]
    w.close()
    r.close()


def _after(cond, act) -> threading.Thread:
    """Run ``act()`` in a thread once ``cond()`` holds (polled, 30 s at most)."""
    def run() -> None:
        end = time.monotonic() + 30
        while not cond() and time.monotonic() < end:
            time.sleep(0.002)
        act()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_wait_log_names_the_readers_behind(caplog) -> None:
    """A waiting side logs every warn_interval, naming whom it waits for. Each logged wait
    ends when a thread sees the log and frees the ring (or publishes), not at a deadline:
    with a 0.15 s deadline a stalled box could time out before its first 20 ms log."""
    w, rs = pair(3, max_chunks=2, warn_interval=0.02)
    for i in range(2):
        w.enqueue(i)
    for r in rs[:2]:
        r.dequeue(timeout=1)

    def logged(what: str) -> bool:
        return any(what in m for m in caplog.messages)

    with caplog.at_level(logging.WARNING, logger="kvwire.shm"):
        t = _after(lambda: logged("behind"), lambda: rs[2].dequeue(timeout=5))
        w.enqueue(2, timeout=30)  # waits for reader 2, which reads once the log is out
        t.join(30)
    lines = [m for m in caplog.messages if "behind" in m]
    assert lines and all("[2]" in m for m in lines)
    for r in rs[1:]:
        assert [r.dequeue(timeout=1) for _ in range(2)] == [1, 2]
    caplog.clear()
    r = rs[0]
    r._warn_interval = 0.02
    with caplog.at_level(logging.WARNING, logger="kvwire.shm"):
        assert [r.dequeue(timeout=1) for _ in range(2)] == [1, 2]  # there: no log
        with pytest.raises(TimeoutError):
            r.dequeue(timeout=0.1, indefinite=True)
        assert not caplog.messages  # indefinite: silent
        t = _after(lambda: logged("rank 0"), lambda: w.enqueue(3, timeout=5))
        assert r.dequeue(timeout=30) == 3  # published once the reader logged its wait
        t.join(30)
    assert any("rank 0" in m for m in caplog.messages)
    w.close()
    for r in rs:
        r.close()


@dataclass
class Step:
    step: int
    tokens: list[int]


def test_msgspec_serializer_for_typed_messages() -> None:
    ser = MsgspecSerializer(Step)
    w, (r,) = pair(serializer=ser)
    w.enqueue(Step(1, [1, 2, 3]))
    assert r.dequeue(timeout=1) == Step(1, [1, 2, 3])
    assert w.export_handle().serializer == "msgspec"
    w.close()
    r.close()


def test_handle_is_plain_data() -> None:
    w, (r,) = pair()
    h = w.export_handle()
    assert msgspec.convert(msgspec.to_builtins(h), Handle) == h
    with pytest.raises(Exception, match="closed to new readers"):
        MessageQueue.create_from_handle(h, 0)
    w.close()
    r.close()
