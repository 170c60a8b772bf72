"""Packed runs (``kvwire bridge --pack N``), the pure part: the ``batches`` layout and the
continuity rule of kvwire.nats.exact.Tracker for runs, as properties (no I/O).

Two redundant packing bridges cut the same engine stream into different runs; their
messages interleave on the subject (each bridge's in its own order, a run written by both
stored once). Whatever the cuts and interleaving, a consumer delivers every seq exactly once,
in order, and ends at the engine's state; a lost run is a Gap, never papered over."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvwire.consume.items import Batch, Reset, Snapshot
from kvwire.index.cache import BlockCache
from kvwire.nats import subjects as S
from kvwire.nats.bridge import last_batch_body
from kvwire.nats.exact import BadMessage, Gap, Tracker
from kvwire.nats.writer import Lane, pack_body
from kvwire.wire.events import BlockRemoved, BlockStored, KVEventBatch, encode_batch

SUBJ = "kvwire.events.e.0"
N = 60  # engine batches per example


def engine(n: int = N) -> tuple[list[KVEventBatch], list[bytes], list[dict[str, Any]]]:
    """Batches 0..n-1 of one epoch, their encodings, and the state after each."""
    batches, bodies, states = [], [], []
    cache = BlockCache()
    for i in range(n):
        evs: list[Any] = [BlockStored([i + 1], i or None, [i % 7] * 2, 2, None)]
        if i % 5 == 4:
            evs.append(BlockRemoved([i - 2], None))
        b = KVEventBatch(float(i), evs, 0)
        cache.apply(b)
        batches.append(b)
        bodies.append(encode_batch(b))
        states.append(cache.as_dict())
    return batches, bodies, states


BATCHES, BODIES, STATES = engine()


def markers() -> list[tuple[dict[str, str], bytes]]:
    """The bridge's markers before seq 0: reset + an empty exact snapshot at (1, -1)."""
    hd = {S.H_EPOCH: "1", S.H_SEQ: "-1"}
    return [({**hd, S.H_KIND: "reset", S.H_REASON: "start"}, b""),
            ({**hd, S.H_KIND: "snapshot", S.H_CHUNK: "0/1"}, b"\x90")]


def message(first: int, last: int) -> tuple[dict[str, str], bytes]:
    """What the bridge's writer puts on the subject for seqs first..last (epoch 1)."""
    e = Lane(SUBJ, "e", 0).run_entry(1, first, BATCHES[first:last + 1],
                                     BODIES[first:last + 1])
    return e.header_dict(), e.payload


def cuts(data: Any, n: int = N, most: int = 16) -> list[tuple[int, int]]:
    """A bridge's runs over seqs 0..n-1: consecutive, each 1..most long."""
    out, i = [], 0
    while i < n:
        k = data.draw(st.integers(1, most))
        out.append((i, min(n, i + k) - 1))
        i += k
    return out


def deliver(t: Tracker, msgs: list[tuple[dict[str, str], bytes]], js0: int = 0,
            on_gap: Any = None) -> list[Any]:
    out: list[Any] = []
    for js, (hd, body) in enumerate(msgs, js0 + 1):
        res = t.feed(SUBJ, js, hd, body)
        assert type(res) is not BadMessage, res
        if type(res) is Gap:
            assert on_gap is not None, res
            res = on_gap(t, js, hd, body)
        out += res
    return out


def check_exact(items: list[Any], upto: int) -> None:
    """Reset, Snapshot, then batches 0..upto once each in order, ending at the truth."""
    assert [type(x) for x in items[:2]] == [Reset, Snapshot]
    seqs = [x.seq for x in items[2:] if type(x) is Batch]
    assert seqs == list(range(upto + 1)), seqs
    cache = BlockCache()
    for x in items[2:]:
        cache.apply(x.batch)
    assert cache.as_dict() == STATES[upto]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_one_bridge_runs_deliver_every_seq_once(data: Any) -> None:
    runs = cuts(data)
    t = Tracker()
    items = deliver(t, markers() + [message(a, b) for a, b in runs])
    check_exact(items, N - 1)
    assert t.counts["batches"] == N and t.counts["duplicates"] == 0


@settings(max_examples=200, deadline=None)
@example(data=None)  # a short run first, then a longer one with the same first seq
@given(st.data())
def test_redundant_bridges_cut_differently_yet_exact(data: Any) -> None:
    """Bridges A and B follow one engine with different cuts; the server keeps the first
    copy of each Msg-Id; the subject is any interleaving keeping each bridge's order."""
    if data is None:  # the @example: A stores 0..1, B's 0..5 has another id: both stored
        a_runs, b_runs, order = [(0, 1), (2, N - 1)], [(0, 5), (6, N - 1)], "abab"
    else:
        a_runs, b_runs = cuts(data), cuts(data)
        order = data.draw(st.permutations("a" * len(a_runs) + "b" * len(b_runs)))
    ia = ib = 0
    seen: set[str] = set()
    msgs = markers()
    for who in order:
        if who == "a":
            run, ia = a_runs[ia], ia + 1
        else:
            run, ib = b_runs[ib], ib + 1
        hd, body = message(*run)
        if hd[S.H_MSG_ID] not in seen:  # JetStream's dedupe by Nats-Msg-Id
            seen.add(hd[S.H_MSG_ID])
            msgs.append((hd, body))
    t = Tracker()
    items = deliver(t, msgs)
    check_exact(items, N - 1)
    assert t.counts["gaps"] == 0


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_lost_run_is_a_gap_and_a_snapshot_resync_is_exact(data: Any) -> None:
    runs = cuts(data)
    if len(runs) < 2:
        return
    lost = data.draw(st.integers(0, len(runs) - 2))  # not the last: a later one shows it
    msgs = markers() + [message(a, b) for i, (a, b) in enumerate(runs) if i != lost]
    gaps: list[int] = []

    def resync(t: Tracker, js: int, hd: dict[str, str], body: bytes) -> list[Any]:
        # The bridge's snapshot object at this message: the state after its last seq.
        last = int(hd[S.H_SEQ])
        gaps.append(last)
        return t.bootstrap(SUBJ, js, 1, last, _blocks(last), True, "gap")

    t = Tracker()
    items = deliver(t, msgs, on_gap=resync)
    assert len(gaps) == 1 and gaps[0] == runs[lost + 1][1]
    batches = [x.seq for x in items if type(x) is Batch]
    a, b = runs[lost][0], runs[lost + 1][1]
    assert batches == [s for s in range(N) if not a <= s <= b]  # none delivered over a loss
    snap = [x for x in items if type(x) is Snapshot][-1]
    cache = BlockCache()
    cache.apply_events(snap.blocks)
    for x in items:
        if type(x) is Batch and x.seq > b:
            cache.apply(x.batch)
    assert cache.as_dict() == STATES[N - 1]


