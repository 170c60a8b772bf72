"""Shared by the engines tier (tests/test_engines_*.py): loud skips for a missing wheel,
raw ZeroMQ readers of a publisher (live SUB, reference replay), the child process that
loads an engine's plugins the way the engine does and publishes on command
(tests/engine_child.py), and the checks both engines' tests make of kvwire's plugin."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import logging
import os
import random
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from ports import free_port
from waiting import wait_for

from kvwire.consume.items import Batch, Snapshot
from kvwire.consume.subscriber import StreamSpec, Subscriber

TIMEOUT = 30.0  # generous: a loaded 2-core box, engines importing for ~10 s of CPU
END_SEQ = (-1).to_bytes(8, "big", signed=True)
ROOT = Path(__file__).resolve().parent.parent


def import_or_skip(module: str, wheel: str) -> Any:
    """``module``, or a skip whose reason names the wheel (conftest's summary lists it)."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # ImportError, or a dependency of the engine missing/broken
        stamp = "DYNAMO" if "dynamo" in wheel else "ENGINES"
        pytest.skip(f"{wheel} is missing or unimportable ({type(e).__name__}: {e}); "
                    f"`make test` installs it (the {stamp} stamp)")


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


def free_ports(n: int, spare: int = 0) -> list[int]:
    """``n`` ports free just now, each with the ``spare`` ports below it free too (a DP rank
    moves a port up by its rank from the port less ``spare``)."""
    return [free_port(spare + 1) + spare for _ in range(n)]


def engine_env(**switches: str) -> dict[str, str]:
    """This environment without any kvwire switch, plus ``switches``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_")}
    env.update(switches)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Child:
    """An engine child (tests/engine_child.py) speaking JSON lines: it prints one object per
    phase, then one per command it gets."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path) -> None:
        self.stderr_path = cwd / "child.stderr"
        self.log: list[str] = []  # the child's stdout lines that are not replies
        self._buf = b""
        self._err = open(self.stderr_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "engine_child.py"), *args], cwd=cwd,
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
            bufsize=0)

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


def random_batches(k: Any, n: int, seed: int, *, block_size: int, t0: float,
                   new_hash: Callable[[random.Random], Any],
                   stored: Callable[[random.Random, list[Any]], dict[str, Any]],
                   removed: Callable[[random.Random], dict[str, Any]]) -> list[Any]:
    """``n`` batches of an engine's own event classes (its kv_events module ``k``),
    deterministic per seed: each stores 1-3 new blocks (``new_hash`` makes their hashes,
    ``stored(rng, hashes)`` the engine's other fields of BlockStored), chained to an
    earlier block half the time; some remove 1-2 earlier blocks (``removed(rng)`` gives
    the other fields of BlockRemoved); every 40th starts with a full clear."""
    rng = random.Random(seed)
    out: list[Any] = []
    live: list[Any] = []
    for i in range(n):
        events: list[Any] = []
        if i % 40 == 39:
            events.append(k.AllBlocksCleared())
            live.clear()
        hashes = [new_hash(rng) for _ in range(rng.randint(1, 3))]
        parent = live[-1] if live and rng.random() < 0.5 else None
        events.append(k.BlockStored(
            block_hashes=hashes, parent_block_hash=parent, block_size=block_size,
            token_ids=[rng.randrange(1 << 17) for _ in range(block_size * len(hashes))],
            **stored(rng, hashes)))
        live.extend(hashes)
        if len(live) > 4 and rng.random() < 0.4:
            gone = [live.pop(rng.randrange(len(live))) for _ in range(rng.randint(1, 2))]
            events.append(k.BlockRemoved(block_hashes=gone, **removed(rng)))
        out.append(k.KVEventBatch(ts=t0 + i, events=events))
    return out


