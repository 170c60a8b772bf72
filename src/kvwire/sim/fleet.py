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
import shutil
import sys
import tempfile
import time
from array import array
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from ..engine.timing import StepCost
from ..publish.publisher import ZmqEventPublisher
from ..router.cache_aware import CacheAwareParams
from ..routing.policy import RoutingPolicy
from .engine import SimEngine, engine_keys
from .quantile import nearest_rank
from .routers import (  # noqa: F401 - re-exported: tests patch fleet._LeastLoad
    _ROUTERS,
    SimError,
    _Kvwire,
    _LeastLoad,
    _Oracle,
    _Random,
    _RoundRobin,
    _Router,
)
from .trace import Request

__all__ = ["POLICIES", "PolicyResult", "SimConfig", "SimError", "SimResult", "run_sim",
           "simulate_policy"]

_JSON_KEYS = ("hit_ratio", "work_max_over_mean", "ttft_p50_s", "ttft_p99_s",
              "events_published", "events_applied", "prefix_reuse_ratio", "itl_p50_s",
              "itl_p99_s", "e2e_p50_s", "e2e_p99_s", "output_tok_s", "preemptions")
POLICIES = ("kvwire", "oracle", "random", "round_robin", "least_load")
#: Every policy ``run_sim`` knows; the ones past POLICIES are run when asked for.
ALL_POLICIES = (*POLICIES, "sglang", "clairvoyant")
ENGINE_MODELS = ("batched", "fifo")


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
    #: RoutingPolicy weights used by ``kvwire`` and ``oracle`` (same cost for both): a
    #: queue counts, block for block, once it exceeds the least-loaded engine's by
    #: ``balance_slack_tokens`` (docs/decisions/0008-cache-first-balance-slack.md). The earlier
    #: weights: ``load_weight=0.5, balance_slack_tokens=0``.
    prefill_weight: float = 1.0
    load_weight: float = 1.0
    balance_slack_tokens: int = 131_072
    #: Ties (a new prefix, engines idle) go to the engine busy least lately: the seconds
    #: it held requests, decayed over ``busy_window`` virtual seconds (LoadTracker.busy).
    busy_window: float = 600.0
    #: Load seen by the policy: reserved load less the prefill each engine has likely
    #: worked off at its learned rate (LoadTracker.load); False: reserved load only.
    drain: bool = True
    #: Load of a routed request = uncached blocks + decode_share x expected output blocks
    #: (expected = mean output of the requests completed so far). None: a decoded token's
    #: cost over a prefilled token's (fifo: prefill_rate / decode_rate; batched: the step
    #: cost's decode_seq_s / prefill_token_s), i.e. load is work in block-prefills.
    decode_share: float | None = None
    #: Predicted entries live this long (virtual s) unless events confirm them.
    predict_ttl: float = 30.0
    #: The ``sglang`` policy's parameters (SGLang router 0.3.2's defaults).
    cache_aware: CacheAwareParams = field(default_factory=CacheAwareParams)
    #: Wall seconds to wait for the subscriber to catch up before failing.
    sync_timeout: float = 30.0
    #: ``kvwire`` only: router replicas the requests are spread over in turn (each with
    #: its own load tracker, as ``kvwire serve --nats`` replicas behind a load balancer),
    #: and whether they share their load (routing/sharing.py's PeerLoads, each report
    #: arriving ``share_delay`` virtual seconds after it was sent).
    replicas: int = 1
    share_load: bool = True
    share_delay: float = 0.002

    def __post_init__(self) -> None:
        if self.engine_model not in ENGINE_MODELS:
            raise ValueError(f"unknown engine model {self.engine_model!r}; choose from "
                             f"{', '.join(ENGINE_MODELS)}")
        if self.replicas < 1 or not self.share_delay >= 0:
            raise ValueError(f"need replicas >= 1 and share_delay >= 0, got "
                             f"{self.replicas} and {self.share_delay}")

    def routing_policy(self) -> RoutingPolicy:
        """The RoutingPolicy of the ``kvwire`` and ``oracle`` routers (slack in blocks)."""
        return RoutingPolicy(self.prefill_weight, self.load_weight, seed=self.seed,
                             balance_slack=self.balance_slack_tokens / self.block_tokens)

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
        """The six headline keys (deterministic for a seed), then wall-clock extras."""
        ttft = sorted(self.ttft_s)
        lat = sorted(self.route_us)
        itl = sorted(self.itl_s)
        e2e = sorted(self.e2e_s)
        return {
            "hit_ratio": round(self.hit_ratio, 6),
            "work_max_over_mean": round(self.work_max_over_mean, 6),
            "ttft_p50_s": round(nearest_rank(ttft, 0.50), 6),
            "ttft_p99_s": round(nearest_rank(ttft, 0.99), 6),
            "events_published": self.events_published,
            "events_applied": self.events_applied,
            "prefix_reuse_ratio": round(self.prefix_reuse_ratio, 6),
            "itl_p50_s": round(nearest_rank(itl, 0.50), 6),
            "itl_p99_s": round(nearest_rank(itl, 0.99), 6),
            "e2e_p50_s": round(nearest_rank(e2e, 0.50), 6),
            "e2e_p99_s": round(nearest_rank(e2e, 0.99), 6),
            "output_tok_s": round(self.output_tokens / self.span_s, 3) if self.span_s else 0.0,
            "preemptions": self.preemptions,
            "route_p50_us": round(nearest_rank(lat, 0.50), 1),
            "route_p99_us": round(nearest_rank(lat, 0.99), 1),
            "engine_work_s": [round(w, 3) for w in self.engine_work_s],
        }


@dataclass
class SimResult:
    """One run: the fleet's shape and each policy's result."""

    requests: int
    config: SimConfig
    results: dict[str, PolicyResult]

    def to_json(self) -> dict[str, Any]:
        """The object ``kvwire sim --json`` prints: one fixed shape, every value
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
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(ALL_POLICIES)}")
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
            router.now = when
            if kind == _COMMIT:
                e, req, keys, rid = payload
                engines[e].commit(req, keys, when)
                router.first_token(rid)
            else:
                router.release(*payload)

    for i, req in enumerate(reqs):
        t = req.t
        advance(t)
        router.sync(t)
        router.now = t
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
        heapq.heappush(heap, (first, order, _COMMIT, (e, req, keys, rid)))
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
            raise ValueError(f"unknown policy {p!r}; choose from {', '.join(ALL_POLICIES)}")
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
