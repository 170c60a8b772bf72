"""The fleet simulator on a prefill/decode fleet: requests routed in pairs, prompts prefilled
on one engine and their KV moved to another.

Each request is routed by :meth:`~kvwire.sim.routers.SimRouter.route_pair` (the decode engine,
the decider, the prefill engine: :func:`~kvwire.routing.pairs.choose_pair`). A disaggregated
request runs as a ``remote_decode`` copy on the prefill engine (its prompt and one token;
its blocks then held under a lease) and as ``remote_prefill`` on the decode engine, which
takes its own cached prefix, allocates the rest and waits in TRANSFERRING while the blocks
it lacks move (:class:`~kvwire.engine.timing.TransferCost`); the prefill engine frees the
lease when they have moved (or when the decode engine needed nothing, or prefilled a small
pull itself). The decode side heartbeats while its request waits, so a lease only expires
for a request that is gone. A request the decider keeps local is an ordinary request on its
decode engine. The two protocols differ in when the decode side starts, which is when its
blocks are allocated and so when the transfer can start:

- ``vllm`` (NixlConnector, sequential): the decode engine gets the request when the prefill
  answer is back; its next step admits it (allocates), and the pull starts at that step's
  end. Its blocks are taken only after the prefill.
- ``sglang`` (concurrent): the decode engine gets the request when the prefill engine does and
  admits it (allocates, tells the prefill engine where the KV goes) while the prompt is
  computed; the prefill engine pushes when its prefill ends, or when the destination is
  known if that is later. The transfer starts up to a decode step earlier, and the decode
  engine holds its blocks for the whole prefill (a full decode engine makes pushes wait).
  It waits for the push at most a lease (``lease_s``), as the engine does; then the
  transfer has failed. The bound also ends a wait no push can end: decode engines full of
  requests whose prefills wait behind leases held for requests those decode engines have
  not admitted.

A ``kv_fail_rate`` share of transfers fail, at their end (one draw per attempt from the
seed and the request: a request's transfers fail alike under every policy that makes them),
and follow ``load_failure``: ``recompute`` has the decode engine compute the prompt past
its own cached prefix; ``fail`` has it answer an error, which ``kvwire serve`` takes for a
failed transfer: the pair runs again with another prefill engine (``reruns``), and after
``pd_retries`` more the prompt is prefilled on a decode engine (``fallbacks``,
``pd_fallback`` "local", the default of ``kvwire serve --pd-fallback``) or the request
fails (``failed``, "fail"). Either way the prefill engine frees the lease, and TTFT
counts from the request's arrival.

Outside events (arrivals, hand-offs, transfer starts and ends, lease expiries) run in time
order once every engine with work has stepped up to them; engines that can prefill step
first, so a decode engine never runs past a hand-off it has not been given. Step results
(their KV events, first tokens, completions) reach the router in time as in
:mod:`.batched`: a step that ends after the event being handled is held back until time
passes its end.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine import EngineRequest, StepResult
from ..routing.pairs import WHY, PairConfig
from .batched import BatchedSim, make_request
from .quantile import nearest_rank
from .routers import SimRouter
from .trace import Request
from .types import PolicyResult, Progress, SimConfig, SimError

__all__ = ["PdCounts", "fleet_roles", "run_pd"]

_ARRIVE, _HANDOFF, _PULL, _PULLED, _RELEASE, _EXPIRE, _NO_PUSH = range(7)


def fleet_roles(cfg: SimConfig) -> list[tuple[str, str]]:
    """Each engine's name and role: ``prefill0..``, ``decode0..``, ``both0..`` (the names
    ``kvwire fleet`` gives them)."""
    return ([(f"prefill{i}", "prefill") for i in range(cfg.prefill)]
            + [(f"decode{i}", "decode") for i in range(cfg.decode)]
            + [(f"both{i}", "both") for i in range(cfg.engines)])


@dataclass
class PdCounts:
    """What a prefill/decode run adds to a policy's result."""

    #: prompt tokens prefilled on the prefill side, and those found in its cache
    prefill_prompt_tokens: int = 0
    prefill_cached_tokens: int = 0
    transfers: int = 0
    transfer_blocks: int = 0
    transfer_bytes: int = 0
    transfer_s: list[float] = field(default_factory=list)
    #: how many requests the decider sent each way (``disagg`` or a local prefill's reason)
    decider: Counter = field(default_factory=Counter)
    #: disaggregated requests whose decode engine pulled nothing (it held the prompt, or
    #: the pull was small enough to recompute)
    decode_local: int = 0
    #: transfers that failed (each then followed load_failure)
    transfers_failed: int = 0
    #: pairs run again after their transfer failed under load_failure "fail", and
    #: requests then prefilled on their decode engine (every prefill try failed)
    reruns: int = 0
    fallbacks: int = 0
    #: requests not answered
    failed: int = 0

    def summary(self) -> dict[str, Any]:
        ts = sorted(self.transfer_s)
        ratio = (self.prefill_cached_tokens / self.prefill_prompt_tokens
                 if self.prefill_prompt_tokens else 0.0)
        return {
            "prefill_cached_ratio": round(ratio, 6),
            "prefill_prompt_tokens": self.prefill_prompt_tokens,
            "transfers": self.transfers,
            "transfer_blocks": self.transfer_blocks,
            "transfer_bytes": self.transfer_bytes,
            "transfer_p50_s": round(nearest_rank(ts, 0.50), 6),
            "transfer_p99_s": round(nearest_rank(ts, 0.99), 6),
            "decider": {w: self.decider.get(w, 0) for w in WHY},
            "decode_local": self.decode_local,
            "transfers_failed": self.transfers_failed,
            "reruns": self.reruns,
            "fallbacks": self.fallbacks,
            "failed": self.failed,
        }


