"""Docs that run: every ```python and every ```sh block of README.md and docs/**/*.md is
executed, so a renamed API, a renamed flag or a wrong argument in an example breaks the
build instead of the reader.

How a file runs. Its blocks run in document order in one fresh child process (one per
Markdown file): ```python blocks with exec() in one shared namespace (an example may build on
the one before, as the prose does), ```sh / ```bash blocks with ``bash -e -o pipefail`` in the
file's scratch directory (the working directory of both kinds), with this interpreter's bin
directory (the venv: ``kvwire``, ``python``) first on PATH, each with a timeout. Tracebacks
name the Markdown file and line.

Conventions the docs follow (and this file checks):

- every fence names its language: ``python`` and ``sh`` (or ``bash``) run; ``text`` (output,
  usage synopses, layouts) never runs; no other language and no bare fence is allowed, so a
  command cannot hide in a block that nothing runs;
- a shell command that keeps running (``kvwire serve``, ``kvwire bridge``) ends with `` &``;
  whatever a block started in the background is stopped (SIGTERM to its process group,
  SIGKILL after 10 s) when the block ends. The lines after it wait for what they need the
  way a script would (``curl --retry-connrefused``, ``kvwire listen --count N``);
- HTML comments right before a fence (blank lines between allowed) are instructions:

  ``<!-- no-run: REASON -->``: the block is not run (keep these rare; the reason shows in the
  test's output);

  ``<!-- engine: ENDPOINT replay=ENDPOINT [topic=T] [ranks=N] -->``: while the block runs,
  a real kvwire publisher (a ``ZmqEventPublisher`` in a child process) serves each DP rank
  there (ports + rank, as ``StreamSpec.for_ranks`` expects): rank 0 first stores the prompt
  ``list(range(1000, 1064))`` (4 blocks of 16 tokens, hashes 1-4), then every rank stores
  one block and evicts the one it stored 32 steps before, every 10 ms. So a router example
  that connects there receives snapshots and batches, and its branches run.

Before running, a file's examples are rewritten for a test box:

- every ``tcp://HOST:PORT``, ``localhost:PORT``, ``127.0.0.1:PORT``, ``--port PORT`` and
  ``start_exporter(PORT`` gets a free port per distinct PORT of the file (with the next 7
  ports free too, for DP ranks); port 0 stays 0; HOST becomes 127.0.0.1, except ``*``,
  which stays (it means bind, and a concrete host means connect); ``kvwire fleet
  --base-port P`` maps P with its family (P + i, P + 1000 + i, P + 2000 + i, i < 8), so the
  ``--engine`` arguments an example derives from it stay right;
- when a runnable block names ``nats://HOST:PORT``, a real nats-server (tests/nats_helpers.py,
  JetStream file storage in the scratch directory) is started for that file and every
  ``nats://HOST:PORT`` points at it;
- ``/etc/kvwire/`` becomes the scratch directory.

An example must end by itself: loops over live streams stop on a condition, with
``poll(timeout)`` / ``poll_many(timeout)``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ports import free_port

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # decisions/ too
COMMENT = re.compile(r"^<!--\s*(?P<key>[\w-]+):\s*(?P<value>.+?)\s*-->$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
RUN_LANGS = {"python": "python", "sh": "sh", "bash": "sh"}
TEXT_LANGS = {"text"}
TIMEOUT = 120.0  # per file, on a loaded 2-core box (the slowest runs in ~20 s alone)
SH_TIMEOUT = 60.0  # per shell block


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the block's first code line in the Markdown file
    code: str
    no_run: str | None = None  # the reason, when marked
    engine: str | None = None  # the <!-- engine: ... --> spec, when marked
    marks: dict[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str | None:
        """``"python"`` or ``"sh"`` when the block runs, else None."""
        return None if self.no_run is not None else RUN_LANGS.get(self.lang)


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, with the HTML-comment marks just before each."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        marks: dict[str, str] = {}
        k = i - 1
        while k >= 0 and (not lines[k].strip() or COMMENT.match(lines[k].strip())):
            c = COMMENT.match(lines[k].strip())
            if c:
                marks.setdefault(c["key"], c["value"])
            k -= 1
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        out.append(Block(m["lang"], i + 2, "\n".join(lines[i + 1 : j]), marks.get("no-run"),
                         marks.get("engine"), marks))
        i = j + 1
    return out


#: ``kvwire fleet --base-port P``: engine i serves HTTP at P + i, events at P + 1000 + i,
#: replay at P + 2000 + i (kvwire.cli.fleet)
FLEET_OFFSETS = (0, 1000, 2000)


class Localize:
    """Rewrites a file's examples to loopback, free ports and a scratch directory."""

    PORT = re.compile(r"(?P<pre>tcp://[A-Za-z0-9.*_-]+:|\blocalhost:|\b127\.0\.0\.1:|--port[ =]"
                      r"|--base-port[ =]|start_exporter\()(?P<port>\d+)\b")
    BASE = re.compile(r"--base-port[ =](?P<port>\d+)\b")
    NATS = re.compile(r"nats://[A-Za-z0-9._-]+:\d+")

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.ports: dict[str, int] = {}
        self.nats_url: str | None = None

    def _port(self, port: str) -> int:
        if port == "0":
            return 0  # any free port already
        if port not in self.ports:
            self.ports[port] = free_port(8)
        return self.ports[port]

    def _sub(self, m: re.Match[str]) -> str:
        pre = m["pre"]
        if pre.startswith("tcp://"):  # a wildcard binds (kvwire's rule), so it stays one
            pre = "tcp://*:" if pre == "tcp://*:" else "tcp://127.0.0.1:"
        return f"{pre}{self._port(m['port'])}"

    def _fleet(self, port: str) -> None:
        """A fleet's base port maps with its whole family (P + i, P + 1000 + i, P + 2000 + i),
        so the ``--engine`` arguments a reader copies from its output stay right."""
        if port in self.ports:
            return
        base, p = free_port(8, FLEET_OFFSETS), int(port)
        for off in FLEET_OFFSETS:
            for i in range(8):
                self.ports.setdefault(str(p + off + i), base + off + i)

    def __call__(self, code: str) -> str:
        for m in self.BASE.finditer(code):
            self._fleet(m["port"])
        code = self.PORT.sub(self._sub, code)
        if self.nats_url is not None:
            code = self.NATS.sub(self.nats_url, code)
        return code.replace("/etc/kvwire/", f"{self.scratch}/")


