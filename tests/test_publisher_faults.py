"""Publisher faults made visible, each forced for real on a live publisher.

* A stalled sender must not slow ``publish()``: its p99 is bounded the way bench/events.py
  measures it, and a synchronous stand-in fails the same bound (the test can fail).
* A batch the snapshot model could apply only in part makes snapshots unavailable until
  the engine clears its cache; never served as exact.
* A dead sender thread shows in ``stats()``, in ``publish()`` (counted, logged once, never
  blocks or raises) and in the Prometheus metrics.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import uuid
from typing import Any

import zmq
from waiting import wait_for  # noqa: E402

from kvwire.index.cache import BlockCache
from kvwire.publish.publisher import ZmqEventPublisher
from kvwire.wire import protocol
from kvwire.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

TIMEOUT = 15.0
#: How long each gated batch holds whoever iterates its events.
HOLD_S = 0.05
#: p99 of publish() while the sender is stalled. Measured ~2-4 us on the 2-core box (bench:
#: 3.5 us); a publish() that waits for the sender pays the stall itself (HOLD_S, in 10% of
#: the calls). Half of it: far above a scheduler stall or a GIL switch interval (5 ms; the
#: old 5 ms bound was exactly one), still clearly below what a waiting publish() gives.
P99_BOUND_S = HOLD_S / 2


class _Gated(list):
    """Events whose iteration waits (up to ``hold`` s) on a gate: stalls whichever thread
    encodes or applies the batch, for real (a forced fault; nothing is mocked)."""

    def __init__(self, items: list[Any], gate: threading.Event, hold: float) -> None:
        super().__init__(items)
        self.gate, self.hold = gate, hold

    def __iter__(self) -> Any:
        self.gate.wait(self.hold)
        return super().__iter__()


class _Fatal(BaseException):
    """Not an Exception: what kills the sender thread in test_dead_sender_* (a forced fault)."""


class _Deadly(list):
    def __iter__(self) -> Any:
        raise _Fatal("forced: the sender thread dies while reading this batch")


def step(i: int) -> list[Any]:
    return [BlockStored([i, i + 1], i - 1, list(range(8)), 4, None, "GPU"),
            BlockRemoved([i - 7], "GPU")]


def make(pubs: list[ZmqEventPublisher], ctx: zmq.Context, **kw: Any) -> ZmqEventPublisher:
    name = f"inproc://faults-{uuid.uuid4().hex}"
    kw.setdefault("heartbeat_interval", None)
    p = ZmqEventPublisher(endpoint=name, replay_endpoint=name + "-r", context=ctx, **kw)
    pubs.append(p)
    return p



def ask_snapshot(ctx: zmq.Context, pub: ZmqEventPublisher) -> tuple[str, Any]:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(pub.replay_endpoint)
    d.send_multipart([b"", protocol.MAGIC, protocol.OP_SNAPSHOT])
    cache = BlockCache()
    try:
        while True:
            assert d.poll(int(TIMEOUT * 1000)), "no snapshot reply"
            f = d.recv_multipart()
            if f[2] == protocol.REPLY_ERR:
                return "err", f[3].decode()
            header = protocol.decode_map(f[3])
            cache.apply(decode_batch(f[4]))
            if header["chunk"] == header["chunks"] - 1:
                return "ok", cache
    finally:
        d.close()


# --------------------------------------------------------------------------- stalled sender


def publish_latencies(publish: Any, n: int = 400, every: int = 10) -> list[float]:
    """Sorted seconds of ``n`` calls of ``publish``, every ``every``-th batch gated
    (bench-style timing: perf_counter around each call, GC off)."""
    gate = threading.Event()
    batches = [
        KVEventBatch(float(i), _Gated(step(i), gate, HOLD_S) if i % every == 0 else step(i), 0)
        for i in range(n)
    ]
    lat = [0.0] * n
    gc.disable()
    try:
        for i, b in enumerate(batches):
            t = time.perf_counter()
            publish(b)
            lat[i] = time.perf_counter() - t
    finally:
        gc.enable()
        gate.set()
    return sorted(lat)


def publish_p99(publish: Any, n: int = 400, every: int = 10) -> float:
    """p99 of ``publish`` over ``n`` calls, every ``every``-th batch gated."""
    return publish_latencies(publish, n, every)[int(n * 0.99)]


def run_delay() -> float:
    """Seconds this process's threads have spent runnable but waiting for a CPU (the
    scheduler's run_delay, /proc/self/task/*/schedstat): the canary for "the box stalled
    us". Time spent blocked on a lock, a sleep or a gate is not counted."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except OSError:  # the thread has ended
            pass
    return total / 1e9


