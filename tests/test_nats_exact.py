"""The per-subject continuity rule of kvwire.nats.exact.Tracker (no I/O), as properties: for
any run of resets, snapshot markers (chunked) and batches, with messages dropped or repeated
anywhere, what the tracker delivers is always continuous per subject, every loss is a Gap,
and a gap resolved from a snapshot object ends exactly at the truth."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.consume.items import Batch, Reset, Snapshot
from kvwire.index.cache import BlockCache
from kvwire.nats import subjects as S
from kvwire.nats.exact import _PER_SUBJECT, BadMessage, Gap, Tracker, decode_snapshot_body
from kvwire.wire.events import BlockRemoved, BlockStored, KVEventBatch, encode_batch

SUBJ = "kvwire.events.e.0"
_enc = msgspec.msgpack.Encoder()


def script(ops: list[tuple[str, int]]) -> tuple[list[tuple[int, dict, bytes]], list[Any]]:
    """Messages as the bridge writes them, and after each one the truth (epoch, seq, blocks)."""
    msgs: list[tuple[int, dict, bytes]] = []
    states: list[Any] = []
    cache, epoch, seq, h = BlockCache(), 0, 0, 1
    live: list[int] = []

    def put(kind: str, body: bytes, **extra: str) -> None:
        hd = {S.H_KIND: kind, S.H_EPOCH: str(epoch), S.H_SEQ: str(seq), **extra}
        msgs.append((len(msgs) + 1, hd, body))
        states.append((epoch, seq, cache.as_dict(), [b.as_event() for b in cache.blocks()]))

    def snapshot(chunks: int) -> None:
        blocks = [b.as_event() for b in cache.blocks()]
        per = max(1, -(-len(blocks) // chunks))
        for i in range(chunks):
            put("snapshot", _enc.encode(blocks[i * per:(i + 1) * per]),
                **{S.H_CHUNK: f"{i}/{chunks}"})

    for op, arg in [("start", 1)] + ops:
        if op == "start":
            epoch, seq, cache, live = epoch + 1, 0, BlockCache(), []
            put("reset", b"", **{S.H_REASON: "engine start"})
            snapshot(arg)
        elif op == "snap":
            snapshot(arg)
        elif op == "cut":
            # A bridge killed inside its marker set (reset + arg % 3 of arg % 3 + 1 chunks),
            # then the next bridge's resync set: the same epoch (a kvwire publisher's), or
            # the next (a reference publisher's incarnation, numbered by the bridges).
            blocks = [b.as_event() for b in cache.blocks()]
            put("reset", b"", **{S.H_REASON: "bridge resync"})
            k = arg % 3
            for i in range(k):
                put("snapshot", _enc.encode(blocks[i::k + 1]), **{S.H_CHUNK: f"{i}/{k + 1}"})
            epoch += arg >= 3
            put("reset", b"", **{S.H_REASON: "bridge resync"})
            snapshot(1 + arg % 2)
        else:
            seq += 1
            evs: list[Any] = [BlockStored([h], None, [h % 97] * 2, 2, None)]
            if live and arg % 3 == 0:
                evs.append(BlockRemoved([live.pop(arg % len(live))], None))
            live.append(h)
            h += 1
            b = KVEventBatch(0.0, evs, 0)
            cache.apply(b)
            put("batch", encode_batch(b))
    return msgs, states


OPS = st.lists(st.one_of(
    st.tuples(st.just("batch"), st.integers(0, 50)),
    st.tuples(st.just("snap"), st.integers(1, 3)),
    st.tuples(st.just("start"), st.integers(1, 3)),
    st.tuples(st.just("cut"), st.integers(0, 5)),
), max_size=40)


def apply(items: list[Any], state: dict[str, Any]) -> None:
    for it in items:
        if type(it) is Reset:
            state["cache"], state["pos"] = BlockCache(), None
        elif type(it) is Snapshot:
            state["cache"] = BlockCache()
            state["cache"].apply_events(it.blocks)
            state["pos"] = (it.epoch, it.seq)
        elif type(it) is Batch:
            assert state["pos"] == (it.epoch, it.seq - 1), (state["pos"], it)
            state["cache"].apply(it.batch)
            state["pos"] = (it.epoch, it.seq)


class Tally:
    """What the tracker handed out, counted from its answers (to check its counters by)."""

    def __init__(self) -> None:
        self.n: Counter[str] = Counter()
        self.events: Counter[str] = Counter()  # per stream

    def add(self, out: Any) -> Any:
        if type(out) is Gap:
            self.n["gaps"] += 1
        elif type(out) is BadMessage:
            self.n["bad_messages"] += 1
        else:
            for it in out:
                if type(it) is Batch:
                    self.n["batches"] += 1
                    self.events[it.stream] += len(it.batch.events)
                elif type(it) is Reset:
                    self.n["resets"] += 1
                else:
                    self.n["snapshots"] += 1
                    self.n["inexact"] += not it.exact
        return out


def check_counts(t: Tracker, tally: Tally, messages: int, resyncs: int) -> None:
    """The tracker's totals are what it handed out, and per subject they add up to them."""
    for k in ("batches", "resets", "snapshots", "inexact", "gaps", "bad_messages"):
        assert t.counts[k] == tally.n[k], (k, t.counts, tally.n)
    assert (t.counts["messages"], t.counts["resyncs"]) == (messages, resyncs)
    for k in _PER_SUBJECT:
        if k != "events":  # (per subject only: checked below)
            assert sum(s.c[k] for s in t.subjects.values()) == t.counts[k], k
    for s in t.subjects.values():
        assert s.c["events"] == tally.events[s.stream]


