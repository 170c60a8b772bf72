"""Fault suite: real engine and subscriber processes, real sockets on loopback.

An engine process (``fault_helpers.engine_main``) runs a seeded ``DemoEngine`` workload and
publishes through ``ZmqEventPublisher`` (replay endpoint, snapshots, 0.2 s heartbeats); at
the end of a run it reports its ground truth (``BlockCache.as_dict()`` of everything it
published, cross-checked against the engine's own LRU keys). The subscriber (in the test
process, or in its own process where it gets killed) rebuilds the cache from deliveries:
Reset clears, Snapshot replaces, Batch applies, and the per-stream contract
``Reset, Snapshot(N), Batch(N+1), ...`` is checked on every item. Every scenario ends with
reconstruction == ground truth, block for block. Waits are conditions with deadlines;
the only timed pauses are the faults themselves (how long a process stays stopped, when a
kill lands).

Scenarios: (a) publisher killed and restarted on the same ports with a different seed;
(b) subscriber SIGKILLed and restarted while the engine publishes; (c) HWM drops forced
by a stalled subscriber (hwm/rcvhwm 10 and 16 KiB kernel socket buffers, so the drops
are real PUB drops, not simulated); (d) publisher SIGSTOPped then SIGCONTed (reported dead
then alive, state exact, no reset); (e) a subscriber joining after 100k batches.

Soak: ``test_soak_randomized`` runs scenarios a-d with seeded random timings (kill points,
rates, stall lengths, stop durations) for ``KVWIRE_SOAK_SECONDS`` seconds (default 8: one
short pass in CI). Long run on demand, reproducible by seed::

    KVWIRE_SOAK_SECONDS=1800 KVWIRE_SOAK_SEED=7 .venv/bin/python -m pytest -q -s \\
        tests/test_faults.py -k soak

(the soak's own pytest timeout grows with KVWIRE_SOAK_SECONDS).
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import zmq
from fault_helpers import Engine, Rebuild, SubProc, pump

from kvwire.consume.stream import StreamConfig
from kvwire.consume.subscriber import Subscriber

pytestmark = pytest.mark.timeout(240)

CFG = {"request_timeout": 1.0, "info_timeout": 0.5, "retry_delay": 0.1}
SOAK_SECONDS = float(os.environ.get("KVWIRE_SOAK_SECONDS", "8"))
SOAK_SEED = int(os.environ.get("KVWIRE_SOAK_SEED", "20240611"))


class Reg:
    """Things to release, closed in reverse order (subscribers before contexts)."""

    def __init__(self) -> None:
        self.things: list = []

    def __call__(self, thing):
        self.things.append(thing)
        return thing

    def close(self) -> None:
        while self.things:
            t = self.things.pop()
            try:
                if isinstance(t, zmq.Context):
                    t.term()
                else:
                    t.close()
            except Exception:  # cleanup must reach every process
                pass


@pytest.fixture
def reg():
    r = Reg()
    try:
        yield r
    finally:
        r.close()


def subscriber(reg: Reg, engine: Engine, **kw) -> tuple[Subscriber, Rebuild]:
    return reg(Subscriber([engine.spec()], config=StreamConfig(**CFG), **kw)), Rebuild()


def converge(sub: Subscriber, rb: Rebuild, engine: Engine, timeout: float = 30.0) -> None:
    """Wait for the engine's run to end and the rebuild to catch up; compare block for block."""
    pump(sub, rb, lambda: engine.poll_done() is not None, timeout, "engine run done")
    done = engine.done
    assert done is not None
    pump(sub, rb, lambda: rb.epoch == engine.epoch and rb.last_seq >= done.last_seq, timeout,
         "rebuild caught up with the engine")
    check_truth(rb.as_dict(), done, rb.exact)


def check_truth(rebuilt: dict, done, exact: bool) -> None:
    assert exact, "the rebuild is not exact"
    assert {h for _, h in done.truth} == set(done.lru)  # the truth is the engine's cache
    assert len(rebuilt) == len(done.truth)
    assert rebuilt == done.truth


def st(sub: Subscriber):
    return sub.stats()["e"].stream


# --------------------------------------------------------------------------- scenarios


