"""Benchmark kvwire's NATS JetStream path beside the direct ZeroMQ path, same run.

Processes (2 cores shared by all of them): a reference engine (vLLM's publisher as the spec
describes it: PUB + replay ROUTER, no epoch, no snapshots), ``kvwire bridge`` (a real
subprocess), a nats-server started here (JetStream file storage in a temp dir, loopback), a
consumer (``Subscriber([NatsStreams(url)])``). The direct path is the same engine read by
``Subscriber([StreamSpec(...)])``. The parent only orchestrates and samples CPU (psutil).
Batches are the reference engine step of bench/events.py (one 4-block BlockStored of 64
tokens + one 4-hash BlockRemoved), ``ts`` set right before the send.

* throughput: the engine sends n batches flat out; delivered batches/s = n / (last delivery
  - first send); CPU per delivered batch of each process over the same window, and the
  CPU-bound ceiling (cores / CPU per batch: what a quiet box would do).
* latency at 1,000 batches/s (``--pacing``: by default ten batches back to back every 10 ms,
  as in every run before 2026-11-24; ``even``: one per ms; ``poisson``: random arrivals, as
  from many engines): consumer wall clock at delivery minus ``batch.ts``; on the NATS
  path the same batches are also read directly from the engine, so what NATS adds is paired
  per batch (robust to a loaded box's stalls). A second paced run reads JetStream by raw
  nats-py instead of the Subscriber (the bridge + JetStream share alone), again paired with
  the direct reader; each run has one NATS reader competing for the two cores.
* bootstrap: the engine stores 10^6 blocks (1000 batches of 1000), the bridge snapshots the
  subject into the object store; a new consumer's time to the Snapshot and to the first live
  Batch after it (the engine trickles 200 batches/s meanwhile).
* raw nats-py rows: what the client library itself does with the same bytes (no kvwire), one
  batch per JetStream message and 8 packed per message: per-message costs set the ceiling.

    .venv/bin/python bench/jetstream.py            # about 2 minutes
    .venv/bin/python bench/jetstream.py --quick    # smaller counts, 200k-block bootstrap
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Named jetstream.py, not nats.py: a bench/jetstream.py on sys.path shadowed nats-py (and its
# process module's `import nats` read as importing it back).
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent / "tests"))  # nats_helpers: the nats-server the tests use

from children import recv, spawn  # noqa: E402
from host import Steal  # noqa: E402
from jetstream_procs import (  # noqa: E402
    PACINGS,
    Cpu,
    bootstrap_main,
    consumer_main,
    engine_main,
    pct,
    raw_consumer_main,
    step,
)

from kvwire.wire import events as E  # noqa: E402


def bridge(url: str, port: int, rport: int, tmp: Path, *extra: str) -> Any:
    """``kvwire bridge`` as a real subprocess (tests/bridge_helpers.py), started."""
    from bridge_helpers import BridgeProc

    b = BridgeProc(tmp, url, [f"e=tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{rport}"],
                   *extra)
    b.wait_started(60)
    return b


def path_runs(kind: str, n: int, lat_n: int, tmp: Path, procs: list[Any], pack: int = 1,
              pace: str = "burst10") -> dict[str, Any]:
    """One engine, (bridge --pack, its own nats-server,) one consumer: warm up, throughput
    run, latency run."""
    from nats_helpers import NatsServer

    ep, eng = spawn(engine_main)
    procs.append(ep)
    port, rport, epid = recv(eng, 30, "engine")
    pids = {"engine": epid}
    br = srv = None
    if kind == "nats":
        srv = NatsServer(tmp / f"nats-p{pack}").start()
        br = bridge(srv.url, port, rport, tmp, "--pack", str(pack))
        pids |= {"bridge": br.proc.pid, "nats-server": srv.proc.pid}
        target: Any = srv.url
    else:
        target = (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
    cp, con = spawn(consumer_main, kind, target)
    procs.append(cp)
    pids["consumer"] = recv(con, 60, "consumer")
    try:
        # warm-up: both ends connected, the bridge's first markers written and read
        con.send(("count", 500, False))
        eng.send(("run", 500, 2000))
        recv(eng, 60, "engine warm-up")
        recv(con, 120, "consumer warm-up")
        cpu = Cpu(pids)
        cpu.start()
        steal = Steal()
        con.send(("count", n, False))
        t0 = time.time()
        eng.send(("run", n, None))
        _, send_s = recv(eng, 300, "engine run")
        t_end, got, _, info = recv(con, 330, "consumer run")
        out = {"rate": got / (t_end - t0), "got": got, "send_rate": n / send_s,
               "cpu": cpu.per(max(got, 1)), "ceiling": cpu.ceiling(max(got, 1)), "info": info,
               "load": os.getloadavg()[0], "steal": steal.percent()}
        dcon = None
        if kind == "nats":
            # The paced run is also read straight from the engine by a direct Subscriber, so
            # each batch's NATS latency pairs with its direct one under the same load. A
            # second paced run pairs JetStream read by raw nats-py instead (the bridge +
            # JetStream share alone); each run has one NATS reader on the two cores.
            dp, dcon = spawn(consumer_main, "direct", (f"tcp://127.0.0.1:{port}", None))
            procs.append(dp)
            recv(dcon, 60, "paired direct consumer")
            for _ in range(30):  # until both have seen a whole warm-up run (a SUB that
                for c in (con, dcon):  # connects late misses the start of one)
                    c.send(("count", 100, False, 5.0))
                eng.send(("run", 100, 2000))
                recv(eng, 60, "engine warm-up")
                if all(recv(c, 60, "consumers warm-up")[1] == 100 for c in (con, dcon)):
                    break
        if br is not None:
            br.report()  # its lag window starts here (SIGUSR2)
        cpu.start()
        steal = Steal()
        for c in (con, dcon):
            if c is not None:
                c.send(("count", lat_n, True))
        eng.send(("run", lat_n, 1000, pace))
        recv(eng, 120, "engine paced run")
        _, got_l, lat, _ = recv(con, 150, "consumer paced run")
        if br is not None:
            out["bridge_lag"] = br.report()["lag_window"]
        out |= {"lat": lat, "lat_got": got_l, "lat_cpu": cpu.per(max(got_l, 1)),
                "lat_load": os.getloadavg()[0], "lat_wait": cpu.waited(max(got_l, 1)),
                "lat_steal": steal.percent()}
        con.send(("quit",))
        if dcon is not None:
            out["pair_lat"] = recv(dcon, 150, "paired direct consumer")[2]
            cp.join(30)  # (the Subscriber(NatsStreams) is gone: raw nats-py reads alone)
            rp, raw = spawn(raw_consumer_main, srv.url, lat_n)  # type: ignore[union-attr]
            procs.append(rp)
            assert recv(raw, 60, "raw consumer") == "ready"
            steal = Steal()
            br.report()  # type: ignore[union-attr]
            dcon.send(("count", lat_n, True))
            eng.send(("run", lat_n, 1000, pace))
            recv(eng, 120, "engine paced run (raw)")
            out["raw_lat"] = recv(raw, 150, "raw consumer paced run")
            out["raw_bridge_lag"] = br.report()["lag_window"]  # type: ignore[union-attr]
            out["raw_pair_lat"] = recv(dcon, 150, "paired direct consumer (raw)")[2]
            out["raw_steal"] = steal.percent()
            dcon.send(("quit",))
        eng.send(("quit",))
        cp.join(30)
        ep.join(30)
        return out
    finally:
        if br is not None:
            br.stop()
        if srv is not None:
            srv.stop()


def bootstrap_run(blocks: int, srv: Any, tmp: Path, procs: list[Any]) -> dict[str, Any]:
    from nats_helpers import NatsServer

    srv2 = NatsServer(tmp / "nats-boot").start()  # its own stream: one subject, one snapshot
    try:
        ep, eng = spawn(engine_main)
        procs.append(ep)
        port, rport, _ = recv(eng, 30, "engine")
        # Snapshots every 15 s (the default is 30): one covers the fill soon after it, and
        # the reads below fall between two rewrites of the ~40 MB object.
        br = bridge(srv2.url, port, rport, tmp, "--snapshot-interval", "15")
        try:
            t = time.perf_counter()
            eng.send(("fill", blocks))
            _, last = recv(eng, 300, "engine fill")
            snap, t_read, stuck = asyncio.run(wait_snapshot(srv2.url, last, 300))
            fill = time.perf_counter() - t
            bp, bc = spawn(bootstrap_main, srv2.url)
            procs.append(bp)
            t_snap, t_batch, got = recv(bc, 180, "bootstrap consumer")
            bp.join(30)
            eng.send(("stop",))
            eng.send(("quit",))
            ep.join(30)
        finally:
            br.stop()
    finally:
        srv2.stop()
    return {"fill": fill, "snap_blocks": snap.block_count, "read": t_read, "stuck": stuck,
            "t_snap": t_snap, "t_batch": t_batch, "got": got}


async def wait_snapshot(url: str, last_seq: int, timeout: float) -> tuple[Any, float, int]:
    """Until the bridge's snapshot object covers the engine's fill (seq >= last_seq), then one
    timed read of it. Each read is bounded: a read racing the object's replacement by the
    bridge can wait forever (counted as stuck, retried)."""
    import nats

    from kvwire.nats.snapshots import read_snapshot

    nc = await nats.connect(url)
    t0 = time.perf_counter()
    stuck = 0

    async def read() -> Any:
        nonlocal stuck
        try:
            return await asyncio.wait_for(read_snapshot(nc.jetstream(), "e", 0), 30)
        except asyncio.TimeoutError:
            stuck += 1
            return None

    try:
        while True:
            snap = await read()
            if snap is not None and snap.seq >= last_seq:
                break
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"no snapshot covering seq {last_seq} after {timeout}s")
            await asyncio.sleep(0.5)
        t = time.perf_counter()
        again = await read()
        return snap, (time.perf_counter() - t if again is not None else float("nan")), stuck
    finally:
        await nc.close()


# ------------------------------------------------------------------ raw nats-py rows


async def raw_rows(url: str, n: int, srv_pid: int) -> list[tuple[str, str, str]]:
    """nats-py alone (no kvwire code) on the reference batch's bytes: one JetStream message
    per batch, and 8 batches packed per message (what per-message costs are, per batch)."""
    import nats
    from nats.js import api

    one = E.encode_batch(step(1), "vllm")
    nc = await nats.connect(url, pending_size=64 << 20)
    js = nc.jetstream()
    await js.add_stream(name="RAW", subjects=["raw.>"], storage=api.StorageType.FILE)
    cpu = Cpu({"client": os.getpid(), "nats-server": srv_pid})
    rows = []

    def row(label: str, t0: float, msgs: int, pack: int) -> None:
        per, pers = ("batch", "batches") if pack > 1 else ("msg", "msgs")
        rows.append((label, f"{pack} x {len(one)} B per msg",
                     f"{msgs * pack / (time.perf_counter() - t0):>9,.0f} {pers}/s   "
                     f"CPU/{per} {cpu.per(msgs * pack)}"))

    async def publish(subject: str, payload: bytes, k: int) -> None:
        """Pipelined: core publish with a reply inbox per message, PubAcks counted."""
        inbox = nc.new_inbox()
        acks = 0
        done = asyncio.Event()
        window = asyncio.Semaphore(4000)

        async def on_ack(m: Any) -> None:
            nonlocal acks
            acks += 1
            window.release()
            if acks == k:
                done.set()

        sub = await nc.subscribe(inbox + ".*", cb=on_ack)
        for i in range(k):
            await window.acquire()
            await nc.publish(subject, payload, reply=f"{inbox}.{i}",
                             headers={"Kvwire-Kind": "batch", "Kvwire-Epoch": "0",
                                      "Kvwire-Seq": str(i), "Nats-Msg-Id": f"{subject}/{i}"})
        await asyncio.wait_for(done.wait(), 120)
        await sub.unsubscribe()

    async def consume(subject: str, k: int) -> None:
        got = 0
        done = asyncio.Event()

        async def on_msg(m: Any) -> None:
            nonlocal got
            got += 1
            if got == k:
                done.set()

        osub = await js.subscribe(subject, stream="RAW", cb=on_msg, ordered_consumer=True)
        await asyncio.wait_for(done.wait(), 120)
        await osub.unsubscribe()

    for pack in (1, 8):
        k = n // pack
        cpu.start()
        t0 = time.perf_counter()
        await publish(f"raw.p{pack}.0", one * pack, k)
        row("raw nats-py publish, core + reply inbox (PubAck each)", t0, k, pack)
        cpu.start()
        t0 = time.perf_counter()
        await consume(f"raw.p{pack}.0", k)
        row("raw nats-py consume, ordered push consumer, callback", t0, k, pack)
    cpu.start()
    t0 = time.perf_counter()
    psub = await js.pull_subscribe("raw.p1.0", stream="RAW",
                                   config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE))
    got = 0
    while got < n:
        got += len(await psub.fetch(batch=min(1000, n - got), timeout=10))
    row("raw nats-py consume, pull fetch(batch=1000), AckNone", t0, n, 1)
    await nc.close()
    return rows


def latency_rows(res: dict[str, Any], label: dict[str, str], lat_n: int, pace: str
                 ) -> list[tuple[str, str, str]]:
    """Per path: p50/p99 at 1,000/s; per NATS path also raw nats-py's read of the same
    JetStream, the paired direct read and what NATS adds per batch (paired difference)."""
    rows = []
    what = f"latency @ 1,000 batches/s, {pace} ({lat_n:,})"
    for k, r in res.items():
        lat = r["lat"]
        rows.append((what, label[k],
                     f"p50 {pct(lat, 0.5):.2f} ms  p99 {pct(lat, 0.99):.2f} ms  "
                     f"max {max(lat.values(), default=float('nan')) * 1e3:.1f} ms  "
                     f"({r['lat_got']:,} delivered; load {r['lat_load']:.1f}, "
                     f"steal {r['lat_steal']})   "
                     f"CPU/batch {r['lat_cpu']}   waiting for a CPU {r['lat_wait']}"))
        if "raw_lat" not in r:
            continue
        rl, pair, rpair = r["raw_lat"], r["pair_lat"], r["raw_pair_lat"]
        rows.append((what, "  same run, the same engine read directly (paired)",
                     f"p50 {pct(pair, 0.5):.2f} ms  p99 {pct(pair, 0.99):.2f} ms"))
        rows.append((what, "  next run, JetStream read by raw nats-py instead (ordered push)",
                     f"p50 {pct(rl, 0.5):.2f} ms  p99 {pct(rl, 0.99):.2f} ms  "
                     f"max {max(rl.values(), default=float('nan')) * 1e3:.1f} ms  "
                     f"({len(rl):,} read; steal {r['raw_steal']})"))
        rows.append((what, "  next run, the same engine read directly (paired)",
                     f"p50 {pct(rpair, 0.5):.2f} ms  p99 {pct(rpair, 0.99):.2f} ms"))
        for run, key in (("same", "bridge_lag"), ("next", "raw_bridge_lag")):
            lg = r.get(key)
            if lg:
                rows.append((what, f"  {run} run, the bridge's own lag: engine ts -> PubAck",
                             f"p50 {lg['p50_ms']:.2f} ms  p99 {lg['p99_ms']:.2f} ms  "
                             f"max {lg['max_ms']:.1f} ms  ({lg['batches']:,} batches; "
                             "upper bounds within 19%)"))
        for name, got, base in (("bridge + JetStream", rl, rpair), ("end to end", lat, pair)):
            added = [got[q] - base[q] for q in got if q in base]
            rows.append((what, f"  added by NATS per batch (paired): {name}",
                         f"p50 {pct(added, 0.5):.2f} ms  p99 {pct(added, 0.99):.2f} ms  "
                         f"p99(nats) - p99(direct) {pct(got, 0.99) - pct(base, 0.99):.2f} ms  "
                         f"({len(added):,} pairs)"))
    return rows


# ------------------------------------------------------------------ main


def main() -> None:
    from nats_helpers import NatsServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("-n", type=int, default=None, help="batches per throughput run")
    ap.add_argument("--blocks", type=int, default=None, help="blocks in the bootstrap snapshot")
    ap.add_argument("--skip", default="", help="comma list of: raw,bootstrap")
    ap.add_argument("--packs", default="256,1", help="bridge --pack values to run (comma list)")
    ap.add_argument("--pacing", default="burst10", choices=PACINGS,
                    help="how the 1,000 batches/s runs space batches (bench/jetstream_procs.py)")
    args = ap.parse_args()
    packs = [int(x) for x in args.packs.split(",") if x]
    n = args.n or (20_000 if args.quick else 100_000)
    lat_n = 3000 if args.quick else 10_000
    blocks = args.blocks or (200_000 if args.quick else 1_000_000)
    skip = set(filter(None, args.skip.split(",")))
    rows: list[tuple[str, str, str]] = []
    procs: list[Any] = []
    whole = Steal()
    with tempfile.TemporaryDirectory(prefix="kvwire-bench-nats-") as d:
        tmp = Path(d)
        srv = NatsServer(tmp / "nats").start()
        try:
            res = {"direct": path_runs("direct", n, lat_n, tmp, procs, pace=args.pacing)}
            for pk in packs:
                res[f"nats{pk}"] = path_runs("nats", n, lat_n, tmp, procs, pk, args.pacing)
            label = {"direct": "direct ZeroMQ: engine -> Subscriber"} | {
                f"nats{pk}": f"engine -> bridge --pack {pk} -> JetStream (file) -> "
                             "Subscriber(NatsStreams)" for pk in packs}
            for k, r in res.items():
                rows.append((f"throughput, {n:,} batches flat out", label[k],
                             f"{r['rate']:>9,.0f} batches/s ({r['got']:,} delivered; engine "
                             f"sent at {r['send_rate']:,.0f}/s; load {r['load']:.1f}, "
                             f"steal {r['steal']})   "
                             f"CPU/batch {r['cpu']}   CPU-bound ceiling on "
                             f"{os.cpu_count()} cores {r['ceiling']:,.0f}/s"))
            rows += latency_rows(res, label, lat_n, args.pacing)
            if "bootstrap" not in skip:
                b = bootstrap_run(blocks, srv, tmp, procs)
                where = f"bootstrap, {b['snap_blocks']:,} blocks (fill + snapshot {b['fill']:.1f}s)"
                rows.append((where, "read_snapshot (object store get + decode)",
                             f"{b['read']:.2f} s"
                             + (f"  ({b['stuck']} reads stuck >30 s, object replaced meanwhile)"
                                if b["stuck"] else "")))
                ts = "n/a" if b["t_snap"] is None else f"{b['t_snap']:.2f} s"
                tb = "n/a" if b["t_batch"] is None else f"{b['t_batch']:.2f} s"
                rows.append((where, "new Subscriber(NatsStreams)",
                             f"to Snapshot {ts} ({b['got']:,} blocks), to first live Batch {tb}"))
            if "raw" not in skip:
                rows += asyncio.run(raw_rows(srv.url, n // 2, srv.proc.pid))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
            srv.stop()
    import nats.aio.client
    from nats_helpers import nats_server_binary

    server_version = subprocess.run([nats_server_binary(), "--version"], capture_output=True,
                                    text=True).stdout.strip()
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"kvwire NATS bench ({os.cpu_count()} cpus, python {sys.version.split()[0]}, "
          f"nats-py {nats.aio.client.__version__}, {server_version}, "
          f"{whole})")
    print(f"{'measurement':<{w0}}  {'path':<{w1}}  result")
    for a, b_, c in rows:
        print(f"{a:<{w0}}  {b_:<{w1}}  {c}")
    for k, r in res.items():
        if r.get("info"):
            print(f"\n{k}: nats consumer stats after the throughput run: {r['info']}")
    print("targets: >= 30,000 batches/s through JetStream; bridge adds <= 5 ms p99 at "
          "1,000/s; bootstrap of 10^6 blocks <= 3 s")


if __name__ == "__main__":
    main()
