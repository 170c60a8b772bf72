"""``kvwire fleet N`` as real processes: it prints a router's ``--engine`` arguments, every
engine answers on its URL and publishes on its endpoint, and SIGTERM, SIGINT or even a
SIGKILL of the fleet leaves no engine running."""

from __future__ import annotations

import os
import random
import re
import selectors
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import zmq

TIMEOUT = 60.0  # two engine processes importing on a loaded 2-core box


def _free_base(n: int) -> int:
    for _ in range(50):
        base = random.randrange(20000, 40000)
        try:
            for off in [i for i in range(n)] + [1000 + i for i in range(n)] \
                    + [2000 + i for i in range(n)]:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + off))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def _until(cond, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _start(n: int, *extra: str):
    base = _free_base(n)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwire", "fleet", str(n), "--base-port", str(base),
         "--speed", "20", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    sel = selectors.DefaultSelector()  # raw reads: a buffered readline would hide lines
    bufs = {proc.stdout.fileno(): b"", proc.stderr.fileno(): b""}
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    specs: list[str] = []
    pids: list[int] = []
    deadline = time.monotonic() + TIMEOUT
    while len(specs) < n or not pids:
        assert time.monotonic() < deadline, f"fleet never came up: {bufs}"
        assert proc.poll() is None, f"fleet exited {proc.returncode}: {bufs}"
        for key, _ in sel.select(0.5):
            bufs[key.fd] += os.read(key.fd, 65536)
            *lines, bufs[key.fd] = bufs[key.fd].split(b"\n")
            for line in map(bytes.decode, lines):
                if line.startswith("--engine "):
                    specs.append(line.split(None, 1)[1].strip())
                m = re.search(r"pids ([\d ]+)", line)
                if m:
                    pids = [int(p) for p in m.group(1).split()]
    sel.close()
    return proc, specs, pids


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_fleet_serves_and_stops_everything(how):
    proc, specs, pids = _start(2)
    try:
        assert len(specs) == 2 and len(pids) == 2
        for i, spec in enumerate(specs):
            m = re.fullmatch(rf"engine{i}=(tcp://[^,]+),replay=(tcp://[^,]+),url=(http://\S+)",
                             spec)
            assert m, spec
            events, _, url = m.groups()
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                           timeout=TIMEOUT)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
            if i == 0:  # its events endpoint is live: heartbeats arrive (kvwire publisher)
                ctx = zmq.Context.instance()
                s = ctx.socket(zmq.SUB)
                s.setsockopt(zmq.SUBSCRIBE, b"")
                s.setsockopt(zmq.LINGER, 0)
                s.connect(events)
                try:
                    assert s.poll(int(TIMEOUT * 1000)), "no batch or heartbeat from engine0"
                finally:
                    s.close()
        assert all(_alive(p) for p in pids)
        proc.send_signal(getattr(signal, how))
        if how != "SIGKILL":
            assert proc.wait(TIMEOUT) in (0, -signal.SIGINT)
        # every engine is gone (after SIGKILL: through PR_SET_PDEATHSIG)
        _until(lambda: not any(_alive(p) for p in pids), "the engines to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(TIMEOUT)
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_fleet_refuses_bad_flags():
    r = subprocess.run([sys.executable, "-m", "kvwire", "fleet", "2", "--port", "9"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2 and "--port is set per engine" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvwire", "fleet", "2", "--no-such-flag"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2 and "--no-such-flag" in r.stderr
