"""Benchmark ``kvwire serve``: /route throughput and latency while ingesting events.

Three kinds of process, like production:

* a publisher process: ``--engines`` kvwire ``ZmqEventPublisher``s (ipc), each first storing
  ``--prefixes`` distinct prompts of ``--prompt-tokens`` tokens (16-token blocks), then
  churning at ``--ingest`` batches/s in total (each batch: store one new block, remove the
  one stored ``--window`` batches before, so the index size stays constant);
* the service process: RouterCore on kvwire's HTTP server, as ``kvwire serve`` runs it (one process);
* the client (this process): asyncio, raw HTTP/1.1 over ``--concurrency`` keep-alive
  connections, bodies pre-encoded, each prompt = one stored prefix + a few fresh tokens.

Rows, in the same run and against the same publishers: the service with kvwire's
PrefixIndex, and a naive baseline service (dict of sets per stream, keys = Python ``hash`` of
each block's token tuple chained; the same policy and HTTP code). For each:

* ``wrk /route cN`` and ``wrk /score cN``: closed loops driven by wrk (C, Debian package
  ``wrk``; skipped without it) over N connections, the service's own ceiling, since the
  Python client costs about as much CPU per request. /route reserves load each time and
  nothing releases it (requests whose completion never comes: the reservations pile up and
  spread the traffic, as the policy intends);
* ``closed+rel``: closed loop from the Python client, each /route followed by its /release
  (so the HTTP request rate is twice the route rate);
* ``open R/s``: the Python client offers R /score per second (``--rates``); latency counts
  from each request's scheduled send time, so a stall is not hidden. Past capacity, latency
  is queueing and grows with the run.

``followed`` = share of routes sent to the engine holding the prompt's prefix; ``ingest`` =
batches/s the service applied during the run (from /engines); ``svc cpu`` = the service
process's CPU time / wall time (100% = one core busy: the service is one Python process, so
that is its ceiling; below it, the box's other load was in the way). A second table gives
the CPU cost of ``RouterCore.route`` itself (no HTTP, no JSON) for 4 and 64 engines.

    .venv/bin/python bench/route.py            # about two minutes
    .venv/bin/python bench/route.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from host import Steal  # noqa: E402

CTX = mp.get_context("spawn")
BS = 16


def prompt_tokens(engine: int, j: int, n: int) -> list[int]:
    rnd = random.Random(engine * 100_003 + j)
    return [rnd.randrange(50_000) for _ in range(n)]


# ----------------------------------------------------------------------------- publisher


def publisher_main(where: str, engines: int, prefixes: int, ntok: int, rate: float,
                   window: int, ready, stop) -> None:
    from kvwire.publish.publisher import ZmqEventPublisher
    from kvwire.wire.events import BlockRemoved, BlockStored, KVEventBatch

    pubs = [ZmqEventPublisher(endpoint=f"ipc://{where}/e{i}.live",
                              replay_endpoint=f"ipc://{where}/e{i}.replay",
                              heartbeat_interval=1.0, buffer_steps=200_000)
            for i in range(engines)]
    for i, pub in enumerate(pubs):
        for j in range(prefixes):
            toks = prompt_tokens(i, j, ntok)
            base = (i << 40) | (j << 20)
            pub.publish(KVEventBatch(time.time(), [BlockStored(
                list(range(base, base + ntok // BS)), None, toks, BS, None, "GPU")], 0))
    ready.set()
    start = time.perf_counter()
    k = 0
    while not stop.is_set():
        due = int((time.perf_counter() - start) * rate)  # batches due by now
        while k < due:  # publish what is due, then nap 1 ms (no spinning: the publisher
            e = k % engines  # shares the 2 cores with the service under test)
            h = (1 << 60) | k
            t0 = (k * BS) % (1 << 31)  # unique tokens per block, cheap to make
            evs: list = [BlockStored([h], None, list(range(t0, t0 + BS)), BS, None, "GPU")]
            if k >= window:
                evs.append(BlockRemoved([(1 << 60) | (k - window)], "GPU"))
            pubs[e].publish(KVEventBatch(time.time(), evs, 0))
            k += 1
        time.sleep(0.001)
    for p in pubs:
        p.shutdown(timeout=1)


# ----------------------------------------------------------------------------- naive index


@dataclass
class _Match:
    stream: str
    prompt_blocks: int
    tiers: dict
    predicted: int
    credit: float

    @property
    def blocks(self) -> int:
        return sum(self.tiers.values()) + self.predicted


@dataclass
class _Stats:
    tiers: dict
    events_applied: int = 0
    batches_applied: int = 0
    block_size: int | None = None
    suspect: str | None = None


class NaiveIndex:
    """The baseline: per stream a set of own keys (Python hash of the chained token tuple)
    and a dict engine hash -> key; match walks every stream's set."""

    def __init__(self) -> None:
        self.keys: dict[str, set] = {}
        self.ids: dict[str, dict] = {}
        self.stats: dict[str, _Stats] = {}

    def apply_many(self, items) -> None:
        for it in items:
            self.apply(it)

    def apply(self, it) -> None:
        from kvwire.consume.stream import Batch, Reset, Snapshot
        from kvwire.wire.events import AllBlocksCleared, BlockRemoved, BlockStored

        s = it.stream
        keys = self.keys.setdefault(s, set())
        ids = self.ids.setdefault(s, {})
        st = self.stats.setdefault(s, _Stats({}))
        if isinstance(it, Reset):
            keys.clear()
            ids.clear()
            return
        if isinstance(it, Snapshot):
            keys.clear()
            ids.clear()
            evs = it.blocks
        elif isinstance(it, Batch):
            evs = it.batch.events
            st.batches_applied += 1
        else:
            return
        for e in evs:
            st.events_applied += 1
            if isinstance(e, BlockStored):
                st.block_size = bs = e.block_size
                prev = ids.get(e.parent_block_hash, 0)
                t = e.token_ids
                for i, h in enumerate(e.block_hashes):
                    prev = hash((prev, tuple(t[i * bs:(i + 1) * bs])))
                    keys.add(prev)
                    ids[h] = prev
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    k = ids.pop(h, None)
                    if k is not None:
                        keys.discard(k)
            elif isinstance(e, AllBlocksCleared):
                keys.clear()
                ids.clear()
        st.tiers = {"GPU": len(keys)}

    def match(self, token_ids, lora_name=None, salt=None) -> dict:
        out = {}
        n = len(token_ids) // BS
        chain = []
        prev = 0
        for i in range(n):
            prev = hash((prev, tuple(token_ids[i * BS:(i + 1) * BS])))
            chain.append(prev)
        for s, keys in self.keys.items():
            m = 0
            for k in chain:
                if k not in keys:
                    break
                m += 1
            out[s] = _Match(s, n, {"GPU": m}, 0, float(m))
        return out

    def predict(self, *args, **kw) -> None:
        pass

    def streams(self) -> dict:
        return dict(self.stats)


