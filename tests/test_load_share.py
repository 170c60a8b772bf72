"""Router replicas that share their load (routing/sharing.py, nats/load_channel.py).

The pure part (:class:`PeerLoads`) against a model under hypothesis, reports lost at random
included; then real ``kvwire serve --nats`` replicas beside a real nats-server: what one
reserves weighs on the other's choice, a release lifts it, and a replica killed with SIGKILL
stops weighing after the ttl."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.routing.load import LoadTracker
from kvwire.routing.sharing import PeerLoads, Report

ENGINES = ("e0", "e1", "e2")


def _tracker() -> LoadTracker:
    return LoadTracker(expiry_s=1e9, clock=lambda: 0.0, drain=False)


def test_a_peers_operations_move_the_load_and_its_own_are_ignored() -> None:
    loads, out = _tracker(), []
    peers = PeerLoads(loads, "me", ttl=2.0, on_output=out.append)
    peers.receive(Report("a", 1, [["r", "1", "e0", 10.0, 8.0], ["r", "2", "e1", 5.0, 0.0]]), 0.0)
    assert loads.loads() == {"e0": 10.0, "e1": 5.0} and peers.held() == 2
    peers.receive(Report("me", 1, [["r", "1", "e2", 99.0, 0.0]]), 0.0)  # its own: ignored
    assert "e2" not in loads.loads()
    peers.receive(Report("a", 2, [["f", "1"]]), 0.1)  # first token: the prefill share goes
    assert loads.loads()["e0"] == pytest.approx(2.0)
    peers.receive(Report("a", 3, [["x", "1", 40], ["x", "2", None]]), 0.2)
    assert loads.loads() == {} and peers.held() == 0 and out == [40]
    # a gap in its sequence is counted; malformed operations are counted and skipped
    peers.receive(Report("a", 5, [["r", 7, "e0", 1.0, 0.0], ["r", "3", "e0", -1.0, 0.0],
                                  ["q", "4"], ["r", "5"], ["r", "6", "e0", 3.0, 0.0],
                                  ["r", "8", 0, 1.0, 0.0]]), 0.3)
    assert peers.counts["gaps"] == 1 and peers.counts["bad"] == 5
    assert loads.loads() == {"e0": 3.0}
    # a release for a reservation never seen (its report lost) is not an unknown release
    peers.receive(Report("a", 6, [["x", "zz", 1]]), 0.4)
    assert loads.unknown_releases == 0 and out == [40]


def test_a_heartbeat_puts_right_what_lost_messages_left_and_silence_drops_all() -> None:
    loads = _tracker()
    peers = PeerLoads(loads, "me", ttl=2.0)
    peers.receive(Report("a", 1, [["r", "1", "e0", 10.0, 0.0], ["r", "2", "e1", 5.0, 4.0]]), 0.0)
    peers.receive(Report("b", 1, [["r", "1", "e0", 7.0, 0.0]]), 0.0)
    # lost since: a's release of "1", its first token of "2", its reservation of "3"
    peers.receive(Report("a", 5, [], live={"2": ["e1", 1.0, 0.0], "3": ["e2", 6.0, 2.0]}), 1.0)
    assert loads.loads() == {"e0": 7.0, "e1": 1.0, "e2": 6.0}
    assert peers.counts["dropped_by_heartbeat"] == 1
    assert peers.counts["corrected_by_heartbeat"] == 2  # ("3" reserved, "2"'s first token)
    assert peers.counts["gaps"] == 1
    assert peers.expire(2.5) == ["b"]  # b silent since 0.0, a heard at 1.0
    assert loads.loads() == {"e1": 1.0, "e2": 6.0} and set(peers.peers) == {"a"}
    assert peers.expire(3.5) == ["a"] and loads.loads() == {} and peers.held() == 0


def test_a_release_asked_of_its_owner_is_answered_once_and_asked_again_while_held() -> None:
    """B got the /release of a reservation A made: B asks A (``q``), A releases it through
    its callback, and B keeps asking at each of A's heartbeats that still lists it (the ask
    was lost) until A's release arrives; asks addressed to another replica are not A's."""
    loads_a, loads_b = _tracker(), _tracker()
    released: list[tuple[str, int | None]] = []

    def release(rid: str, out: int | None) -> bool:
        released.append((rid, out))
        return loads_a.release(rid)

    a = PeerLoads(loads_a, "A", ttl=2.0, on_release=release)
    b = PeerLoads(loads_b, "B", ttl=2.0)
    loads_a.reserve("r1", "e0", 10.0, 0.0)
    loads_a.reserve("r2", "e1", 4.0, 0.0)
    assert b.receive(Report("A", 1, [["r", "r1", "e0", 10.0, 0.0],
                                     ["r", "r2", "e1", 4.0, 0.0]]), 0.0) == []
    assert b.owner("r1") == "A" and b.owner("nope") is None
    ask = b.ask_release("A", "r1", 12)
    assert ask == ["q", "r1", "A", 12] and b.counts["releases_asked"] == 1
    # the ask is lost: A's heartbeat still lists r1, so B asks again (r2 never asked)
    again = b.receive(Report("A", 2, [], live={"r1": ["e0", 10.0, 0.0],
                                               "r2": ["e1", 4.0, 0.0]}), 0.5)
    assert again == [ask] and b.counts["releases_asked_again"] == 1
    # an ask for another replica's reservation is not A's to answer
    a.receive(Report("B", 1, [["q", "r2", "C", None]]), 0.6)
    assert released == [] and loads_a.loads() == {"e0": 10.0, "e1": 4.0}
    a.receive(Report("B", 2, [again[0]]), 0.6)
    assert released == [("r1", 12)] and loads_a.loads() == {"e1": 4.0}
    assert a.counts["releases_answered"] == 1
    a.receive(Report("B", 3, [["q", "r1", "A", -3]]), 0.7)  # (asked twice: held no more)
    assert released[-1] == ("r1", None) and a.counts["releases_not_held"] == 1
    a.receive(Report("B", 4, [["q", 2, "A", None]]), 0.7)  # malformed: counted, not asked
    assert len(released) == 2 and a.counts["bad"] == 1
    # A's release reaches B: nothing more is asked, and its load goes
    assert b.receive(Report("A", 3, [["x", "r1", 12]], live={"r2": ["e1", 4.0, 0.0]}),
                     0.8) == []
    assert loads_b.loads() == {"e1": 4.0} and not b.peers["A"].asked
    # an ask whose reservation the owner no longer lists (released, its "x" lost) is dropped
    b.ask_release("A", "r2", None)
    assert b.receive(Report("A", 5, [], live={}), 1.0) == [] and not b.peers["A"].asked


def test_a_peers_prediction_goes_to_its_callback_and_malformed_ones_are_counted() -> None:
    got: list[tuple[str, bytes]] = []

    def take(stream: str, keys: bytes) -> bool:
        got.append((stream, keys))
        return stream != "unknown"

    peers = PeerLoads(_tracker(), "me", ttl=2.0, on_predict=take)
    keys = (12345).to_bytes(8, "little") + (678).to_bytes(8, "little")
    peers.receive(Report("a", 1, [["p", "e0", keys], ["p", "unknown", keys],
                                  ["p", "e0", keys[:5]], ["p", "e0", "not bytes"],
                                  ["p", 7, keys]]), 0.0)
    assert got == [("e0", keys), ("unknown", keys)]  # (a stream named 7 never reaches it)
    assert peers.counts["predictions"] == 1 and peers.counts["bad"] == 3
    assert peers.counts["ops"] == 2  # the operations applied, well formed


def test_predicted_keys_taken_by_another_index_match_as_the_prediction_does() -> None:
    """What one replica predicts (``prompt_keys`` -> ``predict_keys``) and another applies
    from the keys' bytes matches there as it does where it was predicted."""
    from array import array

    from kvwire.consume.stream import Batch
    from kvwire.index import PrefixIndex
    from kvwire.wire.events import BlockStored, KVEventBatch

    def index() -> PrefixIndex:
        idx = PrefixIndex(predict_ttl=30.0, clock=lambda: 0.0)
        ev = BlockStored([1], None, list(range(900, 916)), 16, None, None, None)
        idx.apply(Batch("e0", 0, KVEventBatch(0.0, [ev], 0), 1))  # (learns block size 16)
        return idx

    a, b = index(), index()
    prompt = list(range(40 * 16 + 5))
    keys = a.prompt_keys("e0", prompt, salt="s")
    assert len(keys) == 40 and a.predict_keys("e0", keys) == 40
    k = array("Q")
    k.frombytes(keys.tobytes())
    assert b.predict_keys("e0", k) == 40
    ma, mb = a.match(prompt, salt="s")["e0"], b.match(prompt, salt="s")["e0"]
    assert ma.blocks == mb.blocks == 40 and ma.predicted == mb.predicted == 40
    assert b.match(prompt)["e0"].blocks == 0  # (another salt: other keys)
    c = index()  # predict() itself is prompt_keys + predict_keys
    assert c.predict("e0", prompt, salt="s") == 40
    assert c.match(prompt, salt="s")["e0"].predicted == 40


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["reserve", "ask", "beat"]), st.integers(0, 5),
                                st.booleans(), st.booleans()), max_size=40))
