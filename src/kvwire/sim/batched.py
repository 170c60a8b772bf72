"""The fleet on the batched engine model: each engine a :class:`~kvwire.engine.EngineModel`
(continuous batching, chunked prefill, paged prefix cache) whose per-step KV events go out
through a real ZmqEventPublisher at the virtual time the step ends.

The loop is the FIFO one's (see :mod:`.fleet`): before an arrival at ``t`` every engine is
stepped until its next step would start at or after ``t``; a step that straddles ``t``
runs, but its events and completions are held back until a later arrival passes its end,
so the router sees exactly what exists at ``t``. Prompts are the trace's token ids
(:func:`~kvwire.sim.trace.prompt_array`); prompt tokens past what the hash ids name are
unique to the request.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence

from ..engine import EngineConfig, EngineModel, EngineRequest, StepResult, block_hashes
from ..publish.publisher import ZmqEventPublisher
from ..wire.events import Event, KVEventBatch
from .routers import SimRouter
from .trace import Request, prompt_array
from .types import PolicyResult, Progress, SimConfig, SimError

__all__ = ["BatchedSim", "engine_config", "make_request", "run_batched"]


def engine_config(cfg: SimConfig, role: str = "both") -> EngineConfig:
    """The engine model's config from the simulator's."""
    return EngineConfig(num_gpu_blocks=cfg.capacity, block_size=cfg.block_tokens,
                        max_num_batched_tokens=cfg.max_num_batched_tokens,
                        max_num_seqs=cfg.max_num_seqs, cpu_blocks=cfg.cpu_blocks,
                        cost=cfg.step_cost, seed=cfg.seed, role=role, lease_s=cfg.lease_s,
                        transfer=cfg.transfer, load_failure=cfg.load_failure,
                        recompute_blocks=cfg.recompute_blocks)


class BatchedSim:
    """The simulator's ``batched`` engine model (``--engine-model batched``): one
    :class:`~kvwire.engine.EngineModel` and its publisher, with the counters the routers read."""

    def __init__(self, name: str, cfg: EngineConfig,
                 publisher: ZmqEventPublisher | None) -> None:
        self.name = name
        self.model = EngineModel(cfg)
        self.publisher = publisher
        self.batches = 0
        self.events = 0

    def prefix_hits(self, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` (block hashes) cached now (the oracle's read)."""
        return len(self.model.cache.longest_hit(keys))

    def publish(self, events: list[Event], ts: float) -> None:
        self.batches += 1
        self.events += len(events)
        if self.publisher is not None:
            self.publisher.publish(KVEventBatch(ts, events, None))


def make_request(i: int, req: Request, block_size: int) -> tuple[EngineRequest, int]:
    """Trace request ``i`` as an engine request (its hashes computed once), and how many
    of its blocks the hash ids name (what a router can match)."""
    prompt = prompt_array(req, req.cacheable_tokens)
    extra = max(req.input_length, 1) - len(prompt)
    if extra > 0:  # tokens no hash id names: unique to this request (outside uint16)
        rng = random.Random(f"kvwire-sim/tail/{i}")
        prompt.extend(65536 + rng.randrange(1 << 20) for _ in range(extra))
    er = EngineRequest(f"r{i}", prompt, max(1, req.output_length))
    er.hashes = block_hashes(prompt, block_size)
    return er, req.cacheable_tokens // block_size


def run_batched(reqs: Sequence[Request], engines: list[BatchedSim], router: SimRouter,
                cfg: SimConfig, bar: Progress, res: PolicyResult) -> PolicyResult:
    """Replay the trace; fill ``res`` (hits at admission, TTFT, ITL, end-to-end, work)."""

    bs = cfg.block_tokens
    pending: list[deque[StepResult]] = [deque() for _ in engines]
    trace_of: dict[str, Request] = {}
    ereqs: list[tuple[EngineRequest, int, float]] = []

    def deliver(eng: BatchedSim, r: StepResult) -> None:
        router.now = r.end
        if r.events:
            eng.publish(r.events, r.end)
        for q in r.first_tokens:
            router.first_token(q.rid)
        for q in r.finished:
            router.release(q.rid, trace_of.pop(q.rid))

    def advance(t: float) -> None:
        for eng, held in zip(engines, pending):
            while held and held[0].end <= t:
                deliver(eng, held.popleft())
            m = eng.model
            while not m.idle and m.now < t:
                r = m.step(t)
                if r.end <= t:
                    deliver(eng, r)
                else:
                    held.append(r)

    for i, req in enumerate(reqs):
        t = req.t
        advance(t)
        router.sync(t)
        router.now = t
        er, nkeys = make_request(i, req, bs)
        keys = er.hashes[:nkeys]
        router.request = er  # (the clairvoyant router runs a copy of it ahead)
        t0 = time.perf_counter()
        e = router.route(er.rid, req, keys, t)
        res.route_us.append((time.perf_counter() - t0) * 1e6)
        model = engines[e].model
        if not model.fits(len(er.prompt), er.max_tokens):
            raise SimError(f"request {i} ({len(er.prompt)} + {er.max_tokens} tokens) does not "
                           f"fit an engine of {cfg.capacity} blocks of {bs} tokens")
        trace_of[er.rid] = req
        model.add(er, t)
        ereqs.append((er, nkeys, t))
        bar.update(i + 1)
    advance(float("inf"))
    bar.done()
    out_tokens = 0
    last = 0.0
    for er, nkeys, t in ereqs:
        assert er.first_token_t is not None and er.finish_t is not None
        res.hit_blocks += min(er.cached_tokens // bs, nkeys)
        res.prompt_blocks += nkeys
        res.cached_tokens += er.cached_tokens
        res.prompt_tokens += len(er.prompt)
        res.ttft_s.append(er.first_token_t - t)
        res.e2e_s.append(er.finish_t - t)
        out_tokens += er.num_output
        last = max(last, er.finish_t)
    for eng in engines:
        res.itl_s.extend(eng.model.itl)
        res.preemptions += eng.model.preemptions
    res.engine_work_s = [eng.model.busy_s for eng in engines]
    res.output_tokens = out_tokens
    res.span_s = last - reqs[0].t if reqs else 0.0
    return res