def scenario_restart(reg: Reg, seed: int, n1: int = 1500, rate1: float = 1000,
                     kill_at: int = 300, n2: int = 400, rate2: float | None = 1000) -> None:
    """(a) SIGKILL the engine mid-stream; a new one (other seed) binds the same ports."""
    e1 = reg(Engine(seed))
    sub, rb = subscriber(reg, e1)
    e1.run(n1, rate1)
    pump(sub, rb, lambda: rb.epoch == e1.epoch and rb.last_seq >= kill_at, 20, "progress")
    e1.kill()
    e2 = reg(Engine(seed + 1000, port=e1.port, rport=e1.rport))
    assert e2.epoch != e1.epoch
    e2.run(n2, rate2)
    converge(sub, rb, e2)
    s = st(sub)
    print(f"restart: resets {rb.resets}")
    assert s.restarts >= 1 and any("restarted" in r for r in rb.resets[1:]), rb.resets
    assert rb.snapshots[-1][2] == e2.epoch and s.phase == "live"


def scenario_sub_kill(reg: Reg, seed: int, n: int = 1500, rate: float = 600,
                      kills: tuple[float, ...] = (0.5, 0.05), capacity: int = 4096) -> None:
    """(b) SIGKILL subscriber processes (after ``kills`` seconds each) while the engine runs."""
    e = reg(Engine(seed, capacity=capacity))
    e.run(n, rate)
    for delay in kills:
        s = reg(SubProc(e.spec(), CFG))
        time.sleep(delay)  # when the kill lands (the fault's timing, not a wait for a result)
        s.kill()
    s = reg(SubProc(e.spec(), CFG))
    done = e.wait_done(60)
    rbs = s.wait(lambda rb, _: rb["epoch"] == e.epoch and rb["last_seq"] >= done.last_seq,
                 30, "restarted subscriber caught up")
    check_truth(s.cache(), done, rbs["exact"])
    assert rbs["resets"] == ["bootstrap"] and rbs["snapshots"][0][1]  # exact snapshot boot
    # the engine carried on: no bad requests from the dead clients' leftovers, still serving
    es = e.stats()
    assert es["bad_requests"] == 0 and es["published"] == n
    assert es["snapshot_requests"] >= 1


def scenario_hwm(reg: Reg, seed: int, warm: int = 100, burst: int = 3000,
                 buffer_steps: int = 10_000, stall_extra: float = 0.0) -> None:
    """(c) The subscriber stops polling while the engine publishes flat out: real HWM drops."""
    e = reg(Engine(seed, hwm=10, sndbuf=16384, buffer_steps=buffer_steps))
    ctx = reg(zmq.Context())
    ctx.setsockopt(zmq.RCVBUF, 16384)  # default for the Subscriber's sockets
    sub, rb = subscriber(reg, e, ctx=ctx, rcvhwm=10)
    e.run(warm, 1000)
    pump(sub, rb, lambda: e.poll_done() is not None and rb.last_seq >= e.done.last_seq, 20,
         "warm-up delivered")
    e.run(burst, None)
    done = e.wait_done(60)  # the stall: nobody reads the subscriber's sockets meanwhile
    if stall_extra:
        time.sleep(stall_extra)  # stay stalled longer (heartbeats pile up too)
    pump(sub, rb, lambda: rb.last_seq >= done.last_seq, 40, "caught up after the stall")
    check_truth(rb.as_dict(), done, rb.exact)
    s = st(sub)
    print(f"hwm: gaps {s.gaps} replayed {s.replayed} resyncs {s.resyncs} lost {s.lost}")
    assert s.gaps >= 1 and (s.replayed > 0 or s.resyncs > 0), s
    assert rb.epoch == e.epoch