def test_every_release_asked_is_done_once_heartbeats_get_through(steps: list[Any]) -> None:
    """Asks (``q``) and releases (``x``) lost at random between B and the owner A: once
    A's heartbeats and B's answers to them get through again, every reservation B was asked
    to release is released at A, and B asks for nothing more."""
    loads_a = _tracker()
    a = PeerLoads(loads_a, "A", ttl=1e9, on_release=lambda rid, out: loads_a.release(rid))
    b = PeerLoads(_tracker(), "B", ttl=1e9)
    seq = {"A": 0, "B": 0}
    asked: set[str] = set()

    def send(sender: PeerLoads, to: PeerLoads, ops: list[Any], live: Any = None) -> list[Any]:
        seq[sender.me] += 1
        return to.receive(Report(sender.me, seq[sender.me], ops, live), 0.0)

    def a_holds() -> dict[str, list[Any]]:
        return {r: [loads_a.holder(r), 1.0, 0.0] for r in held}

    held: set[str] = set()
    for kind, i, lost, lost_back in steps:
        rid = str(i)
        if kind == "reserve" and rid not in held and rid not in asked:
            loads_a.reserve(rid, "e0", 1.0, 0.0)
            held.add(rid)
            send(a, b, [["r", rid, "e0", 1.0, 0.0]])
        elif kind == "ask" and b.owner(rid) == "A" and rid not in asked:
            asked.add(rid)
            op = b.ask_release("A", rid, None)
            if not lost:
                send(b, a, [op])
        elif kind == "beat":
            again = send(a, b, [], a_holds())
            if again and not lost:
                send(b, a, again)
        gone = {r for r in held if loads_a.holder(r) is None}
        if gone:  # A released them: its "x" may be lost
            held -= gone
            if not lost_back:
                send(a, b, [["x", r, None] for r in sorted(gone)])
    for _ in range(2):  # heartbeats and answers that get through
        again = send(a, b, [], a_holds())
        send(b, a, again)
        held -= {r for r in held if loads_a.holder(r) is None}
    assert not (held & asked), (held, asked)
    assert send(a, b, [], a_holds()) == [] and not b.peers["A"].asked