# --- what runs in the child process (one per Markdown file) ---------------------------------


def fake_engine(spec: str) -> None:
    """The publisher behind ``<!-- engine: ... -->`` (see the module docstring)."""
    import random

    from kvwire import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

    endpoint, *opts = (re.sub(r"^tcp://[^:/]+:", "tcp://*:", e) for e in spec.split())
    kw = dict(o.split("=", 1) for o in opts)
    if "replay" in kw:
        kw["replay"] = re.sub(r"^tcp://[^:/]+:", "tcp://*:", kw["replay"])  # bind, not connect
    ranks = int(kw.get("ranks", 1))
    # the publisher adds its rank to the ports itself, as vLLM's does
    pubs = [ZmqEventPublisher(data_parallel_rank=r, endpoint=endpoint,
                              replay_endpoint=kw.get("replay"), topic=kw.get("topic", ""),
                              heartbeat_interval=0.5) for r in range(ranks)]
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    prompt = list(range(1000, 1064))
    pubs[0].publish(KVEventBatch(time.time(), [BlockStored(
        block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=prompt, block_size=16,
        lora_id=None, medium="GPU")], 0))
    print("ready", flush=True)
    rng = random.Random(0)
    step = 0
    while not stop:
        for r, pub in enumerate(pubs):
            h = 1_000_000 * (r + 1) + step
            events: list = [BlockStored(
                block_hashes=[h], parent_block_hash=None,
                token_ids=[rng.randrange(50_000) for _ in range(16)], block_size=16,
                lora_id=None, medium="GPU")]
            if step >= 32:
                events.append(BlockRemoved(block_hashes=[h - 32], medium="GPU"))
            pub.publish(KVEventBatch(time.time(), events, r))
        step += 1
        time.sleep(0.01)  # the engine's step time, not a wait for anything
    for pub in pubs:
        pub.shutdown(timeout=2.0)


