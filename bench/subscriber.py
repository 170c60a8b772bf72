"""Benchmark the reliable Subscriber: delivery latency and snapshot bootstrap time.

Publisher (``ZmqEventPublisher``, live + replay on loopback) in one process, consumer in
another, the parent only orchestrates. Measured in the same run:

* publish()-to-delivery latency (p50/p99/max) at 1k and 10k batches/s: latency is the
  consumer's wall clock at delivery minus ``batch.ts``, set right before ``publish()``
  (same machine, same clock). kvwire's ``Subscriber`` next to a baseline: a raw
  reference-style pyzmq SUB loop (poll, recv_multipart, strict msgspec decode), against the
  same publisher. Batches are the reference engine step of bench/events.py
  (one 4-block BlockStored + one 4-hash BlockRemoved).
* bootstrap of a late joiner while the publisher holds 1M live blocks (16 tokens each) and
  keeps publishing 200 batches/s: time from creating the Subscriber to its Snapshot
  delivery and to the first live Batch after it (snapshot chunks of 1024 and 65536
  blocks). Baseline: what a reference consumer can do at best, a raw DEALER replay from
  seq 0 of the 1000 batches that stored those blocks (only possible while they are all
  still in the replay buffer), decoded strictly.

    .venv/bin/python bench/subscriber.py            # about 1.5 minutes
    .venv/bin/python bench/subscriber.py --quick    # shorter runs, 200k blocks

Prints one table.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import msgspec
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from children import recv, spawn  # noqa: E402
from workload import step  # noqa: E402

from kvwire.consume.stream import Batch, Snapshot, StreamConfig  # noqa: E402
from kvwire.consume.subscriber import StreamSpec, Subscriber  # noqa: E402
from kvwire.publish.publisher import ZmqEventPublisher  # noqa: E402
from kvwire.wire import events as E  # noqa: E402

BLOCKS_PER_FILL_BATCH = 1000




# ------------------------------------------------------------------ publisher process


def publisher_main(conn: Any) -> None:
    logging.getLogger("kvwire").setLevel(logging.ERROR)
    pub = ZmqEventPublisher(endpoint="tcp://*:0", replay_endpoint="tcp://*:0",
                            heartbeat_interval=0.05, buffer_steps=10_000)
    conn.send((int(pub.endpoint.rsplit(":", 1)[1]), int(pub.replay_endpoint.rsplit(":", 1)[1])))
    i = 1 << 20
    while True:
        cmd = conn.recv()
        if cmd[0] == "run":  # publish n batches at rate/s, ts set right before publish()
            _, n, rate = cmd
            t0 = time.perf_counter()
            sent = 0
            while sent < n:
                due = min(n, int((time.perf_counter() - t0) * rate) + 1)
                while sent < due:
                    pub.publish(step(i))
                    i += 1
                    sent += 1
                time.sleep(0.0002)
            conn.send(("done", time.perf_counter() - t0))
        elif cmd[0] == "fill":  # hold `blocks` live blocks, then trickle live batches
            _, blocks, rate = cmd
            h = 1
            for _ in range(blocks // BLOCKS_PER_FILL_BATCH):
                n = BLOCKS_PER_FILL_BATCH
                tokens = [t & 255 for t in range(h, h + 16 * n)]  # small ints: cached objects
                pub.publish(E.KVEventBatch(time.time(), [
                    E.BlockStored(list(range(h, h + n)), None, tokens, 16, None, "GPU")], 0))
                h += n
            conn.send(("filled", pub.stats().last_seq))
            nxt = time.perf_counter()
            while not conn.poll(0):
                nxt += 1.0 / rate
                time.sleep(max(0.0, nxt - time.perf_counter()))
                pub.publish(E.KVEventBatch(time.time(), [
                    E.BlockStored([h], h - 1, [1] * 16, 16, None, "GPU")], 0))
                h += 1
            conn.recv()
            conn.send(("stopped",))
        elif cmd[0] == "quit":
            pub.shutdown(timeout=1.0)
            return


# ------------------------------------------------------------------ consumer processes

_StrictEvent = E._VllmStored | E._VllmRemoved | E._MapCleared


def latency_consumer(conn: Any, kind: str, port: int, rport: int, n: int) -> None:
    """Connect, say ready once warm, then record latency of ``n`` non-empty batches."""
    ep, rep = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"
    lat: list[float] = []
    if kind == "kvwire":
        sub = Subscriber([StreamSpec("e", ep, "", rep)])
        while sub.stats()["e"].stream.phase != "live":
            sub.poll(0.1)
        conn.send("ready")
        while len(lat) < n:
            item = sub.poll(5.0)
            if item is None:
                break
            if type(item) is Batch and item.batch.events:
                lat.append(time.time() - item.batch.ts)
        sub.close()
    else:  # the reference consumer loop
        ctx = zmq.Context()
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(ep)
        poller = zmq.Poller()
        poller.register(s, zmq.POLLIN)
        decode = msgspec.msgpack.Decoder(tuple[float, list[_StrictEvent], int | None]).decode
        while not poller.poll(5000):  # the first heartbeat says we are connected
            pass
        s.recv_multipart()
        conn.send("ready")
        while len(lat) < n:
            if not poller.poll(5000):
                break
            _, _, payload = s.recv_multipart()
            ts, evs, _ = decode(payload)
            if evs:
                lat.append(time.time() - ts)
        s.close(0)
        ctx.term()
    conn.send(lat)


def bootstrap_consumer(conn: Any, port: int, rport: int, chunk: int) -> None:
    ep, rep = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"
    t0 = time.perf_counter()
    sub = Subscriber([StreamSpec("e", ep, "", rep)],
                     config=StreamConfig(snapshot_chunk_blocks=chunk, request_timeout=10.0))
    t_snap = t_batch = None
    blocks = 0
    while t_batch is None and time.perf_counter() - t0 < 60:
        item = sub.poll(1.0)
        if type(item) is Snapshot:
            t_snap = time.perf_counter() - t0
            blocks = item.block_count
        elif type(item) is Batch and t_snap is not None and item.batch.events:
            t_batch = time.perf_counter() - t0
    sub.close()
    conn.send((t_snap, t_batch, blocks))


def replay_baseline(conn: Any, rport: int) -> None:
    """Raw DEALER replay from seq 0 with strict decoding: the reference consumer's best case."""
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.RCVHWM, 0)
    decode = msgspec.msgpack.Decoder(tuple[float, list[_StrictEvent], int | None]).decode
    t0 = time.perf_counter()
    d.connect(f"tcp://127.0.0.1:{rport}")
    d.send_multipart([b"", (0).to_bytes(8, "big")])
    blocks = 0
    first = None
    while d.poll(10_000):
        f = d.recv_multipart()
        if f[2] == b"\xff" * 8:
            break
        if first is None:
            first = int.from_bytes(f[2], "big")
        for ev in decode(f[3])[1]:
            if type(ev) is E._VllmStored:
                blocks += len(ev.block_hashes)
    conn.send((time.perf_counter() - t0, blocks, first))
    d.close(0)
    ctx.term()