_op = st.tuples(st.sampled_from(["r", "f", "x"]), st.integers(0, 7),
                st.sampled_from(ENGINES), st.integers(1, 50), st.integers(0, 50),
                st.booleans())  # (kind, id, engine, amount, prefill, lost in transit)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["a", "b"]), _op), max_size=60),
       beat_every=st.integers(1, 10))
def test_held_load_follows_what_arrived_and_heartbeats_correct_it(ops: list[Any],
                                                                 beat_every: int) -> None:
    """Any operations of two peers, any report lost: the load equals what the reports that
    arrived say (a model applies them too); a heartbeat makes it what the peers hold, whole;
    silence past the ttl ends all of it."""
    loads = _tracker()
    peers = PeerLoads(loads, "me", ttl=5.0)
    truth: dict[str, dict[str, tuple[str, float, float]]] = {"a": {}, "b": {}}  # held
    model: dict[str, dict[str, list[Any]]] = {"a": {}, "b": {}}  # what arrived
    seq = {"a": 0, "b": 0}

    def expected() -> dict[str, float]:
        out: dict[str, float] = {}
        for held in model.values():
            for engine, amount, _ in held.values():
                out[engine] = out.get(engine, 0.0) + amount
        return out

    def check() -> None:
        got, want = loads.loads(), expected()
        assert set(got) == {k for k, v in want.items() if v > 0 or k in got}
        for k in set(got) | set(want):
            assert got.get(k, 0.0) == pytest.approx(want.get(k, 0.0), abs=1e-6)
        assert peers.held() == sum(len(h) for h in model.values())

    def deliver(peer: str, op: list[Any] | None, live: dict[str, list[Any]] | None) -> None:
        seq[peer] += 1
        peers.receive(Report(peer, seq[peer], [op] if op else [], live), 1.0)
        held = model[peer]
        if op is not None and op[0] == "r":
            held[op[1]] = [op[2], op[3], op[4]]
        elif op is not None and op[0] == "f" and op[1] in held:
            held[op[1]][1] -= held[op[1]][2]
            held[op[1]][2] = 0.0
        elif op is not None and op[0] == "x":
            held.pop(op[1], None)
        if live is not None:  # the heartbeat: what the peer holds, whole
            model[peer] = {r: list(v) for r, v in live.items()}

    for n, (peer, (kind, i, engine, amount, prefill, lost)) in enumerate(ops):
        rid, held = str(i), truth[peer]
        if kind == "r":
            prefill = min(prefill, amount)
            held[rid] = (engine, float(amount), float(prefill))
            op = ["r", rid, engine, float(amount), float(prefill)]
        elif kind == "f":
            if rid not in held or held[rid][2] == 0:
                continue  # (a replica sends "f" once, for a reservation it holds)
            held[rid] = (held[rid][0], held[rid][1] - held[rid][2], 0.0)
            op = ["f", rid]
        else:
            if rid not in held:
                continue
            del held[rid]
            op = ["x", rid, 1]
        live = ({r: list(v) for r, v in held.items()} if n % beat_every == 0 else None)
        if lost:
            seq[peer] += 1
        else:
            deliver(peer, op, live)
        check()
    for peer in ("a", "b"):  # a heartbeat each, whatever was lost: exactly what it holds
        deliver(peer, None, {r: list(v) for r, v in truth[peer].items()})
    check()
    want: dict[str, float] = {}
    for held in truth.values():
        for engine, amount, _ in held.values():
            want[engine] = want.get(engine, 0.0) + amount
    for k in set(want) | set(loads.loads()):
        assert loads.loads().get(k, 0.0) == pytest.approx(want.get(k, 0.0), abs=1e-6)
    assert sorted(peers.expire(7.5)) == ["a", "b"]
    assert loads.loads() == {} and peers.held() == 0


