"""The fleet simulator: replay a trace against N engines under each routing policy.

Two engine models (docs/sim.md). ``batched``, the default: each engine is the pure
:class:`~kvwire.engine.EngineModel` (continuous batching, chunked prefill, paged prefix cache;
the loop is in :mod:`.batched`). ``fifo``, described here: each engine is a FIFO server: a
request arriving at ``t`` starts at ``max(t, engine free)``, holds the engine for its prefill
(uncached prompt tokens / prefill rate) then its decode (output tokens / decode rate); its
first token comes at the end of its prefill. When the prefill completes the engine commits the
prompt's blocks to its LRU cache and publishes the batch through a real ZmqEventPublisher; that
is the virtual time at which the events exist. Before each routing decision at ``t`` the
``kvwire`` router waits (bounded) until its Subscriber has delivered, and its PrefixIndex
applied, every batch published up to ``t`` (tracked by seq per engine), so its view never
depends on thread timing; prefixes it routed whose events have not come yet count through the
index's predicted entries (TTL in virtual seconds). The result is deterministic for a seed.
"""

from __future__ import annotations

import heapq
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from ..consume.stream import Batch, Reset, Snapshot
from ..consume.subscriber import StreamSpec, Subscriber
from ..engine.timing import StepCost
from ..publish.publisher import ZmqEventPublisher
from ..router.policy import Candidate, LoadTracker, RoutingPolicy, request_load
from .engine import SimEngine, engine_keys
from .trace import Request, prompt_array

__all__ = ["POLICIES", "PolicyResult", "SimConfig", "SimError", "SimResult", "run_sim",
           "simulate_policy"]

_JSON_KEYS = ("hit_ratio", "work_max_over_mean", "ttft_p50_s", "ttft_p99_s",
              "events_published", "events_applied", "prefix_reuse_ratio", "itl_p50_s",
              "itl_p99_s", "e2e_p50_s", "e2e_p99_s", "output_tok_s", "preemptions")
POLICIES = ("kvwire", "oracle", "random", "round_robin", "least_load")
ENGINE_MODELS = ("batched", "fifo")


class SimError(RuntimeError):
    """The simulation could not proceed (e.g. the subscriber never caught up)."""


@dataclass(frozen=True)
class SimConfig:
    """Fleet and model parameters (rates in tokens/s; times in virtual seconds)."""

    engines: int = 8
    capacity: int = 5000
    block_tokens: int = 512
    #: "batched" (kvwire.engine's model) or "fifo" (one request at a time, below)
    engine_model: str = "batched"
    #: batched only: the scheduler's limits, a CPU tier, the step-time constants
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    cpu_blocks: int = 0
    step_cost: StepCost = field(default_factory=StepCost)
    #: fifo only: service rates
    prefill_rate: float = 20_000.0
    decode_rate: float = 400.0
    seed: int = 0
    #: RoutingPolicy weights used by ``kvwire`` and ``oracle`` (same cost for both). 0.5 on
    #: load: best hit ratio and balance on the bundled trace (docs/sim.md has the sweep).
    prefill_weight: float = 1.0
    load_weight: float = 0.5
    #: Load of a routed request = uncached blocks + decode_share x expected output blocks
    #: (expected = mean output of the requests completed so far). None: a decoded token's
    #: cost over a prefilled token's (fifo: prefill_rate / decode_rate; batched: the step
    #: cost's decode_seq_s / prefill_token_s), i.e. load is work in block-prefills.
    decode_share: float | None = None
    #: Predicted entries live this long (virtual s) unless events confirm them.
    predict_ttl: float = 30.0
    #: Wall seconds to wait for the subscriber to catch up before failing.
    sync_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.engine_model not in ENGINE_MODELS:
            raise ValueError(f"unknown engine model {self.engine_model!r}; choose from "
                             f"{', '.join(ENGINE_MODELS)}")

    def share(self) -> float:
        if self.decode_share is not None:
            return self.decode_share
        if self.engine_model == "batched":
            c = self.step_cost
            return c.decode_seq_s / c.prefill_token_s if c.prefill_token_s > 0 else 0.0
        return self.prefill_rate / self.decode_rate


