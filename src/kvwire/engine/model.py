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
* then, if nothing was preempted, requests whose pull ended (they hold their blocks), and
  waiting requests in order while the budget and
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

Disaggregated serving (``EngineConfig.role``): a ``remote_decode`` request (prefill side)
finishes after its first token and keeps its blocks under a :class:`Lease` until the decode
side releases it (pulled, aborted, all cached there) or it expires. A ``remote_prefill``
request (decode side) takes its local prefix hit on admission, allocates its whole prompt
and, when more than ``recompute_blocks`` blocks are missing, waits ``TRANSFERRING`` (listed
in ``StepResult.pulls``) until the caller says the pull ended (:meth:`EngineModel.transfer_done`);
the step that next runs it caches and publishes the pulled blocks like computed ones, as vLLM
does.
The caller moves the blocks and keeps the time; the model only holds and frees them.
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
from .request import FINISHED, RUNNING, TRANSFERRING, WAITING, EngineRequest
from .timing import StepCost, TransferCost

__all__ = ["ROLES", "EngineConfig", "EngineModel", "Lease", "StepResult"]

ROLES = ("both", "prefill", "decode")
LOAD_FAILURE = ("fail", "recompute")


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
    #: "both" (prefill and decode here), "prefill" (runs remote-decode requests and leases
    #: their blocks) or "decode" (admits remote-prefill requests and pulls their KV)
    role: str = "both"
    #: seconds a prefill engine holds a finished remote-decode request's blocks unless the
    #: decode side extends it (vLLM's ``kv_lease_duration``)
    lease_s: float = 30.0
    transfer: TransferCost = field(default_factory=TransferCost)
    #: a failed pull: "fail" the request, or "recompute" the prompt locally (vLLM's
    #: ``kv_load_failure_policy``)
    load_failure: str = "fail"
    #: a pull of at most this many blocks is recomputed locally instead (vLLM's
    #: ``kv_recompute_threshold``)
    recompute_blocks: int = 0

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if isinstance(self.cpu_blocks, bool) or not isinstance(self.cpu_blocks, int) \
                or self.cpu_blocks < 0:
            raise ValueError(f"cpu_blocks must be an integer >= 0, got {self.cpu_blocks!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.load_failure not in LOAD_FAILURE:
            raise ValueError(f"load_failure must be one of {', '.join(LOAD_FAILURE)}, "
                             f"got {self.load_failure!r}")
        lease = self.lease_s
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) \
                or not math.isfinite(lease) or lease <= 0:
            raise ValueError(f"lease_s must be a finite number > 0, got {lease!r}")
        rb = self.recompute_blocks
        if isinstance(rb, bool) or not isinstance(rb, int) or rb < 0:
            raise ValueError(f"recompute_blocks must be an integer >= 0, got {rb!r}")
        if not isinstance(self.transfer, TransferCost):
            raise ValueError(f"transfer must be a TransferCost, got {self.transfer!r}")


@dataclass(slots=True)
class Lease:
    """A finished remote-decode request's blocks, held for the decode side to pull until
    ``expires`` (model seconds). ``hashes``: the prompt's full blocks' hashes, in order;
    ``blocks`` also holds the partial last block; ``tokens``: the prompt's length."""

    rid: str
    blocks: list[int]
    hashes: list[int]
    tokens: int
    expires: float


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
    #: remote-prefill requests that entered TRANSFERRING in this step (their ``pull_from``
    #: and ``pull_blocks`` say what to pull)
    pulls: list[EngineRequest] = field(default_factory=list)
    #: remote-prefill requests that chose a local prefill instead (everything cached, or a
    #: pull of at most ``recompute_blocks``): their remote lease can be released
    local_prefills: list[EngineRequest] = field(default_factory=list)


