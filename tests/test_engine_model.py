"""The engine model (kvwire.engine): scheduler, paged prefix cache, events, step clock.

Property tests drive random workloads (shared prefixes, LoRA and salt, tiny caches that force
eviction and preemption, an optional CPU tier) and check the model against brute-force ones:
a list-scanning block pool run in its place, a multiset rebuilt from the events, per-step
token counts taken from the requests themselves, longest common prefixes found by scanning.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.engine import (
    EngineConfig,
    EngineModel,
    EngineRequest,
    PagedPrefixCache,
    StepCost,
    block_hashes,
)
from kvwire.wire.events import AllBlocksCleared, BlockRemoved, BlockStored


class BruteCache(PagedPrefixCache):
    """The block pool by brute force: every free block carries an order key and allocation
    scans for the smallest; hits scan every block. Same interface, no clever structures."""

    def __init__(self, num_blocks: int, block_size: int, cpu_blocks: int = 0) -> None:
        self.num_blocks, self.block_size, self.cpu_blocks = num_blocks, block_size, cpu_blocks
        self.ref = [0] * num_blocks
        self.hash: list = [None] * num_blocks
        self.key = list(range(num_blocks))
        self.born = [0] * num_blocks
        self.meta: dict = {}
        self.hi, self.lo, self.clock = num_blocks, -1, 0
        self.cpu_list: list[int] = []
        self.events: list = []

    @property
    def num_free(self) -> int:
        return sum(1 for r in self.ref if r == 0)

    def longest_hit(self, hashes):
        out = []
        for h in hashes:
            held = [b for b in range(self.num_blocks) if self.hash[b] == h]
            if not held:
                break
            out.append(min(held, key=lambda b: self.born[b]))
        return out

    def touch(self, blocks) -> None:
        for b in blocks:
            self.ref[b] += 1

    def allocate(self, n: int):
        out = []
        for _ in range(n):
            b = min((b for b in range(self.num_blocks) if self.ref[b] == 0),
                    key=lambda b: self.key[b])
            h = self.hash[b]
            if h is not None:
                self.hash[b] = None
                self.events.append(BlockRemoved([h], "GPU"))
                if self.cpu_blocks:
                    parent, toks, lora = self.meta[b]
                    if h in self.cpu_list:
                        self.cpu_list.remove(h)
                    else:
                        if len(self.cpu_list) >= self.cpu_blocks:
                            self.events.append(BlockRemoved([self.cpu_list.pop(0)], "CPU"))
                        self.events.append(BlockStored([h], parent, list(toks),
                                                       self.block_size, lora, "CPU"))
                    self.cpu_list.append(h)
            self.ref[b] = 1
            out.append(b)
        return out

    def cache_full(self, blocks, hashes, start, end, tokens, lora_id) -> None:
        if start >= end:
            return
        bs = self.block_size
        for i in range(start, end):
            self.hash[blocks[i]] = hashes[i]
            self.clock += 1
            self.born[blocks[i]] = self.clock
            self.meta[blocks[i]] = (hashes[i - 1] if i else None, tokens[i * bs:(i + 1) * bs],
                                    lora_id)
        self.events.append(BlockStored(list(hashes[start:end]),
                                       hashes[start - 1] if start else None,
                                       list(tokens[start * bs:end * bs]), bs, lora_id, "GPU"))

    def free_blocks(self, blocks) -> None:
        front = []
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash[b] is None:
                    front.append(b)
                else:
                    self.key[b] = self.hi
                    self.hi += 1
        for b in reversed(front):
            self.key[b] = self.lo
            self.lo -= 1


# ------------------------------------------------------------------ workloads

req_spec = st.tuples(st.integers(0, 2), st.integers(0, 24), st.integers(1, 20),
                     st.integers(1, 30), st.floats(0, 0.03), st.sampled_from([None, 7]),
                     st.sampled_from([None, "salt"]))
workloads = st.fixed_dictionaries({
    "reqs": st.lists(req_spec, min_size=1, max_size=14),
    "bs": st.sampled_from([2, 4, 8]),
    "spare": st.integers(0, 30),
    "budget": st.integers(3, 64),
    "seqs": st.integers(1, 6),
    "cpu": st.sampled_from([0, 0, 3, 20]),
    "ctx": st.sampled_from([0.0, 1e-6]),
    "seed": st.integers(0, 3),
})


def build(w: dict, **over) -> tuple[EngineConfig, list[tuple[float, EngineRequest]]]:
    rng = random.Random(w["seed"])
    bases = [[rng.randrange(6) for _ in range(40)] for _ in range(3)]
    out, t, need = [], 0.0, 1
    for i, (g, shared, own, mt, gap, lora, salt) in enumerate(w["reqs"]):
        prompt = bases[g][:shared] + [rng.randrange(6) for _ in range(own)]
        t += gap
        out.append((t, EngineRequest(f"r{i}", prompt, mt, lora, salt)))
        need = max(need, -(-(len(prompt) + mt) // w["bs"]))
    kw = dict(num_gpu_blocks=need + w["spare"], block_size=w["bs"],
              max_num_batched_tokens=w["budget"], max_num_seqs=w["seqs"],
              cpu_blocks=w["cpu"], cost=StepCost(context_token_s=w["ctx"]), seed=w["seed"])
    kw.update(over)
    return EngineConfig(**kw), out


def drive(cfg: EngineConfig, arrivals, cache_cls=None, check=None) -> tuple[EngineModel, list]:
    """Replay arrivals as the fleet does: step each engine up to the arrival, add it."""
    m = EngineModel(cfg)
    if cache_cls is not None:
        m.cache = cache_cls(cfg.num_gpu_blocks, cfg.block_size, cfg.cpu_blocks)
    results = []
    reqs = [r for _, r in arrivals]

    def one(until: float) -> None:
        before = {r.rid: (r.num_computed, r.status) for r in reqs}
        res = m.step(until)
        results.append(res)
        if check is not None:
            check(m, res, before, reqs)

    for t, r in arrivals:
        while not m.idle and m.now < t:
            one(t)
        m.add(r, t)
    while not m.idle:
        one(float("inf"))
    return m, results


def outcome(m: EngineModel, reqs, results) -> tuple:
    per = [(r.rid, r.cached_tokens, r.first_token_t, r.finish_t, r.preemptions, r.num_output,
            tuple(r.tokens)) for r in reqs]
    events = [e for res in results for e in res.events]
    return per, events, sorted(m.itl), m.busy_s, m.steps, m.now


# ------------------------------------------------------------------ properties


@settings(max_examples=60, deadline=None)
@given(w=workloads)
def test_events_rebuild_the_cache_and_pinned_blocks_stay(w: dict) -> None:
    """After every step, the events so far rebuild both tiers exactly (as a multiset: vLLM
    caches a block computed twice at once twice); every block a running request holds is
    still cached under its hash; every request finishes with all its tokens."""
    cfg, arrivals = build(w)
    rebuilt: Counter = Counter()

    def check(m, res, before, reqs) -> None:
        for e in res.events:
            if isinstance(e, BlockStored):
                for h in e.block_hashes:
                    rebuilt[(e.medium, h)] += 1
                    assert rebuilt[(e.medium, h)] == 1 or e.medium == "GPU"
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert rebuilt[(e.medium, h)] > 0, "removed a block never stored"
                    rebuilt[(e.medium, h)] -= 1
            elif isinstance(e, AllBlocksCleared):
                rebuilt.clear()
        truth = Counter(("GPU", h) for h in m.cache.hash if h is not None)
        truth.update(("CPU", h) for h in m.cache.cpu)
        assert +rebuilt == truth
        assert len(m.cache.cpu) <= cfg.cpu_blocks
        for r in m.running:
            for i in range(r.num_cached_blocks):
                b = r.blocks[i]
                assert m.cache.ref[b] > 0 and m.cache.hash[b] == r.hashes[i], "pinned evicted"
                assert rebuilt[("GPU", r.hashes[i])] > 0

    m, _ = drive(cfg, arrivals, check=check)
    reqs = [r for _, r in arrivals]
    assert all(r.status == "finished" and r.num_output == r.max_tokens for r in reqs)
    assert all(r.arrival < r.first_token_t <= r.finish_t for r in reqs)
    assert m.cache.num_free == cfg.num_gpu_blocks, "every block released"


@settings(max_examples=60, deadline=None)
@given(w=workloads)
def test_token_budget_and_max_num_seqs_hold(w: dict) -> None:
    """Counted from the requests themselves: no step computes more tokens than the budget,
    or advances more sequences than max_num_seqs."""
    cfg, arrivals = build(w)

    def check(m, res, before, reqs) -> None:
        grew = []
        for r in reqs:
            was, status = before[r.rid]
            hit = r.hit_tokens if status == "waiting" and r.status != "waiting" else 0
            if r.num_computed - hit > was:  # computed in this step, not taken from the cache
                grew.append(r.num_computed - hit - was)
        assert sum(grew) <= res.steps * cfg.max_num_batched_tokens
        assert len(grew) <= cfg.max_num_seqs
        assert res.tokens <= cfg.max_num_batched_tokens and res.seqs <= cfg.max_num_seqs
        assert sum(grew) == res.tokens * res.steps
        assert len(m.running) <= cfg.max_num_seqs

    drive(cfg, arrivals, check=check)


@settings(max_examples=40, deadline=None)
@given(w=workloads)
def test_block_pool_matches_a_brute_force_pool(w: dict) -> None:
    """The pool's queue and hash map, replaced by scanning every block, give the same
    events, hits, preemptions and times: LRU eviction, LIFO reuse of uncached blocks."""
    cfg, arrivals = build(w)
    cfg2, arrivals2 = build(w)
    m1, r1 = drive(cfg, arrivals)
    m2, r2 = drive(cfg2, arrivals2, cache_cls=BruteCache)
    assert outcome(m1, [r for _, r in arrivals], r1) == outcome(m2, [r for _, r in arrivals2], r2)


@settings(max_examples=40, deadline=None)
@given(w=workloads)
def test_fast_forward_is_exact(w: dict) -> None:
    """Quiet decode stretches run in one call give exactly what single steps give."""
    cfg, arrivals = build(w, fast_forward=True)
    cfg2, arrivals2 = build(w, fast_forward=False)
    m1, r1 = drive(cfg, arrivals)
    m2, r2 = drive(cfg2, arrivals2)
    assert all(r.steps == 1 for r in r2)
    assert outcome(m1, [r for _, r in arrivals], r1) == outcome(m2, [r for _, r in arrivals2], r2)


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@settings(max_examples=60, deadline=None)
@given(w=workloads)
def test_prefix_hits_match_longest_common_prefix(w: dict) -> None:
    """One request at a time in a cache that never evicts: cached_tokens is the longest
    common prefix with any earlier request's computed tokens under the same LoRA and salt,
    in whole blocks, never the whole prompt (its last token is always computed)."""
    cfg, arrivals = build(w, num_gpu_blocks=4000, max_num_seqs=1)
    bs = cfg.block_size
    spaced = [(i * 100.0, r) for i, (_, r) in enumerate(arrivals)]  # each finishes first
    drive(cfg, spaced)
    done: list[EngineRequest] = []
    for _, r in spaced:
        best = max((_lcp(r.prompt, p.tokens[:-1]) for p in done
                    if (p.lora_id, p.cache_salt) == (r.lora_id, r.cache_salt)), default=0)
        assert r.cached_tokens == min(best, len(r.prompt) - 1) // bs * bs, r.rid
        done.append(r)


# ------------------------------------------------------------------ examples


def test_preemption_of_the_youngest_and_recompute() -> None:
    """Two requests that cannot both grow: the younger is preempted, requeued first,
    recomputes its prompt and outputs later, and both finish."""
    cfg = EngineConfig(num_gpu_blocks=6, block_size=4, max_num_batched_tokens=64)
    m = EngineModel(cfg)
    a = EngineRequest("a", list(range(8)), 12)
    b = EngineRequest("b", list(range(100, 108)), 12)
    m.add(a, 0.0)
    m.add(b, 0.0)
    while not m.idle:
        m.step()
    assert b.preemptions >= 1 and a.preemptions == 0 and m.preemptions == b.preemptions
    assert a.finish_t < b.finish_t and a.num_output == b.num_output == 12
    assert b.cached_tokens == 0, "counted at the first admission only"
    # vLLM counts prefix-cache queries of requests never preempted: b's re-admission is not
    assert (m.prefix_queries, m.prefix_hits) == (16, 0)


def test_chunked_prefill_shares_the_budget_with_decodes() -> None:
    cfg = EngineConfig(num_gpu_blocks=100, block_size=4, max_num_batched_tokens=10)
    m = EngineModel(cfg)
    a = EngineRequest("a", [1, 2, 3], 5)
    m.add(a, 0.0)
    m.step()  # a's prefill (3 tokens) and first token
    b = EngineRequest("b", list(range(50, 80)), 1)
    m.add(b)
    res = m.step()
    assert (res.tokens, res.seqs) == (10, 2)  # a decodes 1, b prefills 9 of 30
    assert b.num_computed == 9 and b.first_token_t is None
    while b.first_token_t is None:
        m.step()
    assert b.num_computed == 30


def test_block_stored_fields_and_output_blocks_cached() -> None:
    cfg = EngineConfig(num_gpu_blocks=50, block_size=4, seed=3)
    m = EngineModel(cfg)
    r = EngineRequest("x", list(range(10)), 7, lora_id=5)
    m.add(r, 0.0)
    events = []
    while not m.idle:
        events += m.step().events
    stored = [e for e in events if isinstance(e, BlockStored)]
    first = stored[0]
    assert first.block_hashes == block_hashes(list(range(10)), 4, 5)
    assert first.parent_block_hash is None and first.token_ids == list(range(8))
    assert (first.block_size, first.lora_id, first.medium) == (4, 5, "GPU")
    # 10 prompt + 6 computed outputs = 16 tokens: blocks 3 and 4 hold generated tokens.
    assert sum(len(e.block_hashes) for e in stored) == 4
    assert stored[-1].parent_block_hash == stored[-2].block_hashes[-1]
    assert stored[-1].token_ids == r.tokens[12:16].tolist()


def test_identity_covers_lora_and_salt() -> None:
    t = list(range(32))
    base = block_hashes(t, 16)
    assert block_hashes(t, 16) == base and len(base) == 2
    assert block_hashes(t, 16, lora_id=1)[0] != base[0]
    salted = block_hashes(t, 16, cache_salt="s")
    assert salted[0] != base[0] and salted[1] != base[1], "the salt reaches later blocks"
    assert block_hashes(t[:16] + [99] * 16, 16)[0] == base[0]


def test_reset_only_when_nothing_is_held() -> None:
    m = EngineModel(EngineConfig(num_gpu_blocks=20, block_size=4))
    r = EngineRequest("a", list(range(9)), 2)
    m.add(r, 0.0)
    m.step()
    assert not m.reset_prefix_cache() and m.take_events() == []
    while not m.idle:
        m.step()
    assert m.reset_prefix_cache()
    assert m.take_events() == [AllBlocksCleared()]
    r2 = EngineRequest("b", list(range(9)), 2)
    m.add(r2, m.now + 1)
    m.step()
    assert r2.cached_tokens == 0


def test_cpu_tier_receives_evictions() -> None:
    m = EngineModel(EngineConfig(num_gpu_blocks=4, block_size=4, cpu_blocks=2))
    evs = []
    for i in range(4):  # 8 blocks through a GPU of 4 and a CPU of 2
        r = EngineRequest(f"r{i}", list(range(100 * i, 100 * i + 8)), 1)
        m.add(r, m.now + 1.0)
        while not m.idle:
            evs += m.step().events
    kinds = [(type(e).__name__, e.medium) for e in evs if not isinstance(e, AllBlocksCleared)]
    assert ("BlockStored", "CPU") in kinds and ("BlockRemoved", "CPU") in kinds
    assert len(m.cache.cpu) == 2


def test_step_time_and_determinism() -> None:
    cost = StepCost(base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.002, context_token_s=0)
    m = EngineModel(EngineConfig(num_gpu_blocks=50, block_size=16, cost=cost))
    r = EngineRequest("a", list(range(6)), 10)
    m.add(r, 1.0)
    res = m.step()
    assert res.end - res.start == pytest.approx(0.01 + 6 * 0.001) and res.first_tokens == [r]
    res = m.step()  # 8 quiet decode steps in one call, then the one that finishes
    assert res.end - res.start == pytest.approx(8 * 0.012) and res.steps == 8
    res = m.step()
    assert res.finished == [r] and r.finish_t == pytest.approx(1.0 + 0.016 + 9 * 0.012)
    assert list(m.itl) == pytest.approx([0.012] * 9)

    def run(seed: int) -> list:
        cfg, arrivals = build({"reqs": [(0, 10, 5, 9, 0.0, None, None)] * 3, "bs": 4,
                               "spare": 2, "budget": 16, "seqs": 4, "cpu": 0, "ctx": 0.0,
                               "seed": 1}, seed=seed)
        m, res = drive(cfg, arrivals)
        return outcome(m, [r for _, r in arrivals], res)[:2]

    assert run(0) == run(0)
    assert run(0) != run(1), "generated tokens follow the seed"


def test_bad_requests_and_config() -> None:
    m = EngineModel(EngineConfig(num_gpu_blocks=2, block_size=4))
    with pytest.raises(ValueError, match="exceed"):
        m.add(EngineRequest("big", list(range(8)), 1))
    with pytest.raises(ValueError, match="max_tokens"):
        m.add(EngineRequest("none", [1], 0))
    r = EngineRequest("ok", [1, 2], 1)
    m.add(r)
    with pytest.raises(ValueError, match="already"):
        m.add(r)
    with pytest.raises(ValueError, match="busy"):
        m.add(EngineRequest("late", [1], 1), 5.0)
    with pytest.raises(ValueError):
        EngineConfig(block_size=0)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="cpu_blocks"):
            EngineConfig(cpu_blocks=bad)
    with pytest.raises(ValueError):
        StepCost(base_s=0.0)
    with pytest.raises(RuntimeError):
        EngineModel().step()


def test_abort_frees_a_request_waiting_or_running_once() -> None:
    """A client that goes away: the request leaves the queue or the batch, its blocks go
    back to the pool now (as vLLM frees them), and a second abort is a no-op."""
    m = EngineModel(EngineConfig(num_gpu_blocks=20, block_size=4, max_num_batched_tokens=8))
    free = m.cache.num_free
    a = EngineRequest("a", list(range(12)), 50)
    b = EngineRequest("b", list(range(100, 112)), 50)
    m.add(a, 1.5)
    m.add(b, 1.5)
    assert a.arrival == b.arrival == 1.5
    m.step()  # a prefills 8 of 12 (the budget); b waits
    assert a in m.running and b in m.waiting and m.cache.num_free < free
    assert m.abort(b) and b not in m.waiting and b.status == "finished"
    assert m.abort(a) and a not in m.running and a.status == "finished"
    assert m.idle and m.cache.num_free == free  # every block back (cached ones evictable)
    assert not m.abort(a) and not m.abort(EngineRequest("never", [1], 1))


def test_prefix_counters_count_each_lookup_and_hit() -> None:
    """vLLM's prefix_cache_queries / _hits: tokens looked up and found, per admission."""
    m = EngineModel(EngineConfig(num_gpu_blocks=50, block_size=4))
    a = EngineRequest("a", list(range(16)), 2)
    m.add(a, 0.0)
    while not m.idle:
        m.step()
    b = EngineRequest("b", list(range(12)) + [99, 98, 97, 96, 95], 2)
    m.add(b)
    while not m.idle:
        m.step()
    assert b.cached_tokens == 12  # three full blocks of a's prompt
    assert (m.prefix_queries, m.prefix_hits) == (16 + 17, 12)