# ----------------------------------------------------------------------------- service


def service_main(kind: str, where: str, engines: int, port: int) -> None:
    from kvwire.cli.serve import tune_process
    from kvwire.http1.server import Server, listen
    from kvwire.routing.core import EngineSpec, RouterCore
    from kvwire.serve.app import build_app

    specs = [EngineSpec(f"e{i}", f"ipc://{where}/e{i}.live", f"ipc://{where}/e{i}.replay")
             for i in range(engines)]
    core = RouterCore(specs, block_size=BS, index=NaiveIndex() if kind == "naive" else None)
    core.start()
    app = build_app(core)
    if not os.environ.get("KVW_NO_TUNE"):
        tune_process()  # what `kvwire serve` does: switch interval, gc.freeze, gc threshold
    if os.environ.get("KVW_GC_LOG"):  # diagnostics: collector pauses, written at SIGTERM
        import gc
        import signal
        pauses = []
        t0 = [0.0]

        def cb(phase, info):
            if phase == "start":
                t0[0] = time.perf_counter()
            else:
                pauses.append((info["generation"], time.perf_counter() - t0[0]))

        gc.callbacks.append(cb)

        def dump(*_):
            by = {}
            for g, d in pauses:
                by.setdefault(g, []).append(d)
            with open(os.environ["KVW_GC_LOG"] + "." + kind, "w") as f:
                for g, ds in sorted(by.items()):
                    ds.sort()
                    f.write(f"gen{g} n={len(ds)} p50={ds[len(ds)//2]*1e3:.2f}ms "
                            f"max={ds[-1]*1e3:.2f}ms total={sum(ds)*1e3:.0f}ms\n")
                f.write(f"tracked objects {len(gc.get_objects())}\n")
            os._exit(0)

        signal.signal(signal.SIGTERM, dump)
    Server(app).run(sockets=[listen("127.0.0.1", port)])


