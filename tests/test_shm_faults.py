"""Dead peers and cleanup: SIGKILL / os._exit of readers and writers never hang or leak."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from shm_helpers.procmaps import holders
from shm_helpers.workers import blocked_reader, idle_reader, writer_then_die
from waiting import wait_for  # noqa: E402

from kvwire.shm import (
    MessageQueue,
    MsgspecSerializer,
    QueueShutdownError,
    ReaderDeadError,
    WriterDeadError,
)
from kvwire.shm import layout as L

pytestmark = pytest.mark.timeout(180)  # fail fast instead of the global 300 s

CTX = mp.get_context("spawn")
LIVENESS = 0.05
BOUND = 1.0  # documented bound is liveness_interval (+ scheduling); generous for a busy CI



def _ready(out, k: int) -> dict[int, int]:
    pids = {}
    for _ in range(k):
        tag, rank, pid = out.get(timeout=60)
        assert tag == "ready"
        pids[rank] = pid
    return pids


def test_sigkilled_reader_makes_blocked_writer_raise_then_drop_and_continue() -> None:
    q = MessageQueue(2, 2, max_chunk_bytes=256, max_chunks=4, liveness_interval=LIVENESS)
    name = q.buffer.name
    out = CTX.Queue()
    victim = CTX.Process(target=idle_reader, args=(q.export_handle(), 0, out))
    good = CTX.Process(target=blocked_reader, args=(q.export_handle(), 1, out))
    victim.start()
    good.start()
    q.wait_until_ready(timeout=60)
    _ready(out, 2)
    for i in range(4):  # fills the ring: rank 0 never reads
        q.enqueue(i)
    killed_at: list[float] = []

    def kill() -> None:
        wait_for(lambda: q.buffer.mv[L.OFF_WRITER_SLEEPING] == 1)  # blocked in enqueue(4)
        killed_at.append(time.monotonic())
        os.kill(victim.pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    with pytest.raises(ReaderDeadError) as ei:
        q.enqueue(4)  # no timeout: must not wait forever
    latency = time.monotonic() - killed_at[0]
    assert ei.value.ranks == [0]
    assert "0" in str(ei.value) and "drop_reader" in str(ei.value)
    assert latency < BOUND, latency
    with pytest.raises(ReaderDeadError):  # keeps failing until the user decides
        q.enqueue(4)
    assert q.drop_dead_readers() == [0]
    for i in range(4, 40):
        q.enqueue(i, timeout=30)
    q.shutdown()
    tag, exc, got, _ = out.get(timeout=60)
    assert (tag, exc, got) == ("raised", "QueueShutdownError", list(range(40)))
    good.join(30)
    victim.join(30)
    assert os.getpid() in holders(name)  # the check sees a live mapping (not vacuous)
    q.close()
    assert holders(name) == {}  # nobody maps the ring or holds its fd: its pages are freed


def test_reader_killed_while_writer_not_blocked_is_reported_on_next_enqueue() -> None:
    q = MessageQueue(1, 1, max_chunk_bytes=256, max_chunks=64, liveness_interval=LIVENESS)
    out = CTX.Queue()
    victim = CTX.Process(target=idle_reader, args=(q.export_handle(), 0, out))
    victim.start()
    q.wait_until_ready(timeout=60)
    _ready(out, 1)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(30)
    time.sleep(LIVENESS)  # let the check interval elapse (no condition to wait on: it's a rate)
    with pytest.raises(ReaderDeadError) as ei:
        q.enqueue("x")
    assert ei.value.ranks == [0]
    q.drop_reader(0)
    q.enqueue("y")  # no reader left: the writer goes on
    q.close()


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_dead_writer_makes_readers_raise_after_draining(how: str) -> None:
    hq, go, out = CTX.Queue(), CTX.Event(), CTX.Queue()
    w = CTX.Process(target=writer_then_die, args=(hq, 2, 3, how, go))
    w.start()
    h = hq.get(timeout=60)
    name = h.buffer_handle[3]
    other = CTX.Process(target=blocked_reader, args=(h, 1, out))
    other.start()
    me = MessageQueue.create_from_handle(h, 0, liveness_interval=LIVENESS)
    me.wait_until_ready(timeout=60)
    _ready(out, 1)
    go.set()
    assert [me.dequeue(timeout=30) for _ in range(3)] == [0, 1, 2]
    w.join(30)
    t0 = time.monotonic()
    with pytest.raises(WriterDeadError):
        me.dequeue()  # no timeout: must not hang
    assert time.monotonic() - t0 < BOUND
    tag, exc, got, _ = out.get(timeout=60)
    assert (tag, exc, got) == ("raised", "WriterDeadError", [0, 1, 2])
    other.join(30)
    assert set(holders(name)) == {os.getpid()}  # the writer and the other reader are gone
    me.close()
    assert holders(name) == {}


def test_dead_remote_reader_is_detected() -> None:
    q = MessageQueue(2, 1, [0], max_chunk_bytes=256, max_chunks=4, connect_ip="127.0.0.1",
                     serializer=MsgspecSerializer(), liveness_interval=LIVENESS)
    out = CTX.Queue()
    local = CTX.Process(target=idle_reader, args=(q.export_handle(), 0, out, True))
    remote = CTX.Process(target=idle_reader, args=(q.export_handle(), 1, out, True))
    local.start()
    remote.start()
    q.wait_until_ready(timeout=60)
    _ready(out, 2)
    os.kill(remote.pid, signal.SIGKILL)
    remote.join(30)
    t0 = time.monotonic()
    with pytest.raises(ReaderDeadError) as ei:  # the writer notices on its next enqueues
        while time.monotonic() - t0 < 10:
            q.enqueue(1, timeout=5)  # the local reader is idle: ring fills, writer waits
    assert ei.value.ranks == [1]
    os.kill(local.pid, signal.SIGKILL)
    local.join(30)
    q.close()


def test_writer_shutdown_wakes_an_idle_reader_which_raises() -> None:
    """Only the writer's futex wake can end this reader's sleep early: it checks liveness
    every 30 s, so without the wake it raises after ~30 s, far past the bound."""
    q = MessageQueue(1, 1, max_chunk_bytes=256, max_chunks=4)
    out = CTX.Queue()
    r = CTX.Process(target=blocked_reader, args=(q.export_handle(), 0, out, 30.0))
    r.start()
    q.wait_until_ready(timeout=60)
    _ready(out, 1)
    q.enqueue("last")
    wait_for(lambda: q.buffer.mv[L.OFF_SLEEPERS] == 1)  # read "last", now asleep on the futex
    t0 = time.monotonic()
    q.shutdown()
    tag, exc, got, t_raised = out.get(timeout=90)
    assert (tag, exc, got) == ("raised", "QueueShutdownError", ["last"])
    assert t_raised - t0 < 2.0, t_raised - t0
    r.join(30)
    q.close()


def test_no_leak_and_no_resource_tracker_warning_after_sigkill_and_exit() -> None:
    """Whole group in a fresh interpreter: reader SIGKILLed, writer os._exit()s."""
    script = textwrap.dedent("""
        import multiprocessing as mp, os, signal, sys
        sys.path.insert(0, %r)
        from shm_helpers.workers import PipePut, idle_reader
        from kvwire.shm import MessageQueue
        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = MessageQueue(2, 2, max_chunk_bytes=1 << 16, max_chunks=8)
            rx, tx = ctx.Pipe(duplex=False)
            ps = [ctx.Process(target=idle_reader, args=(q.export_handle(), r, PipePut(tx)))
                  for r in range(2)]
            for p in ps: p.start()
            q.wait_until_ready(timeout=60)
            for _ in ps: rx.recv()
            for i in range(4): q.enqueue(b"x" * 1000)
            print(q.buffer.name, flush=True)
            os.kill(ps[0].pid, signal.SIGKILL)
            ps[0].join()
            os.kill(ps[1].pid, signal.SIGTERM)
            ps[1].join()
            sys.stderr.flush()
            os._exit(0)
    """) % os.path.dirname(__file__)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "resource_tracker" not in r.stderr and "leaked" not in r.stderr, r.stderr
    name = r.stdout.split()[-1]
    assert holders(name) == {}  # no process (writer, readers, trackers) keeps the pages


def test_shutdown_of_blocked_reader_from_another_thread_cancels_it() -> None:
    w = MessageQueue(1, 1, max_chunk_bytes=256, max_chunks=4)
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    w.wait_until_ready(timeout=5)
    r.wait_until_ready(timeout=5)
    err: list[BaseException] = []

    def read() -> None:
        try:
            r.dequeue()
        except BaseException as e:
            err.append(e)

    t = threading.Thread(target=read)
    t.start()
    wait_for(lambda: w.buffer.mv[L.OFF_SLEEPERS] == 1)  # blocked: asleep on the futex
    r.shutdown()
    t.join(5)
    assert not t.is_alive()
    assert isinstance(err[0], QueueShutdownError)
    w.close()
    r.close()
