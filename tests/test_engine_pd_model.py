"""The engine model's disaggregated roles: prefill engines lease a finished prompt's blocks,
decode engines pull what they do not hold, and the core applies the ends of pulls in time.

Examples pin the protocol's rules (what is pulled, what a failure does, what a lease frees);
the property tests drive a prefill and a decode model together over random workloads.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.engine import (
    EngineConfig,
    EngineModel,
    EngineRequest,
    StepCost,
    TransferCost,
    block_hashes,
)
from kvwire.engine.core import EngineCore, Handle
from kvwire.wire.events import BlockRemoved, BlockStored


def _prefill(rid: str, prompt, m: EngineModel, t: float = 0.0) -> EngineRequest:
    r = EngineRequest(rid, prompt, 1, remote_decode=True)
    m.add(r, t)
    while r.status != "finished":
        m.step()
    return r


def _run(m: EngineModel) -> list:
    ev = []
    while m.runnable:
        ev += m.step().events
    return ev


# ------------------------------------------------------------------ examples


def test_transfer_cost() -> None:
    c = TransferCost()
    assert c.bytes_per_token == 32 * 8 * 128 * 2 * 2
    assert c.time(0, 16) == 0.0
    assert c.time(10, 16) == pytest.approx(10 * 16 * 131072 / 50e9 + 1e-3)
    assert TransferCost(bytes_per_token=1, bandwidth_Bps=2.0, latency_s=0).time(3, 4) == 6.0
    assert c.bytes(3, 16) == 3 * 16 * 131072
    for bad in ({"bytes_per_token": 0}, {"bandwidth_Bps": 0.0}, {"latency_s": -1.0},
                {"bandwidth_Bps": float("inf")}, {"bytes_per_token": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TransferCost(**bad)


def test_config_and_roles_refuse_what_does_not_belong() -> None:
    for bad, field in (({"role": "x"}, "role"), ({"lease_s": 0}, "lease_s"),
                       ({"load_failure": "retry"}, "load_failure"),
                       ({"recompute_blocks": -1}, "recompute_blocks"),
                       ({"transfer": 5}, "transfer")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**bad)
    d = EngineModel(EngineConfig(num_gpu_blocks=20, block_size=4, role="decode"))
    with pytest.raises(ValueError, match="decode engine"):
        d.add(EngineRequest("a", [1, 2, 3], 1, remote_decode=True))
    p = EngineModel(EngineConfig(num_gpu_blocks=20, block_size=4, role="prefill"))
    with pytest.raises(ValueError, match="prefill engine"):
        p.add(EngineRequest("a", [1, 2, 3], 1, remote_prefill=True))
    with pytest.raises(ValueError, match="at once"):
        EngineModel().add(EngineRequest("a", [1], 1, remote_decode=True, remote_prefill=True))


def test_prefill_side_leases_the_prompt_blocks_until_released_or_expired() -> None:
    m = EngineModel(EngineConfig(num_gpu_blocks=20, block_size=4, role="prefill", lease_s=2.0))
    prompt = list(range(14))
    r = _prefill("a", prompt, m)
    assert r.num_output == 1 and r.finish_t == r.first_token_t and m.idle
    lease = m.leases["a"]
    assert lease.hashes == block_hashes(prompt, 4) and lease.tokens == 14
    assert len(lease.blocks) == 4 and m.held_blocks == 4 and m.cache.num_free == 16
    assert lease.expires == pytest.approx(r.finish_t + 2.0)
    assert all(m.cache.ref[b] == 1 for b in lease.blocks)
    assert m.read("a", lease.expires - 1e-9) is lease and m.read("a", lease.expires) is None
    assert m.extend("a", lease.expires + 5) and lease.expires == pytest.approx(r.finish_t + 7)
    assert m.extend("a", 0.0) and lease.expires == pytest.approx(r.finish_t + 7), "never shrinks"
    assert m.expire(r.finish_t + 6.9) == [] and "a" in m.leases
    assert m.expire(r.finish_t + 7) == ["a"] and not m.leases and m.held_blocks == 0
    assert m.cache.num_free == 20 and m.leases_expired == 1
    assert not m.release("a") and not m.extend("a", 99.0) and m.read("a", 0.0) is None
    # Released blocks stay cached: the same prompt again is a hit.
    _prefill("b", prompt, m, m.now + 1)
    assert m.release("b") and m.leases_released == 1 and m.cache.num_free == 20
    r3 = _prefill("c", prompt, m, m.now + 1)
    assert r3.cached_tokens == 12
    # the same id prefilled again (a retry): the newer lease replaces the older
    _prefill("c", prompt, m, m.now + 1)
    assert len(m.leases) == 1 and m.held_blocks == 4 and m.cache.num_free == 16


def test_decode_side_pulls_what_it_lacks_and_publishes_the_pulled_blocks() -> None:
    bs = 4
    p = EngineModel(EngineConfig(num_gpu_blocks=40, block_size=bs, role="prefill"))
    d = EngineModel(EngineConfig(num_gpu_blocks=40, block_size=bs, role="decode"))
    shared = list(range(8))
    # The decode engine already holds the first two blocks (an earlier local request).
    d.add(EngineRequest("warm", shared + [50, 51], 1), 0.0)
    _run(d)
    prompt = shared + list(range(100, 110))  # 18 tokens: blocks 0..4, the last partial
    _prefill("x", prompt, p, d.now)
    r = EngineRequest("x", prompt, 4, remote_prefill=True)
    d.add(r, p.now)
    res = d.step()
    assert res.pulls == [r] and r.status == "transferring" and d.transferring == {"x": r}
    assert (r.pull_from, r.pull_blocks) == (2, 3) and r.hit_tokens == 8
    assert len(r.blocks) == 5 and not d.runnable and not d.idle
    with pytest.raises(RuntimeError):
        d.step()
    lease = p.read("x", d.now)
    assert lease is not None and lease.hashes[2:4] == r.hashes[2:4]
    t = d.now + d.cfg.transfer.time(r.pull_blocks, bs)
    assert d.transfer_done(r, True, t) and d.now == t and not d.transfer_done(r, True, t)
    assert p.release("x") and p.held_blocks == 0
    assert r.num_computed == 17 and d.blocks_pulled == 3 and d.transfers_ok == 1
    ev = _run(d)
    stored = [e for e in ev if isinstance(e, BlockStored)]
    # blocks 2 and 3 were pulled and published (block 4 holds the computed last token)
    assert stored[0].block_hashes == r.hashes[2:4] and stored[0].parent_block_hash == r.hashes[1]
    assert r.first_token_t > t and r.num_output == 4 and r.status == "finished"
    assert d.cache.num_free == 40


def test_a_small_or_empty_pull_is_computed_locally() -> None:
    bs = 4
    d = EngineModel(EngineConfig(num_gpu_blocks=40, block_size=bs, role="decode",
                                 recompute_blocks=1))
    prompt = list(range(9))  # tokens 0..7 are blocks 0, 1; token 8 is computed here
    d.add(EngineRequest("warm", prompt[:8] + [70], 1), 0.0)
    _run(d)
    r = EngineRequest("x", prompt, 2, remote_prefill=True)
    d.add(r, d.now + 1)
    res = d.step()
    assert res.pulls == [] and res.local_prefills == [r] and r.hit_tokens == 8
    r2 = EngineRequest("y", list(range(20, 25)), 2, remote_prefill=True)  # one block to pull
    d.add(r2)
    res = d.step()
    assert res.local_prefills == [r2] and r2.num_computed == 5 and d.local_prefill_count == 2
    _run(d)
    assert r.status == r2.status == "finished" and d.transfers_started == 0


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_pull_fails_or_recomputes(policy: str) -> None:
    d = EngineModel(EngineConfig(num_gpu_blocks=40, block_size=4, role="decode",
                                 load_failure=policy))
    r = EngineRequest("x", list(range(17)), 3, remote_prefill=True)
    d.add(r, 1.0)
    d.step()
    assert r.status == "transferring" and d.cache.num_free == 35
    assert d.transfer_done(r, False, 2.0) and d.transfers_failed == 1
    if policy == "fail":
        assert r.status == "finished" and r.failed and r.finish_t == 2.0 and d.idle
        assert d.cache.num_free == 40 and r.num_output == 0
        return
    assert r.status == "waiting" and r.num_computed == 0 and d.runnable
    res = d.step()
    assert res.tokens == 17 and r.first_token_t == res.end
    _run(d)
    assert r.num_output == 3 and not r.failed and d.cache.num_free == 40


def test_abort_frees_a_transferring_request() -> None:
    d = EngineModel(EngineConfig(num_gpu_blocks=40, block_size=4, role="decode"))
    r = EngineRequest("x", list(range(17)), 3, remote_prefill=True)
    d.add(r, 0.0)
    d.step()
    assert d.abort(r) and d.idle and d.cache.num_free == 40 and r.status == "finished"
    assert not d.transfer_done(r, True)
    # aborted after its pull ended, while it waits to be scheduled: its blocks go too
    r2 = EngineRequest("y", list(range(17)), 3, remote_prefill=True)
    d.add(r2, d.now)
    d.step()
    d.transfer_done(r2, True)
    assert r2.status == "waiting" and d.abort(r2) and d.cache.num_free == 40
    # its pulled blocks were never cached: nothing to publish (a quiet stretch after it
    # would not carry a stale BlockStored)
    assert d.take_events() == [] and not any(h is not None for h in d.cache.hash)


def test_both_role_serves_either_side() -> None:
    m = EngineModel(EngineConfig(num_gpu_blocks=40, block_size=4))
    a = _prefill("a", list(range(10)), m)
    assert "a" in m.leases and a.num_output == 1
    r = EngineRequest("b", list(range(30, 47)), 2, remote_prefill=True)
    m.add(r, m.now)
    assert m.step().pulls == [r]


def test_core_applies_pulls_in_time_and_expires_leases() -> None:
    cfg = EngineConfig(num_gpu_blocks=60, block_size=4, role="decode",
                       cost=StepCost(base_s=0.01, prefill_token_s=0.0, decode_seq_s=0.0))
    core = EngineCore(cfg, 200)
    got: list = []

    def sink(h: Handle, n: int, done: bool) -> None:
        got.append((h.req.rid, n, done))

    x = Handle(EngineRequest("x", list(range(17)), 3, remote_prefill=True), 0.0, sink, "length")
    y = Handle(EngineRequest("y", list(range(40, 45)), 30), 0.0, sink, "length")
    core.submit(x)
    core.submit(y)
    st = core.advance(0.0)
    assert [h.req.rid for h in st.pulls] == ["x"] and core.load == (1, 1)
    core.deliver(st)
    assert core.transfer_done("x", True, 0.035) and not core.transfer_done("zz", True, 0.0)
    starts = []
    while (st := core.advance(1.0)) is not None:
        starts.append(st.res.start)
        core.deliver(st)
        if x.req.status != "transferring":
            break
    # the pull's end was applied at the first step boundary at or after it
    assert x.req.status == "running" and starts[-2] < 0.035 <= starts[-1]
    assert starts[-1] - 0.035 < 0.01
    while (st := core.advance(5.0)) is not None:
        core.deliver(st)
    assert ("x", 3, True) in [(r, x.delivered, d) for r, _, d in got if r == "x" and d]
    assert core.transfer_counts["ok"] == 1 and core.transfer_seconds.count == 1
    assert core.transfer_counts["bytes"] == 4 * 4 * 131072 and core.idle

    p = EngineCore(EngineConfig(num_gpu_blocks=60, block_size=4, role="prefill", lease_s=1.0),
                   200)
    z = Handle(EngineRequest("z", list(range(9)), 1, remote_decode=True), 0.0, sink, "length")
    p.submit(z)
    st = p.advance(0.0)
    p.deliver(st)
    assert st.finished == [z] and p.transfer_counts["held_blocks"] == 3
    assert p.advance(0.5) is None and p.next_expiry() == pytest.approx(st.end + 1.0)
    assert p.advance(2.0) is None and p.take_expired() == ["z"]
    assert p.transfer_counts["leases_expired"] == 1 and p.transfer_counts["held_blocks"] == 0


def test_core_reports_a_failed_pull() -> None:
    core = EngineCore(EngineConfig(num_gpu_blocks=60, block_size=4, role="decode"), 200)
    x = Handle(EngineRequest("x", list(range(17)), 3, remote_prefill=True), 0.0,
               lambda *a: None, "length")
    core.submit(x)
    core.advance(0.0)
    core.transfer_done("x", False, 0.5)
    assert core.advance(1.0) is None and core.take_failed() == [x] and core.idle
    assert core.stats.request_success["error"] == 1 and "x" not in core.handles


# ------------------------------------------------------------------ a prefill + decode pair

req_spec = st.tuples(st.integers(0, 2), st.integers(0, 24), st.integers(1, 16),
                     st.integers(1, 12), st.floats(0, 0.03), st.sampled_from([None, 7]),
                     st.sampled_from([None, "salt"]), st.sampled_from([None, None, None, 0.0,
                                                                       0.004, 0.05]))
pairs = st.fixed_dictionaries({
    "reqs": st.lists(req_spec, min_size=1, max_size=12),
    "bs": st.sampled_from([2, 4, 8]),
    "spare_p": st.integers(0, 24),
    "spare_d": st.integers(0, 24),
    "budget": st.integers(3, 48),
    "seqs": st.integers(1, 5),
    "lease": st.sampled_from([0.004, 0.02, 0.3, 30.0]),
    "heartbeat": st.booleans(),
    "failure": st.sampled_from(["fail", "recompute"]),
    "recompute": st.sampled_from([0, 0, 1, 3]),
    "bandwidth": st.sampled_from([400.0, 4e4, 1e9]),
    "latency": st.sampled_from([0.0, 1e-3, 0.02]),
    "warm": st.booleans(),
    "seed": st.integers(0, 3),
})


class Pair:
    """A prefill and a decode model driven together, as a router and two engines would:
    each request prefills remotely, its lease is pulled by the decode engine (heartbeats
    optional), pulls take the modelled time, leases expire on time, some clients abort.
    Outside events (arrivals, hand-offs, ends of pulls, lease expiries, aborts) run in time
    order; a model steps only up to the next event or the other model's clock, so the run
    does not depend on how many steps a call makes. Every check the properties need runs
    as it goes."""

    def __init__(self, w: dict, fast_forward: bool = True) -> None:
        rng = random.Random(w["seed"])
        bs = w["bs"]
        bases = [[rng.randrange(6) for _ in range(40)] for _ in range(3)]
        self.specs = []
        t, need_p, need_d = 0.0, 1, 1
        for i, (g, shared, own, mt, gap, lora, salt, abort) in enumerate(w["reqs"]):
            prompt = bases[g][:shared] + [rng.randrange(6) for _ in range(own)]
            t += gap
            self.specs.append((t, f"r{i}", prompt, mt, lora, salt, abort))
            need_p = max(need_p, -(-(len(prompt) + 1) // bs))
            need_d = max(need_d, -(-(len(prompt) + mt) // bs))
        common = dict(block_size=bs, max_num_batched_tokens=w["budget"],
                      max_num_seqs=w["seqs"], seed=w["seed"], fast_forward=fast_forward,
                      lease_s=w["lease"], load_failure=w["failure"],
                      recompute_blocks=w["recompute"],
                      transfer=TransferCost(bytes_per_token=1, bandwidth_Bps=w["bandwidth"],
                                            latency_s=w["latency"]))
        self.p = EngineModel(EngineConfig(num_gpu_blocks=need_p + w["spare_p"], role="prefill",
                                          **common))
        self.d = EngineModel(EngineConfig(num_gpu_blocks=need_d + w["spare_d"], role="decode",
                                          **common))
        self.w = w
        self.heap: list = []
        self.n = 0
        self.dreqs: dict[str, EngineRequest] = {}
        self.preqs: dict[str, EngineRequest] = {}
        self.gone: set[str] = set()  # requests whose pull found no lease
        self.events: dict[str, list] = {"p": [], "d": []}
        self.rebuilt: dict[str, Counter] = {"p": Counter(), "d": Counter()}
        self.reads = 0
        self.aborted_pulls = 0
        self.abort_after: dict[str, float] = {}

    def at(self, t: float, kind: str, *data) -> None:
        self.n += 1
        heapq.heappush(self.heap, (t, self.n, kind, data))

    # -------------------------------------------------------------- checks

    def check_leases(self, now: float | None = None) -> None:
        p = self.p
        assert p.held_blocks == sum(len(lease.blocks) for lease in p.leases.values())
        for lease in p.leases.values():
            self.check_held(lease)
            if now is not None:
                assert lease.expires > now, "a lease outlived its expiry"

    def check_held(self, lease) -> None:
        c = self.p.cache
        assert all(c.ref[b] > 0 for b in lease.blocks), "a leased block is free"
        assert all(c.hash[b] == h for b, h in zip(lease.blocks, lease.hashes)), \
            "a leased block lost its hash"

    def check_events(self, name: str, m: EngineModel, events) -> None:
        self.events[name] += events
        rebuilt = self.rebuilt[name]
        for e in events:
            if isinstance(e, BlockStored):
                rebuilt.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert rebuilt[h] > 0, "removed a block never stored"
                    rebuilt[h] -= 1
        assert +rebuilt == Counter(h for h in m.cache.hash if h is not None)
        assert len(m.running) <= m.cfg.max_num_seqs
        for r in [*m.running, *m.transferring.values(), *m.ready]:
            for i in range(r.num_cached_blocks):
                assert m.cache.hash[r.blocks[i]] == r.hashes[i], "a pinned block was evicted"

    def read(self, rid: str, t: float, dreq: EngineRequest) -> bool:
        """A pull reads the lease: only live leases, whose blocks are held and hashed."""
        self.p.expire(t)  # what is due by now is gone before anyone reads it
        lease = self.p.read(rid, t)
        if lease is None:
            return False
        self.reads += 1
        self.check_held(lease)
        end = dreq.pull_from + dreq.pull_blocks
        assert end <= len(lease.blocks) and lease.tokens == len(dreq.prompt)
        full = min(end, len(lease.hashes))
        assert lease.hashes[dreq.pull_from:full] == dreq.hashes[dreq.pull_from:full]
        return True

    # -------------------------------------------------------------- driving

    def run(self) -> Pair:
        for t, rid, prompt, mt, lora, salt, abort in self.specs:
            self.at(t, "arrive", rid, prompt, mt, lora, salt, abort)
        if self.w["warm"]:  # a plain request first: the decode engine holds some prefixes
            t0, _, prompt, *_ = self.specs[0]
            self.d.add(EngineRequest("warm", prompt, 1), 0.0)
        p, d = self.p, self.d
        while max(p.now, d.now) < 5.0:  # far past any run's end: a stuck pair fails
            t_ev = self.heap[0][0] if self.heap else math.inf
            if p.runnable and p.now < t_ev and (not d.runnable or p.now <= d.now):
                self.step_p(min(t_ev, d.now) if d.runnable else t_ev)
            elif d.runnable and d.now < t_ev and (not p.runnable or d.now < p.now):
                self.step_d(min(t_ev, p.now) if p.runnable else t_ev)
            elif self.heap:
                t, _, kind, data = heapq.heappop(self.heap)
                getattr(self, "on_" + kind)(t, *data)
                self.check_leases()
            else:
                return self
        raise AssertionError(f"the pair did not finish: p {p.now} {len(p.waiting)} "
                             f"{len(p.running)}, d {d.now} {len(d.waiting)} {len(d.running)}")

    def step_p(self, until: float) -> None:
        res = self.p.step(until)
        assert res.tokens <= self.p.cfg.max_num_batched_tokens
        self.check_events("p", self.p, res.events)
        for r in res.finished:
            lease = self.p.leases[r.rid]
            self.check_held(lease)
            self.at(r.finish_t, "handoff", r)
            self.at(lease.expires, "expire")

    def step_d(self, until: float) -> None:
        d = self.d
        res = d.step(until)
        assert res.tokens <= d.cfg.max_num_batched_tokens and res.seqs <= d.cfg.max_num_seqs
        self.check_events("d", d, res.events)
        for r in res.local_prefills:
            self.p.release(r.rid)
        for r in res.pulls:
            assert r.status == "transferring" and r.pull_blocks > self.w["recompute"]
            # what it lacks up to its last prompt token, which it computes itself
            bs = d.cfg.block_size
            assert r.pull_from * bs == r.hit_tokens
            assert r.pull_from + r.pull_blocks == -(-(len(r.prompt) - 1) // bs)
            if not self.read(r.rid, res.end, r):
                self.gone.add(r.rid)
                self.at(res.end, "pulled", r, False)
                continue
            t_end = res.end + d.cfg.transfer.time(r.pull_blocks, d.cfg.block_size)
            if self.w["heartbeat"]:
                self.p.extend(r.rid, t_end + 1e-9)
            self.at(t_end, "pulled", r, True)

    # -------------------------------------------------------------- outside events

    def on_arrive(self, t, rid, prompt, mt, lora, salt, abort) -> None:
        r = EngineRequest(rid, prompt, 1, lora, salt, remote_decode=True)
        self.preqs[rid] = r
        self.p.add(r, t)
        self.dreqs[rid] = EngineRequest(rid, prompt, mt, lora, salt, remote_prefill=True)
        if abort is not None:
            self.abort_after[rid] = abort

    def on_handoff(self, t, preq) -> None:
        r = self.dreqs[preq.rid]
        self.d.add(r, t)
        if self.w["heartbeat"]:
            if self.p.extend(r.rid, t + self.w["lease"]):
                self.at(self.p.leases[r.rid].expires, "expire")
        after = self.abort_after.get(r.rid)
        if after is not None:
            self.at(t + after, "abort", r)

    def on_pulled(self, t, r, ok) -> None:
        if r.status != "transferring":
            return  # aborted meanwhile
        if ok and not self.read(r.rid, t, r):  # the lease ran out during the pull
            self.gone.add(r.rid)
            ok = False
        assert self.d.transfer_done(r, ok, t)
        self.p.release(r.rid)

    def on_expire(self, t) -> None:
        self.p.expire(t)
        self.check_leases(t)

    def on_abort(self, t, r) -> None:
        self.aborted_pulls += r.status == "transferring"
        if self.d.abort(r):
            self.p.release(r.rid)

    def outcome(self) -> tuple:
        per = [(r.rid, r.status, r.failed, r.first_token_t, r.finish_t, r.num_output,
                tuple(r.tokens), r.cached_tokens, r.pull_from, r.pull_blocks, r.preemptions)
               for r in self.dreqs.values()]
        per += [(r.rid, r.finish_t, r.cached_tokens) for r in self.preqs.values()]
        d = self.d
        return (per, self.events["p"], self.events["d"], self.p.now, d.now, sorted(d.itl),
                d.transfers_started, d.transfers_ok, d.transfers_failed, d.blocks_pulled,
                self.p.leases_expired, self.p.leases_released)


@settings(max_examples=80, deadline=None)
@given(w=pairs)
def test_pair_leases_pulls_and_every_request_finishes(w: dict) -> None:
    """A prefill and a decode engine driven together: no lease outlives its expiry, every
    pull reads live blocks under the right hashes, both engines' events rebuild their
    caches, every request finishes (it fails only under "fail" when its lease was gone,
    or it was aborted), and every block returns to both pools."""
    run = Pair(w).run()
    p, d = run.p, run.d
    assert not p.leases and p.held_blocks == 0 and d.idle and not d.transferring
    assert p.cache.num_free == p.cfg.num_gpu_blocks and d.cache.num_free == d.cfg.num_gpu_blocks
    aborted = set(run.abort_after)
    for r in run.dreqs.values():
        assert r.status == "finished" and not r.blocks, r.rid
        if r.failed:
            assert w["failure"] == "fail" and r.rid in run.gone and r.num_output == 0
        elif r.rid not in aborted:
            assert r.num_output == r.max_tokens and r.first_token_t > r.arrival
    assert d.transfers_started == d.transfers_ok + d.transfers_failed + run.aborted_pulls
    assert d.transfers_failed >= sum(r.failed for r in run.dreqs.values())
    assert p.leases_released + p.leases_expired == len(run.preqs)


@settings(max_examples=40, deadline=None)
@given(w=pairs)
def test_pair_fast_forward_is_exact(w: dict) -> None:
    """With requests transferring, quiet decode stretches run in one call still give what
    single steps give."""
    assert Pair(w, fast_forward=True).run().outcome() == Pair(w, fast_forward=False).run().outcome()