@dataclass
class PolicyResult:
    """Everything measured for one policy."""

    name: str
    hit_blocks: int = 0
    prompt_blocks: int = 0
    engine_work_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    itl_s: array = field(default_factory=lambda: array("d"))
    route_us: list[float] = field(default_factory=list)
    events_published: int = 0
    events_applied: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    span_s: float = 0.0  # first arrival to last completion
    preemptions: int = 0
    wall_s: float = 0.0

    @property
    def prefix_reuse_ratio(self) -> float:
        """Prompt tokens found cached on admission / prompt tokens (the mocker's ratio)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def work_max_over_mean(self) -> float:
        w = self.engine_work_s
        mean = sum(w) / len(w) if w else 0.0
        return max(w) / mean if mean > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The six §4 keys (deterministic for a seed), then wall-clock extras."""
        ttft = sorted(self.ttft_s)
        lat = sorted(self.route_us)
        itl = sorted(self.itl_s)
        e2e = sorted(self.e2e_s)
        return {
            "hit_ratio": round(self.hit_ratio, 6),
            "work_max_over_mean": round(self.work_max_over_mean, 6),
            "ttft_p50_s": round(_pct(ttft, 0.50), 6),
            "ttft_p99_s": round(_pct(ttft, 0.99), 6),
            "events_published": self.events_published,
            "events_applied": self.events_applied,
            "prefix_reuse_ratio": round(self.prefix_reuse_ratio, 6),
            "itl_p50_s": round(_pct(itl, 0.50), 6),
            "itl_p99_s": round(_pct(itl, 0.99), 6),
            "e2e_p50_s": round(_pct(e2e, 0.50), 6),
            "e2e_p99_s": round(_pct(e2e, 0.99), 6),
            "output_tok_s": round(self.output_tokens / self.span_s, 3) if self.span_s else 0.0,
            "preemptions": self.preemptions,
            "route_p50_us": round(_pct(lat, 0.50), 1),
            "route_p99_us": round(_pct(lat, 0.99), 1),
            "engine_work_s": [round(w, 3) for w in self.engine_work_s],
        }


@dataclass
class SimResult:
    """One run: the fleet's shape and each policy's result."""

    requests: int
    config: SimConfig
    results: dict[str, PolicyResult]

    def to_json(self) -> dict[str, Any]:
        """The object ``kvwire sim --json`` prints: exactly the issue's shape, every value
        deterministic for a seed (route latencies, which measure this machine, are left to
        the table and the report)."""
        return {
            "requests": self.requests,
            "engines": self.config.engines,
            "capacity": self.config.capacity,
            "engine_model": self.config.engine_model,
            "policies": {n: {k: v for k, v in r.summary().items() if k in _JSON_KEYS}
                         for n, r in self.results.items()},
        }

    def table(self) -> str:
        """A plain-text table, one row per policy."""
        head = (f"{'policy':<12}{'hit_ratio':>10}{'max/mean':>10}{'ttft_p50':>10}"
                f"{'ttft_p99':>10}{'itl_p50':>9}{'e2e_p99':>9}{'out tok/s':>10}"
                f"{'events pub':>12}{'applied':>10}{'route p99':>11}")
        rows = [head]
        for n, r in self.results.items():
            s = r.summary()
            rows.append(
                f"{n:<12}{s['hit_ratio']:>10.3f}{s['work_max_over_mean']:>10.3f}"
                f"{s['ttft_p50_s']:>9.2f}s{s['ttft_p99_s']:>9.2f}s"
                f"{s['itl_p50_s'] * 1e3:>7.1f}ms{s['e2e_p99_s']:>8.2f}s{s['output_tok_s']:>10.0f}"
                f"{s['events_published']:>12}{s['events_applied']:>10}{s['route_p99_us']:>9.0f}us"
            )
        return "\n".join(rows)


