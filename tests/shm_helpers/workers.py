"""Process entry points for the shm tests (spawn needs importable top-level functions)."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import numpy as np

from kvwire.shm import MessageQueue, MsgspecSerializer


class PipePut:
    """``put`` over a Pipe end: lets a helper report without mp.Queue's semaphores."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def put(self, obj: Any) -> None:
        self.conn.send(obj)


def make_message(i: int, seed: int, chunk: int) -> Any:
    """Deterministic message ``i``: sizes spread across the chunk size and past it (overflow)."""
    rng = random.Random(seed * 1_000_003 + i)
    kind = rng.randrange(4)
    size = rng.choice([0, 1, rng.randrange(chunk // 2), chunk - 200, chunk - 1, chunk,
                       chunk + 1, rng.randrange(chunk, 3 * chunk)])
    if kind == 0:
        return rng.randbytes(size)
    if kind == 1:
        return np.frombuffer(rng.randbytes(size // 8 * 8), dtype=np.int64).copy()
    if kind == 2:
        return {"i": i, "blob": rng.randbytes(size), "tag": f"m{i}"}
    return ("tuple", i, [i] * (size // 64))


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def reader_main(handle: Any, rank: int, n: int, seed: int, chunk: int, out: Any,
                opts: dict | None = None) -> None:
    """Read ``n`` messages, check each against make_message; report (rank, ok, first error)."""
    opts = opts or {}
    kw: dict[str, Any] = {}
    if opts.get("msgspec"):
        kw["serializer"] = MsgspecSerializer()
    if opts.get("trust"):
        kw["trust_remote_pickle"] = True
    try:
        q = MessageQueue.create_from_handle(handle, rank, **kw)
        q.wait_until_ready(timeout=30)
        bad = None
        for i in range(n):
            if opts.get("pause"):
                rng = random.Random(seed + i)
                if rng.random() < opts["pause"]:
                    time.sleep(rng.random() * 0.002)
            got = q.dequeue(timeout=30)
            want = i if opts.get("ints") else (
                {"i": i, "s": "x" * (i % 50)} if opts.get("msgspec")
                else make_message(i, seed, chunk))
            if bad is None and not same(want, got):
                bad = f"message {i}: got {type(got).__name__} {str(got)[:80]}"
        res: tuple = (rank, n if bad is None else -1, bad)
        out.put(res + (q.native,) if opts.get("report_native") else res)
        q.close()
    except BaseException as e:  # report, do not hang the parent
        res = (rank, -2, f"{type(e).__name__}: {e}")
        out.put(res + (None,) if opts.get("report_native") else res)


def idle_reader(handle: Any, rank: int, out: Any, msgspec: bool = False) -> None:
    """Attach, get ready, then stay alive without reading until killed."""
    kw = {"serializer": MsgspecSerializer()} if msgspec else {}
    q = MessageQueue.create_from_handle(handle, rank, **kw)
    q.wait_until_ready(timeout=30)
    out.put(("ready", rank, os.getpid()))
    while True:
        time.sleep(1)


def blocked_reader(handle: Any, rank: int, out: Any, liveness: float = 0.05) -> None:
    """Attach and block in dequeue(); report how it ended (the exception's type name).

    ``liveness`` is how often the waiting reader wakes on its own to check the writer: a
    long one makes it sleep until something wakes it."""
    q = MessageQueue.create_from_handle(handle, rank, liveness_interval=liveness)
    q.wait_until_ready(timeout=30)
    out.put(("ready", rank, os.getpid()))
    got = []
    try:
        while True:
            got.append(q.dequeue())
    except BaseException as e:
        out.put(("raised", type(e).__name__, got, time.monotonic()))


def writer_then_die(hq: Any, n_reader: int, n_msgs: int, how: str, go: Any) -> None:
    """Writer that publishes n_msgs then dies by ``how`` (sigkill / exit)."""
    q = MessageQueue(n_reader, n_reader, max_chunk_bytes=1024, max_chunks=4)
    hq.put(q.export_handle())
    q.wait_until_ready(timeout=30)
    go.wait(30)
    for i in range(n_msgs):
        q.enqueue(i)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


def echo_main(handle_in: Any, hq: Any, n: int) -> None:
    """Ping-pong partner: dequeue from one queue, enqueue the same object on another."""
    rq = MessageQueue.create_from_handle(handle_in, 0)
    wq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=16)
    hq.put(wq.export_handle())
    rq.wait_until_ready(timeout=30)
    wq.wait_until_ready(timeout=30)
    for _ in range(n):
        wq.enqueue(rq.dequeue(timeout=30))
    rq.close()
    wq.close()


def stress_reader(handle: Any, rank: int, n: int | None, seed: int, out: Any) -> None:
    """Read 0..n-1 with random pauses; report the first mismatch. ``n=None``: read until
    the writer's None (a time-bounded run) and report (count, first mismatch)."""
    # No liveness polling: a lost wake-up would then hang until the dequeue timeout.
    q = MessageQueue.create_from_handle(handle, rank, spin_s=20e-6, liveness_interval=1e4,
                                        warn_interval=0)
    q.wait_until_ready(timeout=30)
    rng = random.Random(seed + rank)
    bad = None
    i = 0
    while n is None or i < n:
        if rng.random() < 0.001:
            time.sleep(rng.random() * 0.003)
        elif rng.random() < 0.01:
            time.sleep(0)
        got = q.dequeue(timeout=30)
        if n is None and got is None:
            break
        if bad is None and got != i:
            bad = (i, got)
        i += 1
    out.put((rank, bad if n is not None else (i, bad)))
    q.close()


def group_member(kind: str, port: int, rank: int, world: int, out: Any) -> None:
    """One rank of a group: broadcast through create_from_process_group, then gather
    through create_from_process_group_single_reader. Reports what it received."""
    try:
        if kind == "torch":
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                    rank=rank, world_size=world)
            pg: Any = dist.group.WORLD
        else:
            from kvwire.shm import StatelessGroup

            pg = StatelessGroup("127.0.0.1", port, rank, world)
        mq = MessageQueue.create_from_process_group(pg, 1 << 16, 4, writer_rank=1)
        got = []
        for i in range(5):
            got.append(mq.broadcast_object({"step": i} if rank == 1 else None))
        mine, handles = MessageQueue.create_from_process_group_single_reader(pg, 1 << 16, 4,
                                                                            reader_rank=0)
        readers = [MessageQueue.create_from_handle(h, 0) for h in handles]
        mine.wait_until_ready(timeout=60)
        for r in readers:
            r.wait_until_ready(timeout=60)
        mine.enqueue(("from", rank))
        gathered = [r.dequeue(timeout=60) for r in readers]
        out.put((rank, got, gathered))
        if kind == "torch":
            dist.barrier()
            dist.destroy_process_group()
        else:
            pg.barrier()
    except BaseException as e:
        out.put((rank, f"{type(e).__name__}: {e}", None))


def external_member(port: int, rank: int, world: int, handle: Any, out: Any) -> None:
    """A group rank reading from a writer outside the group (external_writer_handle)."""
    try:
        from kvwire.shm import StatelessGroup

        pg = StatelessGroup("127.0.0.1", port, rank, world)
        mq = MessageQueue.create_from_process_group(pg, 0, 0, external_writer_handle=handle)
        out.put((rank, [mq.dequeue(timeout=60) for _ in range(3)]))
        pg.barrier()
    except BaseException as e:
        out.put((rank, f"{type(e).__name__}: {e}"))


def writer_main(hq: Any, n_reader: int, n: int, seed: int, chunk: int, out: Any) -> None:
    """Writer in its own process: publish make_message(0..n-1); report (tag, native, error)."""
    try:
        q = MessageQueue(n_reader, n_reader, max_chunk_bytes=chunk, max_chunks=4)
        hq.put(q.export_handle())
        q.wait_until_ready(timeout=60)
        for i in range(n):
            q.enqueue(make_message(i, seed, chunk), timeout=30)
        out.put(("writer", q.native, None))
        q.close()
    except BaseException as e:  # report, do not hang the parent
        out.put(("writer", None, f"{type(e).__name__}: {e}"))



def shutdown_writer(hq: Any, env_local: bool, steps: Any, done: Any) -> None:
    """Writer that shuts down without writing, then closes when told (vLLM's cancel test).

    ``env_local`` sets KVWIRE_SHM_LOCAL_SHUTDOWN=1 in this process before the queue is
    built, as a deployment that cannot pass the keyword (create_from_process_group) would."""
    if env_local:
        os.environ["KVWIRE_SHM_LOCAL_SHUTDOWN"] = "1"
    q = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=4)
    hq.put((q.export_handle(), q.local_shutdown))
    q.wait_until_ready(timeout=30)
    steps.get(timeout=60)  # "shutdown"
    q.shutdown()
    done.put(("shut", q.shutting_down))
    steps.get(timeout=60)  # "close"
    q.close()
    done.put(("closed", time.monotonic()))