# ------------------------------------------------------------------ orchestration


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    seconds = 1.0 if args.quick else 3.0
    blocks = 200_000 if args.quick else 1_000_000
    rows: list[tuple[str, str, str]] = []
    procs: list[Any] = []
    try:
        pub_p, pub = spawn(publisher_main)
        procs.append(pub_p)
        port, rport = recv(pub, 30)
        for rate in (1000, 10_000):
            n = int(rate * seconds)
            res = {}
            for kind in ("raw", "kvwire"):
                p, c = spawn(latency_consumer, kind, port, rport, n)
                procs.append(p)
                assert recv(c, 30) == "ready"
                pub.send(("run", n, rate))
                _, took = recv(pub, 120)
                lat = recv(c, 60)
                p.join(10)
                res[kind] = (lat, n / took)
            for kind, label in (("raw", "baseline raw SUB + strict decode"),
                                ("kvwire", "kvwire Subscriber")):
                lat, achieved = res[kind]
                rows.append((f"latency @ {rate // 1000}k/s ({achieved:,.0f}/s achieved)", label,
                             f"p50 {pct(lat, 0.5):.3f} ms  p99 {pct(lat, 0.99):.3f} ms  "
                             f"max {max(lat) * 1e3:.1f} ms  ({len(lat)}/{n} delivered)"))
        pub.send(("quit",))
        pub_p.join(10)

        pub_p, pub = spawn(publisher_main)
        procs.append(pub_p)
        port, rport = recv(pub, 30)
        t = time.perf_counter()
        pub.send(("fill", blocks, 200))
        _, last = recv(pub, 300)
        fill = time.perf_counter() - t
        label = f"bootstrap, {blocks / 1e6:g}M live blocks (fill took {fill:.1f}s)"
        for chunk in (1024, 65536):
            p, c = spawn(bootstrap_consumer, port, rport, chunk)
            procs.append(p)
            t_snap, t_batch, got = recv(c, 120)
            p.join(10)
            snap_s = "n/a" if t_snap is None else f"{t_snap:.2f} s"
            batch_s = "n/a" if t_batch is None else f"{t_batch:.2f} s"
            rows.append((label, f"kvwire Subscriber, SNAPSHOT chunks of {chunk}",
                         f"to Snapshot {snap_s}, to first live Batch {batch_s} "
                         f"({got:,} blocks)"))
        p, c = spawn(replay_baseline, rport)
        procs.append(p)
        took, got, first = recv(c, 120)
        p.join(10)
        rows.append((label, "baseline raw DEALER replay from 0 + strict decode",
                     f"{took:.2f} s for {got:,} blocks (first replayed seq {first}; only "
                     f"works while all {last + 1} batches are in the replay buffer)"))
        pub.send(("stop",))
        recv(pub, 30)
        pub.send(("quit",))
        pub_p.join(10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)

    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"kvwire subscriber bench (loopback tcp, {os.cpu_count()} cpus, "
          f"python {sys.version.split()[0]}, libzmq {zmq.zmq_version()})")
    print(f"{'measurement':<{w0}}  {'consumer':<{w1}}  result")
    for a, b, c in rows:
        print(f"{a:<{w0}}  {b:<{w1}}  {c}")


if __name__ == "__main__":
    main()