# -------------------------------------------------------------------- real processes

pytest.importorskip("nats")
httpx = pytest.importorskip("httpx")

from nats_writer import Writer  # noqa: E402
from test_indexer_api import _url, _url_said  # noqa: E402
from test_nats_consumer import _write, run  # noqa: E402
from test_proxy import engine_procs, serve_proc  # noqa: E402, F401 (fixtures)
from waiting import wait_for  # noqa: E402

BS = 16


def _toks(seed: int, blocks: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(blocks * BS)]


def _replica(url: str, *more: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvwire", "serve", "--nats", url, "--nats-engine", "e0",
         "--nats-engine", "e1", "--port", "0", "--block-size", str(BS),
         "--balance-slack", "0", "--load-weight", "1", *more],
        stderr=subprocess.PIPE, text=True)


def _loads(http: Any) -> dict[str, float]:
    return {e: v["ranks"][0]["load"] for e, v in http.get("/engines").json().items()}


def test_replicas_route_on_each_others_load(nats_server: Any) -> None:
    """Two replicas of the decision API on one stream: a prompt reserved through A weighs
    on B's costs (B sends the next prompt to the other engine), A's release lifts it, and
    once A is SIGKILLed with a reservation open, B stops counting it after the ttl.
    With ``--no-share-load`` B sees none of A's load."""
    async def engines(w: Writer) -> None:
        for e in ("e0", "e1"):
            await w.start(e, 0, epoch=1)

    run(_write(nats_server.url, engines))
    a, b = _replica(nats_server.url), _replica(nats_server.url)
    alone = _replica(nats_server.url, "--no-share-load")
    try:
        (ua, said), ub, (ualone, said_alone) = _url_said(a), _url(b), _url_said(alone)
        assert "sharing load with the other replicas on kvwire.load.KVWIRE" in said
        assert "sharing load" not in said_alone
        with httpx.Client(base_url=ua, timeout=10) as ha, \
                httpx.Client(base_url=ub, timeout=10) as hb, \
                httpx.Client(base_url=ualone, timeout=10) as hl:
            r = ha.post("/route", json={"token_ids": _toks(1, 100)})
            assert r.status_code == 200, r.text
            first, rid = r.json()["engine"], r.json()["request_id"]
            other = "e1" if first == "e0" else "e0"
            wait_for(lambda: _loads(hb)[first] >= 100, timeout=30, interval=0.02,
                     what="A's reservation counted in B's load")
            assert _loads(hb)[other] == 0
            s = hb.post("/score", json={"token_ids": _toks(2, 50)}).json()
            assert s["engine"] == other and s["cost"][first] > s["cost"][other], s
            assert _loads(hl) == {"e0": 0, "e1": 0}  # (not sharing: nothing of A's)
            metrics = hb.get("/metrics").text
            assert "kvwire_router_peer_replicas 1.0" in metrics  # (alone does not send)
            assert ha.post("/release", json={"request_id": rid,
                                             "output_tokens": 10}).status_code == 200
            wait_for(lambda: _loads(hb)[first] == 0, timeout=30, interval=0.02,
                     what="A's release lifted B's load")
            # A reserves again and dies: B counts it until A's silence passes the ttl
            r = ha.post("/route", json={"token_ids": _toks(3, 80)})
            held_on = r.json()["engine"]
            wait_for(lambda: _loads(hb)[held_on] >= 80, timeout=30, interval=0.02,
                     what="A's second reservation seen by B")
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            wait_for(lambda: _loads(hb)[held_on] == 0, timeout=30, interval=0.05,
                     what="a dead replica's load dropped after the ttl")
            assert "kvwire_router_load_reports_total{kind=\"peers_expired\"} 1.0" in \
                hb.get("/metrics").text
    finally:
        for p in (a, b, alone):
            if p.poll() is None:
                p.terminate()
                p.wait(10)
    assert b.returncode == 0 and alone.returncode == 0


