"""``kvwire fleet N`` as real processes: it prints a router's ``--engine`` arguments, every
engine answers on its URL and publishes on its endpoint; SIGTERM or SIGINT of the fleet, or
a terminal's Ctrl-C (SIGINT to the whole process group), leaves no engine running by the
time the fleet's own exit is reaped, and even a SIGKILL of the fleet leaves none for long;
bad engine flags get one line and exit 2; an engine that cannot start stops the others."""

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


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d))
    return out


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
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        start_new_session=True)  # its own process group, as a shell gives a job
    sel = selectors.DefaultSelector()  # raw reads: a buffered readline would hide lines
    bufs = {proc.stdout.fileno(): b"", proc.stderr.fileno(): b""}
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    specs: list[str] = []
    pids: list[int] = []
    seen_err: list[bytes] = []
    deadline = time.monotonic() + TIMEOUT
    while len(specs) < n or not pids:
        assert time.monotonic() < deadline, f"fleet never came up: {bufs}"
        assert proc.poll() is None, f"fleet exited {proc.returncode}: {bufs}"
        for key, _ in sel.select(0.5):
            data = os.read(key.fd, 65536)
            bufs[key.fd] += data
            if key.fd == proc.stderr.fileno():
                seen_err.append(data)
            *lines, bufs[key.fd] = bufs[key.fd].split(b"\n")
            for line in map(bytes.decode, lines):
                if line.startswith("--engine "):
                    specs.append(line.split(None, 1)[1].strip())
                m = re.search(r"pids ([\d ]+)", line)
                if m:
                    pids = [int(p) for p in m.group(1).split()]
    sel.close()
    proc.stderr_head = bufs[proc.stderr.fileno()]  # read so far, not yet a whole line
    proc.stderr_seen = b"".join(seen_err)  # everything read so far
    return proc, specs, pids


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "Ctrl-C", "SIGKILL"])
def test_fleet_serves_and_stops_everything(how):
    """Ctrl-C is SIGINT to the fleet's whole process group (engines included), as a
    terminal sends it. The fleet stops its engines itself and exits only once they are
    gone, relaying each one's ``stopped`` line (printed after its events were flushed);
    engines that died of the parent-death signal alone would outlive the fleet's reaping
    and could not print to it. After a SIGKILL only the parent-death signal is left."""
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
        if how == "Ctrl-C":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(getattr(signal, how))
        if how != "SIGKILL":
            assert proc.wait(TIMEOUT) == 0
            assert [p for p in pids if _alive(p)] == [], "engines outlived the fleet"
            assert _group(proc.pid) == []  # nothing of the job left at all
            err = (proc.stderr_head + proc.stderr.read()).decode()
            sig = "SIG(INT|TERM)" if how == "Ctrl-C" else "SIGTERM"
            assert len(re.findall(rf"kvwire engine: stopped \({sig}\), events flushed", err)) \
                == 2, err
        # every engine is gone (after SIGKILL: through PR_SET_PDEATHSIG)
        _until(lambda: not any(_alive(p) for p in pids), "the engines to exit")
        _until(lambda: not _group(proc.pid), "the fleet's process group to empty")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(TIMEOUT)
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("flags,says", [
    (["--port", "9"], "--port is set per engine"),
    (["--no-such-flag"], "unknown engine flag(s): --no-such-flag"),
    (["--speed", "-1"], "argument --speed: must be a finite number > 0"),
    (["--dp-size", "x"], "argument --dp-size: not an integer"),
    (["--tokenizer", "/nonexistent/tok"], "/nonexistent/tok"),
    (["--lora", "kvwire-engine"], "model and LoRA names must differ"),
])
def test_fleet_refuses_bad_flags_in_one_line(flags, says):
    """Checked before any engine starts: exit 2 and one line, not N engines' errors."""
    r = subprocess.run([sys.executable, "-m", "kvwire", "fleet", "2", *flags],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert r.stderr.startswith("kvwire fleet: ") and r.stderr.count("\n") == 1, r.stderr
    assert r.stdout == ""


def test_fleet_stops_started_engines_when_one_cannot_start():
    """engine1's HTTP port is taken: it exits before serving; the fleet says so, exits 1,
    and stops engine0 (already started) before it exits."""
    base = _free_base(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvwire", "fleet", "2", "--base-port", str(base)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            start_new_session=True)
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
            assert proc.returncode == 1, err
            assert "kvwire fleet: engine1 exited before serving (status 1)" in err.decode()
            assert b"--engine" not in out
            assert _group(proc.pid) == [], "an engine outlived the fleet"
        finally:
            for p in _group(proc.pid):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("everywhere", [False, True], ids=["default", "--all-interfaces"])
def test_fleet_binds_kv_events_on_its_host_unless_asked(everywhere):
    """A test fleet's KV events carry prompts' token ids: by default every engine binds its
    event and replay ports on --host (loopback) alone, and no engine warns; with
    --all-interfaces they bind every interface and each engine says so."""
    import psutil

    proc, specs, pids = _start(1, *(["--all-interfaces"] if everywhere else []))
    try:
        m = re.fullmatch(r"engine0=tcp://127\.0\.0\.1:(\d+),replay=tcp://127\.0\.0\.1:(\d+),"
                         r"url=http://127\.0\.0\.1:\d+", specs[0])
        assert m, specs[0]
        engine = psutil.Process(pids[0])
        listening = {c.laddr.port: c.laddr.ip for c in engine.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN}
        for port in map(int, m.groups()):
            if everywhere:
                assert listening[port] in ("0.0.0.0", "::"), listening
            else:
                assert listening[port] in ("127.0.0.1", "::ffff:127.0.0.1"), listening
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
        err = (proc.stderr_seen + proc.stderr.read()).decode()
        assert ("KV events bound on all interfaces" in err) == everywhere, err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(TIMEOUT)


def test_fleet_bind_host():
    from kvwire.cli.fleet import bind_host, engine_args

    assert bind_host("127.0.0.1", True) == "*" and bind_host("0.0.0.0", False) == "*"
    assert bind_host("::1", False) == "[::1]"
    bind = bind_host("127.0.0.1", False)
    assert bind in ("[::ffff:127.0.0.1]", "*")  # "*" only where IPv6 sockets are missing
    flags, spec = engine_args(1, 8000, "127.0.0.1", 2, bind)
    assert flags[flags.index("--events") + 1] == f"tcp://{bind}:9002"
    assert flags[flags.index("--replay") + 1] == f"tcp://{bind}:10002"
    assert spec == ("engine1=tcp://127.0.0.1:9002,replay=tcp://127.0.0.1:10002,ranks=2,"
                    "url=http://127.0.0.1:8001")