def scenario_sigstop(reg: Reg, seed: int, n: int = 1200, rate: float = 600,
                     stop_at: int = 200, stopped_for: float = 0.0) -> None:
    """(d) SIGSTOP the engine: reported dead (3 x 0.2 s), then alive after SIGCONT, exact."""
    e = reg(Engine(seed, hb=0.2))
    sub, rb = subscriber(reg, e)
    e.run(n, rate)
    pump(sub, rb, lambda: rb.epoch == e.epoch and rb.last_seq >= stop_at, 20, "progress")
    e.signal(signal.SIGSTOP)
    t_stop = time.monotonic()
    pump(sub, rb, lambda: bool(rb.liveness) and not rb.liveness[-1][0], 10, "reported dead")
    dead_after = rb.liveness[-1][1] - t_stop
    assert 0.3 < dead_after < 5.0, dead_after
    if stopped_for:
        end = time.monotonic() + stopped_for  # keep it stopped, the subscriber keeps polling
        pump(sub, rb, lambda: time.monotonic() >= end, stopped_for + 5, "stopped period")
    e.signal(signal.SIGCONT)
    pump(sub, rb, lambda: rb.liveness[-1][0], 10, "reported alive again")
    converge(sub, rb, e)
    s = st(sub)
    assert [a for a, _ in rb.liveness][:2] == [False, True] and s.deaths >= 1
    assert rb.resets == ["bootstrap"] and s.lost == 0 and s.restarts == 0, (rb.resets, s)


# --------------------------------------------------------------------------- fixed runs


def test_a_publisher_restart(reg):
    scenario_restart(reg, seed=1)


def test_b_subscriber_killed_and_restarted(reg):
    scenario_sub_kill(reg, seed=2)


def test_c_hwm_drops_stalled_subscriber(reg):
    scenario_hwm(reg, seed=3)


def test_d_publisher_sigstop_sigcont(reg):
    scenario_sigstop(reg, seed=4, stopped_for=1.5)


def test_e_late_join_after_100k_batches(reg):
    """100k batches before anyone listens (10x the replay buffer): bootstrap from snapshot."""
    e = reg(Engine(5, capacity=20_000, workload="small"))
    e.run(100_000, None)
    done = e.wait_done(180)
    assert done.last_seq >= 99_999 and len(done.truth) == 20_000
    t0 = time.monotonic()
    sub, rb = subscriber(reg, e)
    pump(sub, rb, lambda: rb.epoch == e.epoch and rb.last_seq >= done.last_seq, 60,
         "late joiner bootstrapped")
    boot = time.monotonic() - t0
    check_truth(rb.as_dict(), done, rb.exact)
    seq, exact, epoch, nblocks = rb.snapshots[0]
    assert exact and epoch == e.epoch and nblocks == 20_000 and seq >= 99_999, rb.snapshots
    s = st(sub)
    assert s.snapshots == 1 and s.resets == 1 and s.lost == 0 and s.gaps == 0
    assert boot < 30, boot
    # and it follows the live stream afterwards
    e.run(500, None)
    converge(sub, rb, e)
    assert st(sub).snapshots == 1


@pytest.mark.parametrize("n2,more", [(100, 0), (500, 0), (500, 20)],
                         ids=["below-our-seq", "past-our-seq", "past-then-live"])
def test_i_reference_restart_heard_nothing_of_live_is_found(reg, n2, more):
    """A reference engine restarts on the same ports and its new run goes by while the
    subscriber process is stopped (SIGSTOP: its SUB cannot reconnect, so the new run's
    batches are dropped at the PUB). No live seq ever goes back to tell. Whether the new
    run stays below our last seq (300 batches, then 100) or passes it (500), and whether
    the stream then stays quiet (the tail check) or goes on live (a gap after our seq), the
    replay asked from our last seq shows the restart, and the new run is rebuilt exactly,
    not taken for the old one's continuation."""
    r1 = reg(Engine(41, ref=True, workload="small"))
    s = reg(SubProc(r1.spec(), dict(CFG, info_interval=1.0)))
    r1.run(300, 2000)
    d1 = r1.wait_done(60)
    s.wait(lambda rb, _: rb["last_seq"] == d1.last_seq, 30, "caught up with the first run")
    os.kill(s.proc.pid, signal.SIGSTOP)
    try:
        r1.kill()
        r2 = reg(Engine(42, port=r1.port, rport=r1.rport, ref=True, workload="small"))
        r2.run(n2, None)
        d2 = r2.wait_done(60)
    finally:
        os.kill(s.proc.pid, signal.SIGCONT)
    if more:
        r2.run(more, 200)
        d2 = r2.wait_done(60)
    rb = s.wait(lambda rb, st: st["restarts"] >= 1 and rb["last_seq"] == d2.last_seq, 30,
                "the restart found and the new run followed")
    assert rb["exact"] and any("restarted" in r for r in rb["resets"][1:]), rb
    assert s.cache() == d2.truth


