"""Queues built over a process group: kvwire's StatelessGroup and torch.distributed gloo."""

from __future__ import annotations

import multiprocessing as mp

import pytest
from ports import free_port
from shm_helpers.workers import external_member, group_member

pytestmark = pytest.mark.timeout(180)  # fail fast instead of the global 300 s

CTX = mp.get_context("spawn")


def _run(kind: str, world: int = 3) -> None:
    out = CTX.Queue()
    port = free_port()
    ps = [CTX.Process(target=group_member, args=(kind, port, r, world, out))
          for r in range(world)]
    for p in ps:
        p.start()
    res = {}
    for _ in ps:
        rank, got, gathered = out.get(timeout=120)
        res[rank] = (got, gathered)
    for p in ps:
        p.join(60)
        assert p.exitcode == 0
    steps = [{"step": i} for i in range(5)]
    for rank in range(world):
        got, gathered = res[rank]
        assert got == steps, (rank, got)
        assert gathered == ([("from", r) for r in range(world)] if rank == 0 else [])


def test_stateless_group() -> None:
    _run("stateless")


def test_torch_gloo_group() -> None:
    pytest.importorskip("torch.distributed")
    _run("torch")


def test_external_writer_handle() -> None:
    """The writer is outside the group; every group rank reads (reader rank = group rank)."""
    from kvwire.shm import MessageQueue

    q = MessageQueue(2, 2, max_chunk_bytes=1024, max_chunks=4)
    out, port = CTX.Queue(), free_port()
    ps = [CTX.Process(target=external_member, args=(port, r, 2, q.export_handle(), out))
          for r in range(2)]
    for p in ps:
        p.start()
    q.wait_until_ready(timeout=60)
    for i in range(3):
        q.enqueue(i)
    assert dict(out.get(timeout=60) for _ in ps) == {0: [0, 1, 2], 1: [0, 1, 2]}
    for p in ps:
        p.join(30)
    q.close()
