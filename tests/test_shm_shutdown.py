"""Shutdown semantics: kvwire's (a writer's shutdown() reaches its readers) and vLLM's
(``local_shutdown``: it stays in the writer's process), as vLLM's own cancel test in
tests/distributed/test_shm_broadcast.py exercises them. See docs/shm.md, "Shutdown"."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
from shm_helpers.workers import shutdown_writer

from kvwire.shm import MessageQueue, MsgspecSerializer, QueueShutdownError

pytestmark = pytest.mark.timeout(180)

CTX = mp.get_context("spawn")
PROMPT = 2.0  # "at once" on a loaded 2-core box; a lost wake or a missed state costs 30 s


def _pair(local_shutdown: bool | None, remote: bool = False) -> tuple[MessageQueue, MessageQueue]:
    if remote:
        w = MessageQueue(1, 0, connect_ip="127.0.0.1", serializer=MsgspecSerializer(),
                         local_shutdown=local_shutdown)
        r = MessageQueue.create_from_handle(w.export_handle(), 0, serializer=MsgspecSerializer())
    else:
        w = MessageQueue(1, 1, max_chunk_bytes=256, max_chunks=4, local_shutdown=local_shutdown)
        r = MessageQueue.create_from_handle(w.export_handle(), 0)
    ready = threading.Thread(target=r.wait_until_ready, kwargs={"timeout": 30})
    ready.start()
    w.wait_until_ready(timeout=30)
    ready.join(30)
    return w, r


def _cancel_from_thread(r: MessageQueue) -> None:
    """vLLM's cancel test, second half: another thread shuts the reader down while it waits
    with a long timeout; the wait ends at once with the cancel error (a RuntimeError, as
    vLLM's ``RuntimeError("cancelled")``), not with the timeout."""
    go = threading.Event()
    threading.Thread(target=lambda: (go.wait(30), r.shutdown())).start()
    assert not r.shutting_down
    go.set()
    t0 = time.monotonic()
    with pytest.raises(QueueShutdownError, match="cancelled") as ei:
        r.dequeue(timeout=30)
    assert time.monotonic() - t0 < PROMPT
    assert isinstance(ei.value, RuntimeError)
    assert r.shutting_down


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_vllm_semantics_writer_shutdown_stays_local(remote: bool) -> None:
    w, r = _pair(local_shutdown=True, remote=remote)
    w.shutdown()
    assert w.shutting_down and not r.shutting_down
    with pytest.raises(QueueShutdownError):
        w.enqueue(1)  # the writer itself is shut
    with pytest.raises(TimeoutError):
        r.dequeue(timeout=0.001)  # vLLM: the reader only times out
    with pytest.raises(TimeoutError):
        r.dequeue(timeout=0.3)
    _cancel_from_thread(r)
    r.close()
    w.close()


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_kvwire_semantics_writer_shutdown_reaches_readers(remote: bool) -> None:
    w, r = _pair(local_shutdown=None, remote=remote)  # the default (env not set in CI)
    assert w.local_shutdown is False
    w.enqueue("last")
    w.shutdown()
    assert w.shutting_down
    assert r.dequeue(timeout=30) == "last"  # drained first
    t0 = time.monotonic()
    with pytest.raises(QueueShutdownError, match="writer shut down"):
        r.dequeue(timeout=30)  # at once, not after 30 s
    assert time.monotonic() - t0 < PROMPT
    r.close()
    w.close()


@pytest.mark.parametrize("env_local", [True, False], ids=["env-local", "default"])
def test_writer_process_shutdown_then_close(env_local: bool) -> None:
    """Across processes, the env var alone selects vLLM's semantics; close() still tells
    the readers the writer left, in both modes (else they would wait for its exit)."""
    hq, steps, done = CTX.Queue(), CTX.Queue(), CTX.Queue()
    p = CTX.Process(target=shutdown_writer, args=(hq, env_local, steps, done))
    p.start()
    handle, local = hq.get(timeout=60)
    assert local is env_local
    r = MessageQueue.create_from_handle(handle, 0, liveness_interval=0.05)
    r.wait_until_ready(timeout=60)
    steps.put("shutdown")
    assert done.get(timeout=60) == ("shut", True)
    if env_local:
        with pytest.raises(TimeoutError):
            r.dequeue(timeout=0.3)
    else:
        with pytest.raises(QueueShutdownError, match="writer shut down"):
            r.dequeue(timeout=30)
    steps.put("close")
    tag, _ = done.get(timeout=60)
    assert tag == "closed"
    t0 = time.monotonic()
    with pytest.raises(QueueShutdownError, match="writer shut down"):
        r.dequeue(timeout=30)
    assert time.monotonic() - t0 < PROMPT
    p.join(30)
    assert p.exitcode == 0
    r.close()
