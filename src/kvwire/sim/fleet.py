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
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from typing import Any

from ..publish.publisher import ZmqEventPublisher
from .fifo import FifoSim, engine_keys
from .routers import (  # noqa: F401 - re-exported: tests patch fleet._LeastLoad
    ROUTERS,
    SimRouter,
    _Kvwire,
    _LeastLoad,
    _Oracle,
    _Random,
    _RoundRobin,
)
from .trace import Request
from .types import (  # noqa: F401 - re-exported: kvwire.sim.fleet is the simulator's API
    ALL_POLICIES,
    ENGINE_MODELS,
    POLICIES,
    PolicyResult,
    Progress,
    SimConfig,
    SimError,
    SimResult,
)

__all__ = ["POLICIES", "PolicyResult", "SimConfig", "SimError", "SimResult", "run_sim",
           "simulate_policy"]


_COMMIT, _RELEASE = 0, 1


def simulate_policy(reqs: Sequence[Request], policy: str, cfg: SimConfig,
                    progress: bool | None | Progress = None) -> PolicyResult:
    """Run the whole trace under one policy with a fresh fleet of publishing engines."""
    if policy not in ROUTERS:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(ALL_POLICIES)}")
    t_wall = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="kvwire-sim-")
    engines: list[Any] = []
    router: SimRouter | None = None
    try:
        if cfg.engine_model == "batched":
            from .batched import BatchedSim, engine_config, run_batched

            ecfg = engine_config(cfg)
        if cfg.pd:
            from .pd import fleet_roles, run_pd

            fleet = fleet_roles(cfg)
        else:
            fleet = [(f"engine{i}", "both") for i in range(cfg.engines)]
        for i, (name, role) in enumerate(fleet):
            pub = ZmqEventPublisher(
                endpoint=f"ipc://{tmp}/e{i}", replay_endpoint=f"ipc://{tmp}/e{i}-replay",
                heartbeat_interval=None,  # no heartbeat seqs: seqs count our batches exactly
            )
            if cfg.engine_model == "batched":
                engines.append(BatchedSim(name, engine_config(cfg, role) if cfg.pd else ecfg,
                                          pub))
            else:
                engines.append(FifoSim(name, cfg.capacity, cfg.block_tokens, pub))
        router = ROUTERS[policy](engines, cfg)
        bar = progress if isinstance(progress, Progress) else Progress(
            policy, len(reqs), progress)
        if cfg.pd:
            res = run_pd(reqs, engines, router, cfg, bar, PolicyResult(name=""))
        elif cfg.engine_model == "batched":
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


def _run(reqs: Sequence[Request], engines: list[FifoSim], router: SimRouter, cfg: SimConfig,
         bar: Progress) -> PolicyResult:
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


class _SharedProgress(Progress):
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
        if p not in ROUTERS:
            raise ValueError(f"unknown policy {p!r}; choose from {', '.join(ALL_POLICIES)}")
    if workers is None and len(reqs) * len(policies) < _PARALLEL_MIN:
        workers = 1
    n = _workers(workers, len(policies))
    if n == 1:
        return SimResult(len(reqs), cfg,
                         {p: simulate_policy(reqs, p, cfg, progress) for p in policies})
    ctx = multiprocessing.get_context("spawn")  # no inherited sockets or threads
    counts = ctx.Array("q", len(policies), lock=False)
    bar = Progress(f"{len(policies)} policies", len(policies) * len(reqs), progress)
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
