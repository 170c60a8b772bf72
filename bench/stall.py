"""Long never-seen prompts must not stall the proxy: short streamed requests through ``kvwire
serve`` while 30k-token prompts nobody has sent before arrive at 20/s, against the same short
requests with no long ones (calm) and straight to the engine, in the same run.

Engine: bench/proxy.py's ``trivial`` one (answers in microseconds, 16 SSE chunks), so what is
measured is the proxy. ``kvwire serve --tokenizer builtin`` (or ``--tokenizer DIR``, e.g. the
vendored Qwen3 one: ``--tokenizer qwen3``) tokenizes every prompt; a long one's new text goes
to its tokenize workers (``--tokenize-threads``), past ``--tokenize-queue`` it is refused with
429, counted here. Short requests: a chat of ~40 tokens, streamed, open loop at ``--short-rate``
per second; long ones: a completion prompt of ``--long-tokens`` tokens (by the proxy's
tokenizer) of random words, different for every request, ``max_tokens`` 1, at
``--long-rate`` per second. Reported: the short requests' TTFT p50/p99 in each condition and
the TTFT the proxy adds (through the proxy minus straight), the long ones' outcomes, and the
router's CPU, and its event loop's lag (``kvwire_serve_loop_lag_seconds``) in each condition.

    .venv/bin/python bench/stall.py                     # builtin tokenizer, 20 s per condition
    .venv/bin/python bench/stall.py --tokenizer qwen3
    .venv/bin/python bench/stall.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import lzma
import os
import random
import shutil
import socket
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
from host import Steal  # noqa: E402
from proxy import (  # noqa: E402
    PY,
    _kill,
    _one,
    _pct,
    _start_router,
    free_port,
    start_trivial,
    tree_cpu,
)

MODEL = "trivial"  # what bench/proxy.py's trivial engine serves
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _tokenizer(spec: str) -> tuple[str, str | None]:
    """(the --tokenizer value for kvwire serve, a temp dir to remove)."""
    if spec != "qwen3":
        return spec, None
    d = tempfile.mkdtemp(prefix="kvwire-qwen3-")
    src = os.path.join(ROOT, "tests", "data", "tokenize", "qwen3")
    for f in os.listdir(src):
        if f.endswith(".xz"):
            with lzma.open(os.path.join(src, f)) as i, open(os.path.join(d, f[:-3]), "wb") as o:
                shutil.copyfileobj(i, o)
        else:
            shutil.copy(os.path.join(src, f), d)
    return d, d


def long_prompts(n: int, tokens: int, tokenizer: str) -> list[bytes]:
    """``n`` completion bodies of ~``tokens`` tokens each (by ``tokenizer``), random words
    never repeated across bodies."""
    from kvwire.tokenize import load_tokenizer

    tok = load_tokenizer(None if tokenizer == "builtin" else tokenizer)
    rng = random.Random(7)

    def text(words: int) -> str:
        return " ".join("".join(rng.choices(LETTERS, k=rng.randint(3, 9))) for _ in range(words))

    probe = text(2000)
    per_word = len(tok.encode(probe)) / 2000
    words = int(tokens / per_word)
    return [json.dumps({"model": MODEL, "prompt": f"request {i}: " + text(words),
                        "max_tokens": 1}).encode() for i in range(n)]


def short_bodies(n: int) -> list[bytes]:
    return [json.dumps({"model": MODEL, "stream": True, "max_tokens": 16, "messages": [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": f"question {i}: what does the cache hold for this prompt?"}]}
    ).encode() for i in range(n)]


async def _send(port: int, body: bytes, chat: bool) -> tuple[int, float]:
    """(status, TTFT) of one request on its own connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        if chat:
            ttft, _ = await _one((reader, writer), body, port)
            return 200, ttft
        t0 = time.perf_counter()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                     % len(body) + body)
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.read()
        return int(head.split(b" ", 2)[1]), time.perf_counter() - t0
    finally:
        writer.close()


