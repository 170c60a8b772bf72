"""The per-subject continuity rule of kvwire.nats.exact.Tracker (no I/O), as properties: for
any run of resets, snapshot markers (chunked) and batches, with messages dropped or repeated
anywhere, what the tracker delivers is always continuous per subject, every loss is a Gap,
and a gap resolved from a snapshot object ends exactly at the truth."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.consume.cache import BlockCache
from kvwire.consume.items import Batch, Reset, Snapshot
from kvwire.nats import subjects as S
from kvwire.nats.exact import BadMessage, Gap, Tracker
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


def picks(data: Any, n: int, most: int, least: int = 0) -> set[int]:
    return data.draw(st.sets(st.integers(0, max(n - 1, 0)), min_size=min(least, n),
                             max_size=most))


@settings(max_examples=150, deadline=None)
@given(OPS, st.data())
def test_continuous_and_exact_after_resync(ops: list[tuple[str, int]], data: Any) -> None:
    msgs, states = script(ops)
    drop, again = picks(data, len(msgs), 6), picks(data, len(msgs), 4)
    t = Tracker()
    state: dict[str, Any] = {"cache": BlockCache(), "pos": None}
    js = 0
    gaps = 0
    for i, (_, hd, body) in enumerate(msgs):
        if i in drop:
            continue
        for _ in range(2 if i in again else 1):  # a repeat outside the dedupe window
            js += 1
            out = t.feed(SUBJ, js, hd, body)
            assert type(out) is not BadMessage
            if type(out) is Gap:
                gaps += 1
                # the snapshot object a bridge wrote at this message: covers it
                ep, sq, _, blocks = states[i]
                out = t.bootstrap(SUBJ, js, ep, sq, blocks, True, "gap")
            apply(out, state)
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
    named BadMessage; nothing raises."""
    t = Tracker()
    for js, (subject, hd, body) in enumerate(msgs, 1):
        out = t.feed(subject, js, hd, body)
        assert isinstance(out, list | Gap | BadMessage)
        if isinstance(out, BadMessage):
            assert out.reason and out.subject == subject
