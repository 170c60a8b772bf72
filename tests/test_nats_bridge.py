"""``kvwire bridge`` (the writer side): real nats-server, real engine processes (kvwire
and reference publishers on loopback), real bridge processes. Ground truth at the end of
each test: the engine's own cache vs the state rebuilt from the JetStream subject, which
must also keep the per-subject contract (tests/bridge_helpers.py: no gap, no duplicate)."""

from __future__ import annotations

import asyncio
import re
import time

import msgspec
import pytest

pytest.importorskip("nats")

from bridge_helpers import BridgeProc, subject_log, wait_subject_seq  # noqa: E402
from fault_helpers import Engine  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from nats_api import nats_api_fixture  # noqa: E402, F401 - the nats_api fixture

from kvwire.consume.replies import InfoReply  # noqa: E402
from kvwire.consume.stream import (  # noqa: E402
    Batch,
    SendInfo,
    SendReplay,
    SendSnapshot,
    StreamMachine,
)
from kvwire.index.cache import BlockCache  # noqa: E402
from kvwire.nats.snapshots import read_snapshot  # noqa: E402
from kvwire.nats.subjects import msg_id  # noqa: E402
from kvwire.nats.writer import H_EXPECT, Lane, marker_entries  # noqa: E402
from kvwire.wire.events import BlockStored, KVEventBatch, encode_batch  # noqa: E402

K, R = "kvwire.events.k.0", "kvwire.events.r.0"


def _spec(name: str, e: Engine) -> str:
    return f"{name}={e.endpoint},replay={e.replay_endpoint}"


#: Both writer modes: guarded runs (the default) and one pipelined message per batch.
PACKS = pytest.mark.parametrize("pack", ["256", "1"], ids=["guarded", "pack1"])


@pytest.fixture
def engines():
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


def test_items_land_on_subjects_exactly(nats_server, tmp_path, engines):
    """Both publisher kinds: one subject each, a reset + snapshot marker first, then every
    batch once with (epoch, seq) headers and Msg-Ids; the subject rebuilds the engine."""
    k = Engine(1, workload="small")
    r = Engine(2, ref=True, workload="small")
    engines += [k, r]
    b = BridgeProc(tmp_path, nats_server.url, [_spec("k", k), _spec("r", r)],
                   "--snapshot-interval", "1", "--log-interval", "0.5")
    try:
        b.wait_started()
        k.run(2000, 3000)
        r.run(2000, 3000)
        dk, dr = k.wait_done(60), r.wait_done(60)
        wait_subject_seq(nats_server.url, K, dk.last_seq, 30, procs=[b])
        wait_subject_seq(nats_server.url, R, dr.last_seq, 30, procs=[b])
        assert b.stop() == 0, b.log()
    finally:
        b.kill()
    lk, lr = subject_log(nats_server.url, K), subject_log(nats_server.url, R)
    assert lk.cache.as_dict() == dk.truth and lr.cache.as_dict() == dr.truth
    assert len(lk.markers) == len(lr.markers) == 1
    # kvwire: the publisher's epoch; its heartbeats (empty batches) go on the subject too
    assert lk.batches[-1][0] == k.epoch and lk.batches[-1][1] >= dk.last_seq
    assert lr.batches[-1] == (0, dr.last_seq) and lr.batches[0] == (0, 0)  # reference: run 0
    assert "stopped" in b.log() and "bridge: 2 streams," in b.log()  # + the periodic line
    assert re.search(r"lag p50 [0-9.]+ / p99 [0-9.]+ / max [0-9.]+ ms \([1-9][0-9]*\)",
                     b.log()), b.log()  # some line saw batches stored
    # The object-store snapshot written on the clean exit covers the whole subject.
    snap = asyncio.run(_read_snapshot(nats_server.url, "k", 0))
    assert snap.js_seq == lk.last_js_seq and snap.epoch == k.epoch and snap.exact
    assert snap.cache().as_dict() == dk.truth