def picks(data: Any, n: int, most: int, least: int = 0) -> set[int]:
    return data.draw(st.sets(st.integers(0, max(n - 1, 0)), min_size=min(least, n),
                             max_size=most))


@settings(max_examples=150, deadline=None)
@given(OPS, st.data())
def test_continuous_and_exact_after_resync(ops: list[tuple[str, int]], data: Any) -> None:
    msgs, states = script(ops)
    drop, again = picks(data, len(msgs), 6), picks(data, len(msgs), 4)
    t = Tracker()
    tally = Tally()
    state: dict[str, Any] = {"cache": BlockCache(), "pos": None}
    js = 0
    gaps = 0
    for i, (_, hd, body) in enumerate(msgs):
        if i in drop:
            continue
        for _ in range(2 if i in again else 1):  # a repeat outside the dedupe window
            js += 1
            out = tally.add(t.feed(SUBJ, js, hd, body))
            assert type(out) is not BadMessage
            if type(out) is Gap:
                gaps += 1
                # the snapshot object a bridge wrote at this message: covers it
                ep, sq, _, blocks = states[i]
                out = tally.add(t.bootstrap(SUBJ, js, ep, sq, blocks, True, "gap"))
            apply(out, state)
    check_counts(t, tally, js, gaps)
    if not drop:  # each repeat of a batch (its seq already delivered) is one duplicate
        repeats = sum(msgs[i][1][S.H_KIND] == "batch" for i in again)
        assert t.counts["duplicates"] >= repeats
    ep, sq, truth, _ = states[-1]
    if (len(msgs) - 1) not in drop:  # (a dropped last message is a loss nobody can see yet)
        assert state["pos"] == (ep, sq)
        assert state["cache"].as_dict() == truth
    if not drop:
        assert gaps == 0 and t.counts["resyncs"] == 0


@settings(max_examples=100, deadline=None)
@given(OPS, st.data())
def test_every_loss_of_a_batch_is_seen(ops: list[tuple[str, int]], data: Any) -> None:
    """Without resync help (inexact restarts), a dropped batch is never papered over: the
    subject either reports a Gap or a later reset/snapshot marker covers the loss."""
    msgs, states = script(ops)
    drop = picks(data, len(msgs), 6, least=1)
    t = Tracker()
    state: dict[str, Any] = {"cache": BlockCache(), "pos": None}
    lost_since_marker = False
    for i, (js, hd, body) in enumerate(msgs):
        if i in drop:
            lost_since_marker |= hd[S.H_KIND] == "batch"
            continue
        out = t.feed(SUBJ, js, hd, body)
        if type(out) is Gap:
            lost_since_marker = False
            seq = int(hd[S.H_SEQ])
            out = t.inexact(SUBJ, int(hd[S.H_EPOCH]),
                            seq - 1 if hd[S.H_KIND] == "batch" else seq, "gap")
            if hd[S.H_KIND] == "batch":
                out += t.feed(SUBJ, js, hd, body)  # type: ignore[operator]
        elif hd[S.H_KIND] == "snapshot" and any(type(x) is Snapshot for x in out):
            lost_since_marker = False
        elif hd[S.H_KIND] == "batch" and out:
            assert not lost_since_marker, "a batch was delivered over a lost one"
        apply(out, state)


