"""`kvwire listen` and `kvwire demo` as real processes against real sockets."""

from __future__ import annotations

import argparse
import json
import math
import os
import pty
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq
from cli_helpers import KVWIRE, listen_while_publishing, sigint_default, start_listen

from kvwire.cli.main import RICH_HINT, build_parser
from kvwire.index.cache import BlockCache
from kvwire.publish.publisher import ZmqEventPublisher
from kvwire.sim.demo import run_demo
from kvwire.wire import protocol
from kvwire.wire.events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(
        1_700_000_000.0 + i,
        [BlockStored([i * 10 + 1, b"\x01" * 32], i * 10, list(range(32)), 16, None, "GPU"),
         BlockRemoved([i], "GPU")],
        0,
    )


class ReferencePublisher:
    """A reference-style publisher built from raw pyzmq: PUB + ROUTER replay.

    ``legacy=True`` answers replays without the topic frame, as vLLM < 0.26 did. ``skip``
    holds seqs that are never sent live (forcing gaps) but are in the replay buffer.
    ``deaf_from``: replays asked from this seq on go unanswered (a publisher that stops
    answering tail checks, yet still answers a check of a seq the consumer already has).
    ``hide_from``: replays asked from an earlier seq leave out the seqs from this one on (a
    tail check answered before they were published, however late it is served).
    """

    def __init__(self, topic: bytes, legacy: bool = False) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)  # a PUB that also tells when someone subscribes
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic
        self.legacy = legacy
        self.buffer: dict[int, bytes] = {}
        self.requests: list[tuple[int, int]] = []  # (start seq, batches sent) per replay
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.deaf_from: int | None = None
        self.hide_from: int | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def wait_subscribed(self, timeout: float = 20.0) -> None:
        """Until a subscriber's subscription reached the PUB side (no slow-joiner loss)."""
        assert self.pub.poll(int(timeout * 1000)), "no subscriber within the timeout"
        assert self.pub.recv()[:1] == b"\x01"

    def publish(self, seq: int, payload: bytes, live: bool = True) -> None:
        with self.lock:
            self.buffer[seq] = payload
            if live:
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            if self.deaf_from is not None and start >= self.deaf_from:
                continue
            with self.lock:
                end = self.hide_from if self.hide_from is not None and start < self.hide_from \
                    else math.inf
                items = sorted((s, p) for s, p in self.buffer.items() if start <= s < end)
            for s, p in items:
                if self.legacy:
                    self.router.send_multipart([ident, b"", s.to_bytes(8, "big"), p])
                else:
                    self.router.send_multipart([ident, b"", self.topic, s.to_bytes(8, "big"), p])
            self.requests.append((start, len(items)))
            end = (-1).to_bytes(8, "big", signed=True)
            if self.legacy:
                self.router.send_multipart([ident, b"", end, b""])
            else:
                self.router.send_multipart([ident, b"", b"", end, b""])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.ctx.destroy(linger=0)


