"""OpenAI proxies in front of fast engines: kvwire's proxy
(``kvwire serve ... url=``) against SGLang's router (``sglang-router`` 0.3.2 from PyPI,
``--policy cache_aware``) and against sending the same requests straight to the engine,
all measured in the same run, on this machine's 2 cores (nothing pinned but the load
generator, which runs on CPU 1).

Engines (one of each, both started here):

* ``trivial``: an asyncio (uvloop) HTTP/1.1 server written below that answers
  ``/v1/completions`` and ``/v1/chat/completions`` in microseconds: non-streamed (one JSON
  object with ``usage``), or streamed as 16 SSE chunks plus ``[DONE]``, each chunk its own
  ``send`` (chunked transfer encoding, TCP_NODELAY on its sockets), with a yield to the loop
  between chunks as a real engine's steps would give;
* ``kvwire-engine``: ``kvwire engine --speed 1000`` (the engine model 1000x faster than wall
  time; its KV events feed kvwire's proxy).

Throughput cells: wrk (C, Debian package ``wrk``; one thread pinned to CPU 1; a Lua script
cycling 512 chat bodies: a shared system prompt and a unique user message, about 150
tokens, ``max_tokens`` 16) keeps 8 or 32 keep-alive connections busy for ``--seconds``,
non-streamed and streamed, straight to the engine, through SGLang's router, through
kvwire's proxy. Per cell: requests/s, wrk's p50/p99 of whole-response latency and what the
router adds to the straight cell's, and the router's CPU (utime + stime of its process tree,
from /proc/PID/stat) per request wrk got an answer to. ``--repeat`` rounds, routers
interleaved in each; the table prints medians.

Conditions: ``default`` (this machine's loopback) and ``quickack``: the same bench re-run
inside a fresh network namespace (``unshare -n``, root) whose loopback routes carry
``quickack 1``, so delayed ACKs cannot stall a sender that leaves Nagle on.

Overhead row (``--overhead``, on by default): a hand-written asyncio client (uvloop, pinned
to CPU 1, keep-alive connections opened as needed) sends streamed chat requests of 2k
tokens (by kvwire's built-in tokenizer; a shared 1k-token system prompt and a unique
user part) open-loop at 500 requests/s to the trivial engine, straight and through each
router; TTFT = send to the first byte of the first ``data:`` event. kvwire's proxy runs with
``--tokenizer builtin``, so tokenizing the prompt is inside its TTFT.

    .venv/bin/python bench/proxy.py             # 3 rounds x 5 s per cell, both conditions
    .venv/bin/python bench/proxy.py --quick     # 1 round x 2 s per cell
    .venv/bin/python bench/proxy.py --condition default --engines trivial

Everything listens on 127.0.0.1 only (SGLang's router and its Prometheus port are given
``--host 127.0.0.1`` and ``--prometheus-host 127.0.0.1``: its defaults are 0.0.0.0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = sys.executable
LOADGEN_CPU = 1
ROUTERS = ("straight", "sglang", "kvwire")
ENGINE_KINDS = ("trivial", "kvwire-engine")
CHUNKS = 16
MODEL = {"trivial": "trivial", "kvwire-engine": "kvwire-engine"}


# ---------------------------------------------------------------------- the trivial engine

def _completion(chat: bool, n: int) -> bytes:
    if chat:
        return json.dumps({"id": f"chatcmpl-{n}", "object": "chat.completion", "created": 0,
                           "model": "trivial", "choices": [{
                               "index": 0, "finish_reason": "length",
                               "message": {"role": "assistant", "content": "tok " * CHUNKS}}],
                           "usage": {"prompt_tokens": 100, "completion_tokens": CHUNKS,
                                     "total_tokens": 100 + CHUNKS}}).encode()
    return json.dumps({"id": f"cmpl-{n}", "object": "text_completion", "created": 0,
                       "model": "trivial", "choices": [{"index": 0, "text": "tok " * CHUNKS,
                                                        "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 100, "completion_tokens": CHUNKS,
                                 "total_tokens": 100 + CHUNKS}}).encode()


def _sse_chunks(chat: bool) -> list[bytes]:
    out = []
    for i in range(CHUNKS):
        if chat:
            d = {"id": "chatcmpl-0", "object": "chat.completion.chunk", "created": 0,
                 "model": "trivial", "choices": [{"index": 0, "delta": {"content": "tok "},
                                                  "finish_reason": None}]}
        else:
            d = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "trivial",
                 "choices": [{"index": 0, "text": "tok ", "finish_reason": None}]}
        if i == CHUNKS - 1:
            d["choices"][0]["finish_reason"] = "length"
            d["usage"] = {"prompt_tokens": 100, "completion_tokens": CHUNKS,
                          "total_tokens": 100 + CHUNKS}
        ev = b"data: " + json.dumps(d).encode() + b"\n\n"
        out.append(b"%x\r\n%s\r\n" % (len(ev), ev))
    done = b"data: [DONE]\n\n"
    out.append(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
    return out


_MODELS = json.dumps({"object": "list", "data": [{"id": "trivial", "object": "model",
                                                   "created": 0, "owned_by": "bench",
                                                   "root": "trivial", "parent": None,
                                                   "max_model_len": 32768}]}).encode()
_STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
_CL = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.I)
_STREAM_TRUE = re.compile(rb'"stream"\s*:\s*true')


def _plain(status: bytes, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + ctype +
            b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)


_CHUNKED = re.compile(rb"(?i)\r\ntransfer-encoding:[ \t]*chunked")


def _dechunk(buf: bytes, at: int) -> tuple[bytes, int] | None:
    """A chunked body from ``at`` (no trailers): (body, where it ends), or None if it has
    not all arrived."""
    parts = []
    while True:
        eol = buf.find(b"\r\n", at)
        if eol < 0:
            return None
        size = int(buf[at:eol].split(b";")[0], 16)
        if len(buf) < eol + 2 + size + 2:
            return None
        if size == 0:
            return b"".join(parts), eol + 4
        parts.append(buf[eol + 2:eol + 2 + size])
        at = eol + 2 + size + 2


class _EngineProto(asyncio.Protocol):
    chunks = {True: _sse_chunks(True), False: _sse_chunks(False)}
    answers = {True: _completion(True, 0), False: _completion(False, 0)}

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.t = transport
        self.buf = b""
        self.busy = False  # a stream is being written: later pipelined requests wait
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._drain()

    def _drain(self) -> None:
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end + 2]
            if _CHUNKED.search(head):  # (Envoy sends a body an ext_proc filter echoed so)
                got = _dechunk(self.buf, end + 4)
                if got is None:
                    return
                body, after = got
                self.buf = self.buf[after:]
            else:
                m = _CL.search(head)
                n = int(m.group(1)) if m else 0
                if len(self.buf) < end + 4 + n:
                    return
                body = self.buf[end + 4:end + 4 + n]
                self.buf = self.buf[end + 4 + n:]
            line = head[:head.find(b"\r\n")]
            parts = line.split(b" ")
            path = parts[1] if len(parts) > 1 else b""
            if path in (b"/v1/chat/completions", b"/v1/completions"):
                chat = path == b"/v1/chat/completions"
                if _STREAM_TRUE.search(body):
                    self.busy = True
                    asyncio.get_running_loop().create_task(self._stream(chat))
                    return
                self.t.write(_plain(b"200 OK", self.answers[chat]))
            elif path == b"/health":
                self.t.write(_plain(b"200 OK", b"", b"text/plain"))
            elif path == b"/v1/models":
                self.t.write(_plain(b"200 OK", _MODELS))
            else:
                self.t.write(_plain(b"404 Not Found", b'{"error":"not found"}'))

    async def _stream(self, chat: bool) -> None:
        t = self.t
        t.write(_STREAM_HEAD)
        for c in self.chunks[chat]:
            await asyncio.sleep(0)  # one engine step between chunks (microseconds here)
            if t.is_closing():
                return
            t.write(c)
        self.busy = False
        self._drain()


def serve_trivial(port: int) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass

    async def main() -> None:
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(_EngineProto, "127.0.0.1", port, backlog=1024)
        print(f"serving on 127.0.0.1:{port}", flush=True)
        await srv.serve_forever()

    asyncio.run(main())


# ---------------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, body: bytes | None, timeout: float, proc: subprocess.Popen,
               what: str) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} during start-up")
        try:
            req = urllib.request.Request(url, data=body,
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    r.read()
                    return
        except Exception as e:  # noqa: BLE001 - not up yet
            last = repr(e)
        time.sleep(0.2)
    raise RuntimeError(f"{what} not answering {url} after {timeout}s: {last}")


def _kill(p: subprocess.Popen | None) -> None:
    if p is None or p.poll() is not None:
        return
    p.terminate()
    try:
        p.wait(5)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)


def start_trivial(port: int) -> subprocess.Popen:
    p = subprocess.Popen([PY, os.path.abspath(__file__), "--serve-trivial", str(port)],
                         stdout=subprocess.PIPE)
    line = p.stdout.readline().decode()
    if "serving" not in line:
        raise RuntimeError(f"trivial engine did not start: {line!r}")
    return p


def start_kvwire_engine(port: int, ev: int, rp: int) -> subprocess.Popen:
    p = subprocess.Popen([PY, "-m", "kvwire.cli.engine", "--host", "127.0.0.1", "--port",
                          str(port), "--speed", "1000", "--events", f"tcp://127.0.0.1:{ev}",
                          "--replay", f"tcp://127.0.0.1:{rp}", "--log-level", "error"],
                         stdout=subprocess.PIPE)
    line = p.stdout.readline().decode()
    if "serving" not in line:
        raise RuntimeError(f"kvwire engine did not start: {line!r}")
    return p


def probe(model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hello"}],
                       "max_tokens": 4}).encode()


def _start_router(cmd: list[str], port: int, model: str, log: str,
                  what: str) -> subprocess.Popen:
    """Start a router, wait until it answers a chat request; on failure kill it and show the
    tail of its log."""
    p = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/chat/completions", probe(model), 60, p, what)
    except RuntimeError:
        _kill(p)
        with open(log, "rb") as f:
            sys.stderr.write(f.read()[-2000:].decode(errors="replace"))
        raise
    return p


def start_sglang(port: int, engine_url: str, model: str, log: str) -> subprocess.Popen:
    cmd = [PY, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", engine_url, "--policy", "cache_aware",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--log-level", "warn", "--worker-startup-check-interval", "1"]
    return _start_router(cmd, port, model, log, "sglang-router")


def start_kvwire_serve(port: int, engine_url: str, ev: int, rp: int | None, model: str,
                       log: str) -> subprocess.Popen:
    spec = f"e0=tcp://127.0.0.1:{ev}" + (f",replay=tcp://127.0.0.1:{rp}" if rp else "")
    cmd = [PY, "-m", "kvwire", "serve", "--engine", f"{spec},url={engine_url}",
           "--tokenizer", "builtin", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "error"]
    return _start_router(cmd, port, model, log, "kvwire serve")


def kvwire_proxy_missing() -> str | None:
    """Why ``kvwire serve`` cannot proxy here (None: it can)."""
    out = subprocess.run([PY, "-m", "kvwire", "serve", "--help"], capture_output=True,
                         text=True, cwd=ROOT).stdout
    if "url=" not in out or "--tokenizer" not in out:
        return "kvwire serve has no proxy flags (url=, --tokenizer) in this checkout"
    return None


def tree_pids(pid: int) -> list[int]:
    """pid and its live descendants, from /proc/PID/stat."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    s = f.read()
                ppid = int(s[s.rfind(")") + 2:].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def tree_cpu(pid: int) -> float:
    """utime + stime (s) of pid and its live descendants, from /proc/PID/stat."""
    tck = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                s = f.read()
            fields = s[s.rfind(")") + 2:].split()
            total += (int(fields[11]) + int(fields[12])) / tck
        except (OSError, ValueError, IndexError):
            pass
    return total


# ---------------------------------------------------------------------- load: wrk

WORDS = ("cache block prefix token engine router stream event index radix tree hash "
         "request answer model prompt decode prefill latency replica shard batch queue "
         "worker policy score load share core socket buffer").split()


def chat_bodies(n: int, stream: bool, model: str, user_words: int = 60,
                seed: int = 1) -> list[str]:
    rnd = random.Random(seed)
    system = " ".join(rnd.choice(WORDS) for _ in range(60))
    out = []
    for i in range(n):
        user = f"request {i}: " + " ".join(rnd.choice(WORDS) for _ in range(user_words))
        out.append(json.dumps({"model": model, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": CHUNKS, "ignore_eos": True, "stream": stream}))
    return out


def _lua_str(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def wrk_cell(port: int, bodies: list[str], conns: int, seconds: float, where: str,
             pid: int | None) -> dict:
    script = os.path.join(where, f"load-{conns}-{random.random():.6f}.lua")
    with open(script, "w") as f:
        f.write("local bodies = {\n" + ",\n".join(_lua_str(b) for b in bodies) + "\n}\n"
                "local i = 0\nwrk.method = 'POST'\n"
                "wrk.headers['Content-Type'] = 'application/json'\n"
                "request = function()\n  i = i % #bodies + 1\n"
                "  return wrk.format(nil, '/v1/chat/completions', nil, bodies[i])\nend\n")
    cmd = ["taskset", "-c", str(LOADGEN_CPU), shutil.which("wrk") or "wrk", "-t1",
           f"-c{conns}", f"-d{max(1, round(seconds))}s", "--latency", "--timeout", "10s",
           "-s", script, f"http://127.0.0.1:{port}"]
    c0 = tree_cpu(pid) if pid else 0.0
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    c1 = tree_cpu(pid) if pid else 0.0
    os.unlink(script)
    return parse_wrk(out) | {"cpu": c1 - c0}


def _ms(v: str, unit: str) -> float:
    return float(v) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}[unit]


def parse_wrk(out: str) -> dict:
    r: dict = {"rps": 0.0, "n": 0, "p50": float("nan"), "p99": float("nan"), "bad": 0,
               "errors": 0}
    for m in re.finditer(r"^\s+(50|99)(?:\.000)?%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.M):
        r["p" + m.group(1)] = _ms(m.group(2), m.group(3))
    m = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", out)
    if m:
        r["n"] = int(m.group(1))
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if m:
        r["rps"] = float(m.group(1))
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m:
        r["bad"] = int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        r["errors"] = sum(int(x) for x in m.groups())
    if not r["n"]:
        r["raw"] = out[-400:]
    r["ok"] = max(0, r["n"] - r["bad"])  # answered with 2xx: what rates and CPU count
    if r["n"]:
        r["rps"] *= r["ok"] / r["n"]
    return r


# ---------------------------------------------------------------------- overhead client

async def _one(conn, body: bytes, port: int) -> tuple[float, float]:
    """(TTFT, total) of one streamed request on a keep-alive connection."""
    reader, writer = conn
    t0 = time.perf_counter()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (port, len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"status {head[:40]!r}")
    ttft = None
    hl = head.lower()
    if b"transfer-encoding: chunked" in hl:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if ttft is None and b"data:" in data:
                ttft = time.perf_counter() - t0
            if size == 0:
                break
    else:
        m = _CL.search(b"\r\n" + hl)
        data = await reader.readexactly(int(m.group(1)) if m else 0)
        ttft = time.perf_counter() - t0
    return (ttft if ttft is not None else float("nan")), time.perf_counter() - t0


def overhead_client(port: int, bodies: list[bytes], rate: float, out: str) -> None:
    os.sched_setaffinity(0, {LOADGEN_CPU})
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass

    async def main() -> dict:
        idle: list = []  # (reader, writer, last used); servers close idle ones (uvicorn
        # after 5 s), so a connection idle for over 2 s is closed here and not reused

        async def conn():
            while idle:
                r, w, used = idle.pop()
                if time.perf_counter() - used < 2.0:
                    return r, w
                w.close()
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return r, w

        for _ in range(8):
            idle.append((*await conn(), time.perf_counter()))
        ttfts: list[float] = []
        late: list[float] = []
        errors: list[str] = []

        async def fire(b: bytes) -> None:
            c = await conn()
            try:
                ttft, _ = await _one(c, b, port)
                ttfts.append(ttft)
                idle.append((*c, time.perf_counter()))
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(repr(e))
                c[1].close()

        tasks = []
        t0 = time.perf_counter()
        for i, b in enumerate(bodies):
            due = t0 + i / rate
            d = due - time.perf_counter()
            if d > 0:
                await asyncio.sleep(d)
            late.append(time.perf_counter() - due)
            tasks.append(asyncio.ensure_future(fire(b)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        for _, w, _ in idle:
            w.close()
        return {"ttft": ttfts, "errors": errors[:3], "n_err": len(errors),
                "late_p99": _pct(late, 99), "rate": len(ttfts) / wall}

    res = asyncio.run(main())
    with open(out, "w") as f:
        json.dump(res, f)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q / 100))]


def overhead_bodies(n: int, tokens: int = 2048) -> list[bytes]:
    """Streamed chat bodies of ``tokens`` tokens by kvwire's built-in tokenizer (chat
    template included): a shared system prompt of half of them, a unique user part."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from kvwire.tokenize import load_tokenizer

    tok = load_tokenizer(None)
    rnd = random.Random(7)

    def words(k: int) -> str:
        return " ".join(rnd.choice(WORDS) for _ in range(k))

    def count(msgs: list) -> int:
        return len(tok.encode_chat(msgs))

    system = words(tokens // 2)
    while count([{"role": "system", "content": system}]) > tokens // 2:
        system = system.rsplit(" ", 8)[0]
    base = count([{"role": "system", "content": system}, {"role": "user", "content": ""}])
    k, out = (tokens - base), []
    for i in range(n):
        user = f"{i} " + words(k)
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        if i < 4:  # calibrate the user part's length on the first few
            while count(msgs) > tokens:
                user = user.rsplit(" ", 1)[0]
                msgs[1]["content"] = user
            k = len(user.split()) - 1
        out.append(json.dumps({"model": "trivial", "messages": msgs, "max_tokens": CHUNKS,
                               "stream": True,
                               "ignore_eos": True}).encode())
    out_tokens = [len(tok.encode_chat(json.loads(b)["messages"])) for b in out[:20]]
    print(f"  overhead prompts: {n}, tokens (first 20): {min(out_tokens)}-{max(out_tokens)}",
          flush=True)
    return out


def run_overhead(port: int, bodies: list[bytes], rate: float, where: str) -> dict:
    out = os.path.join(where, f"overhead-{port}-{random.random():.6f}.json")
    bfile = out + ".bodies"
    with open(bfile, "w") as f:
        json.dump([b.decode() for b in bodies], f)
    subprocess.run([PY, os.path.abspath(__file__), "--overhead-client", str(port), bfile,
                    str(rate), out], check=True, timeout=len(bodies) / rate + 120)
    with open(out) as f:
        r = json.load(f)
    os.unlink(out)
    os.unlink(bfile)
    t = r.pop("ttft")
    r["p50"], r["p99"], r["n"] = _pct(t, 50) * 1e3, _pct(t, 99) * 1e3, len(t)
    return r


# ---------------------------------------------------------------------- the bench

def run_condition(a: argparse.Namespace, condition: str) -> dict:
    """Every cell of one network condition, in this process's network namespace."""
    where = tempfile.mkdtemp(prefix="kvwire-bench-proxy-")
    procs: list[subprocess.Popen] = []
    res: dict = {"cells": [], "overhead": [], "skipped": {}}
    missing = kvwire_proxy_missing()
    try:
        import sglang_router  # noqa: F401
        sg_missing = None
    except ImportError:
        sg_missing = "sglang-router not installed (make bench installs sglang-router==0.3.2)"
    if missing:
        res["skipped"]["kvwire"] = missing
    if sg_missing:
        res["skipped"]["sglang"] = sg_missing
    try:
        ports: dict = {}  # (engine kind, router) -> (port, pid or None)
        for kind in a.engines:
            ep, ev, rp = free_port(), free_port(), free_port()
            if kind == "trivial":
                e = start_trivial(ep)
                rp_ = None
            else:
                e = start_kvwire_engine(ep, ev, rp)
                rp_ = rp
            procs.append(e)
            url = f"http://127.0.0.1:{ep}"
            ports[(kind, "straight")] = (ep, None)
            if not sg_missing:
                sp = free_port()
                s = start_sglang(sp, url, MODEL[kind], os.path.join(where, f"sglang-{kind}.log"))
                procs.append(s)
                ports[(kind, "sglang")] = (sp, s.pid)
            if not missing:
                kp = free_port()
                k = start_kvwire_serve(kp, url, ev, rp_, MODEL[kind],
                                      os.path.join(where, f"kvwire-{kind}.log"))
                procs.append(k)
                ports[(kind, "kvwire")] = (kp, k.pid)
        print(f"[{condition}] engines and routers up: "
              f"{sorted(f'{k}/{r}' for k, r in ports)}", flush=True)
        bodies = {(k, s): chat_bodies(512, s, MODEL[k]) for k in a.engines for s in (False, True)}
        for rnd in range(0 if a.only_overhead else a.repeat):
            for kind in a.engines:
                for stream in (False, True):
                    for conns in a.conns:
                        for router in ROUTERS:
                            if (kind, router) not in ports:
                                continue
                            port, pid = ports[(kind, router)]
                            r = wrk_cell(port, bodies[(kind, stream)], conns, a.seconds, where, pid)
                            r.update(engine=kind, router=router, stream=stream, conns=conns,
                                     round=rnd)
                            res["cells"].append(r)
                            print(f"  [{condition}] round {rnd} {kind:13s} "
                                  f"{'stream' if stream else 'plain ':6s} c{conns:<3d} "
                                  f"{router:8s} {r['rps']:9.0f}/s p50 {r['p50']:7.2f} ms "
                                  f"p99 {r['p99']:7.2f} ms cpu {r['cpu']:.2f}s "
                                  f"non-2xx {r['bad']} errors {r['errors']}"
                                  + (f" RAW {r.get('raw')!r}" if "raw" in r else ""),
                                  flush=True)
        if a.overhead and "trivial" in a.engines:
            ob = overhead_bodies(int(a.rate * a.overhead_seconds))
            for rnd in range(a.repeat):
                for router in ROUTERS:
                    if ("trivial", router) not in ports:
                        continue
                    port, pid = ports[("trivial", router)]
                    c0 = tree_cpu(pid) if pid else 0.0
                    r = run_overhead(port, ob, a.rate, where)
                    r["cpu"] = (tree_cpu(pid) if pid else 0.0) - c0
                    r.update(router=router, round=rnd)
                    res["overhead"].append(r)
                    print(f"  [{condition}] overhead round {rnd} {router:8s} "
                          f"{r['rate']:.0f}/s TTFT p50 {r['p50']:.3f} ms p99 {r['p99']:.3f} "
                          f"ms errors {r['n_err']} {r['errors']} "
                          f"client late p99 {r['late_p99'] * 1e3:.2f} ms", flush=True)
    finally:
        for p in reversed(procs):
            _kill(p)
    shutil.rmtree(where, ignore_errors=True)
    return res


def run_in_netns(a: argparse.Namespace, argv: list[str]) -> dict:
    """The same bench in a new network namespace with quick ACKs on loopback."""
    out = tempfile.mktemp(prefix="kvwire-bench-proxy-", suffix=".json")
    inner = " ".join(shlex.quote(x) for x in
                     [PY, os.path.abspath(__file__), *argv, "--netns-child", out])
    script = ("set -e; ip link set lo up; "
              "ip route change local 127.0.0.0/8 dev lo table local scope host quickack 1; "
              "ip route change local 127.0.0.1 dev lo table local proto kernel scope host "
              "src 127.0.0.1 quickack 1; ip route show table local | grep -c quickack >&2; "
              f"exec {inner}")
    r = subprocess.run(["unshare", "-n", "sh", "-c", script])
    if r.returncode != 0 or not os.path.exists(out):
        return {"cells": [], "overhead": [], "skipped": {
            "*": f"network namespace with quickack failed (unshare -n as root; exit "
                 f"{r.returncode})"}}
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res


def med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def report(results: dict[str, dict], a: argparse.Namespace) -> None:
    print()
    print(f"load: wrk -t1 pinned to CPU {LOADGEN_CPU}, {a.seconds:g} s per cell, "
          f"median of {a.repeat} round(s); latency = whole response (wrk); "
          "CPU = router process tree per answered request")
    hdr = (f"{'net':9s} {'engine':13s} {'mode':6s} {'conns':>5s} {'router':9s} "
           f"{'req/s':>8s} {'x sglang':>8s} {'p50 ms':>7s} {'p99 ms':>7s} {'+p50 ms':>7s} "
           f"{'+p99 ms':>7s} {'CPU us/req':>10s} {'errors':>6s}")
    print(hdr)
    print("-" * len(hdr))
    for cond, res in results.items():
        for why in res["skipped"].items():
            print(f"{cond:9s} SKIPPED {why[0]}: {why[1]}")
        cells = res["cells"]
        keys = []
        for c in cells:
            k = (c["engine"], c["stream"], c["conns"])
            if k not in keys:
                keys.append(k)
        for kind, stream, conns in keys:
            got = {}
            for router in ROUTERS:
                cs = [c for c in cells if (c["engine"], c["stream"], c["conns"], c["router"])
                      == (kind, stream, conns, router)]
                if cs:
                    got[router] = {
                        "rps": med([c["rps"] for c in cs]), "p50": med([c["p50"] for c in cs]),
                        "p99": med([c["p99"] for c in cs]),
                        "cpu": med([c["cpu"] / c["ok"] * 1e6 if c["ok"] else float("nan")
                                    for c in cs]),
                        "err": sum(c["bad"] + c["errors"] for c in cs)}
            st = got.get("straight")
            sg = got.get("sglang")
            for router, g in got.items():
                add50 = g["p50"] - st["p50"] if st and router != "straight" else None
                add99 = g["p99"] - st["p99"] if st and router != "straight" else None
                xs = g["rps"] / sg["rps"] if sg and sg["rps"] and router == "kvwire" else None
                print(f"{cond:9s} {kind:13s} {'stream' if stream else 'plain':6s} {conns:5d} "
                      f"{router:9s} {g['rps']:8.0f} "
                      f"{(f'{xs:.2f}x' if xs is not None else ''):>8s} {g['p50']:7.2f} "
                      f"{g['p99']:7.2f} "
                      f"{(f'{add50:+.2f}' if add50 is not None else ''):>7s} "
                      f"{(f'{add99:+.2f}' if add99 is not None else ''):>7s} "
                      f"{(format(g['cpu'], '.0f') if router != 'straight' else ''):>10s} "
                      f"{g['err']:6d}")
    ov = [(cond, r) for cond, res in results.items() for r in res["overhead"]]
    if ov:
        print()
        print(f"overhead: streamed chat, 2k-token prompts, open loop at {a.rate:g}/s for "
              f"{a.overhead_seconds:g} s to the trivial engine (asyncio client pinned to CPU "
              f"{LOADGEN_CPU}); TTFT median of {a.repeat} round(s)")
        hdr = (f"{'net':9s} {'router':9s} {'req/s':>7s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
               f"{'+p50 ms':>8s} {'+p99 ms':>8s} {'CPU us/req':>10s} {'errors':>6s}")
        print(hdr)
        print("-" * len(hdr))
        for cond in results:
            rows = {}
            for router in ROUTERS:
                rs = [r for c, r in ov if c == cond and r["router"] == router]
                if rs:
                    rows[router] = {"rate": med([r["rate"] for r in rs]),
                                    "p50": med([r["p50"] for r in rs]),
                                    "p99": med([r["p99"] for r in rs]),
                                    "cpu": med([r["cpu"] / r["n"] * 1e6 if r["n"] else
                                                float("nan") for r in rs]),
                                    "err": sum(r["n_err"] for r in rs)}
            st = rows.get("straight")
            for router, g in rows.items():
                add = router != "straight" and st
                print(f"{cond:9s} {router:9s} {g['rate']:7.0f} {g['p50']:9.3f} {g['p99']:9.3f} "
                      f"{(format(g['p50'] - st['p50'], '+.3f') if add else ''):>8s} "
                      f"{(format(g['p99'] - st['p99'], '+.3f') if add else ''):>8s} "
                      f"{(format(g['cpu'], '.0f') if router != 'straight' else ''):>10s} "
                      f"{g['err']:6d}")
        print("targets: kvwire added TTFT p50 <= 1 ms, p99 <= 5 ms; streamed req/s >= 1.0x "
              "sglang, non-streamed >= 0.5x (both conditions)")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-trivial":
        serve_trivial(int(sys.argv[2]))
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--overhead-client":
        port, bfile, rate, out = sys.argv[2:6]
        with open(bfile) as f:
            bodies = [b.encode() for b in json.load(f)]
        overhead_client(int(port), bodies, float(rate), out)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 round of 2 s cells, 2 s overhead")
    p.add_argument("--seconds", type=float, default=5.0, help="wrk seconds per cell")
    p.add_argument("--repeat", type=int, default=3, help="rounds (medians printed)")
    p.add_argument("--conns", type=lambda t: [int(x) for x in t.split(",")], default=[8, 32])
    p.add_argument("--engines", type=lambda t: t.split(","), default=list(ENGINE_KINDS),
                   help="comma list of trivial,kvwire-engine")
    p.add_argument("--condition", choices=("default", "quickack", "both"), default="both")
    p.add_argument("--no-overhead", dest="overhead", action="store_false")
    p.add_argument("--only-overhead", action="store_true", help="the overhead row alone")
    p.add_argument("--rate", type=float, default=500.0, help="overhead row: requests/s")
    p.add_argument("--overhead-seconds", type=float, default=10.0)
    p.add_argument("--netns-child", metavar="OUT", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    a = p.parse_args(argv)
    if a.quick:
        a.seconds, a.repeat, a.overhead_seconds = 2.0, 1, 2.0
    bad = [e for e in a.engines if e not in ENGINE_KINDS]
    if bad:
        p.error(f"unknown engine kind(s) {bad}")
    if shutil.which("wrk") is None:
        raise SystemExit("bench/proxy.py needs wrk (apt-get install wrk; make bench does it)")
    if a.netns_child:
        res = run_condition(a, "quickack")
        with open(a.netns_child, "w") as f:
            json.dump(res, f)
        return
    print(f"bench/proxy.py {' '.join(argv)} at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          f" on {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (other work on the"
          " box skews every row alike only roughly: rerun and compare ratios)", flush=True)
    results = {}
    if a.condition in ("default", "both"):
        results["default"] = run_condition(a, "default")
    if a.condition in ("quickack", "both"):
        child = [x for x in argv if x not in ("--condition",)]
        if "--condition" in argv:
            i = argv.index("--condition")
            child = argv[:i] + argv[i + 2:]
        results["quickack"] = run_in_netns(a, child)
    report(results, a)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
