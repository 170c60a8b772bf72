"""The processes of bench/jetstream.py (spawned; imported by name in the children): a reference
engine, consumers (kvwire Subscriber, raw nats-py), a bootstrapping consumer, and the CPU
sampler and small helpers the orchestration uses."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import random
import time
from typing import Any

import msgspec
import psutil
import zmq
from workload import step

from kvwire.consume.items import Batch, Snapshot
from kvwire.consume.subscriber import StreamSpec, Subscriber
from kvwire.wire import events as E

SUBJECT = "kvwire.events.e.0"




# ------------------------------------------------------------------ engine (reference publisher)


#: How a paced run spaces its batches (the same average rate):
#: ``even``: one batch every 1/rate s (an engine publishing one batch per step);
#: ``poisson``: independent arrivals, exponential gaps (many engines merged; fixed seed);
#: ``burst10``: ten back to back every 10/rate s (the pattern of the runs before 2026-11-24).
PACINGS = ("even", "poisson", "burst10")


def pacing(n: int, rate: float | None, how: str) -> list[float | None] | None:
    """When batch k is due, in seconds after the start (None: send at once)."""
    if not rate:
        return None
    if how == "even":
        return [k / rate for k in range(n)]
    if how == "burst10":
        return [k / rate if k % 10 == 0 else None for k in range(n)]
    if how == "poisson":
        rng = random.Random(1234)
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(rate)
        return out
    raise ValueError(f"unknown pacing {how!r}: one of {', '.join(PACINGS)}")


def engine_main(conn: Any) -> None:
    """A reference publisher: [topic, seq, payload] on PUB, whole replay answers on ROUTER
    (``[id, "", topic, seq, payload]``..., then seq -1). Unbounded queues: nothing dropped,
    so both paths see every batch (we measure transport, not loss handling)."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    rport = router.bind_to_random_port("tcp://127.0.0.1")
    conn.send((port, rport, os.getpid()))
    ring: list[bytes] = []  # every payload by seq (a bench-sized run fits in memory)
    send = pub.send_multipart

    def serve() -> None:
        while router.poll(0):
            frames = router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            for s in range(start, len(ring)):
                router.send_multipart([ident, b"", b"", s.to_bytes(8, "big"), ring[s]])
            router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    i = 1 << 20
    while True:
        if not conn.poll(0.01):
            serve()
            continue
        cmd = conn.recv()
        if cmd[0] == "quit":
            break
        if cmd[0] == "run":  # n reference steps at rate/s (None: flat out), paced as told
            _, n, rate, *rest = cmd
            due = pacing(n, rate, rest[0] if rest else "burst10")
            t0 = time.perf_counter()
            for k in range(n):
                if due is not None and due[k] is not None:
                    pause = t0 + due[k] - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)  # pacing the workload
                if k % 256 == 0:
                    serve()
                payload = E.encode_batch(step(i), "vllm")
                i += 1
                send([b"", len(ring).to_bytes(8, "big"), payload])
                ring.append(payload)
            conn.send(("done", time.perf_counter() - t0))
        elif cmd[0] == "fill":  # `blocks` live blocks, then 200 small batches/s until told
            h = 1
            for _ in range(cmd[1] // 1000):
                tokens = [t & 255 for t in range(h, h + 16_000)]
                payload = E.encode_batch(E.KVEventBatch(time.time(), [
                    E.BlockStored(list(range(h, h + 1000)), None, tokens, 16, None, "GPU")], 0))
                h += 1000
                send([b"", len(ring).to_bytes(8, "big"), payload])
                ring.append(payload)
                serve()
            conn.send(("filled", len(ring) - 1))
            nxt = time.perf_counter()
            while not conn.poll(0):
                nxt += 1 / 200
                time.sleep(max(0.0, nxt - time.perf_counter()))
                serve()
                payload = E.encode_batch(E.KVEventBatch(time.time(), [
                    E.BlockStored([h], h - 1, [1] * 16, 16, None, "GPU")], 0))
                h += 1
                send([b"", len(ring).to_bytes(8, "big"), payload])
                ring.append(payload)
    pub.close(0)
    router.close(0)
    ctx.term()


# ------------------------------------------------------------------ consumer


def consumer_main(conn: Any, kind: str, target: Any) -> None:
    """Counts delivered batches on command: ("count", n, latencies?) -> (t_end, lat, info)."""
    logging.getLogger("kvwire").setLevel(logging.ERROR)
    if kind == "nats":
        from kvwire.nats.streams import NatsStreams

        spec: Any = NatsStreams(target)
    else:
        spec = StreamSpec("e", target[0], "", target[1])  # replay None: join live only
    sub = Subscriber([spec])
    gc.freeze()  # as the bridge does (and a router should): startup objects out of gen2 scans
    conn.send(os.getpid())
    while True:
        cmd = conn.recv()
        if cmd[0] == "quit":
            break
        _, n, want_lat, *limit = cmd
        lat: dict[int, float] = {}  # engine seq -> delivery latency
        got = 0
        deadline = time.monotonic() + (limit[0] if limit else 300)
        while got < n and time.monotonic() < deadline:
            for it in sub.poll_many(1.0):
                if type(it) is Batch:
                    got += 1
                    if want_lat:
                        lat[it.seq] = time.time() - it.batch.ts
        t_end = time.time()
        info = str(sub.nats_stats()[0]) if kind == "nats" else ""
        conn.send((t_end, got, lat, info))
    sub.close()


def raw_consumer_main(conn: Any, url: str, n: int) -> None:
    """The bridge's share of the latency alone: JetStream read back by nats-py directly (an
    ordered push consumer from new messages, callback), batch bodies decoded for ``ts``."""
    import nats
    from nats.js.api import DeliverPolicy

    async def amain() -> dict[int, float]:
        nc = await nats.connect(url)
        lat: dict[int, float] = {}
        done = asyncio.Event()

        runs = msgspec.msgpack.Decoder(list[msgspec.Raw])

        async def on_msg(m: Any) -> None:
            h = m.headers or {}
            kind, now = h.get("Kvwire-Kind"), time.time()
            if kind == "batch" and len(lat) < n:
                lat[int(h["Kvwire-Seq"])] = now - E.decode_batch(m.data).ts
            elif kind == "batches" and len(lat) < n:  # bridge --pack: a run first..last
                for i, part in enumerate(runs.decode(m.data), int(h["Kvwire-First-Seq"])):
                    lat[i] = now - E.decode_batch(part).ts
            if len(lat) >= n:
                done.set()

        await nc.jetstream().subscribe(SUBJECT, cb=on_msg, ordered_consumer=True,
                                       deliver_policy=DeliverPolicy.NEW)
        conn.send("ready")
        try:
            await asyncio.wait_for(done.wait(), 300)
        except asyncio.TimeoutError:
            pass
        await nc.close()
        return lat

    conn.send(asyncio.run(amain()))


def bootstrap_main(conn: Any, url: str) -> None:
    """A new consumer joining: time to its Snapshot and to the first live Batch after it."""
    from kvwire.nats.streams import NatsStreams

    logging.getLogger("kvwire").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    t_snap = t_batch = None
    blocks = 0
    with Subscriber([NatsStreams(url)]) as sub:
        while t_batch is None and time.perf_counter() - t0 < 60:
            for it in sub.poll_many(1.0):
                if type(it) is Snapshot and t_snap is None:
                    t_snap, blocks = time.perf_counter() - t0, it.block_count
                elif type(it) is Batch and t_snap is not None and t_batch is None:
                    t_batch = time.perf_counter() - t0
    conn.send((t_snap, t_batch, blocks))


# ------------------------------------------------------------------ orchestration


class Cpu:
    """CPU seconds (user + system, children threads included) of processes since start()."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {k: psutil.Process(p) for k, p in pids.items()}
        self.t0: dict[str, float] = {}
        self.w0: dict[str, tuple[float, int]] = {}
        self.wall0 = 0.0

    def _sched(self) -> dict[str, tuple[float, int]]:
        """Per process, over its threads (/proc/PID/task/*/schedstat): seconds spent runnable
        but not running (the kernel's run-queue wait: what a busy box adds to latency), and
        the times a thread was put on a CPU (each wakeup is one; a VM pays dearly for them)."""
        out = {}
        for k, p in self.procs.items():
            wait, slices = 0.0, 0
            for tid in os.listdir(f"/proc/{p.pid}/task") if os.path.isdir(
                    f"/proc/{p.pid}/task") else []:
                try:
                    with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                        fields = f.read().split()
                    wait += int(fields[1]) / 1e9
                    slices += int(fields[2])
                except (OSError, IndexError, ValueError):
                    pass
            out[k] = (wait, slices)
        return out

    def waited(self, n: int) -> str:
        """Run-queue wait of each process per second of wall time since start(), and its
        times on a CPU per batch (of ``n``)."""
        now, wall = self._sched(), time.perf_counter() - self.wall0
        w = " ".join(f"{k} {(now[k][0] - self.w0.get(k, now[k])[0]) / wall * 1e3:.0f}"
                     for k in self.procs)
        r = " ".join(f"{k} {(now[k][1] - self.w0.get(k, now[k])[1]) / max(n, 1):.1f}"
                     for k in self.procs)
        return f"{w} ms/s   on a CPU per batch {r}"

    def _now(self) -> dict[str, float]:
        out = {}
        for k, p in self.procs.items():
            c = p.cpu_times()
            out[k] = c.user + c.system
        return out

    def start(self) -> None:
        self.t0 = self._now()
        self.w0, self.wall0 = self._sched(), time.perf_counter()

    def ceiling(self, n: int) -> float:
        """Batches/s all these processes could sustain on the machine's cores if they had
        them to themselves: cores / (CPU seconds per batch). Reads through a loaded box."""
        now = self._now()
        per = sum(now[k] - self.t0[k] for k in self.procs) / n
        return (os.cpu_count() or 1) / per if per > 0 else float("nan")

    def per(self, n: int) -> str:
        now = self._now()
        parts = [f"{k} {(now[k] - self.t0[k]) / n * 1e6:.1f}" for k in self.procs]
        total = sum(now[k] - self.t0[k] for k in self.procs) / n * 1e6
        return f"{' + '.join(parts)} = {total:.1f} us"


def pct(xs: Any, p: float) -> float:
    """Percentile in ms of latencies in s (a list, or a dict's values)."""
    xs = sorted(xs.values() if isinstance(xs, dict) else xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))] * 1e3 if xs else float("nan")