def wait_connected(pub_send, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """Slow joiner: the listener uses --from-seq 0, so warm-up batches are replayed anyway."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return
        time.sleep(0.05)
        if pub_send():
            return


class Lines:
    """The listener's stdout, line by line, read by a thread so the test can wait on it."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, f) -> None:
        for line in f:
            self.lines.put(line)
        self.lines.put(None)  # EOF

    def until_batch(self, seq: int, timeout: float = 30.0) -> None:
        """Block until the JSON line of batch ``seq`` was printed (fails on timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"batch {seq} not printed within {timeout}s: {self.seen[-5:]}"
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, f"listener exited before batch {seq}: {self.seen[-5:]}"
            self.seen.append(line)
            r = json.loads(line)
            if r["kind"] == "batch" and r["seq"] == seq:
                return

    def rest(self, timeout: float = 30.0) -> list[str]:
        """Every line printed, once the process closed its stdout."""
        while (line := self.lines.get(timeout=timeout)) is not None:
            self.seen.append(line)
        return self.seen


SUMMARY = re.compile(r"(?P<stream>\S+): (?P<batches>\d+) batches, (?P<gaps>\d+) gaps, "
                     r"(?P<replayed>\d+) replayed, (?P<lost>\d+) lost")


def summary(err: str) -> dict[str, dict[str, int]]:
    """The final per-stream counters the listener printed on stderr."""
    return {m["stream"]: {k: int(v) for k, v in m.groupdict().items() if k != "stream"}
            for m in SUMMARY.finditer(err)}


@pytest.mark.parametrize("legacy", [False, True], ids=["topic-frame", "legacy-replay"])
def test_listen_json_fills_gaps_from_replay(legacy: bool) -> None:
    """A live gap, for real: the listener is caught up, then seqs 10..14 go only into the
    publisher's replay buffer; seq 15 shows the hole and the listener must replay it."""
    ref = ReferencePublisher(b"kv", legacy=legacy)
    n = 30
    proc = start_listen(ref.endpoint, "--replay", ref.replay_endpoint, "--topic", "kv",
                        "--json", "--count", str(n))
    out = Lines(proc)
    try:
        ref.wait_subscribed()
        ref.publish(0, encode_batch(batch(0)))
        out.until_batch(0)  # bootstrapped (whatever it replayed, seq 0 is all there was)
        for i in range(1, 10):
            ref.publish(i, encode_batch(batch(i)))
        out.until_batch(9)  # caught up: nothing is missing, nothing in flight
        with ref.lock:
            before = list(ref.requests)
        for i in range(10, 15):
            ref.publish(i, encode_batch(batch(i)), live=False)  # withheld from the live stream
        ref.publish(15, encode_batch(batch(15)))
        out.until_batch(15)  # the gap was filled, so 15 could follow 14
        for i in range(16, n):
            ref.publish(i, encode_batch(batch(i)))
        proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        proc.kill()
        ref.close()
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in out.rest()]
    kinds = [r["kind"] for r in records]
    # A reference publisher: the stream starts with a reset and a snapshot record (no
    # contents), then exactly one line per batch, in seq order with the gap filled.
    assert kinds[:2] == ["reset", "snapshot"]
    assert kinds[2:] == ["batch"] * n
    objs = records[2:]
    assert [o["seq"] for o in objs] == list(range(n))
    by_seq = {o["seq"]: o for o in objs}
    assert by_seq[3]["events"][0]["block_hashes"] == [31, {"hex": "01" * 32}]
    assert by_seq[3]["events"][1] == {
        "type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}
    assert by_seq[12]["events"][0]["block_hashes"][0] == 121  # a replayed one, intact
    assert all(o["stream"] == ref.endpoint for o in objs)
    # The gap was asked for: a replay after the catch-up covers 10..14, from 9 (checked to be
    # the batch we had), from 10 (9 just confirmed by a tail check), or from 0 (a tail check
    # came back empty on a busy host, and a replay from 0 verified the run). Tail checks may
    # come beside it: after a quiet second, after the listener's own stall (a cold start, a
    # busy host: it confirms the tail once its backlog is read), or at the periodic check;
    # the output above is the same either way.
    new = ref.requests[len(before):]
    assert any(a in (0, 9, 10) and a + k >= 15 for a, k in new), new
    assert set(range(10, 15)) <= {s for a, k in new for s in range(a, a + k)}, new
    counts = summary(err)[ref.endpoint]
    replayed = counts.pop("replayed")
    # (0 gaps where a tail check from 9 brought the withheld batches before 15 showed them
    # missing: seen once with the listener stalled on a loaded box)
    gaps = counts.pop("gaps")
    assert counts == {"batches": n, "lost": 0} and gaps in (0, 1), err
    # Every replayed batch the listener read is counted: the gap's six at least, and no
    # more than the publisher sent. Not always all it sent: a request abandoned at its
    # time-out (a loaded box; seen once beside a spinning process, 6 counted of 7 sent)
    # has its answer sent to a socket the listener already closed.
    assert 6 <= replayed <= sum(sent for _, sent in ref.requests), (err, ref.requests)


def test_listen_reports_unfillable_gap_and_restart() -> None:
    ref = ReferencePublisher(b"")
    proc = start_listen(ref.endpoint, "--json", "--count", "4")
    try:
        ref.wait_subscribed()  # the listener gets everything from here on
        seq = 5  # it joins mid-stream: seqs 0-4 were never sent to it
        for _ in range(2):
            ref.publish(seq, encode_batch(batch(seq)))
            seq += 1
        ref.publish(seq + 10, encode_batch(batch(1)))  # a gap with no replay endpoint
        ref.publish(0, encode_batch(batch(2)))  # seq goes back: restart
        for k in range(1, 5):
            ref.publish(k, encode_batch(batch(k)))
        out, err = proc.communicate(timeout=30)
        lines = out.splitlines()
    finally:
        proc.kill()
        ref.close()
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in lines]
    assert sum(r["kind"] == "batch" for r in records) == 4
    # no replay endpoint: every loss or restart is a reset followed by an inexact snapshot
    resets = [r for r in records if r["kind"] == "reset"]
    assert len(resets) >= 2, records
    snaps = [r for r in records if r["kind"] == "snapshot"]
    assert not snaps[0]["exact"]  # joined mid-stream: what came before is unknown


