"""``kvwire engine`` targets, one engine process on one core.

Throughput (default): the engine pinned to CPU 0 with ``--speed`` high enough that the model
is not the limit; a load generator pinned to CPU 1 keeps ``--conns`` keep-alive connections
busy with streamed completions (``--prompt-tokens`` token ids, unique per request, 16 output
tokens, ``ignore_eos``). Prints requests/s and the engine's CPU (user + system, every
thread, the publisher's included) per request and per streamed token.

``--fidelity``: ``--speed 1``, Poisson arrivals at ``--rate`` requests/s; per request the
client's TTFT (send -> first text chunk) vs the model's own (its ``kvwire`` timing field);
prints the median error against the target 2 ms + 5 % of the model's TTFT.

``--rebuild``: the engine with a small cache (``--num-gpu-blocks 400``, so it evicts) under
streamed load with shared prefixes; the real ``kvwire listen ... --replay ... --json``
follows its events as a subprocess, ``GET /kvwire/cache`` is dumped every few ms during the
load and once after it; the cache rebuilt from listen's JSON lines alone must equal every
dump at the dump's seq, exactly (multisets of block hashes).

    .venv/bin/python bench/engine.py                # throughput
    .venv/bin/python bench/engine.py --fidelity     # TTFT fidelity at 100 requests/s
    .venv/bin/python bench/engine.py --rebuild      # events rebuild the cache exactly

``--quick``: 3 s instead of 10 (any mode).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))


def start_engine(port: int, speed: float, cpu: int | None, extra: list[str]) -> subprocess.Popen:
    def pin() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    p = subprocess.Popen([sys.executable, "-m", "kvwire.cli.engine", "--port", str(port),
                          "--speed", str(speed), "--events", f"tcp://*:{port + 1000}",
                          "--replay", f"tcp://*:{port + 2000}", "--log-level", "error",
                          *extra],
                         stdout=subprocess.PIPE, preexec_fn=pin)
    line = p.stdout.readline().decode()
    if "serving" not in line:
        raise SystemExit(f"engine did not start: {line!r}")
    return p


class Conn(asyncio.Protocol):
    """One keep-alive connection sending one streamed request at a time."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.done: asyncio.Future | None = None
        self.first: float | None = None
        self.t: asyncio.Transport | None = None

    def connection_made(self, t) -> None:
        self.t = t

    def data_received(self, data: bytes) -> None:
        if self.first is None and b'"text":"' in data and b'"text":""' not in data[:0]:
            self.first = time.perf_counter()
        self.buf += data
        if self.buf.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") and self.done is not None:
            self.done.set_result(bytes(self.buf))

    async def request(self, body: bytes) -> tuple[bytes, float | None]:
        self.buf.clear()
        self.first = None
        self.done = asyncio.get_running_loop().create_future()
        self.t.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        out = await self.done
        return out, self.first


def body(i: int, n_prompt: int, max_tokens: int, timing: bool = False) -> bytes:
    rnd = random.Random(i)
    ids = [rnd.randrange(1, 30000) for _ in range(n_prompt)]
    return json.dumps({"prompt": ids, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "kvwire_timing": timing}).encode()


async def throughput(port: int, conns: int, duration: float, n_prompt: int, pid: int) -> dict:
    loop = asyncio.get_running_loop()
    bodies = [body(i, n_prompt, 16) for i in range(2000)]
    cs = []
    for _ in range(conns):
        _, c = await loop.create_connection(Conn, "127.0.0.1", port)
        cs.append(c)
    count = [0]
    tokens = [0]
    chunks = [0]
    stop = [False]

    async def worker(c: Conn, k: int) -> None:
        i = k
        while not stop[0]:
            out, _ = await c.request(bodies[i % len(bodies)])
            i += conns
            count[0] += 1
            chunks[0] += out.count(b"data: {") - 1
            tokens[0] += 16

    tasks = [loop.create_task(worker(c, k)) for k, c in enumerate(cs)]
    await asyncio.sleep(2.0)  # warm-up
    proc = psutil.Process(pid)
    c0, n0, k0, ch0, t0 = proc.cpu_times(), count[0], tokens[0], chunks[0], time.perf_counter()
    await asyncio.sleep(duration)
    c1, n1, k1, ch1, t1 = proc.cpu_times(), count[0], tokens[0], chunks[0], time.perf_counter()
    stop[0] = True
    await asyncio.gather(*tasks)
    cpu = (c1.user + c1.system) - (c0.user + c0.system)
    n = n1 - n0
    return {"requests_per_s": n / (t1 - t0), "cpu_per_request_ms": cpu / n * 1e3,
            "cpu_per_token_us": cpu / (k1 - k0) * 1e6, "chunks_per_request": (ch1 - ch0) / n,
            "engine_cpu_util": cpu / (t1 - t0), "conns": conns, "prompt_tokens": n_prompt}