def loop_lag(port: int) -> dict[float, float]:
    """The router's ``kvwire_serve_loop_lag_seconds`` buckets (cumulative counts by bound)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvwire_serve_loop_lag_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def lag_summary(before: dict[float, float], after: dict[float, float]) -> str:
    """p99 of the loop lag sampled in between (as the bucket bound it falls under) and the
    share of samples later than 5 ms."""
    d = {b: after[b] - before.get(b, 0.0) for b in sorted(after)}
    n = d[float("inf")]
    if not n:
        return "-"
    p99 = next(b for b, c in d.items() if c >= 0.99 * n)
    late = 1 - d[0.005] / n
    return f"<= {p99 * 1e3:g} ms, {late:.1%} > 5 ms"


def run_load(port: int, shorts: list[bytes], short_rate: float, longs: list[bytes],
             long_rate: float) -> dict:
    async def main() -> dict:
        ttfts: list[float] = []
        outcomes: dict[str, int] = {}
        errors: list[str] = []

        async def short(b: bytes) -> None:
            try:
                ttfts.append((await _send(port, b, True))[1])
            except Exception as e:  # noqa: BLE001 - counted
                errors.append(repr(e))

        async def long(b: bytes) -> None:
            try:
                status, _ = await _send(port, b, False)
                outcomes[str(status)] = outcomes.get(str(status), 0) + 1
            except Exception as e:  # noqa: BLE001 - counted
                errors.append(repr(e))

        async def fire(bodies: list[bytes], rate: float, one) -> list:
            tasks = []
            t0 = time.perf_counter()
            for i, b in enumerate(bodies):
                d = t0 + i / rate - time.perf_counter()
                if d > 0:
                    await asyncio.sleep(d)
                tasks.append(asyncio.ensure_future(one(b)))
            return tasks

        groups = await asyncio.gather(fire(shorts, short_rate, short),
                                      fire(longs, long_rate, long) if longs else asyncio.sleep(0))
        await asyncio.gather(*groups[0], *(groups[1] or []))
        return {"ttft": ttfts, "long": outcomes, "errors": len(errors), "error": errors[:2]}

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="builtin", help="builtin, qwen3 or a model dir")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--short-rate", type=float, default=50.0)
    ap.add_argument("--long-rate", type=float, default=20.0)
    ap.add_argument("--long-tokens", type=int, default=30000)
    ap.add_argument("--tokenize-threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="5 s per condition")
    a = ap.parse_args()
    if a.quick:
        a.seconds = 5.0
    spec, tmp = _tokenizer(a.tokenizer)
    engine_port, port = free_port(), free_port()
    logdir = tempfile.mkdtemp(prefix="kvwire-stall-")
    engine = start_trivial(engine_port)
    router = None
    try:
        t_build = time.perf_counter()
        n_short = int(a.seconds * a.short_rate)
        n_long = int(a.seconds * a.long_rate)
        longs = long_prompts(n_long, a.long_tokens, spec)
        shorts = short_bodies(n_short)
        print(f"# {n_short} short streamed chats at {a.short_rate:g}/s; {n_long} never-seen "
              f"~{a.long_tokens}-token completion prompts at {a.long_rate:g}/s "
              f"({len(longs[0]) // 1000} kB each), tokenizer {a.tokenizer}, "
              f"--tokenize-threads {a.tokenize_threads}; built in "
              f"{time.perf_counter() - t_build:.0f} s; "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
        cmd = [PY, "-m", "kvwire", "serve", "--engine",
               f"e0=tcp://127.0.0.1:{free_port()},url=http://127.0.0.1:{engine_port}",
               "--tokenizer", spec, "--host", "127.0.0.1", "--port", str(port),
               "--tokenize-threads", str(a.tokenize_threads), "--log-level", "error"]
        router = _start_router(cmd, port, MODEL, os.path.join(logdir, "serve.log"),
                               "kvwire serve")
        rows = []
        for name, target, with_long in (("straight to the engine", engine_port, False),
                                        ("kvwire serve, short only", port, False),
                                        ("kvwire serve, with the long ones", port, True)):
            cpu0 = tree_cpu(router.pid)
            lag0 = loop_lag(port)
            t0 = time.perf_counter()
            steal = Steal()
            r = run_load(target, shorts, a.short_rate, longs if with_long else [], a.long_rate)
            r["steal"] = steal.percent()
            r["cpu"] = tree_cpu(router.pid) - cpu0
            r["lag"] = lag_summary(lag0, loop_lag(port)) if target == port else "-"
            r["wall"] = time.perf_counter() - t0
            r["name"] = name
            rows.append(r)
            print(f"# {name}: {len(r['ttft'])} short answered, long {r['long']}, errors "
                  f"{r['errors']} {r['error']}; router CPU {r['cpu']:.1f} s over "
                  f"{r['wall']:.0f} s; host steal {r['steal']} of CPU time", flush=True)
        base50, base99 = (_pct(rows[0]["ttft"], q) * 1e3 for q in (50, 99))
        print("\n| condition | short TTFT p50 ms | p99 ms | added p50 ms | added p99 ms | "
              "long answered / 429 | router loop lag p99 |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            p50, p99 = (_pct(r["ttft"], q) * 1e3 for q in (50, 99))
            lg = r["long"]
            longs_s = f"{lg.get('200', 0)} / {lg.get('429', 0)}" if lg else "-"
            print(f"| {r['name']} | {p50:.2f} | {p99:.2f} | {p50 - base50:+.2f} | "
                  f"{p99 - base99:+.2f} | {longs_s} | {r['lag']} |")
        added = _pct(rows[2]["ttft"], 99) * 1e3 - base99
        print(f"\ntarget: added TTFT p99 of short streamed requests while the long ones arrive "
              f"<= 5 ms: {added:.2f} ms {'MET' if added <= 5 else 'MISSED'}")
    finally:
        _kill(router)
        _kill(engine)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