def _stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM to the process group ``proc`` leads, SIGKILL to what is left after ``grace``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=0.05)  # reaps the leader; the others are the group's to end
        except subprocess.TimeoutExpired:
            pass
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass


def _start_engine(spec: str, log: Path) -> subprocess.Popen:
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_docs; " \
           f"test_docs.fake_engine({spec!r})"
    err = open(log, "ab")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err,
                            text=True, process_group=0)
    err.close()
    line = proc.stdout.readline()  # the publisher says "ready" once it bound and published
    if line.strip() != "ready":
        _stop_group(proc)
        raise RuntimeError(f"the engine for {spec!r} did not start: {log.read_text()[-2000:]}")
    return proc


def _run_sh(code: str, where: str, log: Path) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", code], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                process_group=0)
        try:
            rc = proc.wait(timeout=SH_TIMEOUT)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _stop_group(proc)  # and whatever it left running in the background
    if rc != 0:
        what = f"still running after {SH_TIMEOUT:.0f} s" if rc is None else f"exit status {rc}"
        raise RuntimeError(f"{where}: shell block failed ({what}); its output:\n"
                           f"{log.read_text(errors='replace')[-3000:]}")


def run_blocks(plan_path: str) -> None:
    """The child's main: runs the blocks of one file in order (see the module docstring)."""
    plan = json.loads(Path(plan_path).read_text())
    scratch = Path(plan_path).parent
    ns = {"__name__": "__main__"}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by the test (timeout)"))
    for n, b in enumerate(plan):
        where = f"{b['file']}:{b['line']}"
        print(f"--- {where} ({b['kind']})", flush=True)
        engine = _start_engine(b["engine"], scratch / f"engine-{n}.log") if b["engine"] else None
        try:
            if b["kind"] == "python":
                exec(compile("\n" * (b["line"] - 1) + b["code"], b["file"], "exec"), ns)
            else:
                _run_sh(b["code"], where, scratch / f"sh-{n}.log")
        finally:
            if engine is not None:
                _stop_group(engine)
    print("--- all blocks ran", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # examples need not shut down every publisher they started


# --- the tests ------------------------------------------------------------------------------


def _run_file(md: Path, scratch: Path) -> tuple[list[Block], subprocess.CompletedProcess]:
    found = blocks(md.read_text())
    local = Localize(scratch)
    srv = None
    if any("nats://" in b.code for b in found if b.kind):
        pytest.importorskip("nats")
        from nats_helpers import NatsServer

        srv = NatsServer(scratch / "nats").start()
        local.nats_url = srv.url
    try:
        plan = [{"file": str(md), "line": b.line, "kind": b.kind, "code": local(b.code),
                 "engine": local(b.engine) if b.engine else None}
                for b in found if b.kind]
        (scratch / "plan.json").write_text(json.dumps(plan))
        code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_docs; "
                f"test_docs.run_blocks({str(scratch / 'plan.json')!r})")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=scratch,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.terminate()  # its handler stops the engines and shell blocks it started
            try:
                out, err = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            pytest.fail(f"{md.name}: examples still running after {TIMEOUT:.0f} s (an example "
                        f"that waits forever?); the blocks that started:\n{out}\n{err[-3000:]}")
        r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        if srv is not None:
            srv.stop()
    return found, r


