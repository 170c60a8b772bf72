"""Shared by the engines tier (tests/test_engines_*.py): loud skips for a missing wheel,
raw ZeroMQ readers of a publisher (live SUB, reference replay), and a child process that
loads an engine's plugins the way the engine does and publishes on command."""

from __future__ import annotations

import importlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

TIMEOUT = 30.0  # generous: a loaded 2-core box, engines importing for ~10 s of CPU
END_SEQ = (-1).to_bytes(8, "big", signed=True)
ROOT = Path(__file__).resolve().parent.parent


def import_or_skip(module: str, wheel: str) -> Any:
    """``module``, or a skip whose reason names the wheel (conftest's summary lists it)."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # ImportError, or a dependency of the engine missing/broken
        pytest.skip(f"{wheel} is missing or unimportable ({type(e).__name__}: {e}); "
                    "`make test` installs it (the ENGINES stamp)")


def sub_socket(ctx: zmq.Context, endpoint: str, bind: bool = False) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    (s.bind if bind else s.connect)(endpoint)
    return s


def warm_up(socks: list[zmq.Socket], publish: Callable[[], None]) -> None:
    """Publish until every SUB socket has received something (the slow joiner)."""
    deadline = time.monotonic() + TIMEOUT
    got = [False] * len(socks)
    while not all(got):
        assert time.monotonic() < deadline, "a subscriber never received anything"
        publish()
        time.sleep(0.02)
        for i, s in enumerate(socks):
            while s.poll(0):
                s.recv_multipart()
                got[i] = True


def collect(sock: zmq.Socket, last_seq: int) -> dict[int, bytes]:
    """Live payloads by seq, up to and including ``last_seq``."""
    out: dict[int, bytes] = {}
    while last_seq not in out:
        assert sock.poll(int(TIMEOUT * 1000)), f"seq {last_seq} never arrived ({len(out)} did)"
        _, seq_b, payload = sock.recv_multipart()
        out[int.from_bytes(seq_b, "big")] = payload
    return out


def replay_all(ctx: zmq.Context, endpoint: str, start: int = 0) -> dict[int, bytes]:
    """The engines' replay protocol: [b"", start seq] -> (topic, seq, payload)... END."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    d.send_multipart([b"", start.to_bytes(8, "big")])
    out: dict[int, bytes] = {}
    try:
        while True:
            assert d.poll(int(TIMEOUT * 1000)), "replay never ended"
            f = d.recv_multipart()
            if f[2] == END_SEQ:
                return out
            out[int.from_bytes(f[2], "big")] = f[3]
    finally:
        d.close()


def wait_for(cond: Callable[[], Any], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def engine_env(**switches: str) -> dict[str, str]:
    """This environment without any kvwire switch, plus ``switches``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_")}
    env.update(switches)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Child:
    """A Python child speaking JSON lines: it prints one object per command it gets."""

    def __init__(self, script: str, args: list[str], env: dict[str, str], cwd: Path) -> None:
        path = cwd / "child.py"
        path.write_text(script)
        self.stderr_path = cwd / "child.stderr"
        self.log: list[str] = []  # the child's stdout lines that are not replies
        self._buf = b""
        self._err = open(self.stderr_path, "w")
        self.proc = subprocess.Popen([sys.executable, str(path), *args], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, bufsize=0)

    def read(self, timeout: float = 120.0) -> dict[str, Any]:
        """The next JSON line (the first one waits for the engine's import). Lines that are
        not JSON (the engine's log may share stdout) are kept in ``log``."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        while True:
            while b"\n" in self._buf:  # (no buffered reader: select() must see all data)
                line, _, self._buf = self._buf.partition(b"\n")
                text = line.decode(errors="replace")
                if text.startswith("{"):
                    return json.loads(text)
                self.log.append(text)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AssertionError(f"child silent for {timeout} s; stderr:\n{self.stderr()}")
            chunk = os.read(fd, 65536)
            if not chunk:
                self.proc.wait(10)
                raise AssertionError(
                    f"child exited {self.proc.returncode}; stderr:\n{self.stderr()}")
            self._buf += chunk

    def ask(self, command: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        return self.read(timeout)

    def stderr(self) -> str:
        self._err.flush()
        return self.stderr_path.read_text()[-6000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask({"op": "quit"}, timeout=30)
            except (AssertionError, BrokenPipeError, OSError, ValueError):
                pass
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._err.close()


def docs_blocks(marker: str) -> list[str]:
    """The ```python blocks of docs/engines.md right after ``<!-- no-run: ...marker... -->``
    (the docs test skips them: they need an engine; the engines tier runs them)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_docs import blocks

    text = (ROOT / "docs" / "engines.md").read_text()
    return [b.code for b in blocks(text)
            if b.lang == "python" and b.no_run is not None and marker in b.no_run]
