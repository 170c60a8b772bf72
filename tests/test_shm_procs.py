"""kvwire.shm across real spawned processes: 1 writer, 1-3 readers, local and remote."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest
from shm_helpers.workers import make_message, reader_main

from kvwire.shm import MessageQueue, MsgspecSerializer, ShmQueueError

pytestmark = pytest.mark.timeout(180)  # fail fast instead of the global 300 s

CTX = mp.get_context("spawn")
CHUNK = 4096


def _run_readers(q: MessageQueue, ranks: list[int], n: int, seed: int, opts=None):
    out = CTX.Queue()
    procs = [CTX.Process(target=reader_main,
                         args=(q.export_handle(), r, n, seed, CHUNK, out, opts)) for r in ranks]
    for p in procs:
        p.start()
    return out, procs


def _collect(out, procs, k: int) -> dict[int, tuple]:
    res = {}
    for _ in range(k):
        rank, count, err = out.get(timeout=60)
        res[rank] = (count, err)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return res


@pytest.mark.parametrize("n_reader", [1, 2, 3])
def test_every_reader_gets_every_message_in_order(n_reader: int) -> None:
    """Random sizes across the chunk size and beyond it (overflow through several chunks)."""
    n, seed = 120, 7 + n_reader
    q = MessageQueue(n_reader, n_reader, max_chunk_bytes=CHUNK, max_chunks=4)
    out, procs = _run_readers(q, list(range(n_reader)), n, seed)
    q.wait_until_ready(timeout=60)
    for i in range(n):
        q.enqueue(make_message(i, seed, CHUNK), timeout=30)
    res = _collect(out, procs, n_reader)
    assert res == {r: (n, None) for r in range(n_reader)}
    q.close()


def test_remote_and_local_readers_on_loopback() -> None:
    """Rank 0 reads shared memory, ranks 1-2 read over TCP; same order, same content."""
    n, seed = 80, 99
    q = MessageQueue(3, 1, [0], max_chunk_bytes=CHUNK, max_chunks=4, connect_ip="127.0.0.1")
    assert q.export_handle().remote_subscribe_addr.startswith("tcp://127.0.0.1:")
    out, procs = _run_readers(q, [0, 1, 2], n, seed, {"trust": True})
    q.wait_until_ready(timeout=60)
    for i in range(n):
        q.enqueue(make_message(i, seed, CHUNK), timeout=30)
    assert _collect(out, procs, 3) == {r: (n, None) for r in range(3)}
    q.close()


def test_remote_reader_with_msgspec_needs_no_pickle_trust() -> None:
    n = 50
    q = MessageQueue(2, 1, [0], max_chunk_bytes=CHUNK, max_chunks=4, connect_ip="127.0.0.1",
                     serializer=MsgspecSerializer())
    out, procs = _run_readers(q, [0, 1], n, 0, {"msgspec": True})
    q.wait_until_ready(timeout=60)
    for i in range(n):
        q.enqueue({"i": i, "s": "x" * (i % 50)})
    assert _collect(out, procs, 2) == {0: (n, None), 1: (n, None)}
    q.close()


def test_remote_reader_refuses_pickle_without_opt_in(monkeypatch) -> None:
    monkeypatch.delenv("KVWIRE_SHM_TRUST_REMOTE_PICKLE", raising=False)
    q = MessageQueue(1, 0, connect_ip="127.0.0.1")
    h = pickle.loads(pickle.dumps(q.export_handle()))
    with pytest.raises(ShmQueueError, match="refusing to unpickle"):
        MessageQueue.create_from_handle(h, 0)
    q.close()