def engine_child(engine: str, wheel: str,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Child, str, str]]:
    """The body of a module fixture: the engine's child (tests/engine_child.py) running the
    docs example on ipc endpoints; yields it with its live and replay endpoints. Started
    before the test module imports the engine, so the two imports overlap."""
    if importlib.util.find_spec(engine) is None:  # (cheap: no import)
        import_or_skip(engine, wheel)
    d = tmp_path_factory.mktemp(f"{engine}-child")
    ep, rep = f"ipc://{d}/live", f"ipc://{d}/replay"
    [doc] = docs_blocks(f"test_engines_{engine}")
    doc = doc.replace("tcp://*:5557", ep).replace("tcp://*:5558", rep)
    c = Child([engine, doc], engine_env(), d)
    try:
        yield c, ep, rep
    finally:
        c.close()


def read_phase(c: Child, phase: str) -> dict[str, Any]:
    """The child's report of ``phase`` (an earlier phase's line is skipped when the test
    that reads it did not run)."""
    while (got := c.read()).get("phase") != phase:
        pass
    return got


def assert_off_phase(c: Child, engine: str) -> None:
    """Loaded by the engine's own loader with the switches unset: the engine's factory
    registry, its modules' and classes' attributes, environment and threads are as before."""
    off = c.read()
    assert off["phase"] == "off"
    assert off["entry_point"] == [f"kvwire.plugins.{engine}:register"]  # it was loaded
    assert off["changed"] == [], off
    assert off["kvwire_modules"] == ["kvwire", "kvwire.plugins", f"kvwire.plugins.{engine}"]