# --------------------------------------------------------------------------- soak


def _soak_round(rng: random.Random) -> tuple[str, dict]:
    kind = rng.choice(["restart", "sub_kill", "hwm", "sigstop"])
    if kind == "restart":
        n1 = rng.randrange(200, 2000)
        p = {"n1": n1, "rate1": rng.choice([300, 1000, 3000]), "kill_at": rng.randrange(0, n1 // 2),
             "n2": rng.randrange(1, 600), "rate2": rng.choice([None, 500, 2000])}
        return kind, p
    if kind == "sub_kill":
        p = {"n": rng.randrange(300, 1500), "rate": rng.choice([300, 1000, 3000]),
             "kills": tuple(round(rng.uniform(0.0, 0.8), 3) for _ in range(rng.randrange(1, 4))),
             "capacity": rng.choice([1024, 4096, 16384])}
        return kind, p
    if kind == "hwm":
        p = {"warm": rng.randrange(1, 300), "burst": rng.randrange(1000, 4000),
             "buffer_steps": rng.choice([500, 2000, 10_000]),
             "stall_extra": round(rng.uniform(0, 1.0), 3)}
        return kind, p
    p = {"n": rng.randrange(300, 1500), "rate": rng.choice([300, 1000]),
         "stop_at": rng.randrange(0, 200), "stopped_for": round(rng.uniform(0, 2.0), 3)}
    return kind, p


SCENARIOS = {"restart": scenario_restart, "sub_kill": scenario_sub_kill, "hwm": scenario_hwm,
             "sigstop": scenario_sigstop}


@pytest.mark.timeout(SOAK_SECONDS + 240)
def test_soak_randomized():
    """Scenarios a-d with seeded random timings; KVWIRE_SOAK_SECONDS / KVWIRE_SOAK_SEED."""
    rng = random.Random(SOAK_SEED)
    end = time.monotonic() + SOAK_SECONDS
    rounds = 0
    while rounds == 0 or time.monotonic() < end:
        kind, params = _soak_round(rng)
        r = Reg()
        try:
            SCENARIOS[kind](r, seed=rng.randrange(1 << 30), **params)
        except AssertionError as e:
            raise AssertionError(
                f"soak seed {SOAK_SEED} round {rounds}: {kind} {params}: {e}") from e
        finally:
            r.close()
        rounds += 1
    print(f"soak: {rounds} rounds in {SOAK_SECONDS}s (seed {SOAK_SEED})")


# --------------------------------------------------------------------------- reference publisher
# vLLM's own publisher (written here from the spec: fault_helpers.ref_engine_main)
# serves replay from its sending loop and drops replay replies at its ROUTER's HWM. ~2.5 KB
# batches, PUB hwm 20, ROUTER hwm 200 and 64 KiB kernel buffers on both sides, so a stalled
# consumer overflows every buffer on the way (real drops of live and replayed messages).

REF = {"hwm": 20, "router_hwm": 200, "sndbuf": 65536, "capacity": 1500}
REF_CFG = {"request_timeout": 0.5, "info_timeout": 0.3, "retry_delay": 0.1}


@pytest.mark.parametrize("per_send", [None, 8])
def test_f_reference_publisher_consumer_sigstopped_recovers_exactly(reg, per_send):
    """Several SIGSTOPs of a real subscriber process while the reference publisher sends
    ~2.5 KB batches at up to 3,000/s: every gap (and every cut-short replay answer) is
    filled from the publisher's buffer; the rebuilt cache equals the engine's, block for
    block, with nothing counted lost."""
    e = reg(Engine(11, ref=True, per_send=per_send, **REF))
    s = reg(SubProc(e.spec(), dict(REF_CFG, rcvhwm=50, rcvbuf=65536)))
    s.wait(lambda _, st_: st_["mode"] == "reference" and st_["phase"] == "await_first",
           20, "subscriber bootstrapped against an empty publisher")
    e.run(4000, 3000)
    s.wait(lambda rb, _: rb["last_seq"] >= 0, 30, "the run started")
    stalls = 3
    for _ in range(stalls):
        os.kill(s.proc.pid, signal.SIGSTOP)
        time.sleep(0.25)  # how long the consumer stays stopped (the fault itself)
        os.kill(s.proc.pid, signal.SIGCONT)
        time.sleep(0.1)  # running between stalls: it is catching up when the next one lands
    e.wait_done(90)
    # A reference publisher sends no heartbeats: batches dropped at the very end would go
    # unnoticed until the next one, so the engine goes on for a moment (as engines do).
    e.run(30, 100)
    done = e.wait_done(30)
    rb = s.wait(lambda rb, _: rb["last_seq"] >= done.last_seq, 60, "caught up")
    _, st_ = s.state()
    es = e.stats()
    print(f"ref stalls {stalls}: {done.last_seq + 1} batches, "
          f"{es['payload_bytes'] / (done.last_seq + 1):.0f} B avg; "
          f"gaps {st_['gaps']} replays {st_['replays']} replayed {st_['replayed']} "
          f"lost {st_['lost']} timeouts {st_['timeouts']}")
    assert st_["gaps"] >= 1 and st_["replayed"] > 0, st_  # the stalls really dropped
    assert st_["lost"] == 0 and rb["resets"] == ["bootstrap"], (st_, rb)
    check_truth(s.cache(), done, rb["exact"])


def test_g_reference_evicted_range_is_lost_and_reported(reg):
    """A gap longer than the publisher's buffer (200): exactly what it no longer holds is
    counted lost, the stream goes on inexact (Snapshot(exact=False)), and what it holds
    after that is delivered: the cache equals what the batches since then describe."""
    e = reg(Engine(12, ref=True, buffer_steps=200, **REF))
    ctx = reg(zmq.Context())
    ctx.setsockopt(zmq.RCVBUF, 65536)
    sub, rb = reg(Subscriber([e.spec()], config=StreamConfig(**REF_CFG), ctx=ctx,
                             rcvhwm=20)), Rebuild()
    e.run(100, 1000)
    pump(sub, rb, lambda: e.poll_done() is not None and rb.last_seq >= e.done.last_seq, 20,
         "warm-up delivered")
    assert rb.exact
    e.run(1000, None)
    e.wait_done(60)  # the stall: nobody reads the subscriber's sockets meanwhile
    e.run(30, 300)  # the live stream goes on: the gap shows
    pump(sub, rb, lambda: e.poll_done() is not None and rb.last_seq >= e.done.last_seq, 30,
         "caught up after the stall")
    s = st(sub)
    seq, exact, _, _ = rb.snapshots[-1]
    assert not rb.exact and not exact and "lost and no snapshot available" in rb.resets[-1]
    assert s.lost >= 1 and s.resyncs == 0, s
    assert rb.as_dict() == e.truth_since(seq)
    assert e.stats()["oldest"] > seq  # inexact only past what the publisher still holds


def test_h_reference_unreachable_range_with_full_buffer_rebuilds_exactly(reg):
    """A range the consumer could not get (the publisher's loop did not serve replays for a
    while, so every attempt timed out) while its buffer still starts at seq 0: the stream is
    rebuilt exactly by a replay from 0 (Reset, Snapshot(-1, exact), batches from 0)."""
    e = reg(Engine(13, ref=True, **REF))
    ctx = reg(zmq.Context())
    ctx.setsockopt(zmq.RCVBUF, 65536)
    cfg = StreamConfig(**dict(REF_CFG, request_timeout=0.3))
    sub, rb = reg(Subscriber([e.spec()], config=cfg, ctx=ctx, rcvhwm=20)), Rebuild()
    e.run(100, 1000)
    pump(sub, rb, lambda: e.poll_done() is not None and rb.last_seq >= e.done.last_seq, 20,
         "warm-up delivered")
    e.pause_replay(True)
    e.run(1000, None)
    e.wait_done(60)  # the stall: drops at every HWM
    e.run(600, 300)  # live goes on while the replays go unanswered
    # gap replay + 2 retries unanswered, then the replay from 0 is in flight
    pump(sub, rb, lambda: st(sub).replays >= 5, 30, "attempts exhausted, rebuild asked")
    e.pause_replay(False)
    pump(sub, rb, lambda: rb.resets[-1].endswith("rebuilt exactly by a replay from seq 0"),
         10, "rebuilt")
    s = st(sub)
    assert rb.snapshots[-1][:2] == (-1, True) and s.lost == 0 and s.resyncs == 1, s
    converge(sub, rb, e, 60)
