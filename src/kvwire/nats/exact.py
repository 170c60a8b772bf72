"""Per-subject exactness of a JetStream consumer: the pure part (no I/O), so it can be tested
with hypothesis like :class:`kvwire.consume.stream.StreamMachine`.

Per subject, a message is accepted only if it continues what was delivered: a batch with the
same epoch and ``seq + 1``, or a run of batches (``batches``, ``first..last``) of the same
epoch with ``first <= seq + 1 <= last`` (only its seqs after ``seq`` are delivered: runs cut
differently by redundant bridges may overlap), or a reset marker, or a (possibly chunked)
snapshot marker. Batches at or below ``seq`` of the same epoch are duplicates, dropped.
Anything else is a :class:`Gap`; the I/O layer (:mod:`kvwire.nats.consumer`) then resyncs
the subject from its latest snapshot object (:meth:`Tracker.bootstrap`) or, when there is
no usable one, declares it inexact (:meth:`Tracker.inexact`). It never silently carries on.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..consume.items import Batch, Delivery, Reset, Snapshot
from ..wire.events import BatchDecoder, BlockStored, DecodeError
from . import subjects as S

__all__ = ["BadMessage", "Gap", "SubjectState", "Tracker", "decode_snapshot_body"]

_PER_SUBJECT = ("batches", "events", "resets", "snapshots", "duplicates", "gaps", "resyncs",
                "inexact", "bad_messages")

_blocks_dec = msgspec.msgpack.Decoder(list[BlockStored])
_run_dec = msgspec.msgpack.Decoder(list[msgspec.Raw])


class Gap(msgspec.Struct, frozen=True):
    """The message at ``js_seq`` does not continue its subject: resync needed."""

    subject: str
    js_seq: int
    reason: str


class BadMessage(msgspec.Struct, frozen=True):
    """A message that cannot be understood (named and counted, then skipped)."""

    subject: str
    js_seq: int
    reason: str


class SubjectState:
    """What one subject (one engine DP rank) has delivered so far."""

    __slots__ = ("subject", "engine", "rank", "stream", "epoch", "seq", "started",
                 "skip_upto", "chunks", "chunk_key", "chunk_first_js", "last_js", "exact", "c")

    def __init__(self, subject: str, engine: str, rank: int) -> None:
        self.subject = subject
        self.engine = engine
        self.rank = rank
        self.stream = S.stream_name(engine, rank)
        self.epoch: int | None = None
        self.seq: int | None = None  # last seq covered; None: waiting for a snapshot marker
        self.started = False  # a Reset was delivered (or the state was resumed)
        self.skip_upto = 0  # js seqs at or below this are covered by a loaded snapshot
        self.chunks: list[bytes] = []
        self.chunk_key: tuple[int, int, int, bool] | None = None  # epoch, seq, n, exact
        self.chunk_first_js = 0
        self.last_js = 0
        self.exact = True
        self.c: dict[str, int] = dict.fromkeys(_PER_SUBJECT, 0)


def decode_snapshot_body(data: bytes, decoder: BatchDecoder | None = None) -> list[BlockStored]:
    """A snapshot marker body: a msgpack list of BlockStored events (or, leniently, a batch)."""
    try:
        return _blocks_dec.decode(data)
    except msgspec.DecodeError:
        pass
    batch = (decoder or BatchDecoder()).decode(data)  # DecodeError if not a batch either
    return [e for e in batch.events if type(e) is BlockStored]


def _int(headers: dict[str, str], name: str, lo: int = 0) -> int:
    v = headers.get(name)
    if v is None:
        raise ValueError(f"missing header {name}")
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"header {name}={v[:40]!r} is not an integer") from None
    if n < lo:
        raise ValueError(f"header {name}={n} is below {lo}")
    return n


def _exact(headers: dict[str, str]) -> bool:
    return headers.get("Kvwire-Exact", "1").strip().lower() not in ("0", "false", "no")


class Tracker:
    """Subject states + the continuity rule. ``feed`` returns deliveries, a Gap or a BadMessage."""

    def __init__(self, prefix: str = S.DEFAULT_PREFIX) -> None:
        self.prefix = prefix
        self.subjects: dict[str, SubjectState] = {}
        self._decoder = BatchDecoder(on_error=self._bad_event)
        self.counts: dict[str, int] = dict.fromkeys(
            ("messages", "batches", "resets", "snapshots", "skipped", "duplicates", "gaps",
             "resyncs", "inexact", "bad_messages", "bad_events"), 0)
        self.last_error: str | None = None

    def _bad_event(self, err: Any) -> None:
        self.counts["bad_events"] += 1
        self.last_error = f"bad event in batch: {err.message}"

    def state(self, subject: str) -> SubjectState:
        st = self.subjects.get(subject)
        if st is None:
            engine, rank = S.parse_subject(self.prefix, subject)
            st = self.subjects[subject] = SubjectState(subject, engine, rank)
        return st

    def pending_chunks_from(self) -> int | None:
        """Lowest js seq of a chunked snapshot still being reassembled (acks stop below it)."""
        firsts = [st.chunk_first_js for st in self.subjects.values() if st.chunk_key]
        return min(firsts) if firsts else None

    # ------------------------------------------------------------------ messages

    def feed(self, subject: str, js_seq: int, headers: dict[str, str] | None,
             data: bytes) -> list[Delivery] | Gap | BadMessage:
        """One message from the consumer, in stream order."""
        self.counts["messages"] += 1
        try:
            st = self.state(subject)
            h = headers or {}
            kind = h.get(S.H_KIND)
            if kind not in S.KINDS:
                raise ValueError(f"header {S.H_KIND}={kind!r} is not one of {S.KINDS}")
            epoch = _int(h, S.H_EPOCH)
            seq = _int(h, S.H_SEQ, -1)
            first = seq
            if kind == "batches":
                first = _int(h, S.H_FIRST_SEQ)
                if first >= seq:
                    raise ValueError(f"run {first}..{seq} covers fewer than two seqs")
        except ValueError as e:
            return self._bad(subject, js_seq, str(e))
        if js_seq <= st.skip_upto or js_seq <= st.last_js:
            self.counts["skipped"] += 1  # covered by a loaded snapshot, or redelivered
            return []
        if kind == "reset":
            st.last_js = js_seq
            return self._reset(st, epoch, h.get(S.H_REASON) or "engine reset")
        if kind == "snapshot":
            return self._snapshot_part(st, js_seq, h, epoch, seq, data)
        if st.chunk_key is not None:
            return self._gap(st, js_seq, "batch inside a chunked snapshot")
        if st.seq is None or epoch != st.epoch or not first <= st.seq + 1 <= seq:
            if st.seq is not None and epoch == st.epoch and seq <= st.seq:
                st.last_js = js_seq
                self.counts["duplicates"] += 1
                st.c["duplicates"] += 1
                return []
            have = (f"epoch {st.epoch} seq {st.seq}" if st.seq is not None else
                    "a reset marker" if st.started else
                    "an unknown position (nothing of it delivered or still stored)")
            what = f"seq {seq}" if first == seq else f"seqs {first}..{seq}"
            return self._gap(st, js_seq, f"batch epoch {epoch} {what} after {have}")
        if kind == "batches":
            return self._run(st, js_seq, epoch, first, seq, data)
        try:
            batch = self._decoder.decode(data)
        except DecodeError as e:
            return self._bad(subject, js_seq, f"undecodable batch body: {e}")
        st.seq = seq
        st.last_js = js_seq
        self.counts["batches"] += 1
        st.c["batches"] += 1
        st.c["events"] += len(batch.events)
        return [Batch(st.stream, seq, batch, epoch)]

    def _run(self, st: SubjectState, js_seq: int, epoch: int, first: int, last: int,
             data: bytes) -> list[Delivery] | BadMessage:
        """A ``batches`` message continuing the subject: its seqs after ``st.seq``."""
        try:
            parts = _run_dec.decode(data)
        except msgspec.DecodeError as e:
            return self._bad(st.subject, js_seq, f"undecodable run body: {e}")
        if len(parts) != last - first + 1:
            return self._bad(st.subject, js_seq, f"run {first}..{last} holds {len(parts)} "
                             "batches")
        start = st.seq + 1 - first  # type: ignore[operator]
        dec = self._decoder.decode
        try:
            batches = [dec(p) for p in parts[start:]]
        except DecodeError as e:
            return self._bad(st.subject, js_seq, f"undecodable batch in run: {e}")
        if start:
            self.counts["duplicates"] += start
            st.c["duplicates"] += start
        st.seq = last
        st.last_js = js_seq
        n = len(batches)
        self.counts["batches"] += n
        st.c["batches"] += n
        st.c["events"] += sum(len(b.events) for b in batches)
        stream = st.stream
        return [Batch(stream, first + start + i, b, epoch) for i, b in enumerate(batches)]

    def _bad(self, subject: str, js_seq: int, reason: str) -> BadMessage:
        self.counts["bad_messages"] += 1
        st = self.subjects.get(subject)
        if st is not None:
            st.c["bad_messages"] += 1
        self.last_error = f"{subject} #{js_seq}: {reason}"
        return BadMessage(subject, js_seq, reason)

    def _gap(self, st: SubjectState, js_seq: int, reason: str) -> Gap:
        self.counts["gaps"] += 1
        st.c["gaps"] += 1
        return Gap(st.subject, js_seq, reason)

    def _reset(self, st: SubjectState, epoch: int, reason: str) -> list[Delivery]:
        st.epoch, st.seq, st.started = epoch, None, True
        st.chunks, st.chunk_key = [], None
        self.counts["resets"] += 1
        st.c["resets"] += 1
        return [Reset(st.stream, reason, epoch)]

    def _snapshot_part(self, st: SubjectState, js_seq: int, h: dict[str, str], epoch: int,
                       seq: int, data: bytes) -> list[Delivery] | Gap | BadMessage:
        raw = h.get(S.H_CHUNK, "0/1")
        try:
            i_s, _, n_s = raw.partition("/")
            i, n = int(i_s), int(n_s)
            if not 0 <= i < n:
                raise ValueError
        except ValueError:
            return self._bad(st.subject, js_seq, f"header {S.H_CHUNK}={raw[:40]!r} is not i/n "
                             "(0 <= i < n)")
        key = (epoch, seq, n, _exact(h))
        if (st.chunk_key is None and st.started and (epoch, seq) == (st.epoch, st.seq)) or (
                st.chunk_key == key and i < len(st.chunks)):
            # A marker for the position already held (a repeat, or the rest of one a resync
            # went past), or a chunk repeated: nothing new.
            st.last_js = js_seq
            self.counts["duplicates"] += 1
            st.c["duplicates"] += 1
            return []
        if i == 0:
            st.chunks, st.chunk_key, st.chunk_first_js = [], key, js_seq
        elif st.chunk_key != key or len(st.chunks) != i:
            st.chunks, st.chunk_key = [], None
            return self._gap(st, js_seq, f"snapshot chunk {i}/{n} without the ones before")
        st.chunks.append(data)
        st.last_js = js_seq
        if i < n - 1:
            return []
        parts, st.chunks, st.chunk_key = st.chunks, [], None
        try:
            blocks: list[BlockStored] = []
            for p in parts:
                blocks.extend(decode_snapshot_body(p, self._decoder))
        except DecodeError as e:
            # The subject's state after this marker is unknown: resync as after a gap.
            self._bad(st.subject, js_seq, f"undecodable snapshot body: {e}")
            return self._gap(st, js_seq, "snapshot marker lost to a bad body")
        out: list[Delivery] = []
        if not st.started or st.epoch != epoch and st.seq is not None:
            # A snapshot always follows a Reset, for the application's sake.
            out += self._reset(st, epoch, "snapshot marker of a new run" if st.started
                               else "joined at a snapshot marker")
        st.epoch, st.seq = epoch, seq
        self.counts["snapshots"] += 1
        st.c["snapshots"] += 1
        exact = key[3]
        if not exact:
            self.counts["inexact"] += 1
            st.c["inexact"] += 1
        st.exact = exact
        out.append(Snapshot(st.stream, seq, blocks, epoch, exact))
        return out

    # ------------------------------------------------------------------ resync

    def bootstrap(self, subject: str, js_seq: int, epoch: int, seq: int,
                  blocks: list[BlockStored], exact: bool, reason: str,
                  resync: bool = True) -> list[Delivery]:
        """Load a snapshot object covering the subject up to ``js_seq``: Reset + Snapshot,
        and later messages at or below ``js_seq`` are skipped."""
        st = self.state(subject)
        out = self._reset(st, epoch, reason)
        st.seq = seq
        st.skip_upto = max(st.skip_upto, js_seq)
        st.last_js = max(st.last_js, js_seq)
        st.exact = exact
        for k in ("snapshots",) + (("resyncs",) if resync else ()) + (
                () if exact else ("inexact",)):
            self.counts[k] += 1
            st.c[k] += 1
        out.append(Snapshot(st.stream, seq, blocks, epoch, exact))
        return out

    def inexact(self, subject: str, epoch: int | None, seq: int, reason: str) -> list[Delivery]:
        """No usable snapshot: Reset + an empty inexact Snapshot at ``seq`` (the next message
        continues from there); the application knows only what follows."""
        st = self.state(subject)
        out = self._reset(st, epoch if epoch is not None else (st.epoch or 0), reason)
        st.seq = seq
        st.exact = False
        for k in ("snapshots", "inexact"):
            self.counts[k] += 1
            st.c[k] += 1
        out.append(Snapshot(st.stream, seq, [], st.epoch, False))
        return out

    def resume(self, subject: str, js_seq: int, headers: dict[str, str] | None) -> None:
        """A durable consumer restarted: the subject's last acknowledged message (``js_seq``,
        its headers) is where the application is. Nothing is delivered for it."""
        st = self.state(subject)
        h = headers or {}
        kind = h.get(S.H_KIND)
        try:
            epoch, seq = _int(h, S.H_EPOCH), _int(h, S.H_SEQ, -1)
        except ValueError:
            return  # a bad message: the first good one after it will be judged on its own
        st.started = True
        st.last_js = js_seq
        st.epoch = epoch
        st.seq = None if kind == "reset" else seq