def plugin_switched_on(plugin: Any, k: Any, switch: str,
                       monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    """The body of a ``plugin_on`` fixture: only ``switch`` of kvwire's switches set, the
    plugin registered in this process (yields the class in the engine's factory), then
    uninstalled, leaving the engine's own publisher in place."""
    for name in [n for n in os.environ if n.startswith("KVWIRE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(switch, "1")
    plugin.register()
    yield k.EventPublisherFactory._registry["zmq"]
    plugin.uninstall_events()
    assert k.EventPublisherFactory._registry["zmq"] is k.ZmqEventPublisher


def assert_register_changes_nothing(plugin: Any, k: Any) -> None:
    """register() with the switch off: no factory entry, no module imported."""
    registry, mods = dict(k.EventPublisherFactory._registry), set(sys.modules)
    plugin.register()
    assert k.EventPublisherFactory._registry == registry
    assert set(sys.modules) == mods


@contextmanager
def log_messages(logger: logging.Logger, level: int = logging.WARNING) -> Iterator[list[str]]:
    """The messages ``logger`` handles at ``level`` or above while in the block (a handler
    on the logger itself: the engines' loggers may not propagate to pytest's)."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    h = Keep(level)
    logger.addHandler(h)
    try:
        yield messages
    finally:
        logger.removeHandler(h)


def until_snapshot(sub: Subscriber) -> Snapshot:
    deadline = time.monotonic() + TIMEOUT
    while True:
        assert time.monotonic() < deadline, "no snapshot"
        item = sub.poll(TIMEOUT)
        assert item is not None, "no snapshot"
        if isinstance(item, Snapshot):
            return item


def receive(sub: Subscriber, n: int) -> dict[int, Any]:
    """The first ``n`` non-empty batches ``sub`` delivers, by seq (kvwire's seqs also count
    its heartbeats, empty batches)."""
    got: dict[int, Any] = {}
    while len(got) < n:
        item = sub.poll(TIMEOUT)
        assert item is not None, f"Subscriber got {len(got)} of {n}"
        if isinstance(item, Batch) and item.batch.events:
            got[item.seq] = item.batch
    return got


def nonempty(replayed: dict[int, bytes], strict: Any) -> list[int]:
    """Seqs of the real batches (kvwire adds empty heartbeat batches when idle, which the
    engine's strict decoder reads as empty batches)."""
    return sorted(s for s, p in replayed.items() if strict.decode(p).events)


Endpoints = tuple[Any, str, str]  # a publisher, its live and its replay endpoint


def check_same_bytes(ctx: zmq.Context, k: Any, theirs: Endpoints, ours: Endpoints, *,
                     batches: Callable[..., list[Any]], summary: Callable[[Any], Any],
                     rank_field: str, topic: str = "", n: int = 120) -> tuple[list[Any],
                                                                                Snapshot]:
    """The engine's own publisher and kvwire's get the same engine objects (each its own
    copy: both fill the rank in place): every live and replayed payload is byte-identical
    (the engine's bytes, with rank 0), the engine's strict decoder reads all of them, and
    kvwire's Subscriber receives every batch after its snapshot, in order. Returns the
    batches sent and a late joiner's snapshot, taken after the last of them."""
    pubs = [theirs[0], ours[0]]
    subs = [sub_socket(ctx, theirs[1]), sub_socket(ctx, ours[1])]
    sent: list[Any] = []

    def publish_same(bs: list[Any]) -> None:
        for b in bs:
            for p in pubs:
                p.publish(copy.deepcopy(b))
        sent.extend(bs)

    warm = iter(batches(k, 400, seed=99))
    warm_up(subs, lambda: publish_same([next(warm)]))
    strict = msgspec.msgpack.Decoder(k.KVEventBatch)
    with Subscriber([StreamSpec("kvwire", ours[1], topic, ours[2])], ctx=ctx) as sub:
        snaps = [until_snapshot(sub)]  # joined (INFO, SNAPSHOT) before the batches
        publish_same(batches(k, n, seed=1))
        replays: list[dict[int, bytes]] = []

        def all_replayed() -> bool:
            replays[:] = [replay_all(ctx, theirs[2]), replay_all(ctx, ours[2])]
            return all(len(nonempty(r, strict)) == len(sent) for r in replays)

        wait_for(all_replayed, "both replay buffers to hold every batch")
        seqs = nonempty(replays[1], strict)  # kvwire's seqs also count its heartbeats
        assert sorted(replays[0]) == list(range(len(sent)))
        assert [replays[1][s] for s in seqs] == [replays[0][s] for s in range(len(sent))]
        for i, seq in enumerate(seqs):  # the engine's bytes, with the publisher's rank
            want = copy.deepcopy(sent[i])
            setattr(want, rank_field, 0)
            assert replays[1][seq] == msgspec.msgpack.encode(want), seq
            assert strict.decode(replays[1][seq]) == strict.decode(replays[0][i]), seq
        for s, r, last in zip(subs, replays, (len(sent) - 1, seqs[-1])):
            live = collect(s, last)  # live bytes are the replayed bytes, without gaps
            assert all(live[q] == r[q] for q in live)
            assert sorted(live) == list(range(min(live), last + 1))
            assert min(live) <= (seqs[-n] if r is replays[1] else len(sent) - n)
        got: dict[int, Any] = {}
        deadline = time.monotonic() + TIMEOUT
        while seqs[-1] not in got:
            assert time.monotonic() < deadline, f"Subscriber stalled at {sorted(got)[-1:]}"
            item = sub.poll(TIMEOUT)
            assert item is not None, f"Subscriber stalled at {sorted(got)[-1:]}"
            if isinstance(item, Snapshot):
                snaps.append(item)
            elif isinstance(item, Batch) and item.batch.events:
                assert item.seq not in got
                got[item.seq] = item.batch
        assert snaps[0].exact
        assert sorted(got) == [q for q in seqs if q > snaps[0].seq] and len(got) >= n
        index = {q: i for i, q in enumerate(seqs)}
        for q, batch in got.items():
            assert [summary(e) for e in batch.events] == [summary(e) for e in
                                                          sent[index[q]].events]
            assert batch.data_parallel_rank == 0  # the engine's rank, at the same place
        assert sub.stats()["kvwire"].stream.mode == "kvwire"
    with Subscriber([StreamSpec("late", ours[1], topic, ours[2])], ctx=ctx) as late:
        snap = until_snapshot(late)
    assert snap.exact and snap.seq >= seqs[-1]
    st = ours[0].stats()
    assert (st.encode_errors, st.model_unknown_events, st.snapshot_exact) == (0, 0, True)
    return sent, snap