def _blocks(upto: int) -> list[BlockStored]:
    cache = BlockCache()
    for b in BATCHES[:upto + 1]:
        cache.apply(b)
    return [blk.as_event() for blk in cache.blocks()]


def test_layout_of_a_run() -> None:
    hd, body = message(3, 7)
    assert hd[S.H_KIND] == "batches" and hd[S.H_FIRST_SEQ] == "3" and hd[S.H_SEQ] == "7"
    assert hd[S.H_MSG_ID] == "e/0/1/3-7" == S.run_msg_id("e", 0, 1, 3, 7)
    raw = msgspec.msgpack.decode(body, type=list[msgspec.Raw])
    assert [bytes(r) for r in raw] == BODIES[3:8]
    # the hand-built header block says the same as the dict
    e = Lane(SUBJ, "e", 0).run_entry(1, 3, BATCHES[3:8], BODIES[3:8])
    text = e.raw_headers().decode()
    assert text.startswith("NATS/1.0\r\n") and text.endswith("\r\n\r\n")
    assert dict(line.split(": ", 1) for line in text.split("\r\n")[1:-2]) == hd
    # a run of one is an ordinary batch message; bodies of 16+ use an array16 header
    one, body1 = message(4, 4)
    assert one[S.H_KIND] == "batch" and one[S.H_MSG_ID] == "e/0/1/4" and body1 == BODIES[4]
    assert len(msgspec.msgpack.decode(pack_body(BODIES[:20]))) == 20
    with pytest.raises(ValueError):
        S.run_msg_id("e", 0, 1, 3, 3)
    with pytest.raises(ValueError):
        S.msg_id("e", 0, 1, 3, "batches")


def test_last_batch_body_of_a_run() -> None:
    hd, body = message(3, 7)
    assert last_batch_body(hd, body, 7) == BODIES[7]
    assert last_batch_body(hd, body, 9) is None  # not the subject's position: no check
    one, body1 = message(4, 4)
    assert last_batch_body(one, body1, 4) == BODIES[4]


@pytest.mark.parametrize("hd_extra,body,why", [
    ({S.H_FIRST_SEQ: "7"}, None, "fewer than two"),
    ({S.H_FIRST_SEQ: "x"}, None, "not an integer"),
    ({}, None, "missing header Kvwire-First-Seq"),
    ({S.H_FIRST_SEQ: "3"}, b"\x92\x01\x02", "holds 2 batches"),
    ({S.H_FIRST_SEQ: "3"}, b"\xc1", "undecodable run body"),
])
def test_bad_runs_are_named_and_counted(hd_extra: dict[str, str], body: bytes | None,
                                        why: str) -> None:
    t = Tracker()
    deliver(t, markers() + [message(0, 2)])
    hd, good = message(3, 7)
    hd = {k: v for k, v in hd.items() if k != S.H_FIRST_SEQ} | hd_extra
    res = t.feed(SUBJ, 10, hd, good if body is None else body)
    assert type(res) is BadMessage and why in res.reason, res
    assert t.counts["bad_messages"] == 1
    # the subject did not move: the good run continues it
    hd, good = message(3, 7)
    assert [x.seq for x in t.feed(SUBJ, 11, hd, good)] == [3, 4, 5, 6, 7]  # type: ignore[union-attr]


_NAME = st.text(st.characters(min_codepoint=33, max_codepoint=126, blacklist_characters=":"),
                min_size=1, max_size=12)
_VALUE = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"),
                 max_size=20)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_NAME, _VALUE, st.sampled_from([": ", ":", ":\t", " : "])),
                max_size=8))
def test_fast_header_parse_equals_nats_py(headers: list[tuple[str, str, str]]) -> None:
    """The consumer's header parser (installed on its own connection) gives nats-py's
    answer for every header block of printable-ASCII names."""
    from nats.aio.client import Client

    from kvwire.nats.consumer import _header_lines

    raw = b"".join(f"{k}{sep}{v}\r\n".encode() for k, v, sep in headers) + b"\r\n"
    assert _header_lines(raw) == Client._parse_header_lines(raw)


@pytest.mark.parametrize("pack", [0, -3, 5000, 2.5])
def test_bad_pack_is_named(pack: Any) -> None:
    from kvwire.nats.bridge import BridgeConfig, BridgeError

    with pytest.raises(BridgeError, match="pack must be an int from 1 to 4096"):
        BridgeConfig(pack=pack).check()
    BridgeConfig(pack=16).check()  # (and the default, 1)
