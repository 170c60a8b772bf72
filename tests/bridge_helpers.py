"""Helpers for tests/test_nats_bridge.py: read a subject back and check kvwire's per-subject
contract (what every consumer relies on), and run ``kvwire bridge`` as a real process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from kvwire.index.cache import BlockCache
from kvwire.nats import subjects as S
from kvwire.wire.events import BlockStored, decode_batch

_chunk = msgspec.msgpack.Decoder(list[BlockStored])
_runs = msgspec.msgpack.Decoder(list[msgspec.Raw])


class SubjectLog(msgspec.Struct):
    """Everything on one subject, checked: ``batches`` are the (epoch, seq) of batch messages
    in order; ``markers`` the (epoch, seq, reason) of reset markers; ``cache`` the state."""

    messages: int
    batches: list[tuple[int, int]]
    markers: list[tuple[int, int, str]]
    cache: BlockCache
    exact: bool
    last_js_seq: int
    packs: int = 0  # ``batches`` messages (bridge --pack)
    stored_twice: int = 0  # batches stored again by an overlapping run (redundant packing)
    #: marker sets cut short (a bridge killed while writing them), each followed by a reset
    #: (a bridge's resync): their (epoch, seq)
    unfinished: list[tuple[int, int]] = msgspec.field(default_factory=list)


async def read_subject(url: str, subject: str, stream: str = S.DEFAULT_STREAM,
                       overlap: bool = False) -> SubjectLog:
    """Read ``subject`` from its first message; AssertionError on any break of the contract:
    the first message is a reset marker; a reset is followed by chunks 0..n-1 of the
    snapshot at the same (epoch, seq); after that, a batch is (epoch, seq + 1) of the one
    before or a reset comes (a ``batches`` run: its first seq is; with ``overlap``, two
    redundant packing bridges' runs may overlap what came before: counted in
    ``stored_twice``, only the new tail applied); no Nats-Msg-Id twice. A reset may cut a
    marker set short only in a later epoch (recorded in ``unfinished``: what a consumer
    does with it, drop the set, is the new reset's own meaning)."""
    import nats
    from nats.js.api import ConsumerConfig, DeliverPolicy
    from nats.js.errors import NotFoundError

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        try:
            last = await js.get_last_msg(stream, subject)
        except NotFoundError:
            return SubjectLog(0, [], [], BlockCache(), True, 0)
        sub = await js.subscribe(subject, ordered_consumer=True, config=ConsumerConfig(
            deliver_policy=DeliverPolicy.ALL))
        log = SubjectLog(0, [], [], BlockCache(), True, 0)
        ids: set[str] = set()
        pos: tuple[int, int] | None = None
        want_chunk: tuple[int, int] | None = None  # (next chunk, of n) inside a snapshot
        while log.last_js_seq < last.seq:
            m = await sub.next_msg(10)
            h = m.headers or {}
            mid = h[S.H_MSG_ID]
            assert mid not in ids, f"{subject}: {mid} written twice"
            ids.add(mid)
            kind, ep, sq = h[S.H_KIND], int(h[S.H_EPOCH]), int(h[S.H_SEQ])
            if log.messages == 0:
                assert kind == "reset", f"{subject}: first message is {kind}, not a reset"
            if kind == "reset":
                if want_chunk is not None:
                    assert pos is not None and ep > pos[0], \
                        f"{subject}: reset {(ep, sq)} inside the snapshot at {pos}"
                    log.unfinished.append(pos)
                assert mid == S.msg_id(*S.parse_subject(subject.rsplit(".", 2)[0], subject),
                                       ep, sq, "reset")
                log.markers.append((ep, sq, h.get(S.H_REASON, "")))
                log.cache.clear()
                pos, want_chunk = (ep, sq), (0, -1)
            elif kind == "snapshot":
                i, n = (int(x) for x in h[S.H_CHUNK].split("/"))
                assert want_chunk is not None and want_chunk[0] == i and pos == (ep, sq), \
                    f"{subject}: snapshot chunk {i}/{n} at {(ep, sq)} out of place ({pos})"
                log.cache.apply_events(_chunk.decode(m.data))
                log.exact = h.get("Kvwire-Exact", "1") != "0"
                want_chunk = None if i == n - 1 else (i + 1, n)
            else:
                assert kind in ("batch", "batches") and want_chunk is None and pos is not None, \
                    f"{subject}: {kind} {(ep, sq)} out of place"
                eng, rk = S.parse_subject(subject.rsplit(".", 2)[0], subject)
                if kind == "batches":
                    first = int(h[S.H_FIRST_SEQ])
                    assert mid == S.run_msg_id(eng, rk, ep, first, sq)
                    bodies = [bytes(x) for x in _runs.decode(m.data)]
                    assert len(bodies) == sq - first + 1, f"{subject}: {mid} holds {len(bodies)}"
                    log.packs += 1
                else:
                    first, bodies = sq, [m.data]
                    assert mid == S.msg_id(eng, rk, ep, sq)
                if overlap and ep == pos[0] and first <= pos[1]:
                    again = min(sq, pos[1]) - first + 1
                    log.stored_twice += again
                    bodies, first = bodies[again:], first + again
                assert not bodies or (ep, first) == (pos[0], pos[1] + 1), \
                    f"{subject}: batch {(ep, first)}..{sq} after {pos}: gap or duplicate"
                for i, body in enumerate(bodies):
                    log.cache.apply(decode_batch(body))
                    log.batches.append((ep, first + i))
                pos = (ep, max(sq, pos[1]) if ep == pos[0] else sq)
            log.messages += 1
            log.last_js_seq = m.metadata.sequence.stream
        await sub.unsubscribe()
        return log
    finally:
        await nc.close()


def subject_log(url: str, subject: str, stream: str = S.DEFAULT_STREAM,
                overlap: bool = False) -> SubjectLog:
    return asyncio.run(read_subject(url, subject, stream, overlap))


async def _last_seq(url: str, subject: str, stream: str) -> tuple[int, int] | None:
    import nats
    from nats.js.errors import NotFoundError

    nc = await nats.connect(url)
    try:
        m = await nc.jetstream().get_last_msg(stream, subject)
        return int(m.headers[S.H_EPOCH]), int(m.headers[S.H_SEQ])
    except NotFoundError:
        return None
    finally:
        await nc.close()


def last_subject_msg(url: str, subject: str,
                     stream: str = S.DEFAULT_STREAM) -> tuple[int, int] | None:
    """The (epoch, seq) of the subject's last message (None: none)."""
    return asyncio.run(_last_seq(url, subject, stream))


def wait_subject_seq(url: str, subject: str, seq: int, timeout: float,
                     stream: str = S.DEFAULT_STREAM, procs: list[Any] = (),
                     epoch: int | None = None) -> None:
    """Until the subject's last message has Kvwire-Seq >= ``seq`` (and Kvwire-Epoch
    ``epoch`` when given)."""
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        try:
            got = last_subject_msg(url, subject, stream)
        except Exception:  # the server is restarting
            got = None
        if got is not None and got[1] >= seq and epoch in (None, got[0]):
            return
        for p in procs:
            assert p.poll() is None, f"bridge exited {p.returncode}: {p.log()}"
        time.sleep(0.1)  # polling an outside process's progress
    logs = "".join(f"\n--- bridge log (end) ---\n{p.log()}" for p in procs
                   if hasattr(p, "log"))
    raise AssertionError(f"{subject}: last (epoch, seq) {got}, wanted seq {seq}"
                         f"{'' if epoch is None else f' in epoch {epoch}'} within {timeout}s"
                         f"{logs}")


class BridgeProc:
    """``python -m kvwire bridge ...`` with its stderr in a file."""

    def __init__(self, tmp: Path, url: str, engines: list[str], *extra: str) -> None:
        self.log_path = Path(tmp) / f"bridge-{time.monotonic_ns()}.log"
        args = [sys.executable, "-m", "kvwire", "bridge", "--nats", url, "--log-interval", "0",
                "--log-level", "info", *extra]
        for e in engines:
            args += ["--engine", e]
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def poll(self) -> int | None:
        return self.proc.poll()

    def summary(self) -> dict[str, Any]:
        """The stats a stopped bridge printed (``kvwire bridge: stopped {json}``)."""
        import json

        for line in reversed(self.log_path.read_text(errors="replace").splitlines()):
            if line.startswith("kvwire bridge: stopped "):
                return json.loads(line[len("kvwire bridge: stopped "):])
        raise AssertionError(f"no stop summary in the bridge's log: {self.log()}")

    def report(self, timeout: float = 10.0) -> dict[str, Any]:
        """SIGUSR2 to the running bridge; the stats it prints (``kvwire bridge: stats``),
        with ``lag_window``: the lag of the batches it stored since the last report."""
        import json

        tag = "kvwire bridge: stats "
        before = self.log_path.read_text(errors="replace").count(tag)
        self.proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + timeout
        while True:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines()
                     if ln.startswith(tag)]
            if len(lines) > before:
                try:
                    return json.loads(lines[-1][len(tag):])
                except ValueError:
                    pass  # the line is still being written
            if time.monotonic() > deadline:
                raise AssertionError(f"no stats after SIGUSR2: {self.log()}")
            time.sleep(0.02)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def wait_started(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while "engines ->" not in self.log_path.read_text():
            assert self.proc.poll() is None, f"bridge exited: {self.log()}"
            assert time.monotonic() < deadline, f"bridge did not start: {self.log()}"
            time.sleep(0.05)  # polling its log

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # its stacks into the log, for the report
            until = time.monotonic() + 3.0
            while "most recent call first" not in self.log_path.read_text(errors="replace") \
                    and time.monotonic() < until:
                time.sleep(0.05)  # polling its log for the dump
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"bridge did not exit on SIGTERM: {self.log()}") from None