def test_a_release_at_any_replica_releases_where_it_was_routed(nats_server: Any) -> None:
    """The decision API behind a load balancer: a ``/route`` answered by A and its
    ``/release`` by B. B asks A, answers 200 naming A, and the load is gone at both. The
    id is then unknown everywhere."""
    async def engines(w: Writer) -> None:
        for e in ("e0", "e1"):
            await w.start(e, 0, epoch=1)

    run(_write(nats_server.url, engines))
    a, b = _replica(nats_server.url), _replica(nats_server.url)
    try:
        ua, ub = _url(a), _url(b)
        with httpx.Client(base_url=ua, timeout=10) as ha, \
                httpx.Client(base_url=ub, timeout=10) as hb:
            r = ha.post("/route", json={"token_ids": _toks(4, 60)})
            assert r.status_code == 200, r.text
            engine, rid = r.json()["engine"], r.json()["request_id"]
            wait_for(lambda: _loads(hb)[engine] >= 60, timeout=30, interval=0.02,
                     what="A's reservation counted at B")
            r = hb.post("/release", json={"request_id": rid, "output_tokens": 7})
            assert r.status_code == 200, r.text
            assert r.json()["engine"] == engine and r.json()["replica"], r.json()
            wait_for(lambda: _loads(ha)[engine] == 0 and _loads(hb)[engine] == 0,
                     timeout=30, interval=0.02, what="released at A, and so at B")
            assert 'kvwire_router_load_reports_total{kind="releases_answered"} 1.0' in \
                ha.get("/metrics").text
            for h in (ha, hb):
                r = h.post("/release", json={"request_id": rid})
                assert r.status_code == 404 and "unknown request_id" in r.text, r.text
    finally:
        for p in (a, b):
            p.terminate()
            p.wait(10)
    assert a.returncode == 0 and b.returncode == 0


def test_replicas_share_their_predictions(nats_server: Any) -> None:
    """A prompt routed through A is counted as held by the engine A chose at B too, before
    any event confirms it: B's next prompt with that prefix goes there, as A's would. A
    ``--no-share-load`` replica sees no such prediction."""
    from kvwire.wire.events import BlockStored

    async def engines(w: Writer) -> None:
        for i, e in enumerate(("e0", "e1")):
            await w.start(e, 0, epoch=1)
            toks = list(range(60_000 + 100 * i, 60_000 + 100 * i + BS))
            await w.batch(e, 0, [BlockStored([900 + i], None, toks, BS, None, None, None)])

    run(_write(nats_server.url, engines))
    a, b = _replica(nats_server.url), _replica(nats_server.url)
    alone = _replica(nats_server.url, "--no-share-load")
    try:
        ua, ub, ul = _url(a), _url(b), _url(alone)
        with httpx.Client(base_url=ua, timeout=10) as ha, \
                httpx.Client(base_url=ub, timeout=10) as hb, \
                httpx.Client(base_url=ul, timeout=10) as hl:
            for h in (ha, hb, hl):  # (each knows the engines' block size from their events)
                wait_for(lambda h=h: all(v["ranks"][0]["block_size"] == BS
                                         for v in h.get("/engines").json().values()),
                         timeout=30, interval=0.02, what="the engines' blocks indexed")
            prompt = _toks(5, 70)
            r = ha.post("/route", json={"token_ids": prompt})
            assert r.status_code == 200, r.text
            engine = r.json()["engine"]
            wait_for(lambda: hb.post("/score", json={"token_ids": prompt}).json()["overlap"]
                     [engine] == 70, timeout=30, interval=0.02, what="A's prediction at B")
            other = "e1" if engine == "e0" else "e0"
            assert hb.post("/score", json={"token_ids": prompt}).json()["overlap"][other] == 0
            assert 'kvwire_router_load_reports_total{kind="predictions"} 1.0' in \
                hb.get("/metrics").text
            assert hl.post("/score", json={"token_ids": prompt}).json()["overlap"] == \
                {"e0": 0, "e1": 0}
    finally:
        for p in (a, b, alone):
            p.terminate()
            p.wait(10)
    assert a.returncode == 0 and b.returncode == 0


