"""The C hot path (kvwire.shm._ring) and its pure-Python fallback.

* which path is active, and KVWIRE_SHM_PURE=1 turning the C path off;
* a C-path writer with pure-Python readers and the reverse, across processes (same
  protocol, same bytes in the ring);
* edge cases of the fast paths, run on whichever path is active (test_shm_pure.py
  runs this file again with KVWIRE_SHM_PURE=1).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from shm_helpers.workers import make_message, reader_main, writer_main
from waiting import wait_for  # noqa: E402

import kvwire.shm
from kvwire.shm import MessageQueue, QueueShutdownError
from kvwire.shm import layout as L
from kvwire.shm._native import NATIVE, REASON

pytestmark = pytest.mark.timeout(180)  # fail fast instead of the global 300 s

CTX = mp.get_context("spawn")
CHUNK = 4096
PURE_ENV = os.environ.get("KVWIRE_SHM_PURE", "") == "1"
needs_c = pytest.mark.skipif(not NATIVE, reason=f"C path not active: {REASON}")


def pair(n: int = 1, **kw):
    kw.setdefault("max_chunk_bytes", 1024)
    kw.setdefault("max_chunks", 4)
    w = MessageQueue(n, n, **kw)
    rs = [MessageQueue.create_from_handle(w.export_handle(), r) for r in range(n)]
    w.wait_until_ready(timeout=5)
    for r in rs:
        r.wait_until_ready(timeout=5)
    return w, rs



# ------------------------------------------------------------- which path
def test_active_path_matches_build_and_environment() -> None:
    built = list(Path(kvwire.shm.__file__).parent.glob("_ring*.so"))
    assert kvwire.shm.NATIVE is NATIVE
    if PURE_ENV:
        assert not NATIVE and "KVWIRE_SHM_PURE" in REASON
    elif built:
        assert NATIVE, f"_ring is built ({built[0].name}) but not used: {REASON}"
    else:
        pytest.skip(f"kvwire.shm._ring is not built here: {REASON}")
    w, (r,) = pair()
    assert w.native is NATIVE and r.native is NATIVE
    w.close()
    r.close()


def test_pure_env_turns_the_c_path_off_in_a_fresh_process() -> None:
    code = ("import kvwire.shm as s, kvwire.shm.fence as f, kvwire.shm.wake as w; "
            "print(s.NATIVE, type(w.futex_wait).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, KVWIRE_SHM_PURE="1"), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "function"]  # ctypes futex, not the C one


# ------------------------------------------------------------- mixed paths
def _mixed_readers(monkeypatch, pure_ranks: set[int], n_reader: int, n: int, seed: int):
    q = MessageQueue(n_reader, n_reader, max_chunk_bytes=CHUNK, max_chunks=4)
    out = CTX.Queue()
    procs = []
    for r in range(n_reader):
        if r in pure_ranks:
            monkeypatch.setenv("KVWIRE_SHM_PURE", "1")  # read by the child at import
        else:
            monkeypatch.delenv("KVWIRE_SHM_PURE", raising=False)
        p = CTX.Process(target=reader_main, args=(q.export_handle(), r, n, seed, CHUNK, out,
                                                  {"report_native": True}))
        p.start()
        procs.append(p)
    monkeypatch.delenv("KVWIRE_SHM_PURE", raising=False)
    return q, out, procs


@needs_c
def test_c_writer_with_a_pure_and_a_c_reader(monkeypatch) -> None:
    """One ring, read by a pure-Python process and a C-path process; random sizes across
    the chunk size and overflow, numpy (out of band), raw bytes and small objects."""
    n, seed = 150, 31
    q, out, procs = _mixed_readers(monkeypatch, {0}, 2, n, seed)
    q.wait_until_ready(timeout=60)
    assert q.native
    for i in range(n):
        q.enqueue(make_message(i, seed, CHUNK), timeout=30)
    res = {}
    for _ in procs:
        rank, count, err, native = out.get(timeout=60)
        res[rank] = (count, err, native)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert res == {0: (n, None, False), 1: (n, None, True)}
    q.close()


@needs_c
def test_pure_writer_with_a_c_reader(monkeypatch) -> None:
    n, seed = 150, 32
    hq, out = CTX.Queue(), CTX.Queue()
    monkeypatch.setenv("KVWIRE_SHM_PURE", "1")
    w = CTX.Process(target=writer_main, args=(hq, 1, n, seed, CHUNK, out))
    w.start()
    monkeypatch.delenv("KVWIRE_SHM_PURE")
    r = MessageQueue.create_from_handle(hq.get(timeout=60), 0)
    r.wait_until_ready(timeout=60)
    assert r.native
    for i in range(n):
        got, want = r.dequeue(timeout=30), make_message(i, seed, CHUNK)
        if isinstance(want, np.ndarray):
            assert np.array_equal(got, want) and got.dtype == want.dtype, i
        else:
            assert type(got) is type(want) and got == want, i
    assert out.get(timeout=60) == ("writer", False, None)
    w.join(30)
    assert w.exitcode == 0
    r.close()


# ------------------------------------------------------------- edge cases (either path)
def test_unpicklable_object_raises_and_the_queue_goes_on() -> None:
    w, (r,) = pair()
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        w.enqueue(lambda: 1)
    w.enqueue(("ok", 1))
    assert r.dequeue(timeout=5) == ("ok", 1)
    w.close()
    r.close()


def test_sizes_around_the_fast_paths() -> None:
    """Subset objects, other types, shared references, and single frames above the C
    reader's copy-out limit (64 KiB), which it leaves to the general path."""
    w, (r,) = pair(max_chunk_bytes=1 << 18, max_chunks=4)
    shared = [1, 2]
    cases = [None, True, 0, -1, 2**63 - 1, -(2**63), 2**80, 1.5, float("-inf"), "", "é" * 3,
             b"", b"x" * 4095, {"a": (1, [2.5, None])}, (shared, shared), {1, 2}, 1j,
             {"s": "x" * 100_000}, ["y" * 70_000], bytearray(b"ba")]
    for obj in cases:
        w.enqueue(obj, timeout=5)
        got = r.dequeue(timeout=5)
        assert type(got) is type(obj) and got == obj, obj
    w.enqueue((shared, shared))
    a, b = r.dequeue(timeout=5)
    assert a is b  # pickle's sharing semantics kept
    w.close()
    r.close()