def test_reference_publisher_bootstrap_at_seq_minus_one() -> None:
    """A reference publisher's stream starts inexact before seq 0: markers at seq -1, then
    batches 0, 1, ...: continuous, no gap, one inexact Snapshot."""
    t = Tracker()
    hd = {S.H_EPOCH: "0", S.H_SEQ: "-1"}
    out = t.feed(SUBJ, 1, {**hd, S.H_KIND: "reset", S.H_REASON: "bootstrap"}, b"")
    out += t.feed(SUBJ, 2, {**hd, S.H_KIND: "snapshot", S.H_CHUNK: "0/1", "Kvwire-Exact": "0"},
                  b"\x90")  # type: ignore[operator]
    for seq in range(3):
        b = KVEventBatch(0.0, [BlockStored([seq + 1], None, [1, 2], 2, None)], 0)
        out += t.feed(SUBJ, 3 + seq, {S.H_KIND: "batch", S.H_EPOCH: "0", S.H_SEQ: str(seq)},
                      encode_batch(b))  # type: ignore[operator]
    assert [type(i).__name__ for i in out] == ["Reset", "Snapshot", "Batch", "Batch", "Batch"]
    assert out[1].seq == -1 and not out[1].exact  # type: ignore[union-attr]
    assert t.counts["gaps"] == 0 and t.counts["bad_messages"] == 0 and t.counts["inexact"] == 1


_KEYS = st.sampled_from([S.H_KIND, S.H_EPOCH, S.H_SEQ, S.H_CHUNK, S.H_REASON, "Kvwire-Exact",
                         S.H_FIRST_SEQ])
_VALS = st.one_of(st.sampled_from(["batch", "batches", "reset", "snapshot", "0", "1", "-1",
                                   "2/3", "0/1",
                                   "1/0", "x", ""]), st.text(max_size=8),
                  st.integers(-5, 10**20).map(str))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([SUBJ, "kvwire.events.f.1", "kvwire.events.x",
                                           "other.e.0"]),
                          st.one_of(st.none(), st.dictionaries(_KEYS, _VALS, max_size=6)),
                          st.binary(max_size=40)), max_size=30))
def test_any_input_is_an_answer_never_an_exception(msgs: list[Any]) -> None:
    """Arbitrary headers, bodies and subjects: every message gets deliveries, a Gap or a
    named BadMessage (the last error names it too); nothing raises; the counters are what
    was handed out."""
    t = Tracker()
    tally = Tally()
    unknown = 0  # bad messages on a subject that is not the prefix's (no subject state)
    for js, (subject, hd, body) in enumerate(msgs, 1):
        out = tally.add(t.feed(subject, js, hd, body))
        assert isinstance(out, list | Gap | BadMessage)
        if isinstance(out, BadMessage):
            assert out.reason and out.subject == subject
            assert t.last_error == f"{subject} #{js}: {out.reason}"
            unknown += subject not in t.subjects
    t.counts["bad_messages"] -= unknown  # (counted in the total, not per subject)
    tally.n["bad_messages"] -= unknown
    check_counts(t, tally, len(msgs), 0)


# ------------------------------------------------------------- one rule at a time

def _hd(kind: str, epoch: int, seq: int, **extra: str) -> dict[str, str]:
    return {S.H_KIND: kind, S.H_EPOCH: str(epoch), S.H_SEQ: str(seq), **extra}


def _batch(seq: int, n_events: int = 1) -> bytes:
    return encode_batch(KVEventBatch(0.0, [BlockStored([100 * seq + k], None, [1, 2], 2, None)
                                           for k in range(n_events)], 0))


def _snap(epoch: int, seq: int, chunk: str = "0/1", blocks: list | None = None,
          **extra: str) -> tuple[dict[str, str], bytes]:
    return _hd("snapshot", epoch, seq, **{S.H_CHUNK: chunk}, **extra), _enc.encode(
        blocks if blocks is not None else [BlockStored([seq + 1000], None, [1, 2], 2, None)])