def test_listen_human_output_against_kvwire_publisher() -> None:
    pub = ZmqEventPublisher(endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="t",
                            heartbeat_interval=None)
    proc, out, err = listen_while_publishing(
        pub, batch, pub.endpoint, "--replay", pub.replay_endpoint, "--topic", "t",
        "--count", "3", "--no-view", "--name", "engine0")
    assert proc.returncode == 0, err
    assert out.count("engine0  seq ") == 3
    assert "BlockStored   2 blocks" in out and "BlockRemoved  1 blocks" in out
    assert "engine0: snapshot at seq" in err  # bootstrapped from the publisher's snapshot
    assert "mode kvwire, state exact" in err


def test_listen_bad_endpoint_is_a_clear_error() -> None:
    r = subprocess.run([*KVWIRE, "listen", "tcp//nope"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2
    assert "tcp//nope" in r.stderr


def test_demo_runs_and_rebuilds_the_cache_exactly() -> None:
    r = subprocess.run([*KVWIRE, "demo", "--late-join", "--steps", "600", "--rate", "2000"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "exact match" in r.stdout


def test_demo_sim_tells_the_simulated_fleet_story(tmp_path) -> None:
    png = tmp_path / "fleet.png"
    r = subprocess.run([*KVWIRE, "demo", "--sim", "--engines", "3", "--capacity", "300", "--limit", "150",
                        "--report", str(png)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for policy in ("kvwire", "oracle", "random", "round_robin", "least_load"):
        assert f"\n{policy} " in r.stdout
    assert f"report written to {png.resolve()}" in r.stdout
    assert png.stat().st_size > 10_000


def test_demo_and_sim_without_matplotlib_say_so(tmp_path) -> None:
    """`pip install kvwire` has no matplotlib: the demo still tells its story and says how to
    get the PNG; `sim --report` says the same and exits 2 (after printing its results)."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text('raise ImportError("matplotlib blocked by test")\n')
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    png = tmp_path / "x.png"
    # (a fleet where kvwire meets its targets, as in the test above: exit 0)
    r = subprocess.run([*KVWIRE, "demo", "--sim", "--engines", "3", "--capacity", "300",
                        "--limit", "150", "--report", str(png)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "pip install 'kvwire[sim]'" in r.stdout and "Traceback" not in r.stderr
    assert not png.exists()
    r = subprocess.run([*KVWIRE, "sim", "--engines", "2", "--capacity", "200", "--limit", "60",
                        "--policies", "random", "--report", str(png)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2
    assert "random" in r.stdout
    assert "pip install 'kvwire[sim]'" in r.stderr and "Traceback" not in r.stderr


def test_keys_command_writes_a_usable_pair(tmp_path) -> None:
    r = subprocess.run([*KVWIRE, "keys", str(tmp_path), "srv"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "srv.key").exists()
    assert oct((tmp_path / "srv.key_secret").stat().st_mode & 0o777) == "0o600"


def test_json_line_round_trips_to_the_same_batch() -> None:
    """What --json prints is enough to rebuild the batch (bytes as hex)."""
    from kvwire.wire.events import to_jsonable

    b = batch(5)
    obj = json.loads(json.dumps(to_jsonable(b)))
    ev = obj["events"][0]
    hashes = [bytes.fromhex(h["hex"]) if isinstance(h, dict) else h for h in ev["block_hashes"]]
    assert hashes == b.events[0].block_hashes
    assert decode_batch(encode_batch(b)) == b
    assert protocol.unpack_seq(protocol.pack_seq(-1)) == -1


def test_listen_several_engines_json_bootstraps_from_snapshots(tmp_path) -> None:
    """Two engines, each already holding blocks: the listener loads both snapshots, then
    follows both live streams; --json lines carry stream names."""
    pubs = [ZmqEventPublisher(endpoint=f"ipc://{tmp_path}/l{i}",
                              replay_endpoint=f"ipc://{tmp_path}/r{i}", heartbeat_interval=0.2)
            for i in range(2)]
    for i, p in enumerate(pubs):
        for k in range(5):
            p.publish(batch(100 * i + k))
    args = [pubs[0].endpoint, pubs[1].endpoint, "--replay", pubs[0].replay_endpoint,
            "--replay", pubs[1].replay_endpoint, "--name", "a", "--name", "b", "--json",
            "--count", "8"]
    proc = start_listen(*args)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        for p in pubs:
            p.shutdown(timeout=1)
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    snaps = {r["stream"]: r for r in records if r["kind"] == "snapshot"}
    assert set(snaps) == {"a", "b"}
    for i, name in enumerate("ab"):
        truth = BlockCache()
        for k in range(5):
            truth.apply(batch(100 * i + k))
        r = snaps[name]
        assert r["exact"] and r["seq"] >= 4
        got = {bytes.fromhex(h["hex"]) if isinstance(h, dict) else h
               for b in r["blocks"] for h in b["block_hashes"]}
        assert got == {h for _, h in truth.as_dict()}


def test_listen_with_curve_keys(tmp_path) -> None:
    from kvwire.wire.curve import CurveServer, generate_keys

    generate_keys(tmp_path / "srv", "srv")
    generate_keys(tmp_path / "cli", "alice")
    pub = ZmqEventPublisher(
        endpoint="tcp://*:0", replay_endpoint="tcp://*:0", heartbeat_interval=0.1,
        curve=CurveServer(secret_key_file=str(tmp_path / "srv" / "srv.key_secret"),
                          authorized_keys_dir=str(tmp_path / "cli")),
    )
    pub.publish(batch(1))
    good = start_listen(pub.endpoint, "--replay", pub.replay_endpoint, "--json", "--count", "2",
                        "--curve-secret", str(tmp_path / "cli" / "alice.key_secret"),
                        "--curve-server-key", str(tmp_path / "srv" / "srv.key"))
    plain = start_listen(pub.endpoint, "--json", "--duration", "3")
    try:
        out, err = good.communicate(timeout=60)
        pout, _ = plain.communicate(timeout=60)
    finally:
        good.kill()
        plain.kill()
        pub.shutdown(timeout=1)
    assert good.returncode == 0, err
    assert sum(json.loads(x)["kind"] == "batch" for x in out.splitlines()) == 2
    assert not [x for x in pout.splitlines() if json.loads(x)["kind"] == "batch"]


def _flood_until_printed(ref: ReferencePublisher, out: Lines, n: int) -> None:
    ref.wait_subscribed()
    ref.publish(0, encode_batch(batch(0)))
    out.until_batch(0)
    for i in range(1, n):
        ref.publish(i, encode_batch(batch(i)))
    out.until_batch(n - 1)


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_listen_prints_the_summary_when_signalled(sig: int, status: int) -> None:
    """Ctrl-C or a service manager's SIGTERM: the per-stream summary, then 128 + signo."""
    ref = ReferencePublisher(b"")
    proc = start_listen(ref.endpoint, "--json")
    out = Lines(proc)
    try:
        _flood_until_printed(ref, out, 5)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        err = proc.stderr.read()
    finally:
        proc.kill()
        ref.close()
    assert proc.returncode == status, err
    assert "Traceback" not in err, err
    assert summary(err)[ref.endpoint] == {"batches": 5, "gaps": 0, "replayed": 0, "lost": 0}


def _run_on_a_terminal(argv: list[str], env: dict[str, str], drive) -> tuple[int, str]:
    """Run ``argv`` with stdout and stderr on a pseudo-terminal; (status, what it showed).

    ``drive(proc, shown)`` runs meanwhile; ``shown()`` is what the terminal got so far."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env,
                            preexec_fn=sigint_default)
    os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal is gone
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        drive(proc, lambda: b"".join(chunks).decode(errors="replace"))
        proc.wait(timeout=60)
        reader.join(10)
    finally:
        proc.kill()
        os.close(master)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("have_rich", [False, True], ids=["without-rich", "with-rich"])
def test_listen_on_a_terminal_with_and_without_rich(tmp_path, have_rich: bool) -> None:
    """``pip install kvwire`` has no rich: on a terminal the listener falls back to the plain
    view with a one-line hint instead of crashing (rich made unimportable for real: a
    ``rich.py`` that raises ImportError first on the path). With rich, the live table, left
    by Ctrl-C (the usual way out of it) with the summary after it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TERM="xterm", COLUMNS="200")
    if not have_rich:
        (tmp_path / "rich.py").write_text('raise ImportError("rich blocked by test_cli")\n')
        env["PYTHONPATH"] = os.pathsep.join(
            [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    ref = ReferencePublisher(b"")

    def drive(proc: subprocess.Popen, shown) -> None:
        ref.wait_subscribed()
        for i in range(3):
            ref.publish(i, encode_batch(batch(i)))
        if not have_rich:
            return  # --count 3 ends it
        deadline = time.monotonic() + 30
        while not re.search(r"live-only/live\s*│\s*2\s*│", shown()):  # the table shows seq 2
            assert time.monotonic() < deadline and proc.poll() is None, shown()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)

    argv = [*KVWIRE, "listen", ref.endpoint, *([] if have_rich else ["--count", "3"])]
    try:
        status, shown = _run_on_a_terminal(argv, env, drive)
    finally:
        ref.close()
    assert status == (130 if have_rich else 0), shown
    assert "Traceback" not in shown, shown
    if have_rich:
        assert RICH_HINT not in shown
        assert "kvwire listen" in shown and "batches/s" in shown  # the live table
    else:
        assert shown.count(RICH_HINT) == 1, shown
        assert f"{ref.endpoint}  seq 2" in shown  # the plain per-batch view
    assert "3 batches, 0 gaps" in shown


@pytest.mark.parametrize(("argv", "flag"), [
    (["demo", "--steps", "-5"], "--steps"),
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--capacity", "0"], "--capacity"),
    (["demo", "--rate", "-1"], "--rate"),
    (["demo", "--rate", "nan"], "--rate"),
    (["demo", "--steps", "many"], "--steps"),
    (["listen", "tcp://127.0.0.1:1", "--count", "0"], "--count"),
    (["listen", "tcp://127.0.0.1:1", "--duration", "-1"], "--duration"),
    (["listen", "tcp://127.0.0.1:1", "--duration", "inf"], "--duration"),
    (["listen", "tcp://127.0.0.1:1", "--replay-timeout", "0"], "--replay-timeout"),
    (["listen", "tcp://127.0.0.1:1", "--metrics", "65536"], "--metrics"),
    (["listen", "tcp://127.0.0.1:1", "--metrics", "-1"], "--metrics"),
])
def test_bad_numbers_are_argparse_errors_naming_the_flag(argv, flag, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)  # parse only: a missed check must not start a listener
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and argv[-1] in err, err


def test_demo_rejects_a_negative_step_count_as_a_process() -> None:
    r = subprocess.run([*KVWIRE, "demo", "--steps", "-5"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2
    assert "argument --steps: must be >= 1, got -5" in r.stderr
    assert "summary" not in r.stdout  # nothing ran


@pytest.mark.parametrize("kwargs", [{"steps": -5}, {"steps": 0}, {"capacity": 0},
                                    {"rate": -1.0}, {"rate": float("nan")},
                                    {"join_after": 1.5}])
def test_run_demo_rejects_bad_arguments(kwargs) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        run_demo(**kwargs)


def test_every_subcommand_is_reachable_from_kvwire() -> None:
    r = subprocess.run([*KVWIRE, "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    for cmd in ("listen", "keys", "demo", "sim", "serve", "epp", "bridge", "engine", "index",
                "fleet"):
        assert cmd in r.stdout
        h = subprocess.run([*KVWIRE, cmd, "--help"], capture_output=True, text=True, timeout=30)
        assert h.returncode == 0 and f"usage: kvwire {cmd}" in h.stdout, h.stderr


def test_version_is_the_installed_distribution_s() -> None:
    """``kvwire --version`` names the version pip installed (pyproject.toml's), so a bug
    report can say which kvwire it ran."""
    from importlib.metadata import version

    r = subprocess.run([*KVWIRE, "--version"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"kvwire {version('kvwire')}"


def test_demo_exits_3_when_a_printed_target_is_missed() -> None:
    """2 engines on 20 requests share nothing: kvwire cannot beat random by 2.5x. The demo
    says which targets it missed and exits 3, so `make demo` catches a routing regression."""
    r = subprocess.run([*KVWIRE, "demo", "--sim", "--engines", "2", "--limit", "20",
                        "--report", os.devnull], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "kvwire demo: target missed: kvwire's hit ratio is 1.000x random's (target >= 2.5)" \
        in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_listen_metrics_that_cannot_listen_is_one_line_and_exit_1() -> None:
    """--metrics on a port in use, or --metrics-addr that does not resolve: one line naming
    the flags and the reason, exit 1 (it used to be a traceback)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run([*KVWIRE, "listen", "tcp://127.0.0.1:1", "--metrics", str(port),
                            "--duration", "30"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert f"kvwire listen: cannot serve metrics on 127.0.0.1:{port} (--metrics, " \
           "--metrics-addr): [Errno 98] Address already in use" in r.stderr, r.stderr
    r = subprocess.run([*KVWIRE, "listen", "tcp://127.0.0.1:1", "--metrics", "0",
                        "--metrics-addr", "no-such-host.invalid", "--duration", "30"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "kvwire listen: cannot serve metrics on no-such-host.invalid:0" in r.stderr
    assert "Traceback" not in r.stderr


NAME_RULE = ("engine name 'a.b' must be 1-64 of letters, digits, '_' and '-' (it becomes a "
             "NATS subject token, where '.' separates tokens)")


@pytest.mark.parametrize("argv", [
    ["serve", "--engine", "a.b=tcp://127.0.0.1:1"],
    ["bridge", "--nats", "nats://127.0.0.1:1", "--engine", "a.b=tcp://127.0.0.1:1"],
    ["serve", "--nats", "nats://127.0.0.1:1", "--nats-engine", "a.b"],
], ids=["serve", "bridge", "serve-nats-engine"])
def test_one_engine_name_rule_for_every_command(argv: list[str]) -> None:
    """`serve` used to take '.' and ':' in names that `bridge` refused: one parser and rule."""
    r = subprocess.run([*KVWIRE, *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and NAME_RULE in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()[-1]) < 300 and "Traceback" not in r.stderr


def test_bridge_no_longer_borrows_serve_s_engine_parser() -> None:
    code = ("import sys, kvwire.cli.bridge\n"
            "print('kvwire.cli.serve' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", (r.stdout, r.stderr)


def test_exit_codes_are_in_the_help_and_the_docs() -> None:
    """What scripts may rely on is written down (docs/operations.md) and in --help."""
    from pathlib import Path

    ops = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    for needle in ("| 1 |", "| 2 |", "| 3 |", "--connect-timeout"):
        assert needle in ops, needle
    for cmd in ("listen", "serve", "bridge", "demo"):
        h = subprocess.run([*KVWIRE, cmd, "--help"], capture_output=True, text=True,
                           timeout=60)
        assert h.returncode == 0 and "exit status:" in h.stdout, (cmd, h.stdout)


# One bad flag per command: each says what was wrong in one line, exit 2, no usage.
BAD_FLAGS = [
    (["listen", "tcp://127.0.0.1:1", "--count", "0"], "argument --count: must be >= 1, got 0"),
    (["keys", "dir"], "the following arguments are required: name"),
    (["demo", "--speed", "fast"], "argument --speed: not a number: 'fast'"),
    (["sim", "--engines", "0"], "argument --engines: must be >= 1, got 0"),
    (["serve", "--port", "70000"], "argument --port: must be in 0..65535, got 70000"),
    (["serve", "--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    (["serve", "--retries", "-1"], "argument --retries: must be >= 0, got -1"),
    (["bridge", "--nats", "nats://127.0.0.1:1", "--engine", "e=tcp://127.0.0.1:1", "--pack",
      "0"], "argument --pack: must be >= 1, got 0"),
    (["engine", "--num-gpu-blocks", "0"], "argument --num-gpu-blocks: must be >= 1, got 0"),
    (["engine", "--step-prefill-token-us", "nan"],
     "argument --step-prefill-token-us: must be a finite number >= 0, got nan"),
    (["index", "--workers", "65"], "argument --workers: must be in 1..64, got 65"),
    (["fleet", "0"], "argument N: must be >= 1, got 0"),
    (["fleet", "2", "--base-port", "-1"], "--base-port: must be in 0..65535, got -1"),
    (["serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ([], "the following arguments are required: COMMAND"),
]


@pytest.mark.parametrize(("argv", "says"), BAD_FLAGS,
                         ids=[" ".join(a[:1] + a[-2:]) or "none" for a, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_naming_it(argv: list[str], says: str, capsys) -> None:
    """Every command's parser: the flag and the reason on one line (prefixed by the command),
    exit 2; never the usage first (it was 26 lines of it for ``kvwire serve``)."""
    from kvwire.cli.main import main

    try:
        rc = main(argv)  # (kvwire fleet checks the engine flags it passes on itself)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    # (unknown flags are collected by the top parser, which names them)
    prog = "kvwire" if not argv or says.startswith("unrecognized") else f"kvwire {argv[0]}"
    assert err.startswith(f"{prog}: ") and "usage:" not in err, err


def test_the_issue_s_bad_serve_flags_as_processes() -> None:
    for flags, says in ((["--port", "70000"], "argument --port: must be in 0..65535"),
                        (["--log-level", "loud"], "argument --log-level: invalid choice")):
        r = subprocess.run([*KVWIRE, "serve", *flags], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and r.stdout == "", r
        assert r.stderr.startswith("kvwire serve: ") and r.stderr.count("\n") == 1, r.stderr
        assert says in r.stderr, r.stderr


def test_help_still_prints_the_usage(capsys) -> None:
    from kvwire.cli.main import main

    for argv in (["--help"], ["serve", "--help"], ["fleet", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
        assert "usage: kvwire" in capsys.readouterr().out


def test_kvwire_help_lists_every_command_in_plain_text() -> None:
    """One line per command with its purpose, all of them (the parser's own list), and no
    reST markup from a docstring; each command's --help names the extra it needs."""
    parser = build_parser()
    commands = next(a for a in parser._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
    assert len(commands) == 10  # (epp: the endpoint picker behind Envoy)
    r = subprocess.run([*KVWIRE, "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    for name in commands:
        assert re.search(rf"^  {name} +\S.{{10,}}$", r.stdout, re.M), (name, r.stdout)
    for markup in ("``", ":mod:", ":class:", ":func:"):
        assert markup not in r.stdout
    for name, needs in (("serve", "pip install 'kvwire[serve]'"),
                        ("bridge", "pip install 'kvwire[nats]'"),
                        ("sim", "pip install 'kvwire[sim]' for --report")):
        h = commands[name].format_help()
        assert needs in " ".join(h.split()) and "``" not in h, h


@pytest.mark.parametrize(("conv", "text", "says"), [
    ("integer(1)", "0", "must be >= 1, got 0"),
    ("integer(1)", "x", "not an integer: 'x'"),
    ("integer(0, 9)", "10", "must be in 0..9, got 10"),
    ("number(0, strict=True)", "0", "must be a finite number > 0, got 0"),
    ("number(0)", "-1", "must be a finite number >= 0, got -1"),
    ("number(0)", "inf", "must be a finite number >= 0, got inf"),
    ("number(0)", "x", "not a number: 'x'"),
    ("port", "http", "not a port number: 'http'"),
    ("port", "65536", "must be in 0..65535, got 65536"),
])
def test_the_cli_number_converters(conv: str, text: str, says: str) -> None:
    from kvwire.cli import options

    f = eval(conv, vars(options))  # noqa: S307 - a converter expression from this table
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(says)):
        f(text)


def test_one_set_of_number_converters() -> None:
    """Defined once, in kvwire/cli/options.py: no command module defines its own."""
    from pathlib import Path

    cli = Path(__file__).parent.parent / "src" / "kvwire" / "cli"
    for path in cli.glob("*.py"):
        if path.name != "options.py":
            src = path.read_text()
            assert "ArgumentTypeError(f\"must be" not in src, path.name
            assert "argparse.ArgumentParser(" not in src, path.name  # options.Parser only


def test_a_module_missing_while_running_names_its_extra() -> None:
    """The guard behind the check before start: a ModuleNotFoundError a command raises is
    one line when an extra brings the module (the command's own extra first), and left as
    a traceback when none does (a broken install: the traceback says where)."""
    from kvwire.cli import extras

    assert extras.module_line("serve", "prometheus_client") == (
        "kvwire serve: needs the 'serve' extra (no module 'prometheus_client'): "
        "pip install 'kvwire[serve]'")
    assert "'metrics' extra" in extras.module_line("listen", "prometheus_client")
    assert "'tokenize' extra" in extras.module_line("engine", "tokenizers")
    assert extras.module_line("engine", "jinja2") is None  # a core dependency
    code = ("import sys; sys.modules['tokenizers'] = None\n"
            "from kvwire.cli.main import main\n"
            "sys.exit(main(['engine', '--port', '0', '--tokenizer', '/nonexistent']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "pip install 'kvwire[tokenize]'" in r.stderr, r.stderr
