"""Benchmark kvwire.shm.MessageQueue against multiprocessing.Queue, Pipe and a ZeroMQ ipc PAIR.

One writer process and one reader process (spawned), three measures each:
  * ping-pong round trip of a small object (two queues, one per direction),
  * one-way throughput of small objects,
  * one-way throughput of 4 MiB payloads (bytes; for kvwire also numpy and in-place).

Run: .venv/bin/python bench/shm.py            (about a minute)
     .venv/bin/python bench/shm.py --quick    (a few seconds, smaller counts)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from typing import Any

SMALL = ("step", 42, [1, 2, 3])
BIG = 4 * 1024 * 1024


# ------------------------------------------------------------------ transports
class KvwireEnd:
    """One direction of kvwire transport; writer side builds it, reader side joins."""

    def __init__(self, big: bool = False, inplace: bool = False) -> None:
        from kvwire.shm import MessageQueue

        chunk = BIG + 4096 if big else 4096
        self.mq = MessageQueue(1, 1, max_chunk_bytes=chunk, max_chunks=8 if big else 64)
        self.inplace = inplace

    def handle(self) -> Any:
        return self.mq.export_handle()


def kv_join(handle: Any) -> Any:
    from kvwire.shm import MessageQueue

    return MessageQueue.create_from_handle(handle, 0)


def _now() -> float:
    return time.perf_counter()


def _pingpong_child(kind: str, a: Any, b: Any, n: int) -> None:
    # echo: read from a, write to b
    if kind == "kvwire":
        from kvwire.shm import MessageQueue

        rq = MessageQueue.create_from_handle(a, 0)
        wq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=64)
        b.put(wq.export_handle())
        rq.wait_until_ready()
        wq.wait_until_ready()
        for _ in range(n):
            wq.enqueue(rq.dequeue())
        rq.close()
        wq.close()
    elif kind == "mp.Queue":
        for _ in range(n):
            b.put(a.get())
    elif kind == "mp.Pipe":
        for _ in range(n):
            b.send(a.recv())
    elif kind == "zmq-ipc":
        import pickle

        import zmq

        s = zmq.Context.instance().socket(zmq.PAIR)
        s.connect(a)
        for _ in range(n):
            s.send(pickle.dumps(pickle.loads(s.recv())))
        s.close()


def bench_pingpong(kind: str, n: int) -> float:
    ctx = mp.get_context("spawn")
    if kind == "kvwire":
        from kvwire.shm import MessageQueue

        wq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=64)
        back = ctx.Queue()
        p = ctx.Process(target=_pingpong_child, args=(kind, wq.export_handle(), back, n))
        p.start()
        rq = MessageQueue.create_from_handle(back.get(), 0)
        wq.wait_until_ready()
        rq.wait_until_ready()
        send, recv = wq.enqueue, rq.dequeue
        for _ in range(min(n // 10, 1000)):
            pass
        t0 = _now()
        for _ in range(n):
            send(SMALL)
            recv()
        dt = _now() - t0
        p.join()
        wq.close()
        rq.close()
        return dt / n * 1e6
    if kind == "mp.Queue":
        q1, q2 = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_pingpong_child, args=(kind, q1, q2, n))
        p.start()
        send, recv = q1.put, q2.get
    elif kind == "mp.Pipe":
        a1, b1 = ctx.Pipe()
        a2, b2 = ctx.Pipe()
        p = ctx.Process(target=_pingpong_child, args=(kind, b1, a2, n))
        p.start()
        send, recv = a1.send, b2.recv
    else:
        import pickle

        import zmq

        path = "ipc://" + os.path.join(tempfile.mkdtemp(), "pp")
        s = zmq.Context.instance().socket(zmq.PAIR)
        s.bind(path)
        p = ctx.Process(target=_pingpong_child, args=(kind, path, None, n))
        p.start()

        def send(o: Any) -> None:
            s.send(pickle.dumps(o))

        def recv() -> Any:
            return pickle.loads(s.recv())

    t0 = _now()
    for _ in range(n):
        send(SMALL)
        recv()
    dt = _now() - t0
    p.join()
    return dt / n * 1e6


def _sink_child(kind: str, src: Any, res: Any, n: int, payload: str) -> None:
    """Reader: receive n messages, report elapsed time from the first to the last."""
    if kind.startswith("kvwire"):
        from kvwire.shm import MessageQueue

        q = MessageQueue.create_from_handle(src, 0)
        q.wait_until_ready()
        if kind == "kvwire-inplace":
            with q.dequeue_inplace() as m:
                size = len(memoryview(m).cast("B")) if payload != "small" else 0
            t0 = _now()
            for _ in range(n - 1):
                with q.dequeue_inplace() as m:
                    pass
        else:
            m = q.dequeue()
            t0 = _now()
            for _ in range(n - 1):
                m = q.dequeue()
            size = m.nbytes if payload == "numpy" else (len(m) if payload == "bytes" else 0)
        res.put((_now() - t0, size))
        q.close()
        return
    if kind == "mp.Queue":
        get = src.get
    elif kind == "mp.Pipe":
        get = src.recv
    else:
        import pickle

        import zmq

        s = zmq.Context.instance().socket(zmq.PAIR)
        s.connect(src)

        def get() -> Any:
            return pickle.loads(s.recv(copy=False).buffer)

    m = get()
    t0 = _now()
    for _ in range(n - 1):
        m = get()
    res.put((_now() - t0, len(m) if payload == "bytes" else 0))


def bench_oneway(kind: str, n: int, payload: str) -> float:
    """Messages/s for small payloads, GB/s for big ones (measured at the reader)."""
    import numpy as np

    ctx = mp.get_context("spawn")
    res = ctx.Queue()
    if payload == "small":
        obj: Any = SMALL
    elif payload == "numpy":
        obj = np.ones(BIG // 8, dtype=np.float64)
    else:
        obj = b"x" * BIG
    big = payload != "small"
    if kind.startswith("kvwire"):
        from kvwire.shm import MessageQueue

        wq = MessageQueue(1, 1, max_chunk_bytes=BIG + 4096 if big else 4096,
                          max_chunks=8 if big else 256)
        p = ctx.Process(target=_sink_child, args=(kind, wq.export_handle(), res, n, payload))
        p.start()
        wq.wait_until_ready()
        send = wq.enqueue
    elif kind == "mp.Queue":
        q = ctx.Queue()
        p = ctx.Process(target=_sink_child, args=(kind, q, res, n, payload))
        p.start()
        send = q.put
    elif kind == "mp.Pipe":
        a, b = ctx.Pipe()
        p = ctx.Process(target=_sink_child, args=(kind, b, res, n, payload))
        p.start()
        send = a.send
    else:
        import pickle

        import zmq

        path = "ipc://" + os.path.join(tempfile.mkdtemp(), "ow")
        s = zmq.Context.instance().socket(zmq.PAIR)
        s.bind(path)
        p = ctx.Process(target=_sink_child, args=(kind, path, res, n, payload))
        p.start()

        def send(o: Any) -> None:
            s.send(pickle.dumps(o, protocol=5), copy=not big)

    for _ in range(n):
        send(obj)
    dt, _size = res.get()
    p.join()
    if kind.startswith("kvwire"):
        wq.close()
    if big:
        return (n - 1) * BIG / dt / 1e9
    return (n - 1) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small counts, a few seconds")
    args = ap.parse_args()
    n_pp, n_small, n_big = (2000, 20000, 50) if args.quick else (20000, 300000, 400)
    kinds = ["kvwire", "mp.Queue", "mp.Pipe", "zmq-ipc"]
    rows = []
    for k in kinds:
        pp = bench_pingpong(k, n_pp if k == "kvwire" else n_pp // 4)
        small = bench_oneway(k, n_small if k == "kvwire" else n_small // 4, "small")
        big = bench_oneway(k, n_big if k == "kvwire" else n_big // 4, "bytes")
        rows.append((k, pp, small, big))
    np_copy = bench_oneway("kvwire", n_big, "numpy")
    np_view = bench_oneway("kvwire-inplace", n_big, "numpy")
    by_view = bench_oneway("kvwire-inplace", n_big, "bytes")
    print(f"\nkvwire.shm benchmark: 1 writer + 1 reader process, {os.cpu_count()} CPUs")
    w = 28
    print(f"| {'transport':<{w}} | {'ping-pong RTT (us)':>18} | {'small msgs/s':>12} | "
          f"{'4 MiB GB/s':>10} |")
    print(f"|{'-' * (w + 2)}|{'-' * 20}|{'-' * 14}|{'-' * 12}|")
    for k, pp, small, big in rows:
        name = f"{k} (bytes)"
        print(f"| {name:<{w}} | {pp:>18.1f} | {small:>12,.0f} | {big:>10.2f} |")
    for name, v in (("kvwire numpy (copy)", np_copy), ("kvwire numpy (in place)", np_view),
                    ("kvwire bytes (in place)", by_view)):
        print(f"| {name:<{w}} | {'':>18} | {'':>12} | {v:>10.2f} |")


if __name__ == "__main__":
    main()