def _names(out: Any) -> list[str]:
    return [type(i).__name__ for i in out] if isinstance(out, list) else [type(out).__name__]


def test_a_snapshot_marker_always_follows_a_reset() -> None:
    """Joined at a snapshot marker: a Reset first (the application starts clean); a marker of
    a new epoch after batches: a Reset of the new run first; a marker of the same run at
    another position: the Snapshot alone; the marker of the position held: a duplicate."""
    t = Tracker()
    hd, body = _snap(1, 4)
    out = t.feed(SUBJ, 1, hd, body)
    assert _names(out) == ["Reset", "Snapshot"]
    assert out[0].reason == "joined at a snapshot marker"  # type: ignore[index,union-attr]
    assert t.feed(SUBJ, 2, _hd("batch", 1, 5), _batch(5))[0].seq == 5  # type: ignore[index]
    hd, body = _snap(1, 5)  # the position held: a repeat
    assert t.feed(SUBJ, 3, hd, body) == [] and t.counts["duplicates"] == 1
    hd, body = _snap(1, 9)  # the same run further on (a resync went past): no Reset
    assert _names(t.feed(SUBJ, 4, hd, body)) == ["Snapshot"]
    hd, body = _snap(2, 0)  # a new epoch's marker after batches of the old one
    out = t.feed(SUBJ, 5, hd, body)
    assert _names(out) == ["Reset", "Snapshot"] and out[1].epoch == 2  # type: ignore[index]
    assert out[0].reason == "snapshot marker of a new run"  # type: ignore[index,union-attr]
    assert t.subjects[SUBJ].c["resets"] == 2 and t.counts["snapshots"] == 3


def _run_body(*seqs: int) -> bytes:
    return msgspec.msgpack.encode([msgspec.Raw(_batch(q, 2)) for q in seqs])


def test_redelivered_and_covered_messages_are_skipped() -> None:
    """A message at or below the last one taken (JetStream redelivers after a reconnect) or
    below a loaded snapshot object is skipped and counted, whatever its kind and whether it
    was delivered, a duplicate or a repeated marker; a message at a new js that repeats
    what was delivered is a duplicate instead (a redundant bridge's)."""
    t = Tracker()
    st_ = t.subjects.setdefault(SUBJ, t.state(SUBJ))
    reset = _hd("reset", 1, -1)  # no reason given: "engine reset"
    run = _hd("batches", 1, 3, **{S.H_FIRST_SEQ: "2"})
    msgs = [(reset, b""), _snap(1, 0), (_hd("batch", 1, 1), _batch(1, 2)),
            (run, _run_body(2, 3)),
            _snap(1, 3),  # the marker of the position held: a duplicate
            (_hd("batch", 1, 2), _batch(2))]  # a batch already delivered: a duplicate
    outs = []
    for js, (h, b) in enumerate(msgs, 1):
        outs.append(t.feed(SUBJ, js, h, b))
        assert t.feed(SUBJ, js, h, b) == [], js  # redelivered at once: skipped
    assert outs[0][0].reason == "engine reset"  # type: ignore[index]
    assert [len(o) for o in outs] == [1, 1, 1, 2, 0, 0]  # type: ignore[arg-type]
    assert t.counts["skipped"] == len(msgs) and t.counts["duplicates"] == 2
    assert (st_.seq, st_.c["batches"], st_.c["events"]) == (3, 3, 6)
    # a run overlapping what was delivered (redundant bridges cut runs differently)
    out = t.feed(SUBJ, 7, _hd("batches", 1, 5, **{S.H_FIRST_SEQ: "2"}), _run_body(2, 3, 4, 5))
    assert [b.seq for b in out] == [4, 5] and t.counts["duplicates"] == 4  # type: ignore
    assert (st_.c["duplicates"], st_.c["batches"], st_.c["events"]) == (4, 5, 10)
    out = t.feed(SUBJ, 8, _hd("batches", 1, 7, **{S.H_FIRST_SEQ: "6"}),
                 msgspec.msgpack.encode([msgspec.Raw(_batch(6)), msgspec.Raw(b"\x07")]))
    assert type(out) is BadMessage and "undecodable batch in run" in out.reason
    gap = t.feed(SUBJ, 9, _hd("batches", 1, 9, **{S.H_FIRST_SEQ: "8"}), _run_body(8, 9))
    assert type(gap) is Gap and "seqs 8..9 after epoch 1 seq 5" in gap.reason
    out = t.bootstrap(SUBJ, 20, 1, 8, [], False, "gap")  # an object covering js <= 20
    assert _names(out) == ["Reset", "Snapshot"] and st_.exact is False
    assert t.feed(SUBJ, 19, _hd("batch", 1, 4), _batch(4)) == []  # covered by the object
    assert t.feed(SUBJ, 20, _hd("batch", 1, 9), _batch(9)) == []
    assert t.feed(SUBJ, 21, _hd("batch", 1, 9), _batch(9))[0].seq == 9  # type: ignore[index]
    assert t.counts["skipped"] == len(msgs) + 2


