"""The guarded writer's decisions (``kvwire bridge --pack N > 1``), the pure part: what a
lane does when JetStream refused its message because another writer moved the subject on.

``WriterState.resolve_guarded`` (the writer's pure part, driven alone here: no NATS, no
writer) gets the subject's last message and the lane's entries (the
run in flight, the batches held) and must commit exactly what is on the subject already,
hold exactly the rest, in order, and keep the lane's state (the source of its object-store
snapshots) equal to the engine's state at the seq it commits up to. No NATS here: the
decision is a function of its inputs (the processes test is in test_nats_pack_procs.py)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from test_nats_pack import engine

from kvwire.index.cache import BlockCache
from kvwire.nats.lane import H_EXPECT
from kvwire.nats.subjects import H_EPOCH, H_FIRST_SEQ, H_KIND, H_MSG_ID, H_SEQ, run_msg_id
from kvwire.nats.writer import Lane, marker_entries
from kvwire.nats.writer_state import WriterState
from kvwire.wire.events import encode_batch

EPOCH = 7
N = 40


BATCHES, _, STATES = engine(N)  # (the packed-runs tests' engine: 40 batches of one epoch)


def lane_at(upto: int, pack: int = 8) -> tuple[WriterState, Lane]:
    """A guarded writer's lane that has committed batches 0..upto (its state: the engine's)."""
    w = WriterState(pack)
    ln = w.lane("e", 0, "kvwire.events.e.0")
    for i in range(upto + 1):
        ln.cache.apply(BATCHES[i])
    ln.epochs.add(EPOCH)
    ln.last, ln.last_js_seq, ln.expect = (EPOCH, upto), 100 + upto, 100 + upto
    return w, ln


def hold(ln: Lane, first: int, last: int, epoch: int = EPOCH) -> None:
    for i in range(first, last + 1):
        ln.held.append(ln.batch_entry(epoch, i, BATCHES[i], encode_batch(BATCHES[i])))


def in_flight(w: WriterState, ln: Lane) -> Any:
    """Take the next message off ``held`` as the pump does, and mark it refused."""
    e = ln.next_message(w.pack, 1 << 20)
    e.token, e.expect = "1", ln.expect
    w.inflight["1"] = e
    ln.pending.append(e)
    return e


def last_msg(kind: str, seq: int, js: int, first: int | None = None, epoch: int = EPOCH,
             mid: str | None = None) -> tuple[str, int, dict[str, str]]:
    h = {H_KIND: kind, H_EPOCH: str(epoch), H_SEQ: str(seq)}
    if kind == "batches":
        h[H_FIRST_SEQ] = str(first)
    mid = mid or (run_msg_id("other", 0, epoch, first, seq) if kind == "batches"
                  else f"e/0/{epoch}/{seq}")
    h[H_MSG_ID] = mid
    return mid, js, h


def held_seqs(ln: Lane) -> list[tuple[str, int]]:
    return [(e.kind, e.seq) for e in ln.held]


def test_runs_are_consecutive_batches_of_one_epoch_up_to_pack() -> None:
    w, ln = lane_at(-1, pack=4)
    hold(ln, 0, 5)
    ln.held.append(marker_entries(ln, EPOCH, 5, [], True, "x", 1 << 20)[0])
    hold(ln, 6, 6)
    runs = []
    while ln.held:
        e = ln.next_message(w.pack, 1 << 20)
        runs.append((e.kind, e.first, e.seq))
    assert runs == [("batches", 0, 3), ("batches", 4, 5), ("reset", 5, 5), ("batch", 6, 6)]
    hold(ln, 0, 9)
    assert ln.next_message(8, 3 * len(encode_batch(BATCHES[0])) + 2).seq == 2  # bytes cap


def test_guard_header_is_on_the_wire_and_names_the_subjects_last_seq() -> None:
    w, ln = lane_at(-1)
    hold(ln, 0, 2)
    e = ln.next_message(w.pack, 1 << 20)
    e.expect = 41
    raw = e.raw_headers()
    assert raw.endswith(f"{H_EXPECT}: 41\r\n\r\n".encode()) and raw.startswith(b"NATS/1.0\r\n")
    assert f"{H_MSG_ID}: e/0/{EPOCH}/0-2\r\n".encode() in raw
    assert e.send_headers()[H_EXPECT] == "41"
    e.expect = None
    assert H_EXPECT.encode() not in e.raw_headers()


def test_another_writers_overlapping_run_commits_what_it_covers_and_splits_ours() -> None:
    """We had 0..4; our run 5..12 was refused: the other writer stored a run ending at 9.
    5..9 are committed (the state at 9, snapshot-able at the other's stream seq), 10..12
    wait to go after it, as a new run (the old one split)."""
    w, ln = lane_at(4)
    hold(ln, 5, 12)
    e = in_flight(w, ln)
    assert (e.first, e.seq) == (5, 12)
    hold(ln, 13, 14)
    w.resolve_guarded(ln, last_msg("batches", 9, 555, first=3))
    assert held_seqs(ln) == [("batch", s) for s in range(10, 15)]
    assert ln.cache.as_dict() == STATES[9]
    assert ln.last == (EPOCH, 9) and ln.last_js_seq == 555 and ln.expect == 555
    assert not ln.pending and not w.inflight
    assert w.stats.superseded == 5
    nxt = ln.next_message(w.pack, 1 << 20)
    assert (nxt.kind, nxt.first, nxt.seq) == ("batches", 10, 14)


def test_our_own_message_stored_before_the_refusal() -> None:
    """The subject's last message is ours (its ack was lost): it and what came before it are
    stored; nothing of it is sent again."""
    w, ln = lane_at(4)
    hold(ln, 5, 9)
    e = in_flight(w, ln)
    hold(ln, 10, 11)
    w.resolve_guarded(ln, (e.msg_id, 600, {}))
    assert held_seqs(ln) == [("batch", 10), ("batch", 11)]
    assert ln.cache.as_dict() == STATES[9] and ln.last_js_seq == 600 and ln.expect == 600


def test_a_marker_of_another_writer_covers_the_batches_up_to_its_seq() -> None:
    """Another writer resynced the subject at (EPOCH, 8): the state there holds batches up to
    8, so ours up to 8 are passed; the lane's state is right but not at a stream seq it
    knows (no snapshot until its next ack)."""
    w, ln = lane_at(4)
    hold(ln, 5, 12)
    in_flight(w, ln)
    w.resolve_guarded(ln, last_msg("snapshot", 8, 700, mid="e/0/7/8/snapshot/0"))
    assert held_seqs(ln) == [("batch", s) for s in range(9, 13)]
    assert ln.cache.as_dict() == STATES[8]
    assert ln.last_js_seq is None and ln.expect == 700


def test_an_empty_subject_takes_everything_from_zero() -> None:
    w, ln = lane_at(4)
    hold(ln, 5, 9)
    in_flight(w, ln)
    w.resolve_guarded(ln, None)
    assert held_seqs(ln) == [("batch", s) for s in range(5, 10)] and ln.expect == 0
    assert ln.cache.as_dict() == STATES[4]


def test_a_subject_behind_us_in_an_epoch_we_left_gets_ours_after_it() -> None:
    w, ln = lane_at(4)
    ln.epochs.add(3)
    hold(ln, 5, 9)
    in_flight(w, ln)
    w.resolve_guarded(ln, last_msg("batch", 50, 800, epoch=3))
    assert held_seqs(ln) == [("batch", s) for s in range(5, 10)] and ln.expect == 800
    assert ln.cache.as_dict() == STATES[4]


def test_an_epoch_we_never_saw_resyncs_the_subject_from_our_whole_state() -> None:
    """Which of the two timelines is newer is unknown: the subject gets our state as a
    reset + snapshot markers, guarded after the other writer's message (exact either way)."""
    w, ln = lane_at(4)
    hold(ln, 5, 9)
    in_flight(w, ln)
    w.resolve_guarded(ln, last_msg("batch", 3, 900, epoch=99))
    kinds = [e.kind for e in ln.held]
    assert kinds[0] == "reset" and set(kinds[1:]) == {"snapshot"}
    assert all((e.epoch, e.seq) == (EPOCH, 9) for e in ln.held)
    got = BlockCache()
    for e in list(ln.held)[1:]:
        got.apply_events(e.effect)
    assert got.as_dict() == STATES[9] == ln.cache.as_dict()
    assert ln.last_js_seq is None and ln.expect == 900


@settings(max_examples=300, deadline=None)
@given(done=st.integers(-1, 20), n=st.integers(1, 18), pack=st.integers(2, 9),
       other=st.integers(-1, N - 1), other_first=st.integers(0, 6), as_run=st.booleans())
def test_property_exact_partition(done: int, n: int, pack: int, other: int, other_first: int,
                                  as_run: bool) -> None:
    """Whatever we had committed, held and sent, and wherever the other writer's last
    batch ends: every seq of ours is committed iff it is at or before that end; the rest is
    held in order, once; the lane's state is the engine's at what it committed."""
    last = min(done + n, N - 1)
    w, ln = lane_at(done, pack=pack)
    hold(ln, done + 1, last)
    if ln.held:
        in_flight(w, ln)
    if other < done:  # (a guard is only refused by a subject ahead of what we committed)
        other = done
    first = max(0, other - other_first)
    lm = (last_msg("batches", other, 999, first=first) if as_run and first < other
          else last_msg("batch", other, 999, mid=f"other/{other}"))
    w.resolve_guarded(ln, lm)
    held = [e.seq for e in ln.held]
    assert held == list(range(max(other, done) + 1, last + 1))
    assert all(e.kind == "batch" for e in ln.held)
    upto = max(done, min(other, last))
    assert ln.cache.as_dict() == (STATES[upto] if upto >= 0 else {})
    assert ln.expect == 999 and not ln.pending and not w.inflight
    # Batches our engine follower delivers only now, that the other writer already stored:
    # never sent (the pump skips them), the state follows them.
    more = min(N - 1, other + 3)
    hold(ln, last + 1, more)
    w.skip_covered(ln)
    more = max(more, last)
    assert [e.seq for e in ln.held] == list(range(max(other, done) + 1, more + 1))
    upto = max(done, min(other, more))
    assert ln.cache.as_dict() == (STATES[upto] if upto >= 0 else {})
    if upto == other and other > done:  # the state at the other's message: snapshot-able
        assert ln.last_js_seq == 999


def test_never_after_half_of_another_writers_marker_set() -> None:
    """The subject ends in another writer's reset marker whose chunks never came (it died;
    the recovery waited ack_timeout for them): batches after it would sit inside a marker
    set, so the lane writes its own whole set instead."""
    w, ln = lane_at(4)
    hold(ln, 5, 9)
    in_flight(w, ln)
    w.resolve_guarded(ln, last_msg("reset", 30, 901, mid="e/0/7/30/reset"))
    assert [e.kind for e in ln.held][0] == "reset" and ln.held[0].seq == 9
    assert ln.cache.as_dict() == STATES[9] and ln.expect == 901


def test_our_own_half_written_set_is_continued() -> None:
    """The subject ends in our own reset marker (its ack was lost): the set goes on with
    its chunks, not a second set."""
    w, ln = lane_at(-1)
    ln.held.extend(marker_entries(ln, EPOCH, 4, [], True, "x", 1 << 20))
    hold(ln, 5, 6)
    e = in_flight(w, ln)
    assert e.kind == "reset"
    w.resolve_guarded(ln, (e.msg_id, 902, {H_KIND: "reset", H_EPOCH: str(EPOCH),
                                            H_SEQ: "4", H_MSG_ID: e.msg_id}))
    assert [(x.kind, x.seq) for x in ln.held] == [("snapshot", 4), ("batch", 5), ("batch", 6)]
    assert ln.expect == 902


def test_a_batch_over_the_max_payload_resyncs_as_chunked_markers() -> None:
    """A batch that can never go as one message (over the server's max payload) must not be
    retried forever: the lane's whole state goes as a reset + snapshot chunks instead."""
    w, ln = lane_at(4)
    hold(ln, 5, 6)
    ln.held[0].oversize = True  # (what _send found when it tried)
    in_flight(w, ln)
    w.resolve_guarded(ln, (f"e/0/{EPOCH}/4", 104, {H_KIND: "batch", H_EPOCH: str(EPOCH),
                                                     H_SEQ: "4", H_MSG_ID: f"e/0/{EPOCH}/4"}))
    kinds = [e.kind for e in ln.held]
    assert kinds[0] == "reset" and set(kinds[1:]) == {"snapshot"}
    assert ln.held[0].seq == 6 and ln.cache.as_dict() == STATES[6]