class _Pair:
    __slots__ = ("req", "t", "nkeys", "decode", "prefill", "dreq", "preq", "pull_t",
                 "prefilled", "allocated", "needless", "i", "tried", "rerun")

    def __init__(self, req: Request, t: float, nkeys: int, decode: int, prefill: int | None,
                 dreq: EngineRequest, preq: EngineRequest | None) -> None:
        self.req, self.t, self.nkeys = req, t, nkeys
        self.decode, self.prefill, self.dreq, self.preq = decode, prefill, dreq, preq
        self.pull_t = 0.0
        # (sglang) the prefill is done; the decode side allocated for the transfer, or
        # needs none
        self.prefilled = self.allocated = self.needless = False
        self.i = 0  # the trace request
        self.tried: tuple[int, ...] = ()  # prefill engines whose transfer failed, in order
        self.rerun = False  # failed, and run again as another pair


def run_pd(reqs: Sequence[Request], engines: list[BatchedSim], router: SimRouter,
           cfg: SimConfig, bar: Progress, res: PolicyResult) -> PolicyResult:
    """Replay the trace on a prefill/decode fleet; fill ``res`` (TTFT from arrival to the
    decode engine's first token, which includes the remote prefill and the pull)."""
    bs = cfg.block_tokens
    roles = [e.model.cfg.role for e in engines]
    names = {e.name: i for i, e in enumerate(engines)}
    decode_idx = [i for i, r in enumerate(roles) if r != "prefill"]
    prefill_idx = [i for i, r in enumerate(roles) if r != "decode"]
    p_side = prefill_idx
    d_only = [i for i, r in enumerate(roles) if r == "decode"]
    pcfg = PairConfig(min_disagg_blocks=cfg.disagg_min_tokens / bs,
                      prefill_busy=cfg.pd_prefill_busy)
    push_mode = cfg.pd_protocol == "sglang"
    counts = PdCounts()
    heap: list[tuple[float, int, int, Any]] = []
    seq = 0
    held: list[deque[StepResult]] = [deque() for _ in engines]
    pairs: dict[str, _Pair] = {}

    def push(t: float, kind: int, data: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, data))

    def deliver(i: int, r: StepResult) -> None:
        eng = engines[i]
        router.now = r.end
        if r.events:
            eng.publish(r.events, r.end)
        for q in r.first_tokens:
            if q.remote_decode:
                router.prefill_done(q.rid)  # the prefill answer: its load goes
            else:
                router.first_token(q.rid)
        for q in r.finished:
            if not q.remote_decode:
                router.release(q.rid, pairs[q.rid].req)

    def deliver_upto(t: float) -> None:
        for i, h in enumerate(held):
            while h and h[0].end <= t:
                deliver(i, h.popleft())

    def on_step(i: int, r: StepResult) -> None:
        held[i].append(r)
        m = engines[i].model
        for q in r.finished:
            if q.remote_decode:
                push(r.end, _HANDOFF, q.rid)
                push(m.leases[q.rid].expires, _EXPIRE, q.rid)
        for q in r.pulls:
            push(r.end, _PULL, q.rid)
        for q in r.local_prefills:
            push(r.end, _RELEASE, q.rid)

    def arrive(i: int, t: float) -> None:
        req = reqs[i]
        router.sync(t)
        router.now = t
        er, nkeys = make_request(i, req, bs)
        route(i, er, nkeys, t, t, ())

    def route(i: int, er: EngineRequest, nkeys: int, t: float, t0: float,
              tried: tuple[int, ...]) -> None:
        """Route ``er`` (trace request ``i``, arrived at ``t0``) as a pair at ``t``; the
        prefill engines ``tried`` are not candidates (``kvwire serve``'s retries)."""
        req = reqs[i]
        keys = er.hashes[:nkeys]
        fallback = len(tried) > cfg.pd_retries
        if fallback and cfg.pd_fallback == "fail":  # kvwire serve answers 502: no engine
            er.failed = True
            pairs[er.rid] = _Pair(req, t0, nkeys, -1, None, er, None)
            return
        cands = [] if fallback else [p for p in prefill_idx if p not in tried]
        c0 = time.perf_counter()
        pd = router.route_pair(er.rid, req, keys, t, decode_idx, cands, pcfg)
        res.route_us.append((time.perf_counter() - c0) * 1e6)
        if not tried:
            counts.decider[pd.why] += 1
        elif pd.prefill is None:
            counts.fallbacks += 1
        d = names[pd.decode.name]
        dm = engines[d].model
        if not dm.fits(len(er.prompt), er.max_tokens):
            raise SimError(f"request {i} ({len(er.prompt)} + {er.max_tokens} tokens) does not "
                           f"fit an engine of {cfg.capacity} blocks of {bs} tokens")
        if pd.prefill is None:
            pr = pairs[er.rid] = _Pair(req, t0, nkeys, d, None, er, None)
            pr.i, pr.tried = i, tried
            dm.add(er, t)
            return
        p = names[pd.prefill.name]
        preq = EngineRequest(er.rid, er.prompt, 1, remote_decode=True, hashes=list(er.hashes))
        dreq = EngineRequest(er.rid, er.prompt, er.max_tokens, remote_prefill=True,
                             hashes=er.hashes)
        pr = pairs[er.rid] = _Pair(req, t0, nkeys, d, p, dreq, preq)
        pr.i, pr.tried = i, tried
        engines[p].model.add(preq, t)
        if push_mode:  # the same request to both at once
            dm.add(dreq, t)

    def start(pr: _Pair, rid: str, t: float, pm: Any) -> None:
        """The blocks start to move at ``t`` (the lease is alive: the decode side
        heartbeats while it waits)."""
        if pm.read(rid, t) is None:  # cannot happen (heartbeats); a failed transfer
            end_transfer(pr, rid, t, pm, False)
            return
        pr.pull_t = t
        push(t + cfg.transfer.time(pr.dreq.pull_blocks, bs), _PULLED, rid)

    def end_transfer(pr: _Pair, rid: str, t: float, pm: Any, ok: bool) -> None:
        engines[pr.decode].model.transfer_done(pr.dreq, ok, t)
        pm.release(rid)
        if pr.dreq.failed:  # load_failure "fail": the decode engine answers an error now
            router.sync(t)
            router.now = t
            router.fail(rid)
            # kvwire serve runs the pair again with another prefill engine
            pr.rerun = True
            counts.reruns += 1
            d = pr.dreq
            again = EngineRequest(f"{rid.split('#')[0]}#{len(pr.tried) + 1}", d.prompt,
                                  d.max_tokens, hashes=d.hashes)
            route(pr.i, again, pr.nkeys, t, pr.t, (*pr.tried, pr.prefill))

    def handle(t: float, kind: int, data: Any) -> None:
        if kind == _ARRIVE:
            arrive(data, t)
            bar.update(data + 1)
            return
        pr = pairs[data]
        pm = engines[pr.prefill].model if pr.prefill is not None else None
        assert pm is not None
        if kind == _HANDOFF:
            if not push_mode:
                engines[pr.decode].model.add(pr.dreq, t)
                return
            pr.prefilled = True
            if pr.needless:
                pm.release(data)
            elif pr.allocated:
                start(pr, data, t, pm)
        elif kind == _PULL:  # the decode side allocated the blocks to fill
            pr.allocated = True
            if not push_mode or pr.prefilled:
                start(pr, data, t, pm)
            else:
                push(t + cfg.lease_s, _NO_PUSH, data)
        elif kind == _NO_PUSH:  # (sglang) the wait for the push is bounded by a lease
            if not pr.prefilled:
                pr.needless = True  # (the lease, when the prefill ends, goes at once)
                end_transfer(pr, data, t, pm, False)
        elif kind == _PULLED:
            counts.transfer_s.append(t - pr.pull_t)
            end_transfer(pr, data, t, pm, not fails(data))
        elif kind == _RELEASE:  # the decode side needs nothing moved
            pr.needless = True
            if not push_mode or pr.prefilled:
                pm.release(data)
        elif kind == _EXPIRE:
            lease = pm.leases.get(data)
            if lease is None:
                return
            if pr.dreq.status in ("waiting", "transferring") or pr.dreq.pull_pending:
                # the decode side still waits for these blocks: its heartbeat extends them
                pm.extend(data, t + cfg.lease_s)
                push(lease.expires, _EXPIRE, data)
            else:
                pm.expire(t)

    def fails(rid: str) -> bool:
        """Whether the transfer of ``rid`` (a request, or its pair run again) fails: one
        draw per rid from the seed."""
        return (cfg.kv_fail_rate > 0
                and random.Random(f"kvwire-sim/kv-fail/{cfg.seed}/{rid}").random()
                < cfg.kv_fail_rate)

    for i, req in enumerate(reqs):
        push(req.t, _ARRIVE, i)

    def pick(side: list[int], t_ev: float) -> tuple[int, float] | None:
        best = None
        for i in side:
            m = engines[i].model
            if m.runnable and m.now < t_ev and (best is None or m.now < engines[best].model.now):
                best = i
        if best is None:
            return None
        until = t_ev
        if roles[best] == "both":  # it takes hand-offs: not past another prefill's clock
            for i in side:
                m = engines[i].model
                if i != best and m.runnable:
                    until = min(until, m.now)
        return best, until

    while True:
        t_ev = heap[0][0] if heap else math.inf
        chosen = pick(p_side, t_ev) or pick(d_only, t_ev)
        if chosen is not None:
            i, until = chosen
            on_step(i, engines[i].model.step(until))
            continue
        if not heap:
            break
        t, _, kind, data = heapq.heappop(heap)
        deliver_upto(t)
        handle(t, kind, data)
    deliver_upto(math.inf)
    bar.done()
    return _fill(res, engines, pairs, counts, cfg, reqs)