async def _read_snapshot(url: str, engine: str, rank: int):
    import nats

    nc = await nats.connect(url)
    try:
        return await read_snapshot(nc.jetstream(), engine, rank)
    finally:
        await nc.close()


async def _republish(url: str, subject: str) -> tuple[bool, int, int]:
    """Publish the subject's last message again with its Msg-Id: (duplicate?, msgs before,
    msgs after)."""
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        last = await js.get_last_msg("KVWIRE", subject)
        before = (await js.stream_info("KVWIRE")).state.messages
        # (without the bridge's guard, which the server would check first and refuse)
        h = {k: v for k, v in last.headers.items() if k != H_EXPECT}
        ack = await js.publish(subject, last.data, headers=h)
        after = (await js.stream_info("KVWIRE")).state.messages
        return ack.duplicate, before, after
    finally:
        await nc.close()


def _api_used(b: BridgeProc, api: str) -> None:
    """The bridge process wrote through the nats-py path the test asked for (nats_api)."""
    assert f'"nats_api": "{api}"' in b.log(), b.log()


@PACKS
def test_duplicates_dropped_redundant_bridges_write_once(nats_server, tmp_path, engines, pack,
                                                         nats_api):
    """Two bridges follow the same engines (redundant mode): every message exists once; and a
    message published again with its Msg-Id is dropped by the server."""
    k = Engine(3, workload="small")
    r = Engine(4, ref=True, workload="small")
    engines += [k, r]
    specs = [_spec("k", k), _spec("r", r)]
    b1 = BridgeProc(tmp_path, nats_server.url, specs, "--pack", pack)
    b2 = None
    try:
        b1.wait_started()
        # The second joins the kvwire engine's subject once it holds the first's markers, so
        # it resumes after them and the subject has one marker set. (Two bridges that
        # bootstrap at once may each write a whole set: test_nats_pack_procs.py,
        # test_redundant_bridges_bootstrapping_at_once_keep_a_clean_log.)
        wait_subject_seq(nats_server.url, K, -1, 30, procs=[b1])
        b2 = BridgeProc(tmp_path, nats_server.url, specs, "--pack", pack)
        b2.wait_started()
        k.run(1500, 3000)
        r.run(1500, 3000)
        dk, dr = k.wait_done(60), r.wait_done(60)
        wait_subject_seq(nats_server.url, K, dk.last_seq, 30, procs=[b1, b2])
        wait_subject_seq(nats_server.url, R, dr.last_seq, 30, procs=[b1, b2])
        assert b1.stop() == 0 and b2.stop() == 0
    finally:
        b1.kill()
        if b2 is not None:
            b2.kill()
    _api_used(b1, nats_api)
    lk, lr = subject_log(nats_server.url, K), subject_log(nats_server.url, R)
    assert lk.cache.as_dict() == dk.truth and lr.cache.as_dict() == dr.truth
    assert len(lk.markers) == len(lr.markers) == 1
    dup, before, after = asyncio.run(_republish(nats_server.url, K))
    assert dup and before == after