def test_publish_p99_stays_low_while_the_sender_is_stalled(pubs, ctx) -> None:
    """Retried (up to 3 runs) only when the box demonstrably caused a failed run: this
    process's threads waited for a CPU at least P99_BOUND_S for each call over the bound
    beyond the 1% allowed. A publish() that waits for the stalled sender blocks (wants no
    CPU), so it fails at once, and after the third run in any case."""
    runs = []
    for _ in range(3):
        pub = make(pubs, ctx)
        before = run_delay()
        lat = publish_latencies(pub.publish)
        stalled = run_delay() - before
        p99 = lat[int(len(lat) * 0.99)]
        over = sum(t >= P99_BOUND_S for t in lat) - (len(lat) - int(len(lat) * 0.99) - 1)
        runs.append(f"p99 {p99 * 1e3:.3f} ms, {over} calls too many over the bound, "
                    f"CPU wait {stalled * 1e3:.1f} ms")
        wait_for(lambda p=pub: p.stats().sent == 400, "all sent once the stall ends")
        if p99 < P99_BOUND_S or stalled < over * P99_BOUND_S:
            break
    assert p99 < P99_BOUND_S, f"publish() with a stalled sender, per run: {runs}"


def test_a_synchronous_sender_fails_the_same_bound() -> None:
    """The measurement can fail: a publisher that encodes in publish() pays the stall."""
    p99 = publish_p99(lambda b: encode_batch(b))
    assert p99 >= HOLD_S * 0.9 > P99_BOUND_S, p99


# --------------------------------------------------------------------------- the model


def test_half_applied_batch_makes_snapshots_unavailable_until_a_clear(pubs, ctx, caplog) -> None:
    pub = make(pubs, ctx)
    truth = BlockCache()
    good = KVEventBatch(0.0, [BlockStored([1], None, [1] * 4, 4, None)], 0)
    pub.publish(good)
    truth.apply(good)
    # Block 2 applies, then a list as a block hash cannot be a dict key: the model raises
    # half way through the batch (forced for real; the batch still encodes and goes out).
    half = KVEventBatch(1.0, [BlockStored([2], 1, [2] * 4, 4, None),
                              BlockStored([[3]], 2, [3] * 4, 4, None)], 0)  # type: ignore[list-item]
    pub.publish(half)
    pub.publish(KVEventBatch(2.0, [BlockRemoved([1], None)], 0))
    wait_for(lambda: pub.stats().sent == 3, "sent")
    st = pub.stats()
    assert (st.model_errors, st.snapshot_exact, st.encode_errors) == (1, False, 0)
    kind, msg = ask_snapshot(ctx, pub)
    assert kind == "err" and "seq 1 could not be applied (TypeError" in msg, msg
    assert pub.stats().snapshots_unavailable == 1
    errors = [r for r in caplog.records if "snapshot model inexact from seq 1" in r.message]
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR
    # Another bad batch while inexact: still refused; then a clear makes it exact again.
    pub.publish(half)
    after = KVEventBatch(4.0, [AllBlocksCleared(), BlockStored([5], None, [5] * 4, 4, None)], 0)
    pub.publish(after)
    wait_for(lambda: pub.stats().sent == 5, "sent")
    kind, cache = ask_snapshot(ctx, pub)
    assert kind == "ok", cache
    truth.apply(after)
    assert cache.as_dict() == truth.as_dict() == {("GPU", 5): cache.as_dict()[("GPU", 5)]}
    assert pub.stats().snapshot_exact


# --------------------------------------------------------------------------- dead sender


def kill_sender(pub: ZmqEventPublisher) -> None:
    """Kill the sender thread for real: iterating this batch's events raises a
    BaseException in the sender (with the model on, while applying it)."""
    pub.publish(KVEventBatch(0.0, _Deadly(), 0))
    wait_for(lambda: not pub.stats().sender_alive, "the sender thread to die")


def test_dead_sender_shows_in_stats_and_publish(pubs, ctx, caplog) -> None:
    pub = make(pubs, ctx)
    assert pub.stats().sender_alive
    kill_sender(pub)
    assert any("sender thread died" in r.message for r in caplog.records)
    caplog.clear()
    worst = 0.0
    for i in range(50):
        t = time.perf_counter()
        pub.publish(KVEventBatch(float(i), step(i), 0))  # neither blocks nor raises
        worst = max(worst, time.perf_counter() - t)
    assert worst < 0.5  # nothing to wait for: the call returns at once
    st = pub.stats()
    assert (st.sender_alive, st.dropped_sender_dead, st.published) == (False, 50, 1)
    dead_logs = [r for r in caplog.records if "sender thread is dead" in r.message]
    assert len(dead_logs) == 1  # logged once, counted every time
    t = time.monotonic()
    report = pub.shutdown(timeout=1.0)
    assert time.monotonic() - t < 5.0 and report.sent == 0