async def fidelity(port: int, rate: float, duration: float, n_prompt: int) -> dict:
    loop = asyncio.get_running_loop()
    rnd = random.Random(1)
    results: list[tuple[float, float]] = []
    pool: list[Conn] = []

    async def one(i: int) -> None:
        if pool:
            c = pool.pop()
        else:
            _, c = await loop.create_connection(Conn, "127.0.0.1", port)
        b = body(10_000 + i, n_prompt, 16, timing=True)
        t = time.perf_counter()
        out, first = await c.request(b)
        pool.append(c)
        m = re.search(rb'"ttft":([0-9.eE+-]+)', out)
        results.append((first - t, float(m.group(1))))

    # warm connections first, so connect time is not in the client's TTFT
    for _ in range(32):
        _, c = await loop.create_connection(Conn, "127.0.0.1", port)
        pool.append(c)
    tasks = []
    t_end = time.perf_counter() + duration
    nxt = time.perf_counter()
    i = 0
    while nxt < t_end:
        await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
        tasks.append(loop.create_task(one(i)))
        i += 1
        nxt += rnd.expovariate(rate)
    await asyncio.gather(*tasks)
    errs = [abs(c - m) for c, m in results]
    model = [m for _, m in results]
    med_model = statistics.median(model)
    med_err = statistics.median(errs)
    target = 0.002 + 0.05 * med_model
    return {"requests": len(results), "rate": rate, "model_ttft_median_ms": med_model * 1e3,
            "client_ttft_median_ms": statistics.median(c for c, _ in results) * 1e3,
            "median_error_ms": med_err * 1e3,
            "p90_error_ms": sorted(errs)[int(0.9 * len(errs))] * 1e3,
            "target_ms": target * 1e3, "met": med_err <= target}


def rebuild_check(records: list[dict], stream: str, dumps: list[dict]) -> tuple[int, int]:
    """Apply listen's records of one stream in order (reset: clear; snapshot: replace;
    batch: apply GPU events) and compare with each dump at its seq: (checked, mismatched)."""
    want = sorted(dumps, key=lambda d: d["seq"])
    held: Counter = Counter()
    i = checked = bad = 0
    for rec in records:
        if rec["stream"] != stream or rec["kind"] == "liveness":
            continue
        if rec["kind"] == "reset":
            held.clear()
            continue
        if rec["kind"] == "snapshot":
            held.clear()
        for ev in rec["blocks"] if rec["kind"] == "snapshot" else rec["events"]:
            if ev["type"] == "AllBlocksCleared":
                held.clear()
            elif ev.get("medium") in (None, "GPU"):
                if ev["type"] == "BlockStored":
                    held.update(ev["block_hashes"])
                elif ev["type"] == "BlockRemoved":
                    held.subtract(ev["block_hashes"])
        while i < len(want) and want[i]["seq"] <= rec["seq"]:
            checked += 1
            bad += want[i]["seq"] != rec["seq"] or +held != Counter(want[i]["blocks"])
            i += 1
    return checked, bad + len(want) - i


