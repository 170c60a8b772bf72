"""Router replicas that share their load: the NATS I/O (:class:`LoadShare`), on core NATS
(not JetStream: load is of the moment, nothing to keep). What the reports say and how they
are applied is :mod:`kvwire.routing.sharing` (pure); this module is the thread with its own
event loop and NATS connection that sends what the request path queued (never waiting on
the network: a bounded queue, drops counted) and applies what the others send under the
router's lock.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import msgspec

from ..routing.sharing import Outbox, PeerLoads, Report, decode_report, encode_report

__all__ = ["LoadShare"]

log = logging.getLogger("kvwire.router.load_share")  # (the name operators filter on)


class LoadShare:
    """Share this replica's reservations with the others on ``subject`` and apply theirs
    to ``core.loads`` (a :class:`~kvwire.routing.core.RouterCore`), from a thread of its
    own. :meth:`push` is what the request path calls: it appends to a bounded queue
    (:class:`~kvwire.routing.sharing.Outbox`) and wakes the thread at most once per burst."""

    def __init__(self, core: Any, url: str, subject: str, *, replica: str | None = None,
                 heartbeat: float = 0.5, ttl: float = 2.0, max_queue: int = 100_000,
                 flush_interval: float = 0.001, connect_timeout: float = 10.0) -> None:
        if not 0 < heartbeat < ttl:
            raise ValueError(f"need 0 < heartbeat < ttl, got {heartbeat!r} and {ttl!r}")
        self.core, self.url, self.subject = core, url, subject
        self.replica = replica or f"{os.uname().nodename}-{os.getpid()}-{os.urandom(3).hex()}"
        self.heartbeat, self.connect_timeout = float(heartbeat), float(connect_timeout)
        if not 0 <= flush_interval < heartbeat:
            raise ValueError(f"need 0 <= flush_interval < heartbeat, got {flush_interval!r}")
        self.flush_interval = float(flush_interval)
        self.peers = PeerLoads(core.loads, self.replica, ttl, on_output=core.learn_output,
                               on_release=core.release_asked,
                               on_predict=core.predicted_by_peer)
        self.outbox = Outbox(self.replica, max_queue)
        self._out = self.outbox.ops  # (the queue itself: read without a call on hot paths)
        self.max_queue = max_queue
        self._waking = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._fast: Any = None  # kvwire.nats.client_internals: straight to the socket
        self._subject_b = subject.encode()
        self._beat_due = False
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.counts = {"sent": 0, "send_errors": 0, "dropped": 0, "heartbeats_cut": 0}

    # ---------------------------------------------------------------- the request path

    def push(self, op: list[Any]) -> None:
        """Queue one operation for the others (any thread; never waits). A full queue (the
        NATS connection down for long) drops it, counted: the next heartbeat corrects it.
        A prediction is dropped as soon as a backlog forms (``PREDICTION_BACKLOG``): it is
        of the moment, and up to 32 KB."""
        if not self.outbox.put(op):
            self.counts["dropped"] += 1
            return
        if not self._waking and self._loop is not None:
            self._waking = True
            try:
                self._loop.call_soon_threadsafe(self._woken)
            except RuntimeError:  # the loop closed: stopping
                pass

    def _woken(self) -> None:
        """In the sharing thread, once per burst of pushes: send what is queued
        ``flush_interval`` from now, so that the pushes meanwhile go in the same report
        without waking the thread again."""
        if self._loop is not None:
            self._loop.call_later(self.flush_interval, self._flush)

    def _flush(self) -> None:
        """Send what is queued: straight to the socket when nothing of nats-py's is queued
        ahead (no task switch), else through the sending task."""
        self._waking = False  # (before the queue is read: a push from now on wakes again)
        if self._out and self._fast is not None and self._fast.can_write_now():
            self._fast.write_now(self._command(self._report(beat=False)))
            self.counts["sent"] += 1
        if self._out and self._wake is not None:  # (not sent, or more than one report)
            self._wake.set()

    def forward_release(self, rid: str, output_tokens: int | None) -> tuple[str, str] | None:
        """A ``/release`` for a reservation another replica made: ask that replica (under
        the router's lock; never waits). The owner and the engine, or None if no peer
        holds ``rid``."""
        owner = self.peers.owner(rid)
        if owner is None:
            return None
        engine = self.core.loads.holder(f"{owner}:{rid}")
        self.push(self.peers.ask_release(owner, rid, output_tokens))
        return owner, engine

    # ---------------------------------------------------------------- the thread

    def start(self, timeout: float = 15.0) -> None:
        """Connect and subscribe; raises what the thread could not do (NatsConnectError)."""
        self._thread = threading.Thread(target=self._main, name="kvwire-load-share",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("load sharing did not start")
        if self.error is not None:
            raise self.error

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass
        if self._thread is not None:
            self._thread.join(timeout)

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._run(loop))
        except BaseException as e:  # noqa: BLE001 - reported to start(), or logged
            if not self._ready.is_set():
                self.error = e
            else:
                log.error("load sharing stopped: %s: %s", type(e).__name__, e)
        finally:
            self._ready.set()
            self._loop = None
            loop.close()

    async def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        from .client_internals import internals
        from .connect import connect
        from .inbox import subscribe_inline

        nc = await connect(self.url, timeout=self.connect_timeout,
                           name=f"kvwire-serve-load-{self.replica}")
        try:
            self._wake = wake = asyncio.Event()
            self._fast = internals(nc)  # (None: nats-py's own publish only)
            # (in nats-py's read loop: no task per message)
            await subscribe_inline(nc, self.subject, self._on_msg)
            self._loop = loop
            self._ready.set()
            log.info("sharing load with the other replicas on %s as %s", self.subject,
                     self.replica)
            beat = loop.call_later(self.heartbeat, self._beat, wake)
            try:
                while not self._stop.is_set():
                    await wake.wait()
                    wake.clear()
                    due, self._beat_due = self._beat_due, False
                    # what is queued now, in reports of MAX_OPS (or MAX_KEY_BYTES), then
                    # the heartbeat is rescheduled, however fast the request path pushes
                    left, first = len(self._out), True
                    while left > 0 or (due and first):
                        report = self._report(due and first)
                        first, left = False, left - max(len(report.ops), 1)
                        await self._publish(nc, report)
                    if due:
                        with self.core.lock:
                            self.peers.expire(self.core.clock())
                        beat = loop.call_later(self.heartbeat, self._beat, wake)
            finally:
                beat.cancel()
        finally:
            self._fast = None
            try:
                await asyncio.wait_for(nc.close(), 2)
            except Exception:  # noqa: BLE001 - closing on the way out
                pass

    async def _publish(self, nc: Any, report: Report) -> None:
        data = encode_report(report)
        if report.live is not None and len(data) > nc.max_payload:
            # (tens of thousands of requests in flight here: the heartbeat goes without its
            # reservations; peers still hear this replica, and lost messages stay lost)
            self.counts["heartbeats_cut"] += 1
            data = encode_report(Report(report.replica, report.seq, report.ops))
        try:
            await nc.publish(self.subject, data)
            self.counts["sent"] += 1
        except Exception as e:  # noqa: BLE001 - disconnected: the next heartbeat catches up
            self.counts["send_errors"] += 1
            log.debug("load report not sent: %s", e)

    def _beat(self, wake: asyncio.Event) -> None:
        self._beat_due = True
        wake.set()

    def _report(self, beat: bool) -> Report:
        """What is queued, as one report (in the sharing thread); with ``beat``, this
        replica's live reservations too (own ones that expired here left out)."""
        return self.outbox.report(beat, time.monotonic(), self.core.loads.expiry_s)

    def _command(self, report: Report) -> bytes:
        payload = encode_report(report)
        return b"PUB %s %d\r\n%s\r\n" % (self._subject_b, len(payload), payload)

    def _on_msg(self, msg: Any) -> None:
        try:
            report = decode_report(msg.data)
        except msgspec.DecodeError:
            self.peers.counts["bad"] += 1
            return
        with self.core.lock:
            again = self.peers.receive(report, self.core.clock())
        for op in again:
            self.push(op)