@pytest.mark.parametrize("md", [p for p in DOCS if any(b.kind for b in blocks(p.read_text()))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run(md: Path, tmp_path: Path) -> None:
    found, r = _run_file(md, tmp_path)
    skipped = [f"{md.name}:{b.line}: {b.no_run}" for b in found if b.no_run]
    if skipped:
        print("not run (marked no-run):", *skipped, sep="\n  ")
    ran = {k: sum(1 for b in found if b.kind == k) for k in ("python", "sh")}
    print(f"{md.name}: ran {ran['python']} python and {ran['sh']} shell blocks")
    assert r.returncode == 0 and "--- all blocks ran" in r.stdout, (
        f"{md.name}: an example failed\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_says_whether_it_runs(md: Path) -> None:
    """A fence is python or sh (run), or text (never run); a bare fence would hide a command
    from the test, and a mark must be one this file knows."""
    for b in blocks(md.read_text()):
        assert b.lang in RUN_LANGS or b.lang in TEXT_LANGS, (
            f"{md.name}:{b.line}: fence language {b.lang!r}: use python, sh or text")
        assert set(b.marks) <= {"no-run", "engine"}, f"{md.name}:{b.line}: {b.marks}"
        if b.engine is not None:
            assert b.kind, f"{md.name}:{b.line}: an engine for a block that does not run"


def test_benchmark_commands_exist() -> None:
    """docs/benchmarks.md names the command behind each number; each script exists and
    parses its options (the benchmarks themselves take minutes: `make bench` runs them)."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    scripts = sorted(set(re.findall(r"\.venv/bin/python (bench/\w+\.py)", text)))
    assert len(scripts) >= 7, scripts
    for s in scripts:
        r = subprocess.run([sys.executable, str(ROOT / s), "--help"], capture_output=True,
                           text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 0 and "usage:" in r.stdout, (s, r.stderr[-2000:])


def test_block_parser_and_localizer(tmp_path: Path) -> None:
    text = ("intro\n```python\nx = 1\n```\n\n<!-- no-run: needs a GPU -->\n\n```python\n"
            "gpu()\n```\n<!-- engine: tcp://h:5557 ranks=2 -->\n```sh\nkvwire keys /etc/kvwire/a b\n"
            "```\n```text\nout\n```\n")
    found = blocks(text)
    assert [(b.lang, b.line, b.code, b.no_run, b.engine, b.kind) for b in found] == [
        ("python", 3, "x = 1", None, None, "python"),
        ("python", 9, "gpu()", "needs a GPU", None, None),
        ("sh", 13, "kvwire keys /etc/kvwire/a b", None, "tcp://h:5557 ranks=2", "sh"),
        ("text", 16, "out", None, None, None)]
    local = Localize(tmp_path)
    local.nats_url = "nats://127.0.0.1:4999"
    code = local('a("tcp://10.0.0.5:5557", "tcp://*:5557", "tcp://h:5558", "tcp://*:0"); '
                 'start_exporter(9400); open("/etc/kvwire/x"); n("nats://nats.internal:4222")\n'
                 "kvwire serve --port 8000 & curl localhost:8000/route 127.0.0.1:5558")
    p1, p2, p3, p4 = (local.ports[k] for k in ("5557", "5558", "9400", "8000"))
    assert code == (f'a("tcp://127.0.0.1:{p1}", "tcp://*:{p1}", '
                    f'"tcp://127.0.0.1:{p2}", "tcp://*:0"); start_exporter({p3}); '
                    f'open("{tmp_path}/x"); n("nats://127.0.0.1:4999")\n'
                    f"kvwire serve --port {p4} & curl localhost:{p4}/route 127.0.0.1:{p2}")
    # a fleet's base port maps with its family, so the --engine arguments derived from it
    # (HTTP P + i, events P + 1000 + i, replay P + 2000 + i) stay consistent
    code = local("kvwire fleet 2 --base-port 8100 &\n"
                 "kvwire serve --engine e1=tcp://127.0.0.1:9101,replay=tcp://127.0.0.1:10101,"
                 "url=http://127.0.0.1:8101")
    b = local.ports["8100"]
    assert code == (f"kvwire fleet 2 --base-port {b} &\n"
                    f"kvwire serve --engine e1=tcp://127.0.0.1:{b + 1001},"
                    f"replay=tcp://127.0.0.1:{b + 2001},url=http://127.0.0.1:{b + 1}")
