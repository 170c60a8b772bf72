"""The install contract: every ``kvwire`` command works after the install its ``--help``
names, and without it says which extra in one line, exit 2.

One fresh venv per install (the core, then each extra alone), from a wheel of this tree,
offline from the wheelhouse (tests/wheelhouse.py); in each, every command's smallest real
job, as real processes on loopback. Edit :data:`VENVS` (and :data:`REFUSED`) together with
pyproject.toml's extras and src/kvwire/cli/extras.py.
"""

from __future__ import annotations

import json
import lzma
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import wheelhouse

from kvwire.cli.main import build_parser

pytestmark = pytest.mark.timeout(600)

START = 60.0  # a process importing in a fresh venv (no .pyc yet) on a loaded 2-core box
TOKENIZER = Path(__file__).parent / "data" / "tokenize" / "qwen3"


class Venv:
    """A fresh venv with ``kvwire[extra]`` installed offline; runs its ``kvwire``."""

    def __init__(self, root: Path, extra: str, wheel: Path) -> None:
        self.root, self.extra, self.wheel = root, extra, wheel
        self.kvwire = str(root / "bin" / "kvwire")
        # The venv's kvwire, not the tree's: no PYTHONPATH, no user site, no pip.conf.
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        self.env.update(PYTHONNOUSERSITE="1", PYTHONUNBUFFERED="1", PIP_CONFIG_FILE=os.devnull,
                        PIP_DISABLE_PIP_VERSION_CHECK="1")
        self.procs: list[Proc] = []

    def create(self) -> float:
        """A normal venv (pip inside, from ensurepip, as a user's); seconds taken."""
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", str(self.root)], check=True,
                       capture_output=True, timeout=300)
        return time.monotonic() - t0

    def install(self) -> float:
        """``pip install kvwire[extra]`` with the venv's own pip, offline; seconds taken."""
        t0 = time.monotonic()
        spec = str(self.wheel) + (f"[{self.extra}]" if self.extra != "core" else "")
        r = subprocess.run([str(self.root / "bin" / "python"), "-m", "pip", "install", "-q",
                            "--no-compile", "--no-index", "--find-links",
                            str(wheelhouse.WHEELHOUSE), spec],
                           capture_output=True, text=True, timeout=600, env=self.env)
        assert r.returncode == 0, f"pip install {spec} offline failed:\n{r.stdout}{r.stderr}"
        return time.monotonic() - t0

    def run(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run([self.kvwire, *args], capture_output=True, text=True,
                              timeout=timeout, env=self.env, cwd=self.root)

    def start(self, *args: str, exe: str | None = None) -> Proc:
        p = Proc([exe or self.kvwire, *args], self.env, self.root)
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in self.procs:
            p.kill()
        self.procs.clear()


class Proc:
    """A process whose stdout and stderr lines are read as they come (by a thread each), so
    a test waits for a line with a bound and still has everything it printed."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.argv = argv
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL, text=True, env=env, cwd=cwd,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                   signal.SIG_DFL))
        self.lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.changed = threading.Condition()
        self.readers = {name: threading.Thread(target=self._read, args=(name,), daemon=True)
                        for name in self.lines}
        for t in self.readers.values():
            t.start()

    def _read(self, name: str) -> None:
        for line in getattr(self.p, name):
            with self.changed:
                self.lines[name].append(line)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def text(self, name: str) -> str:
        with self.changed:
            return "".join(self.lines[name])

    def wait_line(self, name: str, pattern: str, timeout: float = START) -> re.Match:
        """The first line on stream ``name`` matching ``pattern``; fails the test with all
        the process printed if none comes within ``timeout`` or the process ends first."""
        deadline = time.monotonic() + timeout
        i = 0
        with self.changed:
            while True:
                for line in self.lines[name][i:]:
                    m = re.search(pattern, line)
                    if m:
                        return m
                i = len(self.lines[name])
                left = deadline - time.monotonic()
                if not self.readers[name].is_alive() or left <= 0:
                    break
                self.changed.wait(min(left, 1.0))
        self.kill()
        raise AssertionError(f"no line matching {pattern!r} on {name} of {self.argv}:\n"
                             f"{self.text('stdout')}{self.text('stderr')}")

    def wait(self, timeout: float) -> int | None:
        """The exit status within ``timeout``, else None."""
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        for t in self.readers.values():
            t.join(10)
        return rc

    def interrupt(self, timeout: float = 60.0) -> tuple[int, str]:
        """SIGINT, as Ctrl-C: the exit status and everything printed."""
        self.p.send_signal(signal.SIGINT)
        rc = self.wait(timeout)
        assert rc is not None, f"{self.argv} did not stop on SIGINT"
        return rc, self.text("stdout") + self.text("stderr")

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(30)


def http(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data,
                                 headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def start_engine(v: Venv, *flags: str) -> tuple[Proc, str, str, str]:
    """``kvwire engine`` on free ports: (process, its URL, events and replay endpoints to
    connect to)."""
    p = v.start("engine", "--port", "0", "--events", "tcp://*:0", "--replay", "tcp://*:0",
                "--speed", "50", *flags)
    m = p.wait_line("stdout", r"serving (http://\S+) .*events=tcp://\S+:(\d+) "
                               r"replay=tcp://\S+:(\d+)")
    return p, m.group(1), f"tcp://127.0.0.1:{m.group(2)}", f"tcp://127.0.0.1:{m.group(3)}"


def complete(url: str, prompt: str = "the quick brown fox " * 40) -> dict:
    status, text = http(f"{url}/v1/completions",
                        {"model": "kvwire-engine", "prompt": prompt, "max_tokens": 2})
    assert status == 200, text
    return json.loads(text)


def follow(listener: Proc, url: str) -> int | None:
    """Completions to the engine at ``url`` until ``listener`` (kvwire listen --count 1)
    has seen a batch and exited (it may subscribe after the first ones): its status."""
    deadline = time.monotonic() + START
    rc = None
    while rc is None and time.monotonic() < deadline:
        complete(url)
        rc = listener.wait(1.0)
    return rc


# ------------------------------------------------------------------------- the jobs


def job_help(v: Venv) -> None:
    """``kvwire --help`` and every command's ``--help``, whatever is installed."""
    r = v.run("--help")
    assert r.returncode == 0, r.stderr
    commands = re.findall(r"^  (\w+) +\S", r.stdout, re.M)
    assert set(commands) == set(build_parser()._subparsers._group_actions[0].choices), r.stdout
    for c in commands:
        h = v.run(c, "--help")
        assert h.returncode == 0 and f"usage: kvwire {c}" in h.stdout, (c, h.stderr)


def job_keys(v: Venv) -> None:
    r = v.run("keys", str(v.root / "keys"), "me")
    assert r.returncode == 0, r.stderr
    assert (v.root / "keys" / "me.key").is_file() and (v.root / "keys" / "me.key_secret").is_file()


def job_engine_and_listen(v: Venv) -> None:
    """An engine answers /health and a completion; ``kvwire listen`` follows its events."""
    eng, url, events, replay = start_engine(v)
    assert http(f"{url}/health")[0] == 200
    ls = v.start("listen", "--json", "--count", "1", "--duration", "60", events,
                 "--replay", replay)
    assert follow(ls, url) == 0, ls.text("stderr")
    out = ls.text("stdout")
    assert any(json.loads(line).get("kind") == "batch" for line in out.splitlines()), out
    rc, said = eng.interrupt()
    assert rc == 0 and "kvwire engine: stopped" in said, said


def job_index(v: Venv) -> None:
    p = v.start("index", "--port", "0")
    m = p.wait_line("stderr", r"kvwire index: (http://\S+)")
    status, text = http(f"{m.group(1)}/dump")
    assert status == 200, text
    json.loads(text)
    rc, said = p.interrupt()
    assert rc == 0, said


def job_fleet(v: Venv) -> None:
    from test_fleet import _free_base

    p = v.start("fleet", "1", "--base-port", str(_free_base(1)), "--speed", "50")
    m = p.wait_line("stdout", r"--engine \S+,url=(http://\S+)")
    assert http(f"{m.group(1)}/health")[0] == 200
    rc, said = p.interrupt()
    assert rc == 0, said


def job_sim(v: Venv) -> None:
    r = v.run("sim", "--limit", "40", "--engines", "2", "--policies", "kvwire,random",
              "--workers", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)["policies"]) >= {"kvwire", "random"}, r.stdout[:500]