def test_full_ring_times_out_then_frees_as_the_reader_reads() -> None:
    w, (r,) = pair(max_chunks=3)
    for i in range(3):
        w.enqueue(i)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        w.enqueue(3, timeout=0.05)
    assert time.monotonic() - t0 < 5
    assert r.dequeue(timeout=5) == 0
    for i in range(3, 40):  # the writer re-reads the reader's position as it goes
        w.enqueue(i, timeout=5)
        assert r.dequeue(timeout=5) == i - 2
    w.close()
    r.close()


def test_dropped_reader_raises_instead_of_reading_reused_chunks() -> None:
    w, (r,) = pair(max_chunks=2)
    w.drop_reader(0)
    for i in range(5):  # no live reader left: the writer laps reader 0, reusing its chunks
        w.enqueue(i, timeout=5)
    with pytest.raises(QueueShutdownError, match="dropped"):
        r.dequeue(timeout=5)
    w.close()
    r.close()


def test_reader_closed_by_another_thread_while_it_sleeps() -> None:
    """The blocked thread must raise, not touch an unmapped ring (C path: it sleeps in C
    with the GIL released; close() defers the unmap to it)."""
    w, (r,) = pair()
    err: list[BaseException] = []

    def read() -> None:
        try:
            r.dequeue()
        except BaseException as e:
            err.append(e)

    t = threading.Thread(target=read)
    t.start()
    wait_for(lambda: w.buffer.mv[L.OFF_SLEEPERS] == 1)  # asleep on the futex
    r.close()
    t.join(10)
    assert not t.is_alive()
    assert isinstance(err[0], QueueShutdownError), err  # never the released view's ValueError
    w.enqueue(1)  # the writer is not disturbed (the reader left: status CLOSED)
    w.close()


def test_many_messages_with_wraparound_and_wakeups_in_one_process() -> None:
    """Sleep/wake in both directions with a reader thread, through many ring laps."""
    w, (r,) = pair(max_chunks=2, spin_s=0.0)
    n = 3000
    got: list = []
    t = threading.Thread(target=lambda: got.extend(r.dequeue(timeout=10) for _ in range(n)))
    t.start()
    for i in range(n):
        w.enqueue((i, "x" * (i % 300)), timeout=10)
    t.join(30)
    assert got == [(i, "x" * (i % 300)) for i in range(n)]
    w.close()
    r.close()
