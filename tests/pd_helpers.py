"""Shared by the prefill/decode tests (tests/test_pd_*.py, tests/test_engine_server_pd.py,
tests/test_fleet_pd.py, tests/test_sglang_router_pd.py): real ``kvwire engine --role``,
``kvwire serve`` and ``kvwire fleet`` processes on loopback, a bounded wait and a reader of
Prometheus text.

No port is chosen here and handed to a child: a port found free and closed again can be
taken by anything else on the box before the child binds it ("Address already in use"
beside other work). ``kvwire engine`` binds port 0 for HTTP, the KV side channel, the
bootstrap server and its ZeroMQ events and replay, and ``kvwire serve`` port 0 for HTTP;
the ports they bound are read from their start lines. Only ``kvwire fleet`` (its port
layout is fixed from a base) and SGLang's router (it cannot say what it bound) take ports
from us: their start is retried, a bounded number of times, when a port was taken."""

from __future__ import annotations

import os
import random
import re
import select
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

import httpx
from cli_helpers import KVWIRE
from ports import free_port

TIMEOUT = 60.0  # processes importing on a loaded 2-core box
#: Starts of a process whose fixed port was taken meanwhile, before the test gives up
START_TRIES = 5
IN_USE = re.compile(r"in use", re.IGNORECASE)


