"""Benchmark kvwire.shm.MessageQueue against multiprocessing.Queue, Pipe and a ZeroMQ ipc PAIR.

One writer process and one reader process (spawned). Measures:
  * ping-pong round trip of a small object, the tuple ("step", 42, [1, 2, 3]) (two queues,
    one per direction),
  * one-way throughput of that small tuple,
  * one-way throughput of 4 MiB bytes (for kvwire also numpy, and in place),
  * for each of those, the CPU time both sides spent (process_time of the writer process
    and of the reader/echo process over the same messages, per message): a reader that
    spins instead of sleeping costs a core, which wall-clock rates alone would hide,
  * wake-up latency (kvwire only, next to a bare futex): the reader has been idle and asleep
    for ~1 s, the writer (busy, as an engine between steps) enqueues; time from just
    before enqueue to the reader's return from dequeue, median and p90 of a few trials.
    Baselines, same pattern, two processes: a futex wake timed in C right after the
    kernel returns (the VM's floor), and the same wake once back in the interpreter.

kvwire runs twice: with its C hot path (kvwire.shm._ring) in this process, and in a
subprocess with KVWIRE_SHM_PURE=1 (the pure-Python path), so both are in one table.
Every transport moves the same number of messages.

Run: .venv/bin/python bench/shm.py            (about a minute)
     .venv/bin/python bench/shm.py --quick    (about ten seconds, smaller counts)
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

SMALL = ("step", 42, [1, 2, 3])
BIG = 4 * 1024 * 1024
WAKE_BUSY_S = 0.005  # the writer computes this long before each wake-up enqueue


def _now() -> float:
    return time.perf_counter()


# ------------------------------------------------------------------ ping-pong
def _pingpong_child(kind: str, a: Any, b: Any, warm: int, n: int, res: Any) -> None:
    """Echo: read from a, write to b; report the CPU time of the n timed round trips."""
    cpu0 = 0.0
    if kind == "kvwire":
        from kvwire.shm import MessageQueue

        rq = MessageQueue.create_from_handle(a, 0)
        wq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=64)
        b.put(wq.export_handle())
        rq.wait_until_ready()
        wq.wait_until_ready()
        for i in range(warm + n):
            if i == warm:
                cpu0 = time.process_time()
            wq.enqueue(rq.dequeue())
        res.put(time.process_time() - cpu0)
        rq.close()
        wq.close()
        return
    if kind == "mp.Queue":
        def echo() -> None:
            b.put(a.get())
    elif kind == "mp.Pipe":
        def echo() -> None:
            b.send(a.recv())
    else:
        import pickle

        import zmq

        s = zmq.Context.instance().socket(zmq.PAIR)
        s.connect(a)

        def echo() -> None:
            s.send(pickle.dumps(pickle.loads(s.recv())))
    for i in range(warm + n):
        if i == warm:
            cpu0 = time.process_time()
        echo()
    res.put(time.process_time() - cpu0)


def bench_pingpong(kind: str, n: int) -> tuple[float, float, float]:
    """Average round trip in us over n round trips, after n // 10 untimed warm-up ones,
    and the CPU us per round trip of this process and of the echo process."""
    ctx = mp.get_context("spawn")
    warm = n // 10
    cpu_q = ctx.Queue()
    if kind == "kvwire":
        from kvwire.shm import MessageQueue

        wq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=64)
        back = ctx.Queue()
        p = ctx.Process(target=_pingpong_child,
                        args=(kind, wq.export_handle(), back, warm, n, cpu_q))
        p.start()
        rq = MessageQueue.create_from_handle(back.get(), 0)
        wq.wait_until_ready()
        rq.wait_until_ready()
        send, recv = wq.enqueue, rq.dequeue
    elif kind == "mp.Queue":
        q1, q2 = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_pingpong_child, args=(kind, q1, q2, warm, n, cpu_q))
        p.start()
        send, recv = q1.put, q2.get
    elif kind == "mp.Pipe":
        a1, b1 = ctx.Pipe()
        a2, b2 = ctx.Pipe()
        p = ctx.Process(target=_pingpong_child, args=(kind, b1, a2, warm, n, cpu_q))
        p.start()
        send, recv = a1.send, b2.recv
    else:
        import pickle

        import zmq

        path = "ipc://" + os.path.join(tempfile.mkdtemp(), "pp")
        s = zmq.Context.instance().socket(zmq.PAIR)
        s.bind(path)
        p = ctx.Process(target=_pingpong_child, args=(kind, path, None, warm, n, cpu_q))
        p.start()

        def send(o: Any) -> None:
            s.send(pickle.dumps(o))

        def recv() -> Any:
            return pickle.loads(s.recv())

    for _ in range(warm):
        send(SMALL)
        recv()
    t0, c0 = _now(), time.process_time()
    for _ in range(n):
        send(SMALL)
        recv()
    dt, cpu = _now() - t0, time.process_time() - c0
    cpu_echo = cpu_q.get()
    p.join()
    if kind == "kvwire":
        wq.close()
        rq.close()
    return dt / n * 1e6, cpu / n * 1e6, cpu_echo / n * 1e6


# ------------------------------------------------------------------ one way
def _sink_child(kind: str, src: Any, res: Any, n: int, payload: str) -> None:
    """Reader: receive n messages, report elapsed time from the first to the last."""
    if kind.startswith("kvwire"):
        from kvwire.shm import MessageQueue

        q = MessageQueue.create_from_handle(src, 0)
        q.wait_until_ready()
        if kind == "kvwire-inplace":
            with q.dequeue_inplace() as m:
                size = len(memoryview(m).cast("B")) if payload != "small" else 0
            t0, c0 = _now(), time.process_time()
            for _ in range(n - 1):
                with q.dequeue_inplace() as m:
                    pass
        else:
            m = q.dequeue()
            t0, c0 = _now(), time.process_time()
            for _ in range(n - 1):
                m = q.dequeue()
            size = m.nbytes if payload == "numpy" else (len(m) if payload == "bytes" else 0)
        res.put((_now() - t0, time.process_time() - c0, size))
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
    t0, c0 = _now(), time.process_time()
    for _ in range(n - 1):
        m = get()
    res.put((_now() - t0, time.process_time() - c0, len(m) if payload == "bytes" else 0))


def bench_oneway(kind: str, n: int, payload: str) -> tuple[float, float, float]:
    """Messages/s for small payloads, GB/s for big ones (measured at the reader), and the
    CPU us per message of the writer (all its threads, until the reader is done) and of
    the reader (over the same n - 1 messages its rate is measured on)."""
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

    c0 = time.process_time()
    for _ in range(n):
        send(obj)
    dt, cpu_r, _size = res.get()
    cpu_w = time.process_time() - c0
    p.join()
    if kind.startswith("kvwire"):
        wq.close()
    rate = (n - 1) * BIG / dt / 1e9 if big else (n - 1) / dt
    return rate, cpu_w / n * 1e6, cpu_r / (n - 1) * 1e6


# ------------------------------------------------------------------ wake-up latency
def _busy(seconds: float) -> None:
    end = _now() + seconds
    while _now() < end:
        pass


def _wake_kvwire_child(handle: Any, n: int, res: Any) -> None:
    from kvwire.shm import MessageQueue

    # No liveness timer: the reader stays asleep for the whole idle period, as the futex
    # baseline does (with the default 100 ms timer it would wake up 10 times a second).
    q = MessageQueue.create_from_handle(handle, 0, liveness_interval=3600.0)
    q.wait_until_ready()
    res.put("ready")
    lat = []
    for _ in range(n):
        sent_ns = q.dequeue(indefinite=True)
        lat.append(time.perf_counter_ns() - sent_ns)
    res.put(lat)
    q.close()


def bench_wake_kvwire(trials: int, idle: float) -> list[float]:
    """Wake-up latencies (us): enqueue -> return from dequeue of a reader asleep for ``idle``."""
    from kvwire.shm import MessageQueue

    ctx = mp.get_context("spawn")
    res = ctx.Queue()
    q = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=4)
    p = ctx.Process(target=_wake_kvwire_child, args=(q.export_handle(), trials, res))
    p.start()
    q.wait_until_ready()
    assert res.get() == "ready"
    for _ in range(trials):
        time.sleep(idle)
        _busy(WAKE_BUSY_S)
        q.enqueue(time.perf_counter_ns())
    lat = res.get()
    p.join()
    q.close()
    return [ns / 1e3 for ns in lat]


def _wake_futex_child(buf: Any, n: int, res: Any) -> None:
    from kvwire.shm import layout as L
    from kvwire.shm import wake

    addr = buf.base_address + L.OFF_RWAKE
    u32 = buf.u32
    res.put("ready")
    for _ in range(n):
        g = u32[L.OFF_RWAKE // 4]
        woke = wake.futex_wait(addr, g, None)
        t_py = time.perf_counter_ns()  # back in the interpreter
        res.put((woke if woke > 1 else t_py, t_py))  # C version: kernel-return time
    buf.close()


def bench_wake_futex(trials: int, idle: float) -> tuple[list[float], list[float], str]:
    """Futex wake-up latencies (us) between two processes, same idle/busy pattern: to the
    kernel's return (C timestamp; the bare futex) and to the interpreter's."""
    from kvwire.shm import ShmRingBuffer, wake
    from kvwire.shm import layout as L
    from kvwire.shm._native import ring

    ctx = mp.get_context("spawn")
    res = ctx.Queue()
    buf = ShmRingBuffer(1, 64, 1)
    p = ctx.Process(target=_wake_futex_child, args=(buf, trials, res))
    p.start()
    assert res.get() == "ready"
    addr = buf.base_address + L.OFF_RWAKE
    u32 = buf.u32
    lat, lat_py = [], []
    for _ in range(trials):
        time.sleep(idle)  # the child re-armed long ago (it did right after reporting)
        _busy(WAKE_BUSY_S)
        t0 = time.perf_counter_ns()
        if ring is not None:
            ring.bump_and_wake(addr)
        else:
            u32[L.OFF_RWAKE // 4] = (u32[L.OFF_RWAKE // 4] + 1) & 0xFFFFFFFF
            wake.futex_wake(addr)
        t_kernel, t_py = res.get()
        lat.append((t_kernel - t0) / 1e3)
        lat_py.append((t_py - t0) / 1e3)
    p.join()
    buf.close()
    return lat, lat_py, "C" if ring is not None else "ctypes"


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


# ------------------------------------------------------------------ driver
def counts(quick: bool) -> dict[str, Any]:
    if quick:
        return {"pp": 2000, "small": 20000, "big": 50, "wake": 3, "idle": 0.2}
    return {"pp": 20000, "small": 300000, "big": 400, "wake": 11, "idle": 1.0}


def kvwire_core(c: dict[str, Any]) -> dict[str, Any]:
    """kvwire measurements that run once per hot path (C, then pure Python)."""
    from kvwire.shm._native import NATIVE

    return {
        "native": NATIVE,
        "pp": bench_pingpong("kvwire", c["pp"]),
        "small": bench_oneway("kvwire", c["small"], "small"),
        "big": bench_oneway("kvwire", c["big"], "bytes"),
        "wake": bench_wake_kvwire(c["wake"], c["idle"]),
    }


def run_pure(quick: bool) -> dict[str, Any] | None:
    """kvwire_core in a subprocess with KVWIRE_SHM_PURE=1 (its spawned readers inherit it)."""
    env = dict(os.environ, KVWIRE_SHM_PURE="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--kvwire-only"] + (
        ["--quick"] if quick else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        print(f"pure-Python kvwire run failed:\n{r.stderr}", file=sys.stderr)
        return None
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["native"] is False, "KVWIRE_SHM_PURE=1 did not select the pure-Python path"
    return out


def _wake_cell(lat: list[float] | None) -> str:
    if not lat:
        return ""
    return f"{statistics.median(lat):,.0f} / {pct(lat, 0.9):,.0f}"


def _cpu_cell(m: Any, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    """'writer / reader' CPU per message (us, times ``scale``), or '' when not measured."""
    if m is None:
        return ""
    return f"{fmt.format(m[1] * scale)} / {fmt.format(m[2] * scale)}"


Row = tuple[str, Any, Any, Any, "list[float] | None"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small counts, a few seconds")
    ap.add_argument("--kvwire-only", action="store_true",
                    help="internal: kvwire rows only, as JSON (used for the pure-Python row)")
    args = ap.parse_args()
    c = counts(args.quick)
    if args.kvwire_only:
        print(json.dumps(kvwire_core(c)))
        return

    from kvwire.shm._native import NATIVE, REASON

    rows: list[Row] = []
    main_kv = kvwire_core(c)
    rows.append(("kvwire, C hot path" if NATIVE else "kvwire, pure Python", main_kv["pp"],
                 main_kv["small"], main_kv["big"], main_kv["wake"]))
    if NATIVE:
        pure = run_pure(args.quick)
        if pure is not None:
            rows.append(("kvwire, pure Python", pure["pp"], pure["small"], pure["big"],
                         pure["wake"]))
    for k in ["mp.Queue", "mp.Pipe", "zmq-ipc"]:  # the same message counts as kvwire's
        rows.append((k, bench_pingpong(k, c["pp"]), bench_oneway(k, c["small"], "small"),
                     bench_oneway(k, c["big"], "bytes"), None))
    futex, futex_py, how = bench_wake_futex(c["wake"], c["idle"])
    if how == "C":
        rows.append(("bare futex wake", None, None, None, futex))
    rows.append(("futex wake, back in Python", None, None, None, futex_py))
    for name, kind, payload in (("kvwire numpy (copy)", "kvwire", "numpy"),
                                ("kvwire numpy (in place)", "kvwire-inplace", "numpy"),
                                ("kvwire bytes (in place)", "kvwire-inplace", "bytes")):
        rows.append((name, None, None, bench_oneway(kind, c["big"], payload), None))

    print(f"\nkvwire.shm benchmark: 1 writer + 1 reader process, {os.cpu_count()} CPUs, "
          f"Python {sys.version.split()[0]}" + ("" if NATIVE else f" (C path off: {REASON})"))
    print(f"small = {SMALL!r}, pickled by every transport (kvwire's C path writes the "
          f"pickle opcodes itself); 4 MiB = bytes unless named; wake = enqueue -> dequeue "
          f"returns, reader asleep for {c['idle']:g} s, {c['wake']} trials")
    print(f"messages per transport: {c['pp']:,} round trips, {c['small']:,} small, "
          f"{c['big']:,} x 4 MiB; CPU = process time per message of the writer / the "
          f"reader (echo) process")
    cols = [("transport", 28), ("RTT small (us)", 14), ("RTT CPU w / r (us)", 18),
            ("small msgs/s", 12), ("small CPU w / r (us)", 20), ("4 MiB GB/s", 10),
            ("4 MiB CPU w / r (ms)", 20), ("wake p50 / p90 (us)", 19)]
    print("| " + " | ".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}"
                             for i, (h, w) in enumerate(cols)) + " |")
    print("|" + "|".join("-" * (w + 2) for _, w in cols) + "|")
    for name, pp, small, big, wake in rows:
        cells = [name, "" if pp is None else f"{pp[0]:.1f}", _cpu_cell(pp),
                 "" if small is None else f"{small[0]:,.0f}", _cpu_cell(small),
                 "" if big is None else f"{big[0]:.2f}", _cpu_cell(big, 1e-3, "{:.2f}"),
                 _wake_cell(wake)]
        print("| " + " | ".join(f"{v:<{w}}" if i == 0 else f"{v:>{w}}"
                                 for i, (v, (_, w)) in enumerate(zip(cells, cols))) + " |")


if __name__ == "__main__":
    main()
