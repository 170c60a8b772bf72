"""What the bridge's writer sends on one subject: :class:`Entry` messages (a batch, a run of
batches, a reset marker, a snapshot marker chunk) and the :class:`Lane` that orders them and
holds the subject's acknowledged state (its :class:`~kvwire.index.cache.BlockCache`, the
source of object-store snapshots)."""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec

from ..index.cache import BlockCache
from ..wire.events import BlockStored, KVEventBatch
from .subjects import (
    H_CHUNK,
    H_EPOCH,
    H_FIRST_SEQ,
    H_KIND,
    H_MSG_ID,
    H_REASON,
    H_SEQ,
    msg_id,
    run_msg_id,
)

__all__ = ["H_EXACT", "H_EXPECT", "Entry", "Lane", "apply_entry_effect", "marker_entries",
           "pack_body"]

#: On inexact snapshot markers only ("0"): the Subscriber's Snapshot had exact=False.
H_EXACT = "Kvwire-Exact"
#: JetStream's optimistic-concurrency header: refuse unless the subject's last message has
#: this stream sequence (0: the subject is empty). On every message of a guarded lane.
H_EXPECT = "Nats-Expected-Last-Subject-Sequence"
_EXPECT_LINE = f"{H_EXPECT}: %d\r\n\r\n".encode()

PENDING, ACKED, FAILED = 0, 1, 2
_CHUNK_SLACK = 4096  # headers and protocol overhead under the server's max payload


_event_list = msgspec.msgpack.Encoder()


def pack_body(payloads: list[bytes]) -> bytes:
    """A ``batches`` body: a msgpack array of the encoded batches (header + concatenation)."""
    n = len(payloads)
    head = bytes((0x90 | n,)) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
    return head + b"".join(payloads)


class Entry:
    """One message for a lane: a batch, a run of batches (``batches``), a reset marker or one
    snapshot marker chunk. ``seq`` is the last seq it covers, ``first`` the first. A run a
    guarded lane made keeps its batch entries in ``parts`` (a recovery may split it)."""

    __slots__ = ("lane", "kind", "epoch", "seq", "first", "_mid", "headers", "payload",
                 "effect", "exact", "state", "js_seq", "sent_at", "token", "error", "oversize",
                 "expect", "parts")

    def __init__(self, lane: Lane, kind: str, epoch: int, seq: int, mid: str | None,
                 headers: dict[str, str] | None, payload: bytes, effect: Any,
                 exact: bool = True) -> None:
        self.lane, self.kind, self.epoch, self.seq = lane, kind, epoch, seq
        self.first = seq
        self._mid, self.headers, self.payload, self.effect = mid, headers, payload, effect
        self.exact = exact
        self.state = PENDING
        self.js_seq: int | None = None
        self.sent_at = 0.0
        self.token = ""
        self.error = ""
        self.oversize = False
        self.expect: int | None = None  # guarded lanes: the subject's last stream seq
        self.parts: list[Entry] | None = None

    @property
    def msg_id(self) -> str:
        """``Nats-Msg-Id`` (a batch's is made when asked: most are only ever sent)."""
        if self._mid is None:
            ln = self.lane
            self._mid = msg_id(ln.engine, ln.rank, self.epoch, self.seq)
        return self._mid

    def raw_headers(self) -> bytes:
        """The NATS/1.0 header block (values are one line: see :func:`_header_text`)."""
        if self.kind == "batch":
            h = _BATCH_HDR % (self.epoch, self.seq, self.msg_id.encode())
        elif self.kind == "batches":
            h = _RUN_HDR % (self.epoch, self.first, self.seq, self.msg_id.encode())
        else:
            h = b"NATS/1.0\r\n" + b"".join(
                b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in self.header_dict().items()
            ) + b"\r\n"
        if self.expect is not None:
            h = h[:-2] + _EXPECT_LINE % self.expect
        return h

    def send_headers(self) -> dict[str, str]:
        """The headers as a dict, with the guard (nats-py's own ``publish`` path)."""
        h = dict(self.header_dict())
        if self.expect is not None:
            h[H_EXPECT] = str(self.expect)
        return h

    def header_dict(self) -> dict[str, str]:
        if self.headers is None:  # a batch or a run: its headers are made when needed
            self.headers = {H_KIND: self.kind, H_EPOCH: str(self.epoch), H_SEQ: str(self.seq),
                            H_MSG_ID: self.msg_id}
            if self.kind == "batches":
                self.headers[H_FIRST_SEQ] = str(self.first)
        return self.headers


_BATCH_HDR = (f"NATS/1.0\r\n{H_KIND}: batch\r\n{H_EPOCH}: %d\r\n{H_SEQ}: %d\r\n"
              f"{H_MSG_ID}: %s\r\n\r\n").encode()
_RUN_HDR = (f"NATS/1.0\r\n{H_KIND}: batches\r\n{H_EPOCH}: %d\r\n{H_FIRST_SEQ}: %d\r\n"
            f"{H_SEQ}: %d\r\n{H_MSG_ID}: %s\r\n\r\n").encode()


def apply_entry_effect(cache: BlockCache, kind: str, effect: Any) -> None:
    """What a message does to the subject's state: batch applies, reset clears, a snapshot
    chunk stores its blocks (after the reset that precedes it)."""
    if kind == "batch":
        cache.apply(effect)
    elif kind == "batches":
        for b in effect:
            cache.apply(b)
    elif kind == "reset":
        cache.clear()
    elif effect:
        cache.apply_events(effect)


