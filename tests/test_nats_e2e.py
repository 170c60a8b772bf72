"""The fault suite across the whole JetStream chain: real engines (kvwire and reference
publishers) -> ``kvwire bridge`` process -> real nats-server (file storage) -> consumer
processes (``Subscriber([NatsStreams(url)])``). The bridge and the server are SIGKILLed and
restarted and both engines restart while a consumer keeps reading; at the end the consumer's
caches, a consumer that joins afterwards (snapshot bootstrap) and the subjects themselves
all equal the engines' ground truth, and every consumer saw the per-stream contract
(Reset, Snapshot(N), Batch(N+1), ... : checked item by item by fault_helpers.Rebuild)."""

from __future__ import annotations

import pytest

pytest.importorskip("nats")

from bridge_helpers import (  # noqa: E402
    BridgeProc,
    last_subject_msg,
    subject_log,
    wait_subject_seq,
)
from fault_helpers import Engine  # noqa: E402
from nats_e2e_helpers import NatsConsumer  # noqa: E402

K, R = "kvwire.events.k.0", "kvwire.events.r.0"


def _spec(name: str, e: Engine) -> str:
    return f"{name}={e.endpoint},replay={e.replay_endpoint}"


def test_chain_exact_through_bridge_server_and_engine_restarts(nats_server, tmp_path):
    k = Engine(31, workload="small")
    r = Engine(32, ref=True, workload="small")
    engines, bridges, consumers = [k, r], [], []
    opts = ("--snapshot-interval", "0.5", "--ack-timeout", "1")
    try:
        bridges.append(BridgeProc(tmp_path, nats_server.url, [_spec("k", k), _spec("r", r)],
                                  *opts))
        bridges[-1].wait_started()
        a = NatsConsumer(nats_server.url)  # reads live through everything below
        consumers.append(a)
        k.run(6000, 2500)
        r.run(6000, 2500)
        # (a kvwire engine's heartbeats are empty batches on its subject too: its seq goes
        # on after a run, hence ">=" for k below)
        # 1. the bridge is SIGKILLed mid-stream and a new one takes over
        wait_subject_seq(nats_server.url, K, 1500, 60, procs=bridges)
        bridges[-1].kill()
        bridges.append(BridgeProc(tmp_path, nats_server.url, [_spec("k", k), _spec("r", r)],
                                  *opts))
        bridges[-1].wait_started()
        # 2. the server is SIGKILLed mid-stream and restarted on its file store
        wait_subject_seq(nats_server.url, K, 3500, 60, procs=bridges[-1:])
        nats_server.kill()
        nats_server.start()
        dk, dr = k.wait_done(90), r.wait_done(90)
        wait_subject_seq(nats_server.url, K, dk.last_seq, 90, procs=bridges[-1:])
        wait_subject_seq(nats_server.url, R, dr.last_seq, 90, procs=bridges[-1:])
        a.wait(lambda s: s.get("k/dp0", {}).get("last_seq", -2) >= dk.last_seq
               and s.get("r/dp0", {}).get("last_seq") == dr.last_seq, 90,
               "consumer caught up after bridge and server restarts")
        assert a.cache() == {"k/dp0": dk.truth, "r/dp0": dr.truth}
        # 3. both engines restart: kvwire with a new epoch, the reference one with its seq
        # starting over (the bridge numbers its runs: the next one); every consumer gets a
        # reset. (The reference subject is at epoch 0 unless a bridge was killed while it
        # wrote a marker set: its successor resyncs in the next epoch.)
        epoch_r = last_subject_msg(nats_server.url, R)[0]
        k.kill()
        r.kill()
        k2 = Engine(33, port=k.port, rport=k.rport, workload="small")
        r2 = Engine(34, port=r.port, rport=r.rport, ref=True, workload="small")
        engines += [k2, r2]
        k2.run(1000, 2500)
        r2.run(1000, 2500)
        d2, dr2 = k2.wait_done(60), r2.wait_done(60)
        wait_subject_seq(nats_server.url, K, d2.last_seq, 60, procs=bridges[-1:],
                         epoch=k2.epoch)
        wait_subject_seq(nats_server.url, R, dr2.last_seq, 60, procs=bridges[-1:],
                         epoch=epoch_r + 1)
        st = a.wait(lambda s: s["k/dp0"]["epoch"] == k2.epoch
                    and s["k/dp0"]["last_seq"] >= d2.last_seq
                    and s["r/dp0"]["epoch"] == epoch_r + 1
                    and s["r/dp0"]["last_seq"] == dr2.last_seq, 60, "consumer saw the restarts")
        assert all(s["exact"] for s in st.values()), st
        assert a.cache() == {"k/dp0": d2.truth, "r/dp0": dr2.truth}
        # 4. a consumer that joins now bootstraps from the snapshot objects
        b = NatsConsumer(nats_server.url)
        consumers.append(b)
        b.wait(lambda s: s.get("k/dp0", {}).get("last_seq", -2) >= d2.last_seq
               and s.get("r/dp0", {}).get("last_seq") == dr2.last_seq, 60,
               "late consumer bootstrapped")
        assert b.cache() == {"k/dp0": d2.truth, "r/dp0": dr2.truth}
        assert bridges[-1].stop() == 0, bridges[-1].log()
    finally:
        for c in consumers:
            c.close()
        for bp in bridges:
            bp.kill()
        for e in engines:
            e.close()
    # The subjects themselves: no gap, no duplicate, markers only where something restarted
    # (the engines) or was cut short (a marker set a killed bridge left unfinished, resynced
    # by the next bridge); the consumer had one reset per marker set.
    lk, lr = subject_log(nats_server.url, K), subject_log(nats_server.url, R)
    assert lk.cache.as_dict() == d2.truth and lr.cache.as_dict() == dr2.truth
    for log, name in ((lk, "k/dp0"), (lr, "r/dp0")):
        restarts = [m for m in log.markers if "restarted" in m[2]]
        # (the bridge's log says why, should a restart be labelled otherwise: a follower
        # that failed and started over, a stream that went silent)
        assert len(restarts) == 1 and log.markers[-1] == restarts[0], (
            log.markers, bridges[-1].log())
        assert len(log.markers) == 2 + len(log.unfinished), (log.markers, log.unfinished)
        assert len(st[name]["resets"]) == len(log.markers), (st[name], log.markers)
    assert [m[0] for m in lr.markers] == list(range(epoch_r + 2)), lr.markers