@PACKS
@pytest.mark.parametrize("ref", [False, True], ids=["kvwire", "reference"])
def test_bridge_sigkill_restart_exact(nats_server, tmp_path, engines, ref, pack, nats_api):
    """SIGKILL the bridge mid-stream, restart it while the engine keeps publishing: it reads
    the subject's last (epoch, seq), gets seq + 1 on from the engine's replay buffer, and
    the subject has no batch missing and none twice (one marker set: the first join). The
    engine publishes a second run while no bridge runs, so the restarted one has batches
    to resume however late the host lets it start (the first run may be over by the kill),
    and a third run live beside the resume."""
    e = Engine(5, ref=ref, workload="small")
    engines.append(e)
    subject = R if ref else K
    name = "r" if ref else "k"
    opts = ("--snapshot-interval", "0.5", "--pack", pack)
    b = BridgeProc(tmp_path, nats_server.url, [_spec(name, e)], *opts)
    b2 = None
    try:
        b.wait_started()
        e.run(3000, 3000)
        wait_subject_seq(nats_server.url, subject, 1500, 30, procs=[b])
        b.kill()
        e.wait_done(60)
        e.run(1500)  # nobody bridges these: they must come from the replay buffer
        e.wait_done(60)
        b2 = BridgeProc(tmp_path, nats_server.url, [_spec(name, e)], *opts)
        e.run(1500, 3000)  # live while the restarted bridge resumes
        b2.wait_started()
        d = e.wait_done(60)
        wait_subject_seq(nats_server.url, subject, d.last_seq, 30, procs=[b2])
        assert b2.stop() == 0, b2.log()
    finally:
        b.kill()
        if b2 is not None:
            b2.kill()
    log = subject_log(nats_server.url, subject)
    assert len(log.markers) == 1, log.markers
    assert log.cache.as_dict() == d.truth
    assert '"resumed": 1,' in b2.log() and '"markers": 0,' in b2.log(), b2.log()
    _api_used(b2, nats_api)


@PACKS
def test_nats_server_sigkill_restart(nats_server, tmp_path, engines, pack, nats_api):
    """nats-server SIGKILLed mid-stream and restarted on its file store: what it had stored
    is all there, the bridge reconnects by itself and the subject ends exact."""
    e = Engine(6, workload="small")
    engines.append(e)
    b = BridgeProc(tmp_path, nats_server.url, [_spec("k", e)], "--ack-timeout", "1",
                   "--snapshot-interval", "0.5", "--pack", pack)
    try:
        b.wait_started()
        e.run(6000, 3000)
        wait_subject_seq(nats_server.url, K, 1500, 30, procs=[b])
        nats_server.kill()
        nats_server.start()
        d = e.wait_done(60)
        wait_subject_seq(nats_server.url, K, d.last_seq, 60, procs=[b])
        assert b.stop() == 0, b.log()
    finally:
        b.kill()
    log = subject_log(nats_server.url, K)
    assert log.cache.as_dict() == d.truth
    seqs = {s for ep, s in log.batches if ep == e.epoch}
    first = log.batches[0][1]
    assert set(range(first, 1501)) <= seqs  # everything stored before the kill survived
    assert "reconnected to NATS" in b.log()
    _api_used(b, nats_api)


@pytest.mark.parametrize("ref", [False, True], ids=["kvwire", "reference"])
def test_engine_restart_puts_reset_marker(nats_server, tmp_path, engines, ref):
    """The engine restarts (kvwire: new epoch; reference: its seq starts over): the subject
    gets a reset marker (kvwire: the new epoch; reference: run + 1) and ends as the new
    engine's cache."""
    e = Engine(7, ref=ref, workload="small")
    engines.append(e)
    subject, name = (R, "r") if ref else (K, "k")
    b = BridgeProc(tmp_path, nats_server.url, [_spec(name, e)])
    try:
        b.wait_started()
        e.run(1500, 3000)
        d = e.wait_done(60)
        wait_subject_seq(nats_server.url, subject, d.last_seq, 30, procs=[b])
        e.kill()
        e2 = Engine(8, port=e.port, rport=e.rport, ref=ref, workload="small")
        engines.append(e2)
        e2.run(1000, 3000)
        d2 = e2.wait_done(60)
        # (a reference restart shows as its seq going back under what the bridge had)
        wait_subject_seq(nats_server.url, subject, d2.last_seq, 30, procs=[b],
                         epoch=1 if ref else e2.epoch)
        assert b.stop() == 0, b.log()
    finally:
        b.kill()
    log = subject_log(nats_server.url, subject)
    assert len(log.markers) == 2, log.markers
    assert log.markers[1][0] == (1 if ref else e2.epoch)
    assert log.cache.as_dict() == d2.truth