class EngineModel:
    """The engine: ``add`` requests, ``step`` while not :attr:`idle`."""

    def __init__(self, cfg: EngineConfig | None = None) -> None:
        self.cfg = cfg = cfg if cfg is not None else EngineConfig()
        self.cache = PagedPrefixCache(cfg.num_gpu_blocks, cfg.block_size, cfg.cpu_blocks,
                                      cfg.lora_names)
        self.waiting: deque[EngineRequest] = deque()
        #: requests whose pull ended, holding their prompt's blocks: admitted before
        #: ``waiting`` (a queue head that needs blocks they hold must not wait on them)
        self.ready: deque[EngineRequest] = deque()
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
        #: prefill side: finished remote-decode requests' blocks, by request id
        self.leases: dict[str, Lease] = {}
        self.held_blocks = 0
        self.leases_expired = 0
        self.leases_released = 0
        #: decode side: requests whose KV is being pulled, by request id
        self.transferring: dict[str, EngineRequest] = {}
        self.transfers_started = 0
        self.transfers_ok = 0
        self.transfers_failed = 0
        #: blocks pulled by transfers that ended well (a partial last block counts whole)
        self.blocks_pulled = 0
        #: remote-prefill requests that prefilled locally (all cached, or a small pull)
        self.local_prefill_count = 0
        self._pulls: list[EngineRequest] = []
        self._local: list[EngineRequest] = []

    @property
    def idle(self) -> bool:
        """Nothing waiting, running or transferring (leases do not count: they only hold
        blocks until released or expired)."""
        return not (self.waiting or self.ready or self.running or self.transferring)

    @property
    def runnable(self) -> bool:
        """Whether :meth:`step` has work: something waiting or running."""
        return bool(self.waiting or self.ready or self.running)

    @property
    def num_waiting(self) -> int:
        """Requests not running: queued, transferring, or ready after their pull."""
        return len(self.waiting) + len(self.ready) + len(self.transferring)

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
        role = self.cfg.role
        if req.remote_decode and req.remote_prefill:
            raise ValueError(f"request {req.rid!r}: remote_decode and remote_prefill at once")
        if req.remote_decode and role == "decode":
            raise ValueError(f"request {req.rid!r}: a remote-decode request on a decode engine")
        if req.remote_prefill and role == "prefill":
            raise ValueError(f"request {req.rid!r}: a remote-prefill request on a prefill engine")
        self._to(now, "adding")
        req.arrival = self.now if now is None else now
        req._start(self.cfg.block_size, self.cfg.seed)
        req.pull_pending = req.remote_prefill
        self.waiting.append(req)

    def _to(self, now: float | None, what: str) -> None:
        """Move the clock to ``now`` for an outside event: only an engine with no step to
        run may jump ahead (a busy one must have been stepped up to it)."""
        if now is not None and now > self.now:
            if self.runnable:
                raise ValueError(f"engine busy at {self.now}: step it to {now} before {what}")
            self.now = now

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
        """Drop a waiting, running or transferring request (a client went away): its blocks
        are freed now, as vLLM frees an aborted request's. False if it was not here."""
        if req.status == WAITING and req in self.waiting:
            self.waiting.remove(req)
        elif req.status == WAITING and req in self.ready:
            self.ready.remove(req)
        elif req.status == RUNNING and req in self.running:
            self.running.remove(req)
        elif req.status == TRANSFERRING and self.transferring.get(req.rid) is req:
            del self.transferring[req.rid]
        else:
            return False
        if req.blocks:  # a waiting request holds blocks after its pull ended
            self.cache.free_blocks(req.blocks)
            req.blocks = []
        req.status = FINISHED
        return True

    # ------------------------------------------------------------------ leases (prefill side)

    def extend(self, rid: str, until: float) -> bool:
        """The decode side is still waiting for ``rid``'s blocks: hold them until at least
        ``until``. False if there is no such lease."""
        lease = self.leases.get(rid)
        if lease is None:
            return False
        if until > lease.expires:
            lease.expires = until
        return True

    def release(self, rid: str) -> bool:
        """Free a lease's blocks (pulled, or the decode side aborted or had them all), as
        a finished request frees its blocks: they stay cached. False if none."""
        lease = self.leases.pop(rid, None)
        if lease is None:
            return False
        self._free_lease(lease)
        self.leases_released += 1
        return True

    def expire(self, now: float) -> list[str]:
        """Free every lease with ``expires <= now``; their request ids."""
        gone = [rid for rid, lease in self.leases.items() if lease.expires <= now]
        for rid in gone:
            self._free_lease(self.leases.pop(rid))
        self.leases_expired += len(gone)
        return gone

    def read(self, rid: str, now: float) -> Lease | None:
        """The lease of ``rid`` if alive at ``now`` (for a pull); never frees."""
        lease = self.leases.get(rid)
        return lease if lease is not None and lease.expires > now else None

    def next_expiry(self) -> float | None:
        """When the next lease expires, None without leases."""
        return min((lease.expires for lease in self.leases.values()), default=None)

    def _free_lease(self, lease: Lease) -> None:
        self.cache.free_blocks(lease.blocks)
        self.held_blocks -= len(lease.blocks)

    # ------------------------------------------------------------------ transfers (decode side)

    def transfer_done(self, req: EngineRequest, ok: bool, now: float | None = None) -> bool:
        """``req``'s pull ended at ``now`` (default: the engine's clock; an engine with steps
        to run must have been stepped up to it). ok: the request computes its last prompt
        token and samples in its next step, which caches and publishes the pulled blocks
        (vLLM caches received blocks when it next schedules the request). Not ok: recomputed locally under ``load_failure="recompute"``, else freed
        and finished with ``failed`` set. False if ``req`` was not transferring."""
        if req.status != TRANSFERRING or self.transferring.get(req.rid) is not req:
            return False
        self._to(now, "a transfer ends")
        del self.transferring[req.rid]
        if ok:
            self.transfers_ok += 1
            self.blocks_pulled += req.pull_blocks
            req.num_computed = len(req.prompt) - 1  # cached when it next runs, as vLLM does
        else:
            self.transfers_failed += 1
            if self.cfg.load_failure == "fail":
                self.cache.free_blocks(req.blocks)
                req.blocks = []
                req.status = FINISHED
                req.failed = True
                req.finish_t = self.now
                return True
            req.num_computed = req.hit_tokens
        # Its blocks are held: admitted before the waiting queue, with no lookup.
        req.status = WAITING
        self.ready.append(req)
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
        ``until``). Raises RuntimeError when nothing is :attr:`runnable`."""
        if not self.runnable:
            raise RuntimeError("step() on an engine with nothing to run")
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
        waiting, running, ready = self.waiting, self.running, self.ready
        while ready and budget > 0 and len(running) < cfg.max_num_seqs:
            req = ready.popleft()  # its pull ended: it holds its whole prompt's blocks
            n = min(len(req.tokens) - req.num_computed, budget)
            req.status = RUNNING
            running.append(req)
            self._cache_full(req, req.num_computed + n)
            out.append((req, n))
            budget -= n
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            req = waiting[0]
            hit = cache.longest_hit(req.hashes[:(len(req.tokens) - 1) // bs])
            computed = len(hit) * bs
            if not req.preemptions:
                self.prefix_queries += len(req.tokens)
                self.prefix_hits += computed
            pull = 0
            if req.pull_pending:
                # blocks covering tokens computed .. len - 1 (the last is computed here)
                pull = -(-(len(req.tokens) - 1) // bs) - len(hit)
                if pull <= cfg.recompute_blocks:
                    pull = 0
            if pull:  # no tokens this step: blocks for the whole prompt, to pull into
                need = -(-len(req.tokens) // bs) - len(hit)
            else:
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
            waiting.popleft()
            if req.pull_pending:
                req.pull_pending = False
                if pull:
                    req.pull_from, req.pull_blocks = len(hit), pull
                    req.status = TRANSFERRING
                    self.transferring[req.rid] = req
                    self.transfers_started += 1
                    self._pulls.append(req)
                    continue
                self.local_prefill_count += 1
                self._local.append(req)
            req.status = RUNNING
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
        # A step that only started pulls runs no forward pass (vLLM skips the model when
        # nothing is scheduled): it takes no time. Any other empty step (blocks held by
        # leases or transfers) takes the base time, so the clock moves while it waits.
        dt = 0.0 if not sched and self._pulls else cfg.cost.step_time(prefill, decode, ctx)
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
            if req.remote_decode:  # its decode runs elsewhere: hold the prompt's KV for it
                self.release(req.rid)  # a lease under the same id (a retry) is superseded
                nfull = len(req.prompt) // bs
                self.leases[req.rid] = Lease(req.rid, req.blocks, req.hashes[:nfull],
                                             len(req.prompt), end + cfg.lease_s)
                self.held_blocks += len(req.blocks)
                req.blocks = []
                req.status = FINISHED
                req.finish_t = end
                finished.append(req)
            elif req.num_output >= req.max_tokens:
                self.cache.free_blocks(req.blocks)
                req.blocks = []
                req.status = FINISHED
                req.finish_t = end
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.status == RUNNING]
        pulls, local = self._pulls, self._local
        if pulls or local:
            self._pulls, self._local = [], []
        return StepResult(start, end, 1, self.cache.take_events(), tokens, len(sched), firsts,
                          finished, pulls, local)

    def _fold(self, until: float) -> StepResult | None:
        """The quiet decode steps from now, in one go (None if the next step is not one)."""
        if self.waiting or self.ready or not self.running:
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