def test_chunked_snapshots_in_order_only() -> None:
    """Chunks are reassembled in order; a batch inside a chunked snapshot, a chunk without
    the ones before it, and an impossible chunk header each say what went wrong; the lowest
    js of a snapshot being reassembled is where acks must stop."""
    t = Tracker()
    blocks = [BlockStored([i + 1], None, [1, 2], 2, None) for i in range(4)]
    hd0, b0 = _snap(1, 3, "0/2", blocks[:2])
    assert t.feed(SUBJ, 5, hd0, b0) == [] and t.pending_chunks_from() == 5
    t.feed("kvwire.events.f.0", 7, *_snap(1, 3, "0/3"))
    assert t.pending_chunks_from() == 5
    gap = t.feed(SUBJ, 6, _hd("batch", 1, 4), _batch(4))
    assert type(gap) is Gap and gap.reason == "batch inside a chunked snapshot"
    assert t.feed(SUBJ, 8, hd0, b0) == [] and t.counts["duplicates"] == 1  # a repeat
    assert t.feed(SUBJ, 9, hd0, b0) == [] and t.counts["duplicates"] == 2
    hd1, b1 = _snap(1, 3, "1/2", blocks[2:])
    out = t.feed(SUBJ, 10, hd1, b1)
    assert _names(out) == ["Reset", "Snapshot"]
    assert [b.block_hashes for b in out[1].blocks] == [[1], [2], [3], [4]]  # type: ignore
    assert t.pending_chunks_from() == 7  # only the other subject's is left
    gap = t.feed(SUBJ, 11, *_snap(1, 5, "1/2"))
    assert type(gap) is Gap and "without the ones before" in gap.reason
    assert t.subjects[SUBJ].chunk_key is None
    for js, later in ((20, "2/3"), (22, "1/3")):  # a chunk skipped / another snapshot's
        assert t.feed(SUBJ, js, *_snap(1, 6, "0/3")) == []
        gap = t.feed(SUBJ, js + 1, *_snap(1, 6 if later == "2/3" else 7, later))
        assert type(gap) is Gap and "without the ones before" in gap.reason
        assert t.subjects[SUBJ].chunk_key is None and t.subjects[SUBJ].chunks == []
    for bad in ("2/2", "-1/2", "1", "a/b"):
        out = t.feed(SUBJ, 30, *_snap(1, 5, bad))
        assert type(out) is BadMessage and f"{S.H_CHUNK}={bad!r}" in out.reason
    assert t.counts["gaps"] == 4 and t.subjects[SUBJ].c["bad_messages"] == 4