def _fill(res: PolicyResult, engines: list[BatchedSim], pairs: dict[str, _Pair],
          counts: PdCounts, cfg: SimConfig, reqs: Sequence[Request]) -> PolicyResult:
    bs = cfg.block_tokens
    out_tokens = 0
    last = 0.0
    for pr in pairs.values():
        d = pr.dreq
        if pr.rerun:  # (its prefill ran: the prefill side's counts have it)
            if pr.preq is not None:
                counts.prefill_prompt_tokens += len(pr.preq.prompt)
                counts.prefill_cached_tokens += max(pr.preq.cached_tokens, 0)
            continue
        if d.status != "finished" or d.first_token_t is None or d.finish_t is None:
            if d.failed:
                counts.failed += 1
                continue
            raise SimError(f"request {d.rid} did not finish ({d.status})")
        pre = pr.preq if pr.preq is not None else d
        plen = len(pre.prompt)
        cached = max(pre.cached_tokens, 0)
        if pr.preq is not None:
            counts.prefill_prompt_tokens += plen
            counts.prefill_cached_tokens += cached
        res.hit_blocks += min(cached // bs, pr.nkeys)
        res.prompt_blocks += pr.nkeys
        res.cached_tokens += cached
        res.prompt_tokens += plen
        res.ttft_s.append(d.first_token_t - pr.t)
        res.e2e_s.append(d.finish_t - pr.t)
        out_tokens += d.num_output
        last = max(last, d.finish_t)
    for eng in engines:
        m = eng.model
        res.itl_s.extend(m.itl)
        res.preemptions += m.preemptions
        counts.transfers += m.transfers_started
        counts.transfer_blocks += m.blocks_pulled
        counts.decode_local += m.local_prefill_count
        counts.transfers_failed += m.transfers_failed
        if m.leases or m.held_blocks:
            raise SimError(f"{eng.name} still holds {m.held_blocks} leased blocks at the end")
    counts.transfer_bytes = cfg.transfer.bytes(counts.transfer_blocks, bs)
    res.engine_work_s = [eng.model.busy_s for eng in engines]
    res.output_tokens = out_tokens
    res.span_s = last - reqs[0].t if reqs else 0.0
    res.pd = counts.summary()
    return res
