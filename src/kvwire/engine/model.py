"""A vLLM V1-like engine as a pure state machine: scheduler, paged prefix cache, step clock.

No I/O and no wall clock: the caller adds requests at virtual times and calls :meth:`step`;
each step says when it started and ended, which requests got their first token or finished,
and the KV events the step produced (one ``KVEventBatch`` worth, as vLLM publishes per step).

Scheduling, per step, as vLLM V1 does it with chunked prefill:

* one token budget (``max_num_batched_tokens``) shared by everything in the step;
* running requests first, oldest first: a decode takes one token, a prefill the rest of its
  prompt up to the budget left. If their blocks cannot be had, the youngest running request
  is preempted (its blocks freed, its progress dropped, back to the front of the queue)
  until they can; if that was the request itself, the step stops scheduling;
* then, if nothing was preempted, waiting requests in order while the budget and
  ``max_num_seqs`` allow: each looks up its longest cached prefix (never its last token,
  which must be computed to sample), takes those blocks and allocates the rest of the
  chunk; the tokens found are its ``cached_tokens`` (counted at its first admission);
  every lookup of a never-preempted request adds to :attr:`EngineModel.prefix_queries` and
  ``prefix_hits``, as vLLM's scheduler counts ``prefix_cache_queries``/``_hits`` (per
  lookup, even one whose blocks cannot be had yet; preempted requests' lookups apart);
* blocks are cached as soon as a scheduled chunk fills them (``BlockStored``), and
  allocating a free cached block evicts it (``BlockRemoved``).

Step time is :class:`~kvwire.engine.timing.StepCost` of what was scheduled. When nothing is
waiting and every running request is decoding inside its current block, the next steps
change nothing but counters until a block fills, a request finishes or ``until`` passes;
:meth:`step` runs them in one call (``StepResult.steps`` > 1), with exactly the times and
state single steps give (a test checks it), which is what lets a fleet replay long traces.
"""

from __future__ import annotations

import copy
import math
import operator
from array import array
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate, repeat

from ..wire.events import Event
from .kvcache import PagedPrefixCache
from .request import FINISHED, RUNNING, WAITING, EngineRequest
from .timing import StepCost

__all__ = ["EngineConfig", "EngineModel", "StepResult"]


@dataclass(frozen=True)
class EngineConfig:
    """One engine. Defaults: vLLM's scheduler defaults, and a KV cache of Llama-3.1-8B on
    an 80 GB H100 (about 450k tokens: 28,000 blocks of 16)."""

    num_gpu_blocks: int = 28_000
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    cpu_blocks: int = 0
    cost: StepCost = field(default_factory=StepCost)
    seed: int = 0
    #: run quiet decode-only stretches in one call (same results, much faster)
    fast_forward: bool = True
    #: the LoRA adapters' names: lora_id ``i`` (from 1) is ``lora_names[i - 1]``, published
    #: as ``lora_name`` beside ``lora_id`` as vLLM does (routers key adapters by name)
    lora_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if isinstance(self.cpu_blocks, bool) or not isinstance(self.cpu_blocks, int) \
                or self.cpu_blocks < 0:
            raise ValueError(f"cpu_blocks must be an integer >= 0, got {self.cpu_blocks!r}")


@dataclass(slots=True)
class StepResult:
    """What one call to :meth:`EngineModel.step` did (``steps`` engine steps)."""

    start: float
    end: float
    steps: int
    events: list[Event]
    #: tokens and sequences scheduled in each of the steps (the same in every one)
    tokens: int
    seqs: int
    first_tokens: list[EngineRequest]
    finished: list[EngineRequest]