async def _holders(url: str, names: list[str]) -> dict[str, str | None]:
    import nats

    from kvwire.nats.leases import LeaseTable

    nc = await nats.connect(url)
    try:
        t = LeaseTable(nc.jetstream(), "observer")
        try:
            await t.open()
        except Exception:  # noqa: BLE001 - not created yet
            return dict.fromkeys(names)
        return {n: await t.holder(n) for n in names}
    finally:
        await nc.close()


def _wait_holders(url: str, names: list[str], ok, timeout: float, procs) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = asyncio.run(_holders(url, names))
        if ok(h):
            return h
        for p in procs:
            assert p.poll() is None, p.log()
        assert time.monotonic() < deadline, f"lease holders {h}"
        time.sleep(0.1)  # polling the bucket


def _pid(owner: str | None) -> int:
    return int(owner.split(":")[1]) if owner else -1


def test_share_mode_one_bridge_per_engine_and_takeover(nats_server, tmp_path, engines):
    """Two bridges with --share split two engines by leases (each engine by exactly one);
    SIGKILL one: its lease expires, the other takes the engine over and the subject goes on
    exactly (no marker, no gap, no duplicate)."""
    a = Engine(9, workload="small")
    b_ = Engine(10, workload="small")
    engines += [a, b_]
    specs = [_spec("a", a), _spec("b", b_)]
    opts = ("--share", "--lease-ttl", "1.5", "--snapshot-interval", "0.5")
    p1 = BridgeProc(tmp_path, nats_server.url, specs, *opts)
    p2 = None
    try:
        p1.wait_started()
        p2 = BridgeProc(tmp_path, nats_server.url, specs, *opts)
        p2.wait_started()
        procs = [p1, p2]
        h = _wait_holders(nats_server.url, ["a", "b"],
                          lambda h: None not in h.values() and len(set(h.values())) == 2,
                          30, procs)
        assert {_pid(v) for v in h.values()} == {p1.proc.pid, p2.proc.pid}
        a.run(5000, 2500)
        b_.run(5000, 2500)
        wait_subject_seq(nats_server.url, "kvwire.events.a.0", 1000, 30, procs=procs)
        victim = p1 if _pid(h["a"]) == p1.proc.pid else p2
        survivor = p2 if victim is p1 else p1
        victim.kill()
        _wait_holders(nats_server.url, ["a", "b"],
                      lambda h: {_pid(v) for v in h.values()} == {survivor.proc.pid},
                      30, [survivor])
        da, db = a.wait_done(60), b_.wait_done(60)
        for name, d in (("a", da), ("b", db)):
            wait_subject_seq(nats_server.url, f"kvwire.events.{name}.0", d.last_seq, 30,
                             procs=[survivor])
        assert survivor.stop() == 0, survivor.log()
    finally:
        p1.kill()
        if p2 is not None:
            p2.kill()
    for name, d in (("a", da), ("b", db)):
        log = subject_log(nats_server.url, f"kvwire.events.{name}.0")
        assert len(log.markers) == 1, log.markers
        assert log.cache.as_dict() == d.truth


async def _make_stream(url: str, name: str, subjects: list[str]) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        await nc.jetstream().add_stream(name=name, subjects=subjects)
    finally:
        await nc.close()