def _has(mod: str) -> bool:
    try:
        __import__(mod)
        return True
    except ImportError:
        return False


# ----------------------------------------------------------------------------- client


class Refused(Exception):
    """A 4xx/5xx answer (e.g. 503 "index busy"): counted, not fatal."""


async def _request(reader, writer, path: bytes, body: bytes) -> bytes:
    writer.write(b"POST " + path + b" HTTP/1.1\r\nHost: b\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    i = head.lower().index(b"content-length:") + 15
    n = int(head[i:head.index(b"\r\n", i)])
    data = await reader.readexactly(n)
    if status != 200:
        raise Refused(f"{path.decode()} -> {status}: {data[:200]!r}")
    return data


async def _get(port: int, path: str) -> dict:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: b\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    i = head.lower().index(b"content-length:") + 15
    data = await reader.readexactly(int(head[i:head.index(b"\r\n", i)]))
    writer.close()
    return json.loads(data)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), to report CPU per request: a
    figure that contention from other processes on the box does not inflate much."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def applied(status: dict) -> int:
    return sum(r["batches_applied"] for e in status.values() for r in e["ranks"])


async def closed_loop(port: int, bodies: list, seconds: float, conc: int) -> dict:
    lat: list[float] = []
    hits = [0, 0]
    errors = [0]
    stop = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        rnd = random.Random(w)
        while time.perf_counter() < stop:
            want, body = bodies[rnd.randrange(len(bodies))]
            t0 = time.perf_counter()
            try:
                out = json.loads(await _request(reader, writer, b"/route", body))
            except Refused:
                errors[0] += 1
                continue
            lat.append(time.perf_counter() - t0)
            hits[0] += out["engine"] == want
            hits[1] += 1
            await _request(reader, writer, b"/release",
                           b'{"request_id":"' + out["request_id"].encode() + b'"}')
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(conc)))
    return {"routes": len(lat), "secs": time.perf_counter() - t0, "lat": lat, "hits": hits,
            "errors": errors[0]}


async def open_loop(port: int, bodies: list, seconds: float, rate: float, conc: int) -> dict:
    """Offer ``rate`` /score per second, spread over ``conc`` connections; latency counts
    from the scheduled send time (no coordinated omission)."""
    lat: list[float] = []
    hits = [0, 0]
    errors = [0]
    n = int(seconds * rate)
    start = time.perf_counter() + 0.05

    async def worker(w: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        rnd = random.Random(100 + w)
        for k in range(w, n, conc):
            due = start + k / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            want, body = bodies[rnd.randrange(len(bodies))]
            try:
                out = json.loads(await _request(reader, writer, b"/score", body))
            except Refused:
                errors[0] += 1
                continue
            lat.append(time.perf_counter() - due)
            hits[0] += out["engine"] == want
            hits[1] += 1
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(conc)))
    return {"routes": len(lat), "secs": time.perf_counter() - t0, "lat": lat, "hits": hits,
            "errors": errors[0]}