async def rebuild(port: int, conns: int, duration: float, n_prompt: int,
                  events: str, replay: str) -> dict:
    import httpx

    listen = subprocess.Popen([sys.executable, "-m", "kvwire", "listen", events, "--replay",
                               replay, "--json"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    records: list[dict] = []
    reader = threading.Thread(target=lambda: [records.append(json.loads(ln))
                                              for ln in listen.stdout], daemon=True)
    reader.start()
    try:
        t_end = time.monotonic() + 30
        while not any(r["kind"] == "snapshot" for r in list(records)):  # bootstrapped
            if time.monotonic() > t_end:
                raise SystemExit("kvwire listen never bootstrapped")
            await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        prefixes = [[random.Random(g).randrange(1, 30000) for _ in range(n_prompt // 2)]
                    for g in range(16)]
        count = [0]
        stop = [False]

        async def worker(k: int) -> None:
            _, c = await loop.create_connection(Conn, "127.0.0.1", port)
            i = k
            while not stop[0]:
                rnd = random.Random(i)
                ids = prefixes[i % 16] + [rnd.randrange(1, 30000) for _ in range(n_prompt // 2)]
                await c.request(json.dumps({"prompt": ids, "max_tokens": 16, "stream": True,
                                            "ignore_eos": True}).encode())
                count[0] += 1
                i += conns

        dumps: list[tuple[bool, dict]] = []
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as ac:
            tasks = [loop.create_task(worker(k)) for k in range(conns)]
            t_end = time.monotonic() + duration
            while time.monotonic() < t_end:
                dumps.append((True, (await ac.get("/kvwire/cache")).json()["ranks"][0]))
                await asyncio.sleep(0.01)
            stop[0] = True
            await asyncio.gather(*tasks)
            dumps.append((False, (await ac.get("/kvwire/cache")).json()["ranks"][0]))
            metrics = (await ac.get("/metrics")).text
        last = dumps[-1][1]["seq"]
        t_end = time.monotonic() + 30
        while not any(r.get("seq", -1) >= last for r in list(records)):
            if time.monotonic() > t_end:
                raise SystemExit(f"kvwire listen never reached seq {last}")
            await asyncio.sleep(0.05)
    finally:
        listen.terminate()
        listen.wait(10)
    reader.join(10)
    stream = events
    checked, bad = rebuild_check(records, stream, [d for _, d in dumps])
    batches = [r for r in records if r["kind"] == "batch"]
    evs = [ev for r in batches for ev in r["events"]]
    loaded = sum(1 for under, d in dumps if under and d["running"])
    return {"requests": count[0], "dumps": checked, "dumps_under_load": loaded,
            "mismatched": bad, "batches": len(batches),
            "blocks_stored": sum(len(ev["block_hashes"]) for ev in evs
                                 if ev["type"] == "BlockStored"),
            "blocks_removed": sum(len(ev["block_hashes"]) for ev in evs
                                  if ev["type"] == "BlockRemoved"),
            "final_blocks": len(dumps[-1][1]["blocks"]),
            "listen": listen.stderr.read().strip().removeprefix("kvwire listen: "),
            "met": bad == 0 and checked == len(dumps) and loaded > 0,
            "published_batches": int(float(re.search(
                r"^kvwire_engine_published_batches_total (\S+)$", metrics, re.M).group(1)))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fidelity", action="store_true")
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--quick", action="store_true", help="3 s runs instead of --duration")
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("--speed", type=float, default=None,
                    help="default: 1000 (throughput), 1 (fidelity)")
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--engine-cpu", type=int, default=0)
    ap.add_argument("--client-cpu", type=int, default=1)
    ap.add_argument("--engine-flags", default=None,
                    help="extra kvwire engine flags (fidelity default: --step-prefill-token-us 5, "
                    "so 100 requests/s of 1k tokens load the model ~60%%, not past saturation)")
    a = ap.parse_args()
    if a.quick:
        a.duration = 3.0
    speed = a.speed if a.speed is not None else (1.0 if a.fidelity else 1000.0)
    flags = a.engine_flags if a.engine_flags is not None else (
        "--step-prefill-token-us 5" if a.fidelity else
        "--num-gpu-blocks 400" if a.rebuild else "")
    p = start_engine(a.port, speed, a.engine_cpu, flags.split())
    try:
        if a.client_cpu is not None:
            os.sched_setaffinity(0, {a.client_cpu})
        try:
            import uvloop
            run = uvloop.run
        except ImportError:
            run = asyncio.run
        if a.fidelity:
            res = run(fidelity(a.port, a.rate, a.duration, a.prompt_tokens))
        elif a.rebuild:
            res = run(rebuild(a.port, a.conns, a.duration, a.prompt_tokens,
                              f"tcp://127.0.0.1:{a.port + 1000}",
                              f"tcp://127.0.0.1:{a.port + 2000}"))
        else:
            res = run(throughput(a.port, a.conns, a.duration, a.prompt_tokens, p.pid))
        res["speed"] = speed
        res["engine_flags"] = flags
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                          for k, v in res.items()}))
    finally:
        p.terminate()
        p.wait(10)
    return 0 if res.get("met", True) else 3


if __name__ == "__main__":
    sys.exit(main())
