"""Docs that run: every ```python block of README.md and docs/*.md is executed, so a renamed
API or a wrong argument in an example breaks the build instead of the reader.

The blocks of one file run in order in one fresh interpreter with a shared namespace (an
example may build on the one before, as the prose does). Tracebacks name the Markdown file
and line. The examples are written for real deployments, so before running them:

- every ``tcp://HOST:PORT`` becomes ``tcp://127.0.0.1:P`` with a free port P per distinct
  PORT of the file (tests send traffic only to loopback; port 0 stays 0);
- ``start_exporter(PORT`` gets a free port too;
- when a file's examples name ``nats://HOST:PORT``, a real nats-server (tests/nats_helpers.py,
  JetStream file storage in the scratch directory) is started for that file and every
  ``nats://HOST:PORT`` points at it;
- ``/etc/kvwire/`` becomes a scratch directory, and the ``kvwire keys ...`` lines of the
  file's ```sh blocks run first (so CurveZMQ examples find their key files);
- a block right after ``<!-- no-run: reason -->`` is skipped (keep these rare; the reason
  shows in the test's output).

An example must end by itself: write loops over live streams with ``poll(timeout)``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NO_RUN = re.compile(r"<!--\s*no-run:\s*(?P<reason>.+?)\s*-->")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
TIMEOUT = 60.0  # per file, on a loaded 2-core box (the slowest runs in ~15 s)


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the block's first code line in the Markdown file
    code: str
    no_run: str | None  # the reason, when marked


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, with the no-run mark just before each."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = NO_RUN.search(prev)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        out.append(Block(m["lang"], i + 2, "\n".join(lines[i + 1 : j]),
                         mark["reason"] if mark else None))
        i = j + 1
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Localize:
    """Rewrites a file's examples to loopback, free ports and a scratch directory."""

    TCP = re.compile(r"tcp://[A-Za-z0-9.*_-]+:(\d+)")
    EXPORTER = re.compile(r"start_exporter\((\d+)")
    NATS = re.compile(r"nats://[A-Za-z0-9._-]+:\d+")

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.ports: dict[str, int] = {}
        self.nats_url: str | None = None

    def _port(self, port: str) -> int:
        if port == "0":
            return 0  # any free port already
        if port not in self.ports:
            self.ports[port] = _free_port()
        return self.ports[port]

    def __call__(self, code: str) -> str:
        code = self.TCP.sub(lambda m: f"tcp://127.0.0.1:{self._port(m[1])}", code)
        code = self.EXPORTER.sub(lambda m: f"start_exporter({self._port(m[1])}", code)
        if self.nats_url is not None:
            code = self.NATS.sub(self.nats_url, code)
        return code.replace("/etc/kvwire/", f"{self.scratch}/")


RUNNER = """
import json, os, sys
blocks = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for b in blocks:
    print(f"--- {b['file']}:{b['line']}", flush=True)
    exec(compile("\\n" * (b["line"] - 1) + b["code"], b["file"], "exec"), ns)
print("--- all blocks ran", flush=True)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # examples need not shut down every publisher they started
"""


def _run_file(md: Path, scratch: Path) -> tuple[list[Block], subprocess.CompletedProcess]:
    found = blocks(md.read_text())
    local = Localize(scratch)
    for b in found:
        if b.lang in ("sh", "bash", "console") and b.no_run is None:
            for line in b.code.splitlines():
                if line.startswith("kvwire keys "):
                    argv = shlex.split(local(line), comments=True)[1:]
                    subprocess.run([sys.executable, "-m", "kvwire", *argv], check=True,
                                   timeout=60, capture_output=True)
    srv = None
    if any("nats://" in b.code for b in found if b.lang == "python" and b.no_run is None):
        pytest.importorskip("nats")
        from nats_helpers import NatsServer

        srv = NatsServer(scratch / "nats").start()
        local.nats_url = srv.url
    try:
        runnable = [{"file": str(md), "line": b.line, "code": local(b.code)}
                    for b in found if b.lang == "python" and b.no_run is None]
        (scratch / "blocks.json").write_text(json.dumps(runnable))
        (scratch / "runner.py").write_text(RUNNER)
        r = subprocess.run([sys.executable, str(scratch / "runner.py"),
                            str(scratch / "blocks.json")], capture_output=True, text=True,
                           timeout=TIMEOUT, cwd=scratch, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    finally:
        if srv is not None:
            srv.stop()
    return found, r


@pytest.mark.parametrize("md", [p for p in DOCS if "```python" in p.read_text()],
                         ids=lambda p: p.name)
def test_python_examples_run(md: Path, tmp_path: Path) -> None:
    try:
        found, r = _run_file(md, tmp_path)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{md.name}: examples still running after {TIMEOUT:.0f} s (an example "
                    f"that waits forever?); last block started:\n{e.stdout}")
    skipped = [f"{md.name}:{b.line}: {b.no_run}" for b in found
               if b.lang == "python" and b.no_run]
    if skipped:
        print("not run (marked no-run):", *skipped, sep="\n  ")
    assert r.returncode == 0 and "--- all blocks ran" in r.stdout, (
        f"{md.name}: an example failed\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


def test_block_parser_and_localizer(tmp_path: Path) -> None:
    text = ("intro\n```python\nx = 1\n```\n\n<!-- no-run: needs a GPU -->\n\n```python\n"
            "gpu()\n```\n```sh\nkvwire keys /etc/kvwire/a b\n```\n")
    found = blocks(text)
    assert [(b.lang, b.line, b.code, b.no_run) for b in found] == [
        ("python", 3, "x = 1", None), ("python", 9, "gpu()", "needs a GPU"),
        ("sh", 12, "kvwire keys /etc/kvwire/a b", None)]
    local = Localize(tmp_path)
    local.nats_url = "nats://127.0.0.1:4999"
    code = local('a("tcp://10.0.0.5:5557", "tcp://*:5557", "tcp://h:5558", "tcp://*:0"); '
                 'start_exporter(9400); open("/etc/kvwire/x"); n("nats://nats.internal:4222")')
    p1, p2, p3 = local.ports["5557"], local.ports["5558"], local.ports["9400"]
    assert code == (f'a("tcp://127.0.0.1:{p1}", "tcp://127.0.0.1:{p1}", '
                    f'"tcp://127.0.0.1:{p2}", "tcp://127.0.0.1:0"); start_exporter({p3}); open("{tmp_path}/x"); '
                    'n("nats://127.0.0.1:4999")')