def test_bad_config_clear_errors(nats_server, capsys):
    """Each bad setting: exit 2 and one line naming it, no traceback."""
    from nats_helpers import free_port

    from kvwire.cli.main import main

    eng = "e=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558"
    url = nats_server.url

    def run(*argv: str) -> str:
        rc = main(["bridge", "--nats", url, "--log-interval", "0", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err, err
        return err

    assert "duplicate_window (60s) cannot exceed max_age (30s)" in run(
        "--engine", eng, "--max-age", "30", "--duplicate-window", "60")
    with pytest.raises(SystemExit) as ex:  # refused by argparse (kvwire.consume.engine_spec)
        main(["bridge", "--nats", url, "--engine", "a.b=tcp://127.0.0.1:5557"])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and "engine name 'a.b' must be" in err and "Traceback" not in err
    assert "below 1 MiB" in run("--engine", eng, "--max-bytes", "1000")
    assert "stream name 'X.Y'" in run("--engine", eng, "--stream", "X.Y")
    asyncio.run(_make_stream(url, "OTHER", ["other.>"]))
    assert "exists with subjects ['other.>']" in run("--engine", eng, "--stream", "OTHER")
    asyncio.run(_make_stream(url, "TAKEN", ["kvwire.events.>"]))
    assert "JetStream refused stream KVWIRE" in run("--engine", eng)  # subjects overlap
    url = f"nats://127.0.0.1:{free_port()}"
    rc = main(["bridge", "--nats", url, "--engine", eng, "--connect-timeout", "1"])
    err = capsys.readouterr().err  # no server there: a runtime failure, exit 1
    assert rc == 1 and "cannot connect to NATS" in err and "Traceback" not in err, err
    with pytest.raises(SystemExit):
        main(["bridge", "--nats", url, "--engine", eng, "--max-age", "-5"])
    assert "must be a finite number > 0" in capsys.readouterr().err


# --------------------------------------------------------------------------- pure parts

_blocks = st.lists(st.integers(1, 40), min_size=0, max_size=30)


@settings(max_examples=60, deadline=None)
@given(sizes=_blocks, limit=st.integers(1500, 20_000), exact=st.booleans())
def test_marker_chunks_round_trip(sizes, limit, exact):
    """Snapshot markers: a reset, then chunks 0..n-1 each under the size limit (a chain too
    big is split), whose events rebuild exactly the state given."""
    events, h = [], 1
    for n in sizes:
        events.append(BlockStored(list(range(h, h + n)), h - 1 if h > 1 else None,
                                  list(range(n * 4)), 4, None))
        h += n
    lane = Lane("kvwire.events.e.0", "e", 0)
    out = marker_entries(lane, 7, 41, events, exact, "why\r\nnot", limit + 4096)
    assert out[0].kind == "reset" and out[0].headers["Kvwire-Reason"] == "why not"
    chunks = out[1:]
    assert [c.headers["Kvwire-Chunk"] for c in chunks] == \
        [f"{i}/{len(chunks)}" for i in range(len(chunks))]
    want, got = BlockCache(), BlockCache()
    want.apply_events(events)
    dec = msgspec.msgpack.Decoder(list[BlockStored])
    for c in chunks:
        assert len(c.payload) <= limit
        i = int(c.headers["Kvwire-Chunk"].split("/")[0])
        assert c.headers["Nats-Msg-Id"] == msg_id("e", 0, 7, 41, "snapshot", i)
        assert ("Kvwire-Exact" in c.headers) == (not exact)
        got.apply_events(dec.decode(c.payload))
    assert got.as_dict() == want.as_dict()


def _payload() -> bytes:
    return encode_batch(KVEventBatch(0.0, [], None))


def test_stream_machine_resume_after():
    """The bridge's restart: a publisher still running epoch 7 and holding seq 11 is asked
    for a replay from 11 and batches 11.. come without Reset/Snapshot; another epoch, or
    11 no longer buffered, bootstraps as usual (snapshot)."""
    m = StreamMachine("s", resume_after=(7, 10))
    assert isinstance(m.start(0.0)[0], SendInfo)
    out = m.info(InfoReply(epoch=7, seq=12, oldest=5, snapshot=True), 0.1)
    assert [type(o) for o in out] == [SendReplay] and out[0].start == 11
    got = [o for s in (11, 12) for o in m.replay(s, _payload(), 0.2)]
    assert [(type(o), o.seq, o.epoch) for o in got] == [(Batch, 11, 7), (Batch, 12, 7)]
    for info in (InfoReply(epoch=8, seq=12, oldest=5, snapshot=True),
                 InfoReply(epoch=7, seq=30, oldest=12, snapshot=True)):
        m = StreamMachine("s", resume_after=(7, 10))
        m.start(0.0)
        assert [type(o) for o in m.info(info, 0.1)] == [SendSnapshot]


def test_reference_engine_restarted_while_bridge_down(nats_server, tmp_path, engines):
    """A reference engine has no epoch: when it restarted while the bridge was away and its
    new run is already past the subject's seq, the bridge sees that the batch at that seq
    differs and writes the new run as incarnation 1 (markers), not as a continuation."""
    e = Engine(11, ref=True, workload="small")
    engines.append(e)
    b = BridgeProc(tmp_path, nats_server.url, [_spec("r", e)])
    try:
        b.wait_started()
        e.run(800, 3000)
        d = e.wait_done(60)
        wait_subject_seq(nats_server.url, R, d.last_seq, 30, procs=[b])
        b.kill()
        e.kill()
        e2 = Engine(12, port=e.port, rport=e.rport, ref=True, workload="small")
        engines.append(e2)
        e2.run(1200, 5000)
        d2 = e2.wait_done(60)
        b = BridgeProc(tmp_path, nats_server.url, [_spec("r", e2)])
        b.wait_started()
        wait_subject_seq(nats_server.url, R, d2.last_seq, 30, procs=[b], epoch=1)
        assert b.stop() == 0, b.log()
    finally:
        b.kill()
    log = subject_log(nats_server.url, R)
    assert [m[:2] for m in log.markers] == [(0, -1), (1, 799)], log.markers
    assert log.cache.as_dict() == d2.truth
    assert '"diverged": 1,' in b.log()


async def _retained(url: str, subject: str, engine: str):
    import nats

    from kvwire.nats.snapshots import rebuild_subject

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info("KVWIRE", subjects_filter=subject)
        st = await rebuild_subject(js, "KVWIRE", subject, engine, 0)
        return info, st
    finally:
        await nc.close()


def test_retention_limits_and_snapshot_bootstrap(nats_server, tmp_path, engines):
    """Limits given on the command line are the stream's; with per-subject history cut to
    300 messages, the object-store snapshot + what is left rebuilds the engine exactly.
    The bridge packs what it reads together into one message, so how many messages a number
    of batches makes depends on the box's speed: the engine runs until over 400 were
    written, so that the cut is sure to have happened."""
    e = Engine(13, workload="small")
    engines.append(e)
    b = BridgeProc(tmp_path, nats_server.url, [_spec("k", e)], "--max-age", "3600",
                   "--max-bytes", str(64 << 20), "--max-msgs-per-subject", "300",
                   "--duplicate-window", "30", "--snapshot-interval", "0.3")
    try:
        b.wait_started()
        for _ in range(20):
            e.run(1000, 3000)
            d = e.wait_done(60)
            wait_subject_seq(nats_server.url, K, d.last_seq, 30, procs=[b])
            if b.report()["writer"]["sent"] > 400:
                break
        assert b.stop() == 0, b.log()
    finally:
        b.kill()
    info, st = asyncio.run(_retained(nats_server.url, K, "k"))
    c = info.config
    assert (c.max_age, c.max_bytes, c.max_msgs_per_subject, c.duplicate_window) == \
        (3600, 64 << 20, 300, 30)
    assert c.allow_direct and str(getattr(c.storage, "value", c.storage)) == "file"
    assert info.state.last_seq > 400  # written (the stream holds subject K alone)
    assert info.state.subjects[K] == 300  # history before the last 300 is gone
    assert st.exact and st.complete and st.epoch == e.epoch
    assert st.cache.as_dict() == d.truth
    # A bridge started with other limits updates the existing stream.
    b = BridgeProc(tmp_path, nats_server.url, [_spec("k", e)], "--max-msgs-per-subject", "200")
    try:
        b.wait_started()
        assert b.stop() == 0, b.log()
    finally:
        b.kill()
    info, _ = asyncio.run(_retained(nats_server.url, K, "k"))
    assert info.config.max_msgs_per_subject == 200 and info.state.subjects[K] == 200


def _two_free_pairs() -> tuple[int, int]:
    """Base ports P, Q with P, P+1, Q, Q+1 all free (DP ranks sit at port + rank)."""
    from ports import free_port

    return free_port(2), free_port(2)


def test_dp_ranks_get_one_subject_each(nats_server, tmp_path, engines):
    """``ranks=2``: ranks at port + rank, each on its own subject ``<engine>.<rank>``."""
    p, q = _two_free_pairs()
    e0 = Engine(14, port=p, rport=q, workload="small")
    e1 = Engine(15, port=p + 1, rport=q + 1, workload="small")
    engines += [e0, e1]
    b = BridgeProc(tmp_path, nats_server.url,
                   [f"m={e0.endpoint},replay={e0.replay_endpoint},ranks=2"])
    try:
        b.wait_started()
        e0.run(800, 3000)
        e1.run(500, 3000)
        d0, d1 = e0.wait_done(60), e1.wait_done(60)
        for rank, d in ((0, d0), (1, d1)):
            wait_subject_seq(nats_server.url, f"kvwire.events.m.{rank}", d.last_seq, 30,
                             procs=[b])
        assert b.stop() == 0, b.log()
    finally:
        b.kill()
    for rank, d, e in ((0, d0, e0), (1, d1, e1)):
        log = subject_log(nats_server.url, f"kvwire.events.m.{rank}")
        assert log.cache.as_dict() == d.truth and log.batches[-1][0] == e.epoch


def _lane_with(states: list[int]):
    """A lane with batches seq 0..n-1 (epoch 1) in flight, in the given ack states. (No I/O:
    the writer's recovery decision is its pure part's; the real recoveries are in the fault
    tests.)"""
    from kvwire.nats.writer_state import WriterState

    w = WriterState()
    lane = w.lane("e", 0, "kvwire.events.e.0")
    truth = BlockCache()
    for seq, state in enumerate(states):
        b = KVEventBatch(0.0, [BlockStored([seq + 1], seq or None, [seq] * 4, 4, None)], None)
        truth.apply(b)
        e = lane.batch_entry(1, seq, b, encode_batch(b))
        e.state, e.js_seq = state, (100 + seq if state == 1 else None)
        lane.pending.append(e)
    return w, lane, truth


def test_writer_recovery_decisions():
    """After a broken connection or a refused/timed-out ack: what the subject's last
    message says was stored is kept, the rest is re-sent in order with the same Msg-Ids;
    a refused message before a stored one (a hole) becomes reset + snapshot markers."""
    w, lane, truth = _lane_with([1, 0, 0, 0, 0])  # acked, then four unanswered
    w.resolve(lane, ("e/0/1/2", 102))
    assert [e.seq for e in lane.held] == [3, 4] and lane.last == (1, 2)
    assert lane.last_js_seq == 102 and w.stats.resent == 2
    w, lane, _ = _lane_with([0, 0])
    w.resolve(lane, None)  # nothing of them on the subject
    assert [e.msg_id for e in lane.held] == ["e/0/1/0", "e/0/1/1"] and lane.last is None
    w, lane, truth = _lane_with([1, 2, 0, 0, 0])  # seq 1 refused, 3 stored after it
    w.resolve(lane, ("e/0/1/3", 103))
    kinds = [e.kind for e in lane.held]
    assert kinds[0] == "reset" and set(kinds[1:]) == {"snapshot"} and w.stats.holes == 1
    assert {(e.epoch, e.seq) for e in lane.held} == {(1, 4)}
    rebuilt = BlockCache()
    for e in list(lane.held)[1:]:
        rebuilt.apply_events(e.effect)
    assert rebuilt.as_dict() == truth.as_dict()
