"""Reading kvwire's exact streams back from NATS JetStream (the reader side).

:class:`NatsSource` (asyncio) pulls a JetStream consumer over ``<prefix>.>`` (or a narrower
filter) and turns messages into the same items a ZeroMQ :class:`~kvwire.consume.Subscriber`
delivers (``Batch``, ``Reset``, ``Snapshot``), named ``engine/dpR``. Per subject the
:class:`~kvwire.nats.exact.Tracker` accepts only what continues the subject; a gap (history
discarded by retention, a consumer started past it) resyncs that subject from its latest
snapshot object: Reset + Snapshot, and the subject's messages up to the snapshot's
``js_seq`` are skipped. Without a usable snapshot the subject restarts inexact
(``Snapshot(exact=False)``, counted as ``inexact``).

* ephemeral (``durable=None``): bootstraps: per subject, read the snapshot; consume from the
  lowest ``js_seq + 1`` over the filter (the stream's first message if a subject has none).
* durable: a named consumer that survives this process. It resumes after what it acked;
  items are acked once the application comes back for more (it is done with them), or on
  :meth:`commit`. On resume, each subject's last acknowledged message is read back (one
  direct-get batch, ``multi_last`` up to the ack floor) so continuity is still checked.

Flow control: messages are fetched only while fewer than ``max_pending`` items wait for the
application. The NATS client reconnects by itself; after any consumer error the consumer is
repositioned (reset to the next sequence needed, or re-created), never silently skipped.
:class:`kvwire.nats.link.NatsLink` runs a source on a background thread for
:class:`~kvwire.consume.Subscriber`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .._moved import moved
from ..consume.items import Delivery
from . import subjects as S
from .client_internals import internals
from .connect import connect as connect_nats
from .exact import BadMessage, Gap, Tracker
from .inbox import subscribe_inline
from .stats import NatsStats

if TYPE_CHECKING:
    from .streams import NatsStreams

__all__ = ["NatsSource", "NatsStats"]

# ``NatsStreams`` was importable from here; its home is kvwire.nats.streams (which opens the
# link that runs this reader, so this module cannot import it back).
__getattr__ = moved(__name__, "kvwire.nats.streams", ["NatsStreams"])

log = logging.getLogger("kvwire.nats.consumer")

#: An item for the application (or None: a message that produced none) and the stream
#: sequence that may be acknowledged once the application is done with it.
Handout = tuple[Delivery | None, int]


def _hdrs(msg: Any) -> dict[str, str]:
    return msg.headers or {}


_HDR_NAME = re.compile(rb"[!-9;-~]+")  # printable ASCII, no ':' and no whitespace


def _header_lines(raw: bytes) -> dict[str, str]:
    """nats-py's ``Client._parse_header_lines``, about 5x cheaper: it tests every character
    of every name with a Python generator (most of a consumer's CPU per message). Same
    result for names of printable ASCII (all JetStream and kvwire headers); a name with
    control characters is dropped here, as nats-py drops names with spaces."""
    out: dict[str, str] = {}
    for line in raw.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep:
            name = name.strip()
            if _HDR_NAME.fullmatch(name):
                out[name.decode()] = value.strip().decode("utf-8", "replace")
    return out


def _stream_seq(reply: str) -> int:
    """The stream sequence in a JetStream ack subject: ``$JS.ACK.<stream>.<consumer>.
    <delivered>.<sseq>...`` (9 tokens) or with domain and account hash (12+ tokens)."""
    t = reply.split(".")
    return int(t[5] if len(t) == 9 else t[7])


#: How long one try at the first connection lasts (then: a log line, a look at stop, again).
CONNECT_TRY = 3.0
#: Setting up the consumer (the stream may not exist yet: a router started before its
#: bridge) is tried this often (s), and said at WARNING at most once this often (s).
SETUP_RETRY = 0.5
SETUP_LOG_EVERY = 30.0

#: A pull request's lifetime: the server ends it with a 408 status after this long.
_EXPIRES_NS = 1_000_000_000


class NatsSource:
    """The asyncio consumer. ``run(put)`` loops until :meth:`stop`; ``put(entries)`` hands
    items on (and may wait: that is the flow control); ``done_js`` is how far the
    application is done (acks never pass it)."""

    def __init__(self, spec: NatsStreams) -> None:
        try:
            import nats  # noqa: F401 - said here, not in the background thread
        except ImportError:
            raise ImportError("NATS streams need nats-py: pip install 'kvwire[nats]'") from None
        for part in spec.prefix.split("."):
            S.check_token(part, "subject prefix part")
        if spec.durable is not None:
            S.check_token(spec.durable, "durable consumer name")
        if spec.max_pending < 1 or spec.fetch < 1:
            raise ValueError("max_pending and fetch must be >= 1")
        self.spec = spec
        self.tracker = Tracker(spec.prefix)
        self.done_js = 0  # set by the application side
        self.nc: Any = None
        self.js: Any = None
        self.psub: Any = None
        self.consumer = spec.durable
        self.next_js = 1  # the next stream sequence this source needs
        self.acked_js = 0
        self._unacked: deque[tuple[int, Any]] = deque()  # (js_seq, msg) of acked-later msgs
        self._stop = asyncio.Event()
        self.connected = False
        self.c = dict.fromkeys(
            ("reconnects", "repositions", "acked", "unverified_resumes", "caught_up",
             "setup_failures"), 0)
        self.last_error: str | None = None
        self._lost = False
        self._msgs: deque[Any] = deque()
        self._arrived = asyncio.Event()
        self._want = 0  # messages asked for and not yet arrived (or ended by a status)
        self._asked = 0.0
        self._inbox = ""
        self._first_seq = 1
        self._direct = False

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> NatsStats:
        t = self.tracker.counts
        return NatsStats(self.connected, **t, **self.c,
                         last_error=self.last_error or self.tracker.last_error)

    async def _connect(self) -> None:
        async def disconnected() -> None:
            self.connected = False

        async def reconnected() -> None:
            self.connected = True
            self.c["reconnects"] += 1
            self._lost = True  # what the server sent meanwhile may be lost: reposition

        async def error(e: Exception) -> None:
            self.last_error = f"nats: {e}"

        while not self._stop.is_set():
            try:
                # (bounded: nats-py alone retries a first connect for ever, and never
                # looks at the stop flag meanwhile)
                self.nc = await connect_nats(
                    self.spec.url, timeout=CONNECT_TRY, warn=False,
                    disconnected_cb=disconnected, reconnected_cb=reconnected,
                    error_cb=error, name="kvwire-consumer")
                self.js = self.nc.jetstream(timeout=5)
                fast = internals(self.nc)
                if fast is not None:
                    fast.use_header_parser(_header_lines)
                self.connected = True
                return
            except Exception as e:  # server not up yet: keep trying, one line per try
                self.last_error = str(e)
                log.warning("%s", self.last_error)
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self.psub is not None:
            with contextlib.suppress(Exception):
                await self.psub.unsubscribe()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 5)
        self.connected = False

    # ------------------------------------------------------------------ set-up

    async def _snapshot(self, engine: str, rank: int) -> Any:
        from .snapshots import read_snapshot

        try:
            return await read_snapshot(self.js, engine, rank, self.spec.snapshot_bucket)
        except Exception as e:  # an unreadable snapshot is as good as none: say so
            self.last_error = f"snapshot {engine}.{rank} unusable: {e}"
            log.warning("%s", self.last_error)
            return None

    async def _subjects(self) -> list[str]:
        info = await self.js.stream_info(self.spec.stream, subjects_filter=self.spec.filter)
        self._first_seq = info.state.first_seq or 1
        self._direct = bool(getattr(info.config, "allow_direct", False))
        return sorted((info.state.subjects or {}).keys())

    async def _bootstrap(self, put: Callable[[list[Handout]], Awaitable[None]]) -> int:
        """Fresh consumer: per subject read the snapshot; the sequence to start from.

        With direct gets (``allow_direct``) the consumer starts after the newest snapshot
        and each subject first catches up on its own messages since its snapshot (or its
        first message), so no other subject's history is read just to be skipped; without,
        it starts at the oldest point needed and skips what the snapshots cover."""
        entries: list[Handout] = []
        starts: dict[str, int] = {}
        for subject in await self._subjects():
            try:
                engine, rank = S.parse_subject(self.spec.prefix, subject)
            except ValueError:
                continue  # not the layout: counted (and named) when its messages are read
            snap = await self._snapshot(engine, rank)
            if snap is None:
                starts[subject] = self._first_seq
                continue
            out = self.tracker.bootstrap(subject, snap.js_seq, snap.epoch, snap.seq,
                                         snap.blocks, snap.exact, "bootstrap from snapshot",
                                         resync=False)
            entries += [(d, 0) for d in out]
            starts[subject] = snap.js_seq + 1
        if not starts:
            return self._first_seq
        start = min(starts.values())
        if self._direct and len(starts) > 1:
            start = max(starts.values())
            for subject, first in starts.items():
                if first < start:
                    entries += await self._catch_up(subject, first, start - 1)
        if entries:
            await put(entries)
        return start

    async def _catch_up(self, subject: str, first: int, last: int) -> list[Handout]:
        """The subject's messages with stream sequence in [first, last] (direct get batches),
        through the tracker like consumed ones."""
        out: list[Handout] = []
        seq = first
        inbox = self.nc.new_inbox()
        got: list[Any] = []
        ended = asyncio.Event()

        async def on_msg(m: Any) -> None:  # only queues: one batch is handled at its end
            got.append(m)
            if m.headers and m.headers.get("Status"):  # 204 end of batch, 404 nothing more
                ended.set()

        sub = await self.nc.subscribe(inbox, cb=on_msg)
        try:
            while seq <= last:
                got.clear()
                ended.clear()
                req = json.dumps({"seq": seq, "next_by_subj": subject, "batch": 1000}).encode()
                await self.nc.publish(f"$JS.API.DIRECT.GET.{self.spec.stream}", req,
                                      reply=inbox)
                await asyncio.wait_for(ended.wait(), 10)
                data = [m for m in got if not m.headers.get("Status")]
                for m in data:
                    h = m.headers
                    js_seq = int(h["Nats-Sequence"])
                    seq = js_seq + 1
                    if js_seq > last:
                        break  # (the rest: the consumer delivers those)
                    res = self.tracker.feed(subject, js_seq, h, m.data)
                    if type(res) is Gap:
                        res = await self._resync(res, m)
                    elif type(res) is BadMessage:
                        res = []
                    out += [(d, 0) for d in res]
                if not data:
                    break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self.c["caught_up"] += 1
        return out

    async def _resume(self, ack_floor: int) -> None:
        """Durable restart: each subject's last message at or below the ack floor."""
        if ack_floor <= 0:
            return
        req = json.dumps({"multi_last": [self.spec.filter], "up_to_seq": ack_floor,
                          "batch": 100_000}).encode()
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        n = 0
        try:
            await self.nc.publish(f"$JS.API.DIRECT.GET.{self.spec.stream}", req, reply=inbox)
            while True:
                m = await sub.next_msg(timeout=5)
                h = _hdrs(m)
                status = h.get("Status")
                if status in ("204", "404"):  # end of the batch / nothing at or below
                    break
                if status or not h.get("Nats-Sequence"):
                    raise RuntimeError(f"direct get answered {status} {h.get('Description')}")
                with contextlib.suppress(ValueError):
                    self.tracker.resume(h["Nats-Subject"], int(h["Nats-Sequence"]), h)
                    n += 1
        except Exception as e:  # e.g. no allow_direct on the stream
            # Where each subject stood is unknown: its next message is a gap (a resync from
            # its snapshot, or inexact), never taken on trust.
            self.c["unverified_resumes"] += 1
            self.last_error = (f"durable resume: cannot read each subject's last acknowledged "
                               f"message ({type(e).__name__}: {e}); subjects will resync")
            log.warning("%s", self.last_error)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if n == 0 and not self.c["unverified_resumes"]:
            log.info("durable %s: no message at or below ack floor %d", self.consumer, ack_floor)

    def _config(self, start: int) -> Any:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        spec = self.spec
        cfg = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(start, 1),
            filter_subject=spec.filter, max_ack_pending=-1)
        if spec.durable is not None:
            cfg.name = cfg.durable_name = spec.durable
            cfg.ack_policy, cfg.ack_wait = AckPolicy.ALL, spec.ack_wait
            cfg.max_ack_pending = spec.max_pending + 2 * spec.fetch
        else:
            cfg.ack_policy, cfg.inactive_threshold, cfg.mem_storage = AckPolicy.NONE, 120.0, True
        return cfg

    async def _create(self, start: int) -> None:
        info = await self.js.add_consumer(self.spec.stream, config=self._config(start))
        self.consumer = info.name
        self._want = 0

    async def _setup(self, put: Callable[[list[Handout]], Awaitable[None]]) -> None:
        from nats.js.errors import NotFoundError

        spec = self.spec
        await self._open_inbox()
        if spec.durable is not None:
            try:
                info = await self.js.consumer_info(spec.stream, spec.durable)
            except NotFoundError:
                info = None
            floor = info.ack_floor.stream_seq if info is not None and info.ack_floor else 0
            if info is not None and floor == 0:
                # Never acknowledged: nothing the application did is recorded; start afresh.
                await self.js.delete_consumer(spec.stream, spec.durable)
            elif info is not None:
                # Deliver again from the ack floor (what was delivered to a dead process but
                # not acked would otherwise come back only after ack_wait, out of order).
                self.acked_js = floor
                self.next_js = floor + 1
                await self.js.reset_consumer(spec.stream, spec.durable, seq=floor + 1)
                await self._resume(floor)
                self.consumer = spec.durable
                return
        start = await self._bootstrap(put)
        self.next_js = start
        await self._create(start)

    async def _open_inbox(self) -> None:
        """One inbox receives every pull request's messages; the callback only queues them
        (in the read loop: no task of nats-py's between a message and :meth:`run`)."""
        self._inbox = self.nc.new_inbox()
        msgs, arrived = self._msgs, self._arrived

        def on_msg(m: Any) -> None:  # in nats-py's read loop (kvwire.nats.inbox)
            msgs.append(m)
            arrived.set()

        self.psub = await subscribe_inline(self.nc, self._inbox, on_msg, pending_msgs_limit=-1,
                                           pending_bytes_limit=-1)

    async def _pull(self) -> None:
        """Ask for the next ``fetch`` messages (they arrive in stream order on the inbox)."""
        req = json.dumps({"batch": self.spec.fetch, "expires": _EXPIRES_NS}).encode()
        await self.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{self.spec.stream}.{self.consumer}",
                              req, reply=self._inbox)
        self._want += self.spec.fetch
        self._asked = time.monotonic()

    async def _reposition(self, why: str) -> None:
        """After an error: make the consumer deliver from the next sequence we need."""
        from nats.js.errors import NotFoundError

        self.c["repositions"] += 1
        self.last_error = f"repositioning consumer: {why}"
        log.warning("%s", self.last_error)
        seq = self.acked_js + 1 if self.spec.durable else self.next_js
        self._want = 0  # requests made before are void
        try:
            # (asked first: CONSUMER.RESET of a missing consumer times out, no 404, on 2.15)
            await self.js.consumer_info(self.spec.stream, self.consumer)
            await self.js.reset_consumer(self.spec.stream, self.consumer, seq=max(seq, 1))
            return
        except NotFoundError:
            pass
        # The consumer is gone (an ephemeral after a server restart, or deleted): re-create
        # it at that sequence. Messages already seen are skipped by the tracker.
        await self._create(seq)

    # ------------------------------------------------------------------ main loop

    async def run(self, put: Callable[[list[Handout]], Awaitable[None]],
                  room: Callable[[], bool], wait_room: Callable[[], Awaitable[None]]) -> None:
        """Consume until :meth:`stop`. ``room()`` says whether to ask for more now."""
        await self._connect()
        c, next_log = self.c, 0.0
        while not self._stop.is_set():
            try:
                await self._setup(put)
                if c["setup_failures"]:
                    log.info("consumer on %s set up after %d failed attempts",
                             self.spec.stream, c["setup_failures"])
                break
            except Exception as e:  # stream missing yet, server restarting: retry
                self.last_error = f"cannot set up consumer on {self.spec.stream}: {e}"
                c["setup_failures"] += 1
                now = time.monotonic()
                if now >= next_log:  # (a router started before its bridge: no log flood)
                    log.warning("%s (retrying every %g s, %d failed so far; said again "
                                "after %g s if it still fails)", self.last_error, SETUP_RETRY,
                                c["setup_failures"], SETUP_LOG_EVERY)
                    next_log = now + SETUP_LOG_EVERY
                await asyncio.sleep(SETUP_RETRY)
        msgs, arrived = self._msgs, self._arrived
        half = max(1, self.spec.fetch // 2)
        while not self._stop.is_set():
            if self._lost:
                self._lost = False
                try:
                    await self._reposition(self.last_error or "connection lost")
                except Exception as e:  # noqa: BLE001 - retried on the next error
                    self.last_error = f"reposition failed: {type(e).__name__}: {e}"
                    log.warning("%s", self.last_error)
                    self._lost = True
                    await asyncio.sleep(0.25)
                    continue
            await self._ack()
            if self._want < half and self.connected:
                if room():
                    try:
                        await self._pull()
                    except Exception as e:  # noqa: BLE001 - disconnected: the flag follows
                        self.last_error = f"pull request failed: {e}"
                elif not msgs:
                    await wait_room()
                    continue
            if not msgs:
                arrived.clear()
                try:
                    await asyncio.wait_for(arrived.wait(), 0.25)
                except asyncio.TimeoutError:
                    if self._want and time.monotonic() - self._asked > _EXPIRES_NS / 1e9 + 2:
                        # The request's end never came (a reconnect, or no consumer any
                        # more): ask again, after checking the consumer is still there.
                        self._want = 0
                        await self._check_consumer()
                continue
            batch = list(msgs)
            msgs.clear()
            entries = await self._process(batch)
            if entries:
                await put(entries)

    async def _process(self, msgs: list[Any]) -> list[Handout]:
        out: list[Handout] = []
        tracker = self.tracker
        for m in msgs:
            if not m.reply:  # a status: the end of a request, or the consumer is gone
                self._status(m)
                continue
            self._want -= 1
            js_seq = _stream_seq(m.reply)
            if js_seq < self.next_js and self.spec.durable is None:
                continue  # delivered again after a reposition
            res = tracker.feed(m.subject, js_seq, _hdrs(m), m.data)
            if type(res) is Gap:
                res = await self._resync(res, m)
            elif type(res) is BadMessage:
                log.warning("bad message: %s", tracker.last_error)
                res = []
            if self.spec.durable is not None:
                self._unacked.append((js_seq, m))
            if res:
                # A message counts as done with its last item: the items before it (a run's
                # batches, a Reset before its Snapshot) only finish the messages before.
                out += [(d, js_seq - 1) for d in res[:-1]]
                out.append((res[-1], js_seq))
            else:
                out.append((None, js_seq))
            self.next_js = max(self.next_js, js_seq + 1)
        return out

    async def _check_consumer(self) -> None:
        from nats.js.errors import NotFoundError

        try:
            await self.js.consumer_info(self.spec.stream, self.consumer)
        except NotFoundError:
            self.last_error = f"consumer {self.consumer} is gone"
            self._lost = True
        except Exception as e:  # noqa: BLE001 - disconnected etc.: the next round retries
            self.last_error = f"consumer check failed: {e}"

    def _status(self, m: Any) -> None:
        h = m.headers or {}
        code = h.get("Status", "")
        if code in ("408", "404", "409"):
            left = S.header_int(h.get("Nats-Pending-Messages"))
            self._want = max(0, self._want - left) if left is not None else 0
        desc = str(h.get("Description", "")).lower()
        if code == "503" or ("consumer" in desc and ("deleted" in desc or "not found" in desc)):
            # No consumer answers (503: no responders) or it was deleted under us: re-create
            # it where we are.
            self.last_error = f"pull answered {code} {desc}"
            self._lost = True

    async def _resync(self, gap: Gap, m: Any) -> list[Delivery]:
        """A gap on one subject: its snapshot object if it reaches this far, else inexact."""
        st = self.tracker.state(gap.subject)
        h = _hdrs(m)
        log.warning("gap on %s at #%d: %s", gap.subject, gap.js_seq, gap.reason)
        snap = await self._snapshot(st.engine, st.rank)
        reason = f"gap: {gap.reason}"
        if snap is not None and snap.js_seq >= gap.js_seq:
            return self.tracker.bootstrap(gap.subject, snap.js_seq, snap.epoch, snap.seq,
                                          snap.blocks, snap.exact, reason + "; resync")
        epoch = S.header_int(h.get(S.H_EPOCH))
        seq = S.header_int(h.get(S.H_SEQ)) or 0
        kind = h.get(S.H_KIND)
        first = (S.header_int(h.get(S.H_FIRST_SEQ)) or 0) if kind == "batches" else seq
        if kind == "batches":
            kind = "batch"  # (a run is judged by its first seq here)
        if snap is not None and kind == "batch" and epoch == snap.epoch and (
                first <= snap.seq + 1 <= seq):
            # An older snapshot still continues here (nothing of this subject in between).
            out = self.tracker.bootstrap(gap.subject, snap.js_seq, snap.epoch, snap.seq,
                                         snap.blocks, snap.exact, reason + "; resync")
            res = self.tracker.feed(gap.subject, gap.js_seq, h, m.data)
            return out + (res if isinstance(res, list) else [])
        why = reason + ("; no snapshot" if snap is None else
                        f"; snapshot at #{snap.js_seq} is older") + ": contents before unknown"
        self.last_error = f"{gap.subject}: {why}"
        if kind == "batch":
            res2 = self.tracker.inexact(gap.subject, epoch, first - 1, why)
            res = self.tracker.feed(gap.subject, gap.js_seq, h, m.data)
            return res2 + (res if isinstance(res, list) else [])
        return self.tracker.inexact(gap.subject, epoch, seq, why)

    async def _ack(self, sync: bool = False) -> None:
        """AckAll up to what the application is done with (never inside a snapshot that
        is still being reassembled)."""
        if self.spec.durable is None or not self._unacked:
            return
        limit = self.done_js
        pending = self.tracker.pending_chunks_from()
        if pending is not None:
            limit = min(limit, pending - 1)
        last = None
        q = self._unacked
        while q and q[0][0] <= limit:
            last = q.popleft()
        if last is None:
            return
        try:
            if sync:
                await last[1].ack_sync(timeout=5)
            else:
                await last[1].ack()
            self.acked_js = last[0]
            self.c["acked"] += 1
        except Exception as e:  # the ack is lost: the server redelivers, the tracker skips
            self.last_error = f"ack failed: {e}"

    async def commit(self) -> None:
        """Ack everything the application is done with and wait for the server to confirm."""
        await self._ack(sync=True)