def test_bad_headers_and_bodies_are_named() -> None:
    """Each header a message needs is checked, and the answer names it; an event the
    decoder cannot read is dropped from its batch and counted, the rest delivered."""
    t = Tracker()
    t.feed(SUBJ, 1, *_snap(1, 0))
    for hd, says in [({S.H_KIND: "batchez", S.H_EPOCH: "1", S.H_SEQ: "1"}, "is not one of"),
                     (_hd("batch", 1, -2), "Kvwire-Seq=-2 is below -1"),
                     ({S.H_KIND: "batch", S.H_SEQ: "1"}, "missing header Kvwire-Epoch"),
                     (_hd("batch", 1, 1) | {S.H_EPOCH: "one"}, "is not an integer")]:
        out = t.feed(SUBJ, 2, hd, _batch(1))
        assert type(out) is BadMessage and says in out.reason, (says, out)
    out = t.feed(SUBJ, 2, _hd("batch", 1, 1), b"\xc1")
    assert type(out) is BadMessage and "undecodable batch body" in out.reason
    hd, _ = _snap(1, 4)
    out = t.feed(SUBJ, 3, hd, b"\xc1")  # a snapshot marker that cannot be read
    assert _names(out) == ["Gap"] and t.counts["bad_messages"] == 6
    t = Tracker()
    t.feed(SUBJ, 1, *_snap(1, 0))
    bad = msgspec.msgpack.encode([0.0, [["BlockRemoved", [1]], {"type": "NoSuchEvent"}], 0])
    out = t.feed(SUBJ, 2, _hd("batch", 1, 1), bad)
    assert len(out[0].batch.events) == 1 and t.counts["bad_events"] == 1  # type: ignore
    assert t.last_error is not None and t.last_error.startswith("bad event in batch")
    assert t.subjects[SUBJ].c["events"] == 1


def test_resume_puts_a_restarted_consumer_where_it_acked() -> None:
    """A durable consumer restarted at its last acknowledged message: the next batch
    continues from it, nothing is delivered for the position itself, a redelivery at or
    below it is skipped; after a reset marker it waits for the snapshot marker."""
    t = Tracker()
    t.resume(SUBJ, 40, _hd("batch", 3, 17))
    st_ = t.subjects[SUBJ]
    assert (st_.started, st_.last_js, st_.epoch, st_.seq) == (True, 40, 3, 17)
    assert t.feed(SUBJ, 40, _hd("batch", 3, 17), _batch(17)) == []  # redelivered
    out = t.feed(SUBJ, 41, _hd("batch", 3, 18), _batch(18))
    assert _names(out) == ["Batch"] and out[0].seq == 18  # type: ignore[index]
    t.resume("kvwire.events.f.0", 7, _hd("reset", 2, 5))
    st_ = t.subjects["kvwire.events.f.0"]
    assert st_.seq is None and st_.started and st_.epoch == 2
    gap = t.feed("kvwire.events.f.0", 8, _hd("batch", 2, 6), _batch(6))
    assert type(gap) is Gap and "after a reset marker" in gap.reason
    t.resume("kvwire.events.g.0", 3, {S.H_KIND: "batch", S.H_EPOCH: "x"})  # unreadable
    assert not t.subjects["kvwire.events.g.0"].started
    t.resume("kvwire.events.h.0", 5, _hd("snapshot", 0, -1))  # a reference run's marker
    assert t.subjects["kvwire.events.h.0"].seq == -1
    assert _names(t.feed("kvwire.events.h.0", 6, _hd("batch", 0, 0), _batch(0))) == ["Batch"]


def test_inexact_restart_and_lenient_snapshot_bodies() -> None:
    """``inexact`` without an epoch keeps the subject's; a snapshot body may be a batch
    (its stored blocks are the snapshot); the inexact flag follows the marker's header."""
    t = Tracker()
    t.feed(SUBJ, 1, *_snap(4, 2))
    out = t.inexact(SUBJ, None, 9, "no object")
    assert out[1].epoch == 4 and out[1].seq == 9 and not out[1].exact  # type: ignore
    assert not t.subjects[SUBJ].exact and t.counts["inexact"] == 1
    assert t.subjects[SUBJ].c["inexact"] == 1 and t.subjects[SUBJ].c["snapshots"] == 2
    t2 = Tracker()
    assert t2.inexact(SUBJ, None, 0, "cold")[1].epoch == 0  # type: ignore[union-attr]
    body = encode_batch(KVEventBatch(0.0, [BlockStored([5], None, [1, 2], 2, None),
                                           BlockRemoved([6], None)], 0))
    assert [b.block_hashes for b in decode_snapshot_body(body)] == [[5]]
    out = t.feed(SUBJ, 2, _hd("snapshot", 5, 0, **{S.H_CHUNK: "0/1", "Kvwire-Exact": "no"}),
                 body)
    assert not out[1].exact and t.subjects[SUBJ].exact is False  # type: ignore[index]
    assert t.subjects[SUBJ].c["inexact"] == 2
    out = t.feed(SUBJ, 3, *_snap(6, 0))
    assert out[1].exact and t.subjects[SUBJ].exact is True  # type: ignore[index]