def job_sim_report(v: Venv) -> None:
    png = v.root / "report.png"
    r = v.run("sim", "--limit", "40", "--engines", "2", "--policies", "kvwire",
              "--workers", "1", "--report", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def job_demo_late_join(v: Venv) -> None:
    r = v.run("demo", "--late-join", "--steps", "300", "--rate", "0", "--capacity", "512")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "exact match" in r.stdout, r.stdout


def _serve(v: Venv, *engine: str) -> tuple[Proc, str]:
    p = v.start("serve", "--port", "0", *engine)
    return p, p.wait_line("stderr", r"(http://\S+)/$").group(1)


def job_serve_decision_api(v: Venv) -> None:
    """``kvwire serve`` with no url=: the decision API answers /route."""
    eng, url, events, replay = start_engine(v)
    p, api = _serve(v, "--engine", f"e0={events},replay={replay}")
    status, text = http(f"{api}/route", {"token_ids": list(range(64))})
    assert status == 200 and json.loads(text)["engine"] == "e0", text
    assert p.interrupt()[0] == 0
    assert eng.interrupt()[0] == 0


def job_serve_proxy(v: Venv) -> None:
    """``kvwire serve`` with url=: the OpenAI proxy forwards a completion to the engine."""
    eng, url, events, replay = start_engine(v)
    p, api = _serve(v, "--engine", f"e0={events},replay={replay},url={url}",
                    "--tokenizer", "builtin")
    deadline = time.monotonic() + START
    while True:  # until the proxy's first health probe has seen the engine up
        try:
            out = complete(api)
            break
        except OSError:  # urllib's HTTPError (503 while no engine is known up) too
            assert time.monotonic() < deadline, "the proxy never forwarded a completion"
            time.sleep(0.2)
    assert out["choices"][0]["text"] is not None, out
    assert p.interrupt()[0] == 0
    assert eng.interrupt()[0] == 0


def job_epp_envoy_config(v: Venv) -> None:
    """``kvwire epp --envoy-config`` prints Envoy's bootstrap with the core alone."""
    r = v.run("epp", "--envoy-config", "--grpc-port", "9102")
    assert r.returncode == 0, r.stderr
    assert "envoy.filters.http.ext_proc" in r.stdout and "port_value: 9102" in r.stdout


def job_epp(v: Venv) -> None:
    """``kvwire epp`` (the epp extra alone): the picker serves gRPC health (the ext_proc
    service SERVING once the engine was probed) beside serve's HTTP side."""
    eng, url, events, replay = start_engine(v)
    p = v.start("epp", "--port", "0", "--grpc-port", "0", "--engine",
                f"e0={events},replay={replay},url={url}", "--tokenizer", "builtin")
    port = p.wait_line("stderr", r"ext_proc on 127\.0\.0\.1:(\d+)").group(1)
    code = ("import grpc, sys, time\n"
            "n = b'envoy.service.ext_proc.v3.ExternalProcessor'\n"
            "ch = grpc.insecure_channel('127.0.0.1:' + sys.argv[1])\n"
            "check = ch.unary_unary('/grpc.health.v1.Health/Check')\n"
            "deadline = time.monotonic() + 60\n"
            "while check(b'\\x0a' + bytes([len(n)]) + n, timeout=10) != b'\\x08\\x01':\n"
            "    assert time.monotonic() < deadline, 'never SERVING'\n"
            "    time.sleep(0.2)\n"
            "print('SERVING')\n")
    r = subprocess.run([str(v.root / "bin" / "python"), "-c", code, port], capture_output=True,
                       text=True, timeout=120, env=v.env)
    assert r.returncode == 0 and "SERVING" in r.stdout, r.stderr
    assert p.interrupt()[0] == 0
    assert eng.interrupt()[0] == 0


def job_bridge(v: Venv) -> None:
    """A real nats-server (the extra's binary), ``kvwire bridge`` writing an engine's events
    to JetStream, ``kvwire listen nats://`` reading them back."""
    from nats_helpers import free_port

    port = free_port()
    store = v.root / "nats"
    server = v.start("-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store),
                     exe=str(v.root / "bin" / "nats-server"))
    server.wait_line("stderr", r"Server is ready")
    eng, url, events, replay = start_engine(v)
    nats = f"nats://127.0.0.1:{port}"
    br = v.start("bridge", "--nats", nats, "--engine", f"e0={events},replay={replay}")
    br.wait_line("stderr", r"kvwire bridge: 1 engines ->")
    ls = v.start("listen", "--json", "--count", "1", "--duration", "60", nats)
    assert follow(ls, url) == 0, ls.text("stderr")
    assert '"kind":"batch"' in ls.text("stdout"), ls.text("stdout")
    assert br.interrupt()[0] == 0
    assert eng.interrupt()[0] == 0
    server.kill()


def job_engine_tokenizer(v: Venv) -> None:
    """``kvwire engine --tokenizer DIR`` (a model's tokenizer.json) answers a chat."""
    model = v.root / "qwen3"
    model.mkdir()
    shutil.copy2(TOKENIZER / "tokenizer_config.json", model)
    (model / "tokenizer.json").write_bytes(lzma.decompress(
        (TOKENIZER / "tokenizer.json.xz").read_bytes()))
    eng, url, _, _ = start_engine(v, "--tokenizer", str(model))
    status, text = http(f"{url}/v1/chat/completions", {
        "model": "kvwire-engine", "max_tokens": 2,
        "messages": [{"role": "user", "content": "hello"}]})
    assert status == 200 and json.loads(text)["usage"]["prompt_tokens"] > 0, text
    assert eng.interrupt()[0] == 0


# Commands run without their extra: (argv, the extra the one line must name).
REFUSED: dict[str, tuple[list[str], str]] = {
    "serve": (["serve", "--engine", "e=tcp://127.0.0.1:1"], "serve"),
    "serve-proxy": (["serve", "--engine", "e=tcp://127.0.0.1:1,url=http://127.0.0.1:1"],
                    "serve"),
    "demo": (["demo", "--limit", "5"], "serve"),
    "bridge": (["bridge", "--nats", "nats://127.0.0.1:1", "--engine", "e=tcp://127.0.0.1:1"],
               "nats"),
    "listen-nats": (["listen", "--duration", "5", "nats://127.0.0.1:1"], "nats"),
    "listen-metrics": (["listen", "--metrics", "0", "--duration", "5", "tcp://127.0.0.1:1"],
                       "metrics"),
    "serve-nats": (["serve", "--nats", "nats://127.0.0.1:1"], "nats"),
    "epp": (["epp", "--engine", "e=tcp://127.0.0.1:1,url=http://127.0.0.1:1"], "epp"),
    "sim-report": (["sim", "--limit", "5", "--report", "r.png"], "sim"),
    "engine-tokenizer": (["engine", "--port", "0", "--tokenizer", str(TOKENIZER)], "tokenize"),
}

#: Per venv: what it installs, the jobs that must work in it, the commands that must refuse.
VENVS: dict[str, tuple[list[Callable[[Venv], None]], list[str]]] = {
    "core": ([job_help, job_keys, job_engine_and_listen, job_index, job_fleet, job_sim,
              job_demo_late_join, job_epp_envoy_config],
             ["serve", "serve-proxy", "demo", "bridge", "listen-nats", "listen-metrics",
              "sim-report", "engine-tokenizer", "epp"]),
    "serve": ([job_serve_decision_api, job_serve_proxy], ["bridge", "serve-nats",
                                                          "sim-report", "epp"]),
    "epp": ([job_epp], ["bridge", "sim-report"]),
    "sim": ([job_sim_report], ["serve", "engine-tokenizer"]),
    "nats": ([job_bridge], ["serve"]),
    "tokenize": ([job_engine_tokenizer], ["serve", "sim-report"]),
}


@pytest.fixture(scope="module")
def venvs(tmp_path_factory) -> dict[str, Venv]:
    """Every venv of :data:`VENVS`, built at once (they share the wheelhouse)."""
    tmp = tmp_path_factory.mktemp("install")
    built = {name: Venv(tmp / name, name, tmp / "dist") for name in VENVS}
    with ThreadPoolExecutor(len(built)) as pool:
        made = {n: pool.submit(v.create) for n, v in built.items()}  # meanwhile, the wheel
        t0 = time.monotonic()
        try:
            wheel = wheelhouse.ensure(tmp / "dist")
        except wheelhouse.Offline as e:
            msg = ("PIP CANNOT REACH THE PACKAGE INDEX: the install contract was NOT checked "
                   f"({e})")
            print(msg, file=sys.stderr)
            pytest.skip(msg)
        took = f"wheel {time.monotonic() - t0:.0f} s"
        for n, v in built.items():
            took += f", {n} venv {made[n].result():.0f} s"
            v.wheel = wheel
        installed = {n: pool.submit(v.install) for n, v in built.items()}
        took += "".join(f", {n} install {f.result():.0f} s" for n, f in installed.items())
    print(f"install test set-up: {took}", file=sys.stderr)
    yield built
    for v in built.values():
        v.stop_all()


CASES = [(venv, job) for venv, (jobs, _) in VENVS.items() for job in jobs]


@pytest.mark.parametrize(("venv", "job"), CASES,
                         ids=[f"{v}-{j.__name__[4:]}" for v, j in CASES])
def test_command_works_with_its_install(venvs, venv: str, job) -> None:
    v = venvs[venv]
    try:
        job(v)
    finally:
        v.stop_all()


REFUSALS = [(venv, cmd) for venv, (_, refused) in VENVS.items() for cmd in refused]


@pytest.mark.parametrize(("venv", "cmd"), REFUSALS, ids=[f"{v}-{c}" for v, c in REFUSALS])
def test_command_without_its_extra_says_which_in_one_line(venvs, venv: str, cmd: str) -> None:
    argv, extra = REFUSED[cmd]
    r = venvs[venv].run(*argv, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"'{extra}' extra" in lines[0] and f"pip install 'kvwire[{extra}]'" in lines[0], \
        lines[0]
    assert lines[0].startswith(f"kvwire {argv[0]}: ") and r.stdout == "", (r.stdout, r.stderr)


def test_extras_table_matches_pyproject() -> None:
    """src/kvwire/cli/extras.py's modules come with the extras pyproject.toml declares, and
    every extra the command table names exists there."""
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11 has no tomllib")

    from kvwire.cli import extras

    declared = tomllib.loads((wheelhouse.ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    # distribution -> the top-level module kvwire imports from it
    module_of = {"nats-py": "nats", "prometheus_client": "prometheus_client",
                 "uvicorn[standard]": "uvicorn", "grpcio": "grpc", "xds-protos": "envoy",
                 "protobuf": "google"}
    for extra, modules in extras.EXTRA_MODULES.items():
        assert extra in declared, extra
        provided = {module_of.get(re.split(r"[<>=!~;]", d)[0].strip(),
                                  re.split(r"[<>=!~;\[]", d)[0].strip().replace("-", "_"))
                    for d in declared[extra]}
        assert set(modules) <= provided, (extra, modules, provided)
    for needs in extras.NEEDS.values():
        for n in needs:
            assert n.extra in extras.EXTRA_MODULES, n
    assert set(wheelhouse.EXTRAS) <= set(declared)
    assert set(VENVS) == {"core", *wheelhouse.EXTRAS}
    # make test installs .[test]: it must hold every other extra's requirements
    test = set(declared["test"])
    for extra, reqs in declared.items():
        if extra not in ("test", "torch"):
            names = {re.split(r"[<>=!~;\[]", r)[0] for r in reqs}
            assert names <= {re.split(r"[<>=!~;\[]", r)[0] for r in test}, (extra, names)