def test_share_load_needs_nats() -> None:
    r = subprocess.run([sys.executable, "-m", "kvwire", "serve", "--engine",
                        "e0=tcp://127.0.0.1:5999", "--share-load", "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--share-load needs --nats" in r.stderr, r.stderr


def test_proxy_replicas_share_a_streamed_requests_load_until_its_client_leaves(
        nats_server: Any, tmp_path: Any, engine_procs: Any,  # noqa: F811
        serve_proc: Any) -> None:  # noqa: F811
    """Two proxy replicas in front of two slow ``kvwire engine``s (their events through a
    ``kvwire bridge``): while a streamed chat runs through A, B counts its load on the
    engine A chose; the client leaving ends it at A, and at B."""
    from bridge_helpers import BridgeProc
    from test_proxy import _chat

    es = engine_procs(2, "--speed", "0.05")  # (200 output tokens: about 20 s)
    bridge = BridgeProc(tmp_path, nats_server.url, [f"e{i}={e.events}" for i, e in enumerate(es)])
    try:
        bridge.wait_started()
        args = ("--nats", nats_server.url, "--tokenizer", "builtin", "--probe-interval", "0.1",
                *[f"--nats-engine=e{i},url={e.url}" for i, e in enumerate(es)])
        _, ua = serve_proc(*args)
        _, ub = serve_proc(*args)
        with httpx.Client(base_url=ua, timeout=30) as ha, \
                httpx.Client(base_url=ub, timeout=30) as hb:
            for h in (ha, hb):
                wait_for(lambda h=h: h.get("/health").status_code == 200, timeout=60,
                         interval=0.05, what="replica healthy")
            # one answered request first: its output length, learned by A and (shared)
            # by B, gives a running request the decode load it keeps after its first token
            r = ha.post("/v1/chat/completions", json={**_chat("warm up " * 50, "hi"),
                                                      "max_tokens": 20})
            assert r.status_code == 200, r.text
            body = {**_chat("a long story " * 200, "go on"), "max_tokens": 200, "stream": True}
            with ha.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                engine = r.headers["x-kvwire-engine"]
                chunks = r.iter_raw()  # (kept: a dropped iterator closes the response)
                next(chunks)  # the first chunk: running, its prefill done
                wait_for(lambda: 0 < _loads(ha)[engine] == _loads(hb)[engine], timeout=30,
                         interval=0.02, what="the running request's load the same at B")
                assert "kvwire_router_peer_reservations 1.0" in hb.get("/metrics").text
                # a proxied request's id (p0 the warm-up, p1 this one) is not the
                # decision API's to release, at A or (forwarded) at B
                for h in (ha, hb):
                    assert h.post("/release", json={"request_id": "p1"}).status_code == 404
                assert 0 < _loads(ha)[engine] == _loads(hb)[engine]
            wait_for(lambda: _loads(ha)[engine] == 0, timeout=30, interval=0.02,
                     what="the client gone: A released it")
            wait_for(lambda: _loads(hb)[engine] == 0, timeout=30, interval=0.02,
                     what="... and B with it")
            assert "kvwire_router_peer_reservations 0.0" in hb.get("/metrics").text
    finally:
        bridge.stop()


def _pair(url: str, ttl: float, heartbeat: float = 0.2) -> tuple[Any, Any, Any, Any]:
    """Two RouterCores (no engines: the load tracker is what they share) in this process,
    each sharing through its own LoadShare on one subject; A's changes are pushed."""
    from kvwire.nats.load_channel import LoadShare
    from kvwire.routing.core import RouterCore

    a, b = RouterCore([]), RouterCore([])
    sa = LoadShare(a, url, "kvwire.load.T", replica="A", heartbeat=heartbeat, ttl=ttl)
    sb = LoadShare(b, url, "kvwire.load.T", replica="B", heartbeat=heartbeat, ttl=ttl)
    sa.start()
    sb.start()
    a.share = sa.push
    return a, b, sa, sb


def test_a_long_queue_goes_in_several_reports_and_heartbeats_keep_peers_exact(
        nats_server: Any) -> None:
    """Two LoadShares in this process over a real nats-server: 20,000 reservations pushed
    at once reach the other side whole (in reports of at most MAX_OPS operations), half of
    them released reach it too, and A's heartbeats, which carry what it holds, then find
    nothing to put right."""
    from kvwire.routing.sharing import MAX_OPS

    a, b, sa, sb = _pair(nats_server.url, ttl=5.0)
    try:
        wait_for(lambda: "A" in sb.peers.peers, timeout=30, interval=0.02,
                 what="B hears A's heartbeat")
        with a.lock:
            for i in range(20_000):  # (in one report: 1.3 MB, over NATS's 1 MB payload)
                a.loads.reserve(f"q{i}", f"e{i % 3}", 2.0)
                a.share(["r", f"q{i}", f"e{i % 3}", 2.0, 0.0])
        wait_for(lambda: sb.peers.held() == 20_000, timeout=30, interval=0.02,
                 what="all 20,000 reservations at B")
        assert b.loads.loads() == pytest.approx({"e0": 13334.0, "e1": 13334.0, "e2": 13332.0})
        assert sa.counts["sent"] >= 20_000 // MAX_OPS and sa.counts["send_errors"] == 0
        for i in range(0, 20_000, 2):
            a.finish(f"q{i}", None)
        wait_for(lambda: sb.peers.held() == 10_000, timeout=30, interval=0.02,
                 what="the releases at B")
        want: dict[str, float] = {}
        for i in range(1, 20_000, 2):
            want[f"e{i % 3}"] = want.get(f"e{i % 3}", 0.0) + 2.0
        seen = sb.peers.counts["reports"]
        wait_for(lambda: sb.peers.counts["reports"] >= seen + 3, timeout=30, interval=0.02,
                 what="three more heartbeats from A")
        # A's heartbeats carry what it holds, and B already holds the same: nothing to put right
        assert sb.peers.held() == 10_000 and b.loads.loads() == pytest.approx(want)
        assert sb.peers.counts["corrected_by_heartbeat"] == 0
        assert sb.peers.counts["dropped_by_heartbeat"] == 0
    finally:
        a.close()
        b.close()


def test_a_change_reaches_the_peer_at_once_not_with_the_next_heartbeat(
        nats_server: Any) -> None:
    """What the request path pushes goes out within ``flush_interval`` (1 ms), not with
    the next heartbeat: with heartbeats 30 s apart, each reservation, first token and release
    at A is at B within 5 s (about 2 ms here), one after the other."""
    a, b, sa, sb = _pair(nats_server.url, ttl=60.0, heartbeat=30.0)
    try:
        for i in range(5):
            with a.lock:
                a.loads.reserve(f"q{i}", "e0", 10.0, prefill=8.0)
                a.share(["r", f"q{i}", "e0", 10.0, 8.0])
            wait_for(lambda i=i: b.loads.amount(f"A:q{i}") == 10.0, timeout=5, interval=0.005,
                     what=f"reservation {i} at B before any heartbeat")
        with a.lock:
            a.share(["f", "q0"])
        wait_for(lambda: b.loads.prefill("A:q0") == 0, timeout=5, interval=0.005,
                 what="the first token at B")
        a.finish("q1", 3)
        wait_for(lambda: b.loads.holder("A:q1") is None, timeout=5, interval=0.005,
                 what="the release at B")
        assert sb.peers.counts["ops"] == 7 and sb.peers.held() == 4
        # (no heartbeat yet: every report A counts as sent is one B received)
        assert sa.counts["sent"] == sb.peers.counts["reports"] and sa.counts["sent"] >= 1
    finally:
        a.close()
        b.close()
        for share in (sa, sb):  # close() ends the sharing thread
            share.close()
            assert share._thread is not None and not share._thread.is_alive()


def test_bad_settings_are_refused_by_name() -> None:
    from kvwire.nats.connect import NatsConnectError
    from kvwire.nats.load_channel import LoadShare
    from kvwire.routing.core import RouterCore

    share = LoadShare(RouterCore([]), "nats://127.0.0.1:1", "s", connect_timeout=0.5)
    with pytest.raises(NatsConnectError, match="cannot connect to NATS at nats://127.0.0.1:1"):
        share.start()  # nothing listens there: start() says so, it does not hang

    with pytest.raises(ValueError, match="ttl must be > 0"):
        PeerLoads(_tracker(), "me", ttl=0)
    core = RouterCore([])
    with pytest.raises(ValueError, match="heartbeat < ttl"):
        LoadShare(core, "nats://127.0.0.1:1", "s", heartbeat=2.0, ttl=2.0)
    with pytest.raises(ValueError, match="heartbeat < ttl"):
        LoadShare(core, "nats://127.0.0.1:1", "s", heartbeat=0, ttl=2.0)
    with pytest.raises(ValueError, match="flush_interval < heartbeat"):
        LoadShare(core, "nats://127.0.0.1:1", "s", heartbeat=0.5, flush_interval=0.5)
    with pytest.raises(ValueError, match="flush_interval < heartbeat"):
        LoadShare(core, "nats://127.0.0.1:1", "s", flush_interval=-1)


def test_a_report_carries_at_most_max_ops_and_the_live_reservations_as_they_stand() -> None:
    """The queue as reports (no thread started: ``_report`` is what the thread calls):
    at most MAX_OPS operations each, in order; a heartbeat's reservations are the ones
    reserved and not released, first tokens applied."""
    from kvwire.nats.load_channel import LoadShare
    from kvwire.routing.core import RouterCore
    from kvwire.routing.sharing import MAX_OPS

    share = LoadShare(RouterCore([]), "nats://127.0.0.1:1", "kvwire.load.T", replica="A")
    for i in range(MAX_OPS + 10):
        share.push(["r", f"q{i}", "e0", 5.0, 3.0])
    share.push(["f", "q1"])
    share.push(["x", "q0", 7])
    first = share._report(False)
    assert len(first.ops) == MAX_OPS and first.live is None
    assert first.ops[0] == ["r", "q0", "e0", 5.0, 3.0]
    second = share._report(True)
    assert [op[0] for op in second.ops] == ["r"] * 10 + ["f", "x"]
    assert second.seq == first.seq + 1 and second.live is not None
    assert len(second.live) == MAX_OPS + 9 and "q0" not in second.live
    assert second.live["q1"] == ["e0", 2.0, 0.0] and second.live["q2"] == ["e0", 5.0, 3.0]
    assert len(share._report(False).ops) == 0


def test_a_heartbeat_over_the_servers_max_payload_goes_without_its_reservations(
        tmp_path: Any) -> None:
    """A nats-server that takes 64 KB a message at most, and 3,000 reservations in flight at
    A (about 90 KB as a heartbeat's list): the heartbeats are cut to fit and still sent (B
    keeps hearing A, nothing fails to send); the reservations themselves went in reports
    that fit."""
    from nats_helpers import NatsServer

    conf = tmp_path / "small.conf"
    conf.write_text("max_payload: 65536\n")
    srv = NatsServer(tmp_path / "nats", extra_args=["-c", str(conf)]).start()
    try:
        a, b, sa, sb = _pair(srv.url, ttl=5.0)
        try:
            for chunk in range(30):
                with a.lock:
                    for i in range(chunk * 100, chunk * 100 + 100):
                        a.loads.reserve(f"q{i}", "e0", 1.0)
                        a.share(["r", f"q{i}", "e0", 1.0, 0.0])
                wait_for(lambda c=chunk: sb.peers.held() == c * 100 + 100, timeout=30,
                         interval=0.01, what=f"chunk {chunk} at B")
            wait_for(lambda: sa.counts["heartbeats_cut"] >= 2, timeout=30, interval=0.02,
                     what="heartbeats cut to fit")
            heard = sb.peers.counts["reports"]
            wait_for(lambda: sb.peers.counts["reports"] > heard, timeout=30, interval=0.02,
                     what="B still hears A")
            assert sa.counts["send_errors"] == 0 and sb.peers.held() == 3000
        finally:
            a.close()
            b.close()
            sa.close()
            sb.close()
    finally:
        srv.stop()


def test_a_heartbeat_leaves_out_own_reservations_expired_here() -> None:
    """A reservation older than the load tracker's expiry (its release never came) is not
    sent in heartbeats any more: the peers' copies then expire with the heartbeat's."""
    from kvwire.nats.load_channel import LoadShare
    from kvwire.routing.core import RouterCore

    share = LoadShare(RouterCore([], expiry_s=0.05), "nats://127.0.0.1:1", "s", replica="A")
    share.push(["r", "old", "e0", 5.0, 0.0])
    assert share._report(True).live == {"old": ["e0", 5.0, 0.0]}
    time.sleep(0.1)  # (older than the expiry: load only makes it older)
    share.push(["r", "new", "e0", 3.0, 0.0])
    assert share._report(True).live == {"new": ["e0", 3.0, 0.0]}


def test_predictions_are_cut_by_bytes_and_dropped_first_when_a_backlog_forms() -> None:
    """Predictions carry up to 32 KB of keys: a report holds MAX_KEY_BYTES of them (and
    the operation that crosses it); once PREDICTION_BACKLOG operations wait (NATS slow or
    down), new predictions are dropped, counted, while reservations still queue."""
    from kvwire.nats.load_channel import LoadShare
    from kvwire.routing.core import RouterCore
    from kvwire.routing.sharing import MAX_KEY_BYTES, PREDICTION_BACKLOG

    share = LoadShare(RouterCore([]), "nats://127.0.0.1:1", "kvwire.load.T", replica="A")
    keys = bytes(32 * 1024)
    n = MAX_KEY_BYTES // len(keys) + 3
    for _ in range(n):
        share.push(["p", "e0", keys])
    share.push(["r", "q0", "e0", 5.0, 0.0])
    first = share._report(False)
    assert len(first.ops) == MAX_KEY_BYTES // len(keys)
    assert [op[0] for op in share._report(False).ops] == ["p"] * 3 + ["r"]
    for i in range(PREDICTION_BACKLOG):
        share.push(["r", f"b{i}", "e0", 1.0, 0.0])
    share.push(["p", "e0", keys])
    share.push(["r", "last", "e0", 1.0, 0.0])
    assert share.counts["dropped"] == 1 and len(share._out) == PREDICTION_BACKLOG + 1
    assert share._out[-1][1] == "last"


def test_a_nats_server_down_and_back_neither_blocks_nor_ends_the_sharing(
        nats_server: Any) -> None:
    """The nats-server SIGKILLed: pushes on the request path still return at once (they
    queue); the peers, silent to each other, drop each other's reservations after the ttl.
    The server back on the same port: both reconnect by themselves, and the next heartbeat
    gives each the other's reservations again, whole."""
    import time

    a, b, sa, sb = _pair(nats_server.url, ttl=1.0)
    try:
        with a.lock:
            a.loads.reserve("q0", "e0", 4.0)
            a.share(["r", "q0", "e0", 4.0, 0.0])
        wait_for(lambda: b.loads.loads() == {"e0": 4.0}, timeout=30, interval=0.02,
                 what="q0 at B")
        nats_server.kill()
        t0 = time.perf_counter()
        with a.lock:
            for i in range(1, 1001):
                a.loads.reserve(f"q{i}", "e1", 1.0)
                a.share(["r", f"q{i}", "e1", 1.0, 0.0])
        # Queued, not sent: a push that waited on the dead connection would wait out a
        # timeout (>= 1 s) each, >= 1000 s for these; the bound is far from both that and
        # a busy host's ~1 ms a push.
        assert time.perf_counter() - t0 < 30
        assert sa.counts["dropped"] == 0
        wait_for(lambda: b.loads.loads() == {}, timeout=30, interval=0.05,
                 what="A silent past the ttl: its reservations dropped at B")
        nats_server.start()
        wait_for(lambda: b.loads.loads() == {"e0": 4.0, "e1": 1000.0}, timeout=60,
                 interval=0.05, what="reconnected: A's reservations at B again, whole")
        assert "A" in sb.peers.peers and sb.peers.counts["peers_expired"] == 1
    finally:
        a.close()
        b.close()
