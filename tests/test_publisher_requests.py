"""The request server on its own: it serves a stream it is handed (``StreamView``) within
``RequestLimits``, with no publisher and no socket behind it."""

from __future__ import annotations

from typing import Any

from kvwire.publish.replay import ReplayRing
from kvwire.publish.requests import RequestLimits, RequestServer, StreamView
from kvwire.wire import protocol

LIMITS = RequestLimits(request_slice=8, replay_slice=2, max_replay_jobs=1,
                       max_snapshot_jobs=1, job_timeout=30.0)


def server(last: int, done: int, limits: RequestLimits = LIMITS) -> tuple[Any, ...]:
    ring = ReplayRing(4, lambda seq, batch: None)
    for seq in range(done + 1):  # the sender has handled (and kept) up to done
        ring.slots[seq % 4] = (seq, b"payload-%d" % seq)
    counters = {k: 0 for k in ("replay_requests", "busy_rejections", "info_requests",
                               "snapshot_requests", "snapshots_unavailable", "bad_requests",
                               "replayed", "snapshot_chunks")}
    stream = StreamView(ring=ring, model=None, counters=counters, topic=b"t", epoch=7, rank=3,
                        last_seq=lambda: last, done_seq=lambda: done,
                        info=lambda: {"seq": last, "epoch": 7})
    inbox: list[list[bytes]] = []
    sent: list[tuple[bytes, ...]] = []

    def recv() -> list[bytes] | None:
        return inbox.pop(0) if inbox else None

    def send(*frames: bytes) -> bool:
        sent.append(frames)
        return True

    return RequestServer(stream, limits, send, recv), inbox, sent, counters


def test_replay_and_info_are_served_from_the_stream_view() -> None:
    srv, inbox, sent, counters = server(last=5, done=5)
    inbox.append([b"a", b"", protocol.pack_seq(0)])  # older than the ring: starts at 2
    inbox.append([b"b", b"", protocol.MAGIC, protocol.OP_INFO])
    assert srv.read()
    assert counters["replay_requests"] == counters["info_requests"] == 1
    assert sent[0][0] == b"b" and protocol.decode_map(sent[0][4]) == {"seq": 5, "epoch": 7}
    while srv.advance():  # replay_slice=2 per turn
        pass
    replay = [f for f in sent[1:] if f[0] == b"a"]
    assert [f[3] for f in replay[:-1]] == [protocol.pack_seq(s) for s in range(2, 6)]
    assert [f[4] for f in replay[:-1]] == [b"payload-%d" % s for s in range(2, 6)]
    assert replay[-1][3] == protocol.END_SEQ and counters["replayed"] == 4
    assert all(f[2] == b"t" for f in replay[:-1])


def test_replay_waits_for_seqs_the_sender_has_not_handled() -> None:
    srv, inbox, sent, counters = server(last=5, done=3)
    inbox.append([b"a", b"", protocol.pack_seq(3)])
    srv.read()
    srv.advance()
    srv.advance()
    assert [f[3] for f in sent] == [protocol.pack_seq(3)]  # 4 and 5 are not done yet


def test_limits_are_the_ones_given() -> None:
    srv, inbox, sent, counters = server(last=5, done=5)
    inbox.append([b"a", b"", protocol.pack_seq(2)])
    inbox.append([b"b", b"", protocol.pack_seq(2)])  # max_replay_jobs=1: refused
    inbox.append([b"c", b"", protocol.MAGIC, protocol.OP_SNAPSHOT])  # model=None
    srv.read()
    assert counters["busy_rejections"] == 1
    assert sent[0] == (b"b", b"", b"", protocol.END_SEQ, b"")
    assert sent[1][0] == b"c" and b"disabled" in sent[1][4]
    srv.advance()
    assert len([f for f in sent if f[0] == b"a"]) == 2  # replay_slice=2 per turn