def _pct(sorted_vals: Sequence[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    i = min(len(sorted_vals) - 1, max(0, int(q * len(sorted_vals) + 0.5) - 1))
    return float(sorted_vals[i])


# --------------------------------------------------------------------------- routers


class _Router:
    """Base: chooses an engine index for a request at virtual time ``now``."""

    events_applied = 0

    def __init__(self, engines: list[SimEngine], cfg: SimConfig) -> None:
        self.engines = engines
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.loads = LoadTracker(expiry_s=1e12, clock=lambda: 0.0)

    def sync(self, now: float) -> None:
        """Make everything published up to ``now`` visible (only the kvwire router waits)."""

    def route(self, rid: str, req: Request, keys: list[int], now: float) -> int:
        raise NotImplementedError

    # A router does not know a request's output length: it expects the mean output of the
    # requests that have completed so far (learned online, no peeking at the trace).
    _out_sum = 0
    _out_n = 0

    def reserve(self, rid: str, e: int, prompt_blocks: int, credit: float, req: Request,
                now: float) -> None:
        expect = self._out_sum / self._out_n if self._out_n else 0.0
        amount = request_load(prompt_blocks, credit, expect / self.cfg.block_tokens,
                              self.cfg.share())
        self.loads.reserve(rid, self.engines[e].name, amount, now)

    def release(self, rid: str, req: Request) -> None:
        self._out_sum += req.output_length
        self._out_n += 1
        self.loads.release(rid)

    def close(self) -> None:
        pass


class _Random(_Router):
    def route(self, rid: str, req: Request, keys: list[int], now: float) -> int:
        return self.rng.randrange(len(self.engines))


class _RoundRobin(_Router):
    n = 0

    def route(self, rid: str, req: Request, keys: list[int], now: float) -> int:
        e = self.n % len(self.engines)
        self.n += 1
        return e


class _LeastLoad(_Router):
    def route(self, rid: str, req: Request, keys: list[int], now: float) -> int:
        loads = [self.loads.load(e.name) for e in self.engines]
        low = min(loads)
        tied = [i for i, v in enumerate(loads) if v <= low + 1e-9]
        e = tied[self.rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
        self.reserve(rid, e, len(keys), 0.0, req, now)
        return e


class _Oracle(_Router):
    """The same cost as kvwire, with each engine's cache read directly (no events)."""

    def __init__(self, engines: list[SimEngine], cfg: SimConfig) -> None:
        super().__init__(engines, cfg)
        self.policy = RoutingPolicy(cfg.prefill_weight, cfg.load_weight, seed=cfg.seed)
        self.index = {e.name: i for i, e in enumerate(engines)}

    def route(self, rid: str, req: Request, keys: list[int], now: float) -> int:
        cands = [Candidate(e.name, float(e.prefix_hits(keys)), self.loads.load(e.name))
                 for e in self.engines]
        d = self.policy.choose(len(keys), cands)
        e = self.index[d.name]
        self.reserve(rid, e, len(keys), d.overlap[d.name], req, now)
        return e


class _Kvwire(_Router):
    """Sees the fleet only through Subscriber -> PrefixIndex -> RoutingPolicy."""

    def __init__(self, engines: list[SimEngine], cfg: SimConfig) -> None:
        super().__init__(engines, cfg)
        from ..index import PrefixIndex  # helper E's package; imported when used

        self.now = 0.0
        self.idx = PrefixIndex(predict_ttl=cfg.predict_ttl, clock=lambda: self.now)
        self.policy = RoutingPolicy(cfg.prefill_weight, cfg.load_weight, seed=cfg.seed)
        specs = [StreamSpec(e.name, e.publisher.endpoint, "", e.publisher.replay_endpoint)
                 for e in engines if e.publisher is not None]
        if len(specs) != len(engines):
            raise SimError("the kvwire policy needs every engine to publish")
        self.sub = Subscriber(specs)
        self.applied = {e.name: -1 for e in engines}
        self.alive = {e.name: True for e in engines}
        self._dirty = True  # items applied since alive was read from the index
        self.index = {e.name: i for i, e in enumerate(engines)}
        self._wait_live()

    def _wait_live(self) -> None:
        """Every stream bootstrapped (its first Snapshot) before the first request."""
        deadline = time.monotonic() + self.cfg.sync_timeout
        seen: set[str] = set()
        while len(seen) < len(self.engines):
            if time.monotonic() > deadline:
                missing = sorted(set(self.applied) - seen)
                raise SimError(f"subscriber did not bootstrap streams {missing} within "
                               f"{self.cfg.sync_timeout}s")
            for item in self.sub.poll_many(0.05):
                self._apply(item)
                if isinstance(item, Snapshot):
                    seen.add(item.stream)

    def _apply(self, item: Any) -> None:
        self.idx.apply(item)
        self._dirty = True
        if isinstance(item, Batch):
            self.applied[item.stream] = item.seq
            self.events_applied += len(item.batch.events)
        elif isinstance(item, Snapshot):
            self.applied[item.stream] = item.seq
        elif isinstance(item, Reset):
            self.applied[item.stream] = -1

    def sync(self, now: float) -> None:
        self.now = now
        behind = [e for e in self.engines if self.applied[e.name] < e.batches - 1]
        if not behind:
            return
        deadline = time.monotonic() + self.cfg.sync_timeout
        while behind:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SimError(
                    "subscriber did not deliver every published batch within "
                    f"{self.cfg.sync_timeout}s: " + ", ".join(
                        f"{e.name} applied seq {self.applied[e.name]} of {e.batches - 1}"
                        for e in behind)
                )
            for item in self.sub.poll_many(min(left, 0.25), max_items=10_000):
                self._apply(item)
            behind = [e for e in behind if self.applied[e.name] < e.batches - 1]

    def route(self, rid: str, req: Request, keys: list[int], now: float) -> int:
        self.now = now
        tokens = prompt_array(req, len(keys) * self.cfg.block_tokens)
        m = self.idx.match(tokens)
        if self._dirty:  # liveness only changes when the subscriber delivers something
            streams = self.idx.streams()
            self.alive = {n: streams[n].alive if n in streams else True for n in self.alive}
            self._dirty = False
        cands = []
        for e in self.engines:
            sm = m.get(e.name)
            cands.append(Candidate(e.name, sm.credit if sm is not None else 0.0,
                                   self.loads.load(e.name), self.alive[e.name]))
        d = self.policy.choose(len(keys), cands)
        self.idx.predict(d.name, tokens)
        e = self.index[d.name]
        self.reserve(rid, e, len(keys), d.overlap[d.name], req, now)
        return e

    def close(self) -> None:
        self.sub.close()


_ROUTERS: dict[str, Callable[[list[SimEngine], SimConfig], _Router]] = {
    "kvwire": _Kvwire, "oracle": _Oracle, "random": _Random, "round_robin": _RoundRobin,
    "least_load": _LeastLoad,
}


# --------------------------------------------------------------------------- the loop


class _Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, label: str, total: int, enabled: bool | None = None) -> None:
        self.on = sys.stderr.isatty() if enabled is None else enabled
        self.label, self.total, self.last = label, total, 0.0

    def update(self, n: int, force: bool = False) -> None:
        if not self.on:
            return
        now = time.monotonic()
        if not force and now - self.last < 0.1:
            return
        self.last = now
        frac = n / self.total if self.total else 1.0
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{self.label:<11} [{bar:<30}] {n}/{self.total}")
        sys.stderr.flush()

    def done(self) -> None:
        if self.on:
            self.update(self.total, force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()


_COMMIT, _RELEASE = 0, 1


def simulate_policy(reqs: Sequence[Request], policy: str, cfg: SimConfig,
                    progress: bool | None | _Progress = None) -> PolicyResult:
    """Run the whole trace under one policy with a fresh fleet of publishing engines."""
    if policy not in _ROUTERS:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    t_wall = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="kvwire-sim-")
    engines: list[Any] = []
    router: _Router | None = None
    try:
        if cfg.engine_model == "batched":
            from .batched import BatchedEngine, engine_config, run_batched

            ecfg = engine_config(cfg)
        for i in range(cfg.engines):
            pub = ZmqEventPublisher(
                endpoint=f"ipc://{tmp}/e{i}", replay_endpoint=f"ipc://{tmp}/e{i}-replay",
                heartbeat_interval=None,  # no heartbeat seqs: seqs count our batches exactly
            )
            if cfg.engine_model == "batched":
                engines.append(BatchedEngine(f"engine{i}", ecfg, pub))
            else:
                engines.append(SimEngine(f"engine{i}", cfg.capacity, cfg.block_tokens, pub))
        router = _ROUTERS[policy](engines, cfg)
        bar = progress if isinstance(progress, _Progress) else _Progress(
            policy, len(reqs), progress)
        if cfg.engine_model == "batched":
            res = run_batched(reqs, engines, router, cfg, bar, PolicyResult(name=""))
        else:
            res = _run(reqs, engines, router, cfg, bar)
        res.name = policy
        router.sync(float("inf"))  # the last commits' events, so applied can match published
        res.events_published = sum(e.events for e in engines)
        res.events_applied = router.events_applied
    finally:
        if router is not None:
            router.close()
        for e in engines:
            if e.publisher is not None:
                e.publisher.shutdown(timeout=1.0)
        shutil.rmtree(tmp, ignore_errors=True)
    res.wall_s = time.monotonic() - t_wall
    return res


def _run(reqs: Sequence[Request], engines: list[SimEngine], router: _Router, cfg: SimConfig,
         bar: _Progress) -> PolicyResult:
    res = PolicyResult(name="")
    n = len(engines)
    free = [0.0] * n
    work = [0.0] * n
    heap: list[tuple[float, int, int, Any]] = []
    order = 0
    bs = cfg.block_tokens
    pre, dec = cfg.prefill_rate, cfg.decode_rate

    def advance(t: float) -> None:
        while heap and heap[0][0] <= t:
            when, _, kind, payload = heapq.heappop(heap)
            if kind == _COMMIT:
                e, req, keys = payload
                engines[e].commit(req, keys, when)
            else:
                router.release(*payload)

    for i, req in enumerate(reqs):
        t = req.t
        advance(t)
        router.sync(t)
        keys = engine_keys(req, bs)
        rid = f"r{i}"
        t0 = time.perf_counter()
        e = router.route(rid, req, keys, t)
        res.route_us.append((time.perf_counter() - t0) * 1e6)
        hit = engines[e].prefix_hits(keys)
        res.hit_blocks += hit
        res.prompt_blocks += len(keys)
        res.cached_tokens += hit * bs
        res.prompt_tokens += req.input_length
        prefill = (req.input_length - hit * bs) / pre
        decode = req.output_length / dec
        start = max(t, free[e])
        first = start + prefill
        free[e] = first + decode
        work[e] += prefill + decode
        res.ttft_s.append(first - t)
        res.e2e_s.append(first + decode - t)
        res.itl_s.extend([1.0 / dec] * max(0, req.output_length - 1))
        res.output_tokens += req.output_length
        res.span_s = max(res.span_s, first + decode - reqs[0].t)
        heapq.heappush(heap, (first, order, _COMMIT, (e, req, keys)))
        heapq.heappush(heap, (first + decode, order + 1, _RELEASE, (rid, req)))
        order += 2
        bar.update(i + 1)
    advance(float("inf"))
    bar.done()
    res.engine_work_s = work
    return res


def _workers(n: int | None, policies: int) -> int:
    if n is None:
        try:
            n = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            n = os.cpu_count() or 1
    return max(1, min(n, policies))


class _SharedProgress(_Progress):
    """In a worker process: progress goes to a shared counter the parent draws."""

    def __init__(self, slot: int) -> None:
        super().__init__("", 0, False)
        self.slot = slot

    def update(self, n: int, force: bool = False) -> None:
        if _COUNTS is not None:
            _COUNTS[self.slot] = n


_COUNTS: Any = None
#: Requests x policies below which the default is one process (spawning costs ~1 s each).
_PARALLEL_MIN = 3000


def _worker_init(counts: Any) -> None:
    global _COUNTS
    _COUNTS = counts


def _worker(reqs: Sequence[Request], policy: str, cfg: SimConfig, slot: int) -> PolicyResult:
    return simulate_policy(reqs, policy, cfg, _SharedProgress(slot))


def run_sim(reqs: Sequence[Request], cfg: SimConfig, policies: Sequence[str] = POLICIES,
            progress: bool | None = None, workers: int | None = 1) -> SimResult:
    """Every policy over the same trace, each with its own fresh fleet.

    Policies are independent, so they can run in ``workers`` processes (None: one per CPU,
    at most one per policy, and one for runs too small to repay starting processes);
    results do not depend on it. Worker processes are spawned, so a script calling this
    with ``workers != 1`` needs the ``if __name__ == "__main__":`` guard; the CLI, the
    fleet demo and the bench have it."""
    for p in policies:
        if p not in _ROUTERS:
            raise ValueError(f"unknown policy {p!r}; choose from {', '.join(POLICIES)}")
    if workers is None and len(reqs) * len(policies) < _PARALLEL_MIN:
        workers = 1
    n = _workers(workers, len(policies))
    if n == 1:
        return SimResult(len(reqs), cfg,
                         {p: simulate_policy(reqs, p, cfg, progress) for p in policies})
    ctx = multiprocessing.get_context("spawn")  # no inherited sockets or threads
    counts = ctx.Array("q", len(policies), lock=False)
    bar = _Progress(f"{len(policies)} policies", len(policies) * len(reqs), progress)
    # The kvwire policy takes longest: start it first so the others fill the other workers.
    order = sorted(range(len(policies)), key=lambda i: policies[i] != "kvwire")
    with ProcessPoolExecutor(n, mp_context=ctx, initializer=_worker_init,
                             initargs=(counts,)) as ex:
        futs = {i: ex.submit(_worker, reqs, policies[i], cfg, i) for i in order}
        pending = set(futs.values())
        while pending:
            _, pending = wait(pending, timeout=0.1, return_when=FIRST_EXCEPTION)
            if any(f.done() and f.exception() is not None for f in futs.values()):
                break
            bar.update(sum(counts))
        results = {policies[i]: futs[i].result() for i in range(len(policies))}
    bar.done()
    return SimResult(len(reqs), cfg, results)