class Lane:
    """One subject: what is in flight (send order), what waits, and the acked state."""

    def __init__(self, subject: str, engine: str, rank: int) -> None:
        self.subject, self.engine, self.rank = subject, engine, rank
        self.subject_b = subject.encode()
        self.pending: deque[Entry] = deque()
        self.held: deque[Entry] = deque()
        self.recovering = False
        self.cut = False  # the connection broke with messages of this lane in flight
        self.cache = BlockCache()
        self.exact = True
        self.last: tuple[int, int] | None = None  # (epoch, seq) of the last acked message
        self.last_js_seq: int | None = None
        self.dirty = False  # acked messages since the last object-store snapshot
        self.snapshot_js_seq: int | None = None  # js_seq of the last snapshot written
        # Guarded lanes (pack > 1): the subject's last stream seq as far as this writer knows
        # (0: empty; None: unknown, read it before sending), the epochs this lane has
        # written or taken over, and "a message is being handed to the connection".
        self.expect: int | None = None
        # (kind, epoch, seq) of the subject's last message when another writer wrote it
        # (None: it is ours, or unknown): held entries it covers are never sent.
        self.pos: tuple[str, int, int] | None = None
        self.epochs: set[int] = set()
        self.busy = False

    def batch_entry(self, epoch: int, seq: int, batch: KVEventBatch, payload: bytes) -> Entry:
        return Entry(self, "batch", epoch, seq, None, None, payload, batch)

    def run_entry(self, epoch: int, first: int, batches: list[KVEventBatch],
                  payloads: list[bytes]) -> Entry:
        """Consecutive batches ``first..`` of one epoch as one message (one: a ``batch``)."""
        if len(batches) == 1:
            return self.batch_entry(epoch, first, batches[0], payloads[0])
        last = first + len(batches) - 1
        e = Entry(self, "batches", epoch, last,
                  run_msg_id(self.engine, self.rank, epoch, first, last), None,
                  pack_body(payloads), batches)
        e.first = first
        return e

    def next_message(self, pack: int, max_bytes: int) -> Entry:
        """Take the next message off ``held``: a marker alone, or up to ``pack`` consecutive
        batches of one epoch (at most ``max_bytes`` of payload) as one run."""
        held = self.held
        e = held.popleft()
        if pack < 2 or e.kind != "batch":
            return e
        parts = [e]
        size = len(e.payload)
        while held and len(parts) < pack:
            x = held[0]
            if (x.kind != "batch" or x.epoch != e.epoch or x.seq != parts[-1].seq + 1
                    or size + len(x.payload) > max_bytes):
                break
            parts.append(held.popleft())
            size += len(x.payload)
        if len(parts) == 1:
            return e
        run = self.run_entry(e.epoch, e.seq, [p.effect for p in parts],
                             [p.payload for p in parts])
        run.parts = parts
        return run


def marker_entries(lane: Lane, epoch: int, seq: int, events: list[BlockStored], exact: bool,
                   reason: str, max_payload: int) -> list[Entry]:
    """A reset marker and the snapshot marker chunks of state ``events`` at ``(epoch, seq)``."""
    mid = msg_id(lane.engine, lane.rank, epoch, seq, "reset")
    base = {H_EPOCH: str(epoch), H_SEQ: str(seq)}
    out = [Entry(lane, "reset", epoch, seq, mid,
                 {H_KIND: "reset", **base, H_REASON: _header_text(reason), H_MSG_ID: mid},
                 b"", None, exact)]
    chunks = _chunks(events, max(1024, max_payload - _CHUNK_SLACK))
    for i, (evs, body) in enumerate(chunks):
        cid = msg_id(lane.engine, lane.rank, epoch, seq, "snapshot", i)
        h = {H_KIND: "snapshot", **base, H_CHUNK: f"{i}/{len(chunks)}", H_MSG_ID: cid}
        if not exact:
            h[H_EXACT] = "0"
        out.append(Entry(lane, "snapshot", epoch, seq, cid, h, body, evs, exact))
    return out


def _header_text(text: str) -> str:
    return " ".join(text.split())[:400]  # one line: a header value cannot hold CR/LF


def _chunks(events: list[BlockStored], limit: int) -> list[tuple[list[BlockStored], bytes]]:
    """Events cut into msgpack lists of at most ``limit`` bytes (an event too big alone is
    split into sub-chains); always at least one chunk (an empty state is ``[]``)."""
    enc = _event_list.encode
    out: list[tuple[list[BlockStored], bytes]] = []
    cur: list[BlockStored] = []
    size = 1
    todo = list(reversed(events))
    while todo:
        ev = todo.pop()
        n = len(enc(ev))
        if n + 8 > limit and len(ev.block_hashes) > 1:
            half = len(ev.block_hashes) // 2
            bs = ev.block_size
            a = msgspec.structs.replace(ev, block_hashes=ev.block_hashes[:half],
                                        token_ids=ev.token_ids[:half * bs], extra_keys=None,
                                        lookahead_token_ids=None)
            b = msgspec.structs.replace(ev, block_hashes=ev.block_hashes[half:],
                                        parent_block_hash=ev.block_hashes[half - 1],
                                        token_ids=ev.token_ids[half * bs:], extra_keys=None,
                                        lookahead_token_ids=None)
            todo += [b, a]
            continue
        if cur and size + n + 8 > limit:
            out.append((cur, enc(cur)))
            cur, size = [], 1
        cur.append(ev)
        size += n
    out.append((cur, enc(cur)))
    return out