def wrk_run(port: int, bodies: list, seconds: float, conc: int, where: str,
            path: str = "/score") -> dict | None:
    """Closed loop with wrk (a C load generator, Debian package ``wrk``), one thread: the
    Python client above costs about as much CPU per request as the service, so on 2 cores
    it caps what can be measured. ``path`` (/score, or /route: each reserves load that no
    release frees, so reservations pile up as for requests whose completion never comes)
    with the same prompt mix; None without wrk."""
    wrk = shutil.which("wrk")
    if wrk is None:
        return None
    script = os.path.join(where, "load.lua")
    with open(script, "w") as f:
        f.write("bodies = {\n")
        for _, b in bodies:
            f.write("[[" + b.decode() + "]],\n")
        f.write("}\nwrk.method = 'POST'\nwrk.headers['Content-Type'] = 'application/json'\n"
                f"request = function()\n  return wrk.format(nil, '{path}', nil, "
                "bodies[math.random(#bodies)])\nend\n")
    out = subprocess.run([wrk, "-t1", f"-c{conc}", f"-d{max(1, int(seconds))}s", "--latency",
                          "-s", script, f"http://127.0.0.1:{port}"],
                         capture_output=True, text=True, timeout=seconds + 60).stdout

    def ms(label: str) -> float:
        m = re.search(rf"^\s*{label}\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        if not m:
            return float("nan")
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"route_per_s": float(rps.group(1)) if rps else float("nan"),
            "p50_ms": ms("50%"), "p99_ms": ms("99%"), "refused": int(bad.group(1)) if bad else 0}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_ready(port: int, engines: int, blocks: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            st = await _get(port, "/engines")
            if all(sum(e["ranks"][0]["blocks"].values()) >= blocks for e in st.values()):
                return
        except (OSError, ValueError, asyncio.IncompleteReadError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("service did not index the prefixes in time")
        await asyncio.sleep(0.2)


def run_variant(kind: str, where: str, a: argparse.Namespace, bodies: list) -> list[dict]:
    port = free_port()
    proc = CTX.Process(target=service_main, args=(kind, where, a.engines, port), daemon=True)
    proc.start()
    rows = []
    try:
        asyncio.run(wait_ready(port, a.engines, a.prefixes * (a.prompt_tokens // BS)))
        for path, conns in [("/route", c) for c in a.wrk_conns] + [("/score", a.concurrency)]:
            before, cpu0, t0 = (applied(asyncio.run(_get(port, "/engines"))),
                                cpu_seconds(proc.pid), time.perf_counter())
            w = wrk_run(port, bodies, a.seconds, conns, where, path)
            if w is None:
                break
            secs = time.perf_counter() - t0
            after = applied(asyncio.run(_get(port, "/engines")))
            rows.append({"service": kind, "mode": f"wrk {path} c{conns}", **w,
                         "followed": float("nan"),
                         "ingest_batches_per_s": (after - before) / secs,
                         "service_cpu": (cpu_seconds(proc.pid) - cpu0) / secs})
        for mode in ("closed", *[f"open {r:g}" for r in a.rates]):
            async def one(mode: str = mode) -> tuple[dict, int, int, float]:
                before = applied(await _get(port, "/engines"))
                cpu0 = cpu_seconds(proc.pid)
                if mode == "closed":
                    r = await closed_loop(port, bodies, a.seconds, a.concurrency)
                else:
                    rate = float(mode.split()[1])
                    r = await open_loop(port, bodies, a.seconds, rate, a.concurrency)
                cpu = cpu_seconds(proc.pid) - cpu0
                after = applied(await _get(port, "/engines"))
                return r, before, after, cpu
            r, before, after, cpu = asyncio.run(one())
            rows.append({
                "service": kind, "mode": "closed+rel" if mode == "closed" else f"{mode}/s",
                "route_per_s": r["routes"] / r["secs"],
                "p50_ms": pct(r["lat"], 0.50), "p99_ms": pct(r["lat"], 0.99),
                "followed": r["hits"][0] / max(r["hits"][1], 1),
                "ingest_batches_per_s": (after - before) / r["secs"],
                "service_cpu": cpu / r["secs"],
                "refused": r["errors"],
            })
    finally:
        proc.terminate()
        proc.join(10)
    return rows


def core_cpu(kind: str, engines: int, prefixes: int, ntok: int) -> dict:
    """CPU time (process_time, so other load on the box barely counts) of RouterCore.route
    (index match + policy, no HTTP, no JSON) and of applying one churn batch, in-process."""
    from kvwire.consume.stream import Batch
    from kvwire.routing.core import EngineSpec, RouterCore
    from kvwire.wire.events import BlockRemoved, BlockStored, KVEventBatch

    core = RouterCore([EngineSpec(f"e{i}", f"ipc:///nonexistent/e{i}")
                       for i in range(engines)], block_size=BS,
                      index=NaiveIndex() if kind == "naive" else None)
    core.alive = dict.fromkeys(core.alive, True)
    prompts = []
    for e in range(engines):
        for j in range(prefixes):
            base = (e << 40) | (j << 20)
            toks = prompt_tokens(e, j, ntok)
            prompts.append(toks + [7, 8, 9])
            ev = BlockStored(list(range(base, base + ntok // BS)), None, toks, BS, None, "GPU")
            core.index.apply(Batch(f"e{e}/dp0", j, KVEventBatch(0.0, [ev], 0)))
    rnd = random.Random(3)
    churn = []
    for k in range(20_000):
        evs: list = [BlockStored([(1 << 60) | k], None, [rnd.randrange(50_000) for _ in range(BS)],
                                 BS, None, "GPU")]
        if k >= 5_000:
            evs.append(BlockRemoved([(1 << 60) | (k - 5_000)], "GPU"))
        churn.append(Batch(f"e{k % engines}/dp0", 10_000 + k, KVEventBatch(0.0, evs, 0)))
    t = time.process_time()
    for b in churn:
        core.index.apply(b)
    apply_us = (time.process_time() - t) / len(churn) * 1e6
    n = 3000
    t = time.process_time()
    for i in range(n):
        core.route(prompts[i % len(prompts)], reserve=False)
    return {"service": kind, "engines": engines,
            "route_us": (time.process_time() - t) / n * 1e6,
            "apply_us": apply_us}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--prefixes", type=int, default=64, help="stored prompts per engine")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--ingest", type=float, default=10_000, help="batches/s, all engines")
    p.add_argument("--window", type=int, default=50_000, help="live churn blocks")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rates", type=lambda t: [float(x) for x in t.split(",")],
                   default=[500.0, 2000.0], help="open-loop offered /score/s (comma list)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--wrk-conns", type=lambda t: [int(x) for x in t.split(",")],
                   default=[4, 8], help="wrk connections of the /route rows (comma list)")
    p.add_argument("--cpu-engines", type=int, default=64,
                   help="engines of the second in-process CPU table")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    steal = Steal()
    if a.quick:
        a.seconds, a.prefixes = 3.0, 16
    bodies = []
    for e in range(a.engines):
        for j in range(a.prefixes):
            toks = prompt_tokens(e, j, a.prompt_tokens) + [7, 8, 9]
            bodies.append((f"e{e}", json.dumps({"token_ids": toks}).encode()))
    cpu_rows = [core_cpu(k, n, max(1, 256 // n), a.prompt_tokens)
                for n in sorted({a.engines, a.cpu_engines}) for k in ("kvwire", "naive")]
    with tempfile.TemporaryDirectory(prefix="kvw-route-") as where:
        ready, stop = CTX.Event(), CTX.Event()
        pub = CTX.Process(target=publisher_main, daemon=True, args=(
            where, a.engines, a.prefixes, a.prompt_tokens, a.ingest, a.window, ready, stop))
        pub.start()
        if not ready.wait(60):
            raise SystemExit("publisher did not start")
        try:
            rows = run_variant("kvwire", where, a, bodies) + run_variant("naive", where, a,
                                                                         bodies)
        finally:
            stop.set()
            pub.join(10)
    if a.json:
        print(json.dumps({"http": rows, "cpu": cpu_rows}))
        return 0
    print(f"kvwire serve: {a.engines} engines x {a.prefixes} prompts of {a.prompt_tokens} "
          f"tokens, ingest offered {a.ingest:.0f} batches/s, {a.concurrency} connections, "
          f"{os.cpu_count()} cpus, {steal}")
    print(f"{'service':8} {'mode':14} {'route/s':>8} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'followed':>8} {'ingest b/s':>10} {'svc cpu':>7} {'refused':>7}")
    for r in rows:
        print(f"{r['service']:8} {r['mode']:14} {r['route_per_s']:8.0f} {r['p50_ms']:7.2f} "
              f"{r['p99_ms']:7.2f} {r['followed']:8.1%} {r['ingest_batches_per_s']:10.0f} "
              f"{r['service_cpu']:7.0%} {r['refused']:7d}")
    print(f"\nin-process CPU (process_time: other load barely counts), "
          f"{a.prompt_tokens}-token prompts, 256 stored prompts over the engines")
    print(f"{'index':8} {'engines':>7} {'route() us':>10} {'route()/s/core':>14} "
          f"{'apply us/batch':>14}")
    for r in cpu_rows:
        print(f"{r['service']:8} {r['engines']:7d} {r['route_us']:10.1f} "
              f"{1e6 / r['route_us']:14.0f} {r['apply_us']:14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