class EngineModel:
    """The engine: ``add`` requests, ``step`` while not :attr:`idle`."""

    def __init__(self, cfg: EngineConfig | None = None) -> None:
        self.cfg = cfg = cfg if cfg is not None else EngineConfig()
        self.cache = PagedPrefixCache(cfg.num_gpu_blocks, cfg.block_size, cfg.cpu_blocks,
                                      cfg.lora_names)
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.now = 0.0
        self.busy_s = 0.0
        self.steps = 0
        self.preemptions = 0
        #: tokens looked up in / found in the prefix cache on admission (vLLM's counters)
        self.prefix_queries = 0
        self.prefix_hits = 0
        #: every inter-token gap (seconds) of every request, in the order produced
        self.itl = array("d")

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def fits(self, prompt_len: int, max_tokens: int) -> bool:
        """Whether a request this long can ever run here (vLLM checks the same against
        its KV cache at startup, through max_model_len)."""
        return -(-(prompt_len + max_tokens) // self.cfg.block_size) <= self.cfg.num_gpu_blocks

    def add(self, req: EngineRequest, now: float | None = None) -> None:
        """Queue a new request arriving at ``now`` (default: the engine's clock). A busy
        engine must have been stepped up to ``now`` first; an idle one jumps to it."""
        if req.status != WAITING or req.tokens:
            raise ValueError(f"request {req.rid!r} was already added")
        if not req.prompt or req.max_tokens < 1:
            raise ValueError(f"request {req.rid!r}: needs a prompt and max_tokens >= 1")
        if not self.fits(len(req.prompt), req.max_tokens):
            raise ValueError(f"request {req.rid!r}: {len(req.prompt)} + {req.max_tokens} tokens "
                             f"exceed the KV cache ({self.cfg.num_gpu_blocks} blocks of "
                             f"{self.cfg.block_size})")
        t = self.now if now is None else now
        if t > self.now:
            if not self.idle:
                raise ValueError(f"engine busy at {self.now}: step it to {t} before adding")
            self.now = t
        req.arrival = t
        req._start(self.cfg.block_size, self.cfg.seed)
        self.waiting.append(req)

    def fork(self) -> EngineModel:
        """An independent copy to run ahead on (a what-if: when would a request added now
        get its first token?), sharing nothing with this engine; its :attr:`itl` starts
        empty (the gaps already produced are this engine's history, not its state)."""
        itl, self.itl = self.itl, array("d")
        try:
            return copy.deepcopy(self)
        finally:
            self.itl = itl

    def abort(self, req: EngineRequest) -> bool:
        """Drop a waiting or running request (a client went away): its blocks are freed
        now, as vLLM frees an aborted request's. False if it was not here."""
        if req.status == WAITING and req in self.waiting:
            self.waiting.remove(req)
        elif req.status == RUNNING and req in self.running:
            self.running.remove(req)
            self.cache.free_blocks(req.blocks)
            req.blocks = []
        else:
            return False
        req.status = FINISHED
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (``AllBlocksCleared`` in :meth:`take_events`); only when
        no request holds blocks, like vLLM; False otherwise."""
        return self.cache.reset()

    def take_events(self) -> list[Event]:
        """Events produced outside a step (a reset)."""
        return self.cache.take_events()

    # ------------------------------------------------------------------ stepping

    def step(self, until: float = math.inf) -> StepResult:
        """Run the next step (or a quiet stretch of them, none starting at or after
        ``until``). Raises RuntimeError when idle."""
        if self.idle:
            raise RuntimeError("step() on an idle engine")
        if self.cfg.fast_forward:
            folded = self._fold(until)
            if folded is not None:
                return folded
        return self._one_step()

    def _cache_full(self, req: EngineRequest, upto: int) -> None:
        full = min(upto, len(req.tokens)) // self.cfg.block_size
        if full > req.num_cached_blocks:
            self.cache.cache_full(req.blocks, req.hashes, req.num_cached_blocks, full,
                                  req.tokens, req.lora_id)
            req.num_cached_blocks = full

    def _grow(self, req: EngineRequest, n: int) -> bool:
        """Blocks for ``n`` more tokens of a running request; False if not enough free."""
        need = -(-(req.num_computed + n) // self.cfg.block_size) - len(req.blocks)
        if need > 0:
            if need > self.cache.num_free:
                return False
            req.blocks += self.cache.allocate(need)
        self._cache_full(req, req.num_computed + n)
        return True

    def _preempt(self, req: EngineRequest) -> None:
        self.cache.free_blocks(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_cached_blocks = 0
        req.status = WAITING
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self, budget: int) -> list[tuple[EngineRequest, int]]:
        cfg, cache = self.cfg, self.cache
        bs = cfg.block_size
        out = []
        waiting, running = self.waiting, self.running
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            req = waiting[0]
            hit = cache.longest_hit(req.hashes[:(len(req.tokens) - 1) // bs])
            computed = len(hit) * bs
            if not req.preemptions:
                self.prefix_queries += len(req.tokens)
                self.prefix_hits += computed
            n = min(len(req.tokens) - computed, budget)
            need = -(-(computed + n) // bs) - len(hit)
            ref = cache.ref
            held_free = sum(1 for b in hit if ref[b] == 0)  # touching takes them off the queue
            if need > cache.num_free - held_free:
                break
            cache.touch(hit)
            req.blocks = hit + cache.allocate(need)
            req.num_computed = computed
            req.num_cached_blocks = len(hit)
            req.hit_tokens = computed
            if req.cached_tokens < 0:
                req.cached_tokens = computed
            req.status = RUNNING
            waiting.popleft()
            running.append(req)
            self._cache_full(req, computed + n)
            out.append((req, n))
            budget -= n
        return out

    def _one_step(self) -> StepResult:
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        sched: list[tuple[EngineRequest, int]] = []
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(len(req.tokens) - req.num_computed, budget)
            while not self._grow(req, n):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status != RUNNING:
                break
            sched.append((req, n))
            budget -= n
            i += 1
        if not preempted:
            sched += self._admit(budget)
        prefill = decode = ctx = tokens = 0
        for req, n in sched:
            if n == 1 and req.num_output and req.num_computed == len(req.tokens) - 1:
                decode += 1
            else:
                prefill += n
            ctx += req.num_computed + n
            tokens += n
        dt = cfg.cost.step_time(prefill, decode, ctx)
        start = self.now
        end = self.now = start + dt
        self.busy_s += dt
        self.steps += 1
        bs = cfg.block_size
        firsts: list[EngineRequest] = []
        finished: list[EngineRequest] = []
        for req, n in sched:
            req.num_computed += n
            if req.num_computed < len(req.tokens):
                continue  # a prefill chunk: nothing sampled yet
            req._append_output(1, bs)
            if req.first_token_t is None:
                req.first_token_t = end
                firsts.append(req)
            else:
                self.itl.append(end - req.last_token_t)
            req.last_token_t = end
            if req.num_output >= req.max_tokens:
                self.cache.free_blocks(req.blocks)
                req.blocks = []
                req.status = FINISHED
                req.finish_t = end
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.status == RUNNING]
        return StepResult(start, end, 1, self.cache.take_events(), tokens, len(sched), firsts,
                          finished)

    def _fold(self, until: float) -> StepResult | None:
        """The quiet decode steps from now, in one go (None if the next step is not one)."""
        if self.waiting or not self.running:
            return None
        running = self.running
        n = len(running)
        cfg = self.cfg
        if n > cfg.max_num_batched_tokens:
            return None
        bs = cfg.block_size
        k = 1 << 62
        ctx = 0
        for r in running:
            ntok = len(r.tokens)
            if r.num_output == 0 or r.num_computed != ntok - 1:
                return None
            # steps before a block fills (or a new one is needed), and before it finishes
            k = min(k, len(r.blocks) * bs - ntok, r.max_tokens - r.num_output - 1)
            if k <= 0:
                return None
            ctx += ntok
        cost = cfg.cost
        start = self.now
        if cost.context_token_s:
            dts = [cost.step_time(0, n, ctx + j * n) for j in range(k)]
        else:
            dts = list(repeat(cost.step_time(0, n, ctx), k))
        # Left folds: the same float additions, in the same order, as single steps make.
        times = list(accumulate(dts, initial=start))
        m = bisect_left(times, until, 0, k)  # steps that start before ``until``
        if m == 0:
            return None
        ends = times[1:m + 1]
        self.busy_s = list(accumulate(dts[:m], initial=self.busy_s))[-1]
        self.steps += m
        self.now = ends[-1]
        gaps = list(map(operator.sub, ends[1:], ends))
        itl = self.itl
        for r in running:
            itl.append(ends[0] - r.last_token_t)
            itl.extend(gaps)
            r.num_computed += m
            r._append_output(m, bs)
            r.last_token_t = ends[-1]
        return StepResult(start, ends[-1], m, [], n, n, [], [])