def until(cond: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
    """Wait (bounded) for ``cond()`` to be truthy; its value."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.05)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The sum of the Prometheus samples ``name`` in ``text`` carrying ``labels`` (others
    may be there too); None when there is none."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
                f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of Prometheus ``text``, keyed by name and its sorted labels."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        pairs = tuple(sorted(tuple(kv.split("=", 1)) for kv in labels.rstrip("}").split(",")
                             if kv)) if labels else ()
        out[name, tuple((k, v.strip('"')) for k, v in pairs)] = float(value)
    return out


class Output:
    """A child's pipe read line by line until a wanted line (bounded), then drained by a
    thread into a bounded tail, so the child never blocks on a full pipe and a failure can
    show what it said."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self.pipe = pipe
        self.tail: deque[str] = deque(maxlen=200)
        self._buf = b""

    def wait_for(self, pattern: str, what: str, proc: subprocess.Popen,
                 timeout: float = TIMEOUT, drain: bool = True) -> re.Match[str]:
        """The next line matching ``pattern``; then (``drain``) the rest is drained.
        AssertionError if the child exits first or stays silent past ``timeout``."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        fd = self.pipe.fileno()
        while True:
            while b"\n" in self._buf:
                line, _, self._buf = self._buf.partition(b"\n")
                text = line.decode(errors="replace")
                self.tail.append(text)
                if m := rx.search(text):
                    if drain:
                        self.drain()
                    return m
            left = deadline - time.monotonic()
            assert left > 0, f"{what} never printed /{pattern}/: {self.said()}"
            if select.select([fd], [], [], left)[0]:
                data = os.read(fd, 65536)
                if not data:
                    raise AssertionError(f"{what} exited {proc.wait(TIMEOUT)}: {self.said()}")
                self._buf += data

    def drain(self) -> None:
        self.tail.extend(self._buf.decode(errors="replace").splitlines())
        self._buf = b""

        def run() -> None:
            for line in self.pipe:
                self.tail.append(line.decode(errors="replace").rstrip("\n"))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def said(self) -> str:
        return "\n".join(self.tail)[-3000:]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def loopback_bind() -> str:
    """The host part of a ZeroMQ bind endpoint on 127.0.0.1 only (kvwire fleet's rule: a
    publisher binds only ``*`` or an IPv6 form)."""
    from kvwire.cli.fleet import bind_host

    return bind_host("127.0.0.1", False)


class Engine:
    """One ``kvwire engine --role`` process on ports it bound itself (all read from its
    serving line): HTTP (``url``), the KV side channel (``kv_port``), a prefill engine's
    bootstrap server (``bootstrap_port``) and, with ``events``, its KV events and replay
    (``events``, ``replay``: endpoints to connect to). ``flags`` come after
    ``DEFAULT_FLAGS`` and so override them (argparse keeps the last)."""

    DEFAULT_FLAGS: tuple[str, ...] = ("--num-gpu-blocks", "1024", "--block-size", "16",
                                      "--speed", "4")

    def __init__(self, name: str, role: str, *flags: str, events: bool = True) -> None:
        self.name, self.role = name, role
        cmd = [*KVWIRE, "engine", "--role", role, "--port", "0", "--kv-port", "0"]
        if events:
            bind = loopback_bind()
            cmd += ["--events", f"tcp://{bind}:0", "--replay", f"tcp://{bind}:0"]
        else:
            cmd += ["--events", "none"]
        if role == "prefill":
            cmd += ["--bootstrap-port", "0"]
        cmd += [*self.DEFAULT_FLAGS, *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL)
        self.err = Output(self.proc.stderr)
        self.err.drain()
        try:
            m = Output(self.proc.stdout).wait_for(
                r"serving (http://\S+) .*events=(\S+) replay=(\S+)(?:.* kv=(http://\S+))?",
                f"engine {name}", self.proc)
        except AssertionError as e:
            self.close()
            raise AssertionError(f"{e}\nits stderr: {self.err.said()}") from None
        line = m.string
        self.url = m.group(1)
        self.events = self.replay = None
        if events:
            self.events = "tcp://127.0.0.1:" + m.group(2).rsplit(":", 1)[1]
            self.replay = "tcp://127.0.0.1:" + m.group(3).rsplit(":", 1)[1]
        self.kv_port = int(m.group(4).rsplit(":", 1)[1]) if m.group(4) else None
        b = re.search(r"bootstrap_port=(\d+)", line)
        self.bootstrap_port = int(b.group(1)) if b else None
        self.http = httpx.Client(base_url=self.url, timeout=TIMEOUT)

    @property
    def spec(self) -> str:
        """Its ``--engine`` value for ``kvwire serve``."""
        s = f"{self.name}={self.events},replay={self.replay},url={self.url},role={self.role}"
        return s + (f",bootstrap_port={self.bootstrap_port}" if self.bootstrap_port else "")

    def metric(self, name: str, **labels: str) -> float:
        got = metric(self.http.get("/metrics").text, name, **labels)
        assert got is not None, f"{name} {labels} not in {self.name}'s /metrics"
        return got

    def idle(self) -> bool:
        """Holds no leased block and runs nothing."""
        return (self.metric("kvwire_engine_kv_held_blocks") == 0
                and self.metric("vllm:num_requests_running") == 0
                and self.metric("vllm:num_requests_waiting") == 0)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(TIMEOUT)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if hasattr(self, "http"):
            self.http.close()
        _stop(self.proc)


class Fleet:
    """Engines of the given roles (``Engine`` processes) behind one ``kvwire serve`` process
    on a port it bound itself (read from its start line)."""

    def __init__(self, roles: dict[str, str], protocol: str, *serve_flags: str,
                 engine_flags: dict[str, tuple[str, ...]] | None = None) -> None:
        self.engines: dict[str, Engine] = {}
        self.serve: subprocess.Popen | None = None
        try:
            for n, r in roles.items():
                self.engines[n] = Engine(n, r, *(engine_flags or {}).get(n, ()))
            cmd = [*KVWIRE, "serve", "--port", "0", "--tokenizer", "builtin", "--pd-protocol",
                   protocol, "--probe-interval", "0.2", "--cooloff", "1", *serve_flags]
            for e in self.engines.values():
                cmd += ["--engine", e.spec]
            self.serve = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
            self.serve_err = Output(self.serve.stderr)
            m = self.serve_err.wait_for(r"kvwire serve: \d+ streams; (http://\S+?)/?$",
                                        "kvwire serve", self.serve)
            self.url = m.group(1)
            self.http = httpx.Client(base_url=self.url, timeout=TIMEOUT)
            until(self._ready, "kvwire serve live on every engine's events and HTTP")
        except BaseException:
            self.close()
            raise

    def _ready(self) -> bool:
        assert self.serve is not None and self.serve.poll() is None, \
            f"kvwire serve exited: {self.serve_err.said()}"
        try:
            e = self.http.get("/engines").json()
        except httpx.HTTPError:
            return False
        return len(e) == len(self.engines) and all(
            v["ranks"][0]["alive"] and v.get("http", {}).get("http_up") for v in e.values())

    def status(self) -> dict[str, Any]:
        return self.http.get("/engines").json()

    def blocks(self, name: str) -> int:
        return sum(sum(r["blocks"].values()) for r in self.status()[name]["ranks"])

    def settled(self) -> bool:
        """Every load 0 and nothing in flight at the router."""
        st = self.status()
        return all(r["load"] == 0 for v in st.values() for r in v["ranks"]) and all(
            v["http"]["in_flight"] == 0 for v in st.values())

    def all_idle(self) -> bool:
        return self.settled() and all(e.idle() for e in self.engines.values() if e.alive)

    def client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0,
                             timeout=TIMEOUT)

    def metrics(self) -> str:
        return self.http.get("/metrics").text

    def close(self) -> None:
        if self.serve is not None:
            _stop(self.serve)
        if hasattr(self, "http"):
            self.http.close()
        for e in self.engines.values():
            e.close()


@contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port where a connection is refused for the whole block: bound (so nothing
    else can take it) but not listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def free_base(n: int, offsets: range = range(0, 5000, 1000)) -> int:
    """A base port with ``base + offset + i`` free just now for every offset and ``i < n``
    (kvwire fleet's layout). Only a likely choice: another process may still take one
    before the fleet binds it, which ``FleetProcess`` retries."""
    return free_port(n, offsets)


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """An ``--engine NAME=EVENTS,k=v,...`` value: its name and options (``events`` too)."""
    name, rest = spec.split("=", 1)
    parts = rest.split(",")
    opts = dict(p.split("=", 1) for p in parts[1:])
    opts["events"] = parts[0]
    return name, opts


class FleetProcess:
    """A ``kvwire fleet`` process with roles: its base port and the ``--engine`` specs it
    printed (``engines``: by name, parsed). Its ports follow a fixed layout from the base,
    so a port taken between :func:`free_base` and the engines' binds fails the start: it
    is started again on another base (``START_TRIES`` at most)."""

    def __init__(self, *roles: str, extra: tuple[str, ...] = ()) -> None:
        n = sum(int(v) for v in roles[1::2])
        for attempt in range(START_TRIES):
            self.base = base = free_base(n)
            self.proc = subprocess.Popen(
                [*KVWIRE, "fleet", *roles, "--base-port", str(base), "--speed", "20",
                 "--num-gpu-blocks", "64", "--block-size", "4", "--kv-lease-s", "600",
                 *extra],  # leases of 30 s: none expires on a busy box
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
            self.err = Output(self.proc.stderr)
            try:
                self.err.wait_for(r"kvwire fleet: \d+ engines up", "kvwire fleet", self.proc)
                break
            except AssertionError:
                self.close(check=False)
                if attempt + 1 == START_TRIES or not IN_USE.search(self.err.said()):
                    raise
        out = Output(self.proc.stdout)  # (printed before the "engines up" line)
        self.specs = [out.wait_for(r"^--engine (\S+)$", "kvwire fleet", self.proc,
                                   drain=i == n - 1).group(1) for i in range(n)]
        self.engines = dict(map(parse_spec, self.specs))

    def close(self, check: bool = True) -> None:
        proc = self.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(TIMEOUT)
            assert code == 0 or not check, f"kvwire fleet exited {code}: {self.err.said()}"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def start_retried(start: Callable[[int], subprocess.Popen], ready: Callable[[subprocess.Popen,
                  int], bool], what: str) -> tuple[subprocess.Popen, int, Output]:
    """A process that must be given its port (it cannot say what it bound): ``start(port)``
    on a port free just now, until ``ready(proc, port)``; started again on another port
    (``START_TRIES`` at most) when it exits saying a port is in use. Its stderr must be a
    pipe; returns the process, its port and its stderr's reader."""
    for attempt in range(START_TRIES):
        port = free_port()
        proc = start(port)
        err = Output(proc.stderr)
        err.drain()

        def up(proc: subprocess.Popen = proc, port: int = port) -> bool:
            return proc.poll() is not None or ready(proc, port)

        try:
            until(up, f"{what} to serve")
        except BaseException:
            _stop(proc)
            raise
        if proc.poll() is None:
            return proc, port, err
        err.thread.join(TIMEOUT)  # (its last lines: the pipe ends with the process)
        if attempt + 1 == START_TRIES or not IN_USE.search(err.said()):
            raise AssertionError(f"{what} exited {proc.returncode}: {err.said()}")
    raise AssertionError("unreachable")


MODEL = "kvwire-engine"


def fleets() -> Iterator[Callable[..., Fleet]]:
    """The body of a test module's ``fleet`` fixture (``yield from fleets()``): it makes
    :class:`Fleet` s (``fleet(roles, protocol, *serve_flags, engine_flags=...)``), all
    closed after the test."""
    made: list[Fleet] = []

    def make(roles: dict[str, str], protocol: str, *flags: str, **kw: Any) -> Fleet:
        f = Fleet(roles, protocol, *flags, **kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def words_prompt(seed: int, words: int = 120) -> str:
    """A prompt of ``words`` words drawn by a generator seeded with ``seed``."""
    rng = random.Random(seed)
    return " ".join(rng.choice(("alpha", "bravo", "charlie", "delta", "echo", "foxtrot",
                                "golf", "hotel", "india", "juliet", "kilo", "lima"))
                    for _ in range(words))


def total_metric(text: str, name: str, **labels: str) -> float:
    """:func:`metric`, 0 where there is no such sample."""
    return metric(text, name, **labels) or 0.0
