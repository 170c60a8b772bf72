"""The simulator's routers: each chooses an engine for a request at virtual time ``now``.

``kvwire`` sees the fleet only through Subscriber -> PrefixIndex -> RoutingPolicy (the objects
``kvwire serve`` uses); ``oracle`` reads the caches directly with the same cost; ``sglang`` is
SGLang's ``cache_aware`` (:mod:`kvwire.sim.baselines`), which sees only what it sent;
``clairvoyant`` runs every engine ahead to pick each request's earliest first token (perfect
knowledge of the engines, which no router has); the rest ignore the cache. Routers are told
when a request's first token comes (:meth:`SimRouter.first_token`) and when it finishes
(:meth:`SimRouter.release`), as the proxy is.

A prefill/decode fleet is routed in pairs (:meth:`SimRouter.route_pair`) by
:func:`~kvwire.routing.pairs.choose_pair`, the function ``kvwire serve`` uses, with one
policy per side (as SGLang's router has a prefill and a decode policy): what each router
knows of the caches is its candidates' credit (none for the cache-blind ones).
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Callable
from typing import Any

from ..consume.config import StreamConfig
from ..consume.stream import Batch, Reset, Snapshot
from ..consume.subscriber import StreamSpec, Subscriber
from ..engine import EngineRequest
from ..routing.load import LoadTracker
from ..routing.pairs import PairConfig, PairDecision, choose_pair
from ..routing.policy import (
    Candidate,
    Decision,
    LeastLoadPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    request_load,
)
from ..routing.sharing import PeerLoads, Report
from .baselines import CacheAwarePolicy
from .fifo import FifoSim
from .trace import Request, prompt_array
from .types import SimConfig, SimError


class SimRouter:
    """Base: chooses an engine index for a request at virtual time ``now``."""

    events_applied = 0
    #: the engine request being routed (batched model: run_batched sets it before a route)
    request: EngineRequest | None = None

    def __init__(self, engines: list[FifoSim], cfg: SimConfig) -> None:
        self.engines = engines
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        # the virtual time: the fleet loop sets it before each route, first token and
        # release, so the load tracker (its busy times) runs on the simulation's clock
        self.now = 0.0
        self.loads = LoadTracker(expiry_s=1e12, clock=lambda: self.now,
                                 busy_window=cfg.busy_window, drain=cfg.drain)
        self._prefill: dict[str, float] = {}  # request -> prefill share still reserved

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
        prefill = max(prompt_blocks - credit, 0.0)
        self.loads.reserve(rid, self.engines[e].name, amount, now, prefill=prefill)
        self._prefill[rid] = prefill

    def first_token(self, rid: str) -> None:
        """The request's first token is out: its prefill share of the load is dropped, as
        ``kvwire serve`` drops it at the first byte (what is left is its decode share)."""
        share = self._prefill.pop(rid, 0.0)
        if share:
            self.loads.reduce(rid, share)

    def release(self, rid: str, req: Request) -> None:
        self._prefill.pop(rid, None)
        self._out_sum += req.output_length
        self._out_n += 1
        self.loads.release(rid)

    def close(self) -> None:
        pass

    def fail(self, rid: str) -> None:
        """The request failed before its first token (its KV transfer, under
        ``load_failure="fail"``): its load goes; its output, never produced, is not counted
        in the expected output."""
        self._prefill.pop(rid, None)
        self.loads.release(rid)

    # ------------------------------------------------------------------ P/D pairs

    def side_policies(self) -> tuple[Any, Any]:
        """The decode side's policy and the prefill side's (each keeps its own turn)."""
        raise SimError(f"the {type(self).__name__.strip('_').lower()} policy does not route "
                       "prefill/decode pairs")

    def credits(self, req: Request, keys: list[int], now: float) -> dict[str, float]:
        """Each engine's cached prefix of the prompt in blocks, as this router knows it."""
        return {}

    def alive(self, name: str) -> bool:
        return True

    def predict(self, name: str, req: Request, keys: list[int]) -> None:
        """The prompt was routed to ``name``: count it as cached there until events say."""

    def route_pair(self, rid: str, req: Request, keys: list[int], now: float,
                   decode: list[int], prefill: list[int], pcfg: PairConfig) -> PairDecision:
        """Choose the decode engine, whether to disaggregate and the prefill engine (engine
        indices ``decode``/``prefill`` are the candidates of each side), and reserve load on
        each side as ``kvwire serve`` does: the prefill side its uncached blocks there
        under ``rid + "/p"`` (released by :meth:`prefill_done`); the decode side as a single
        route, less the prefill share when the prefill is remote."""
        sides = getattr(self, "_sides", None)
        if sides is None:
            sides = self._sides = _Sides(*self.side_policies())
        credit = self.credits(req, keys, now)
        loads, busy = self.loads, self.loads.busy
        cands = {}
        for i in {*decode, *prefill}:
            name = self.engines[i].name
            cands[i] = Candidate(name, credit.get(name, 0.0), loads.load(name),
                                 self.alive(name), busy(name, now))
        dec = sides.decode_list = [cands[i] for i in decode]
        pre = [cands[i] for i in prefill]
        pd = choose_pair(sides, len(keys), dec, pre, pcfg)
        d_over = pd.decode.overlap.get(pd.decode.name, 0.0)
        remote = pd.prefill is not None
        expect = self._out_sum / self._out_n if self._out_n else 0.0
        amount = request_load(len(keys), len(keys) if remote else d_over,
                              expect / self.cfg.block_tokens, self.cfg.share())
        d_pre = 0.0 if remote else max(len(keys) - d_over, 0.0)
        self.loads.reserve(rid, pd.decode.name, amount, now, prefill=d_pre)
        self._prefill[rid] = d_pre
        self.predict(pd.decode.name, req, keys)
        if pd.prefill is not None:
            p = pd.prefill
            p_pre = max(len(keys) - p.overlap.get(p.name, 0.0), 0.0)
            self.loads.reserve(rid + "/p", p.name, p_pre, now, prefill=p_pre)
            self.predict(p.name, req, keys)
        return pd

    def prefill_done(self, rid: str) -> None:
        """The remote prefill of ``rid`` ended (its answer is back): its load goes."""
        self.loads.release(rid + "/p")


class _Sides:
    """Two policies as one for :func:`choose_pair`: the decode side's list goes to the
    first, anything else to the second, so each side keeps its own turn (a round robin
    over decode engines is not advanced by prefill choices)."""

    def __init__(self, decode: Any, prefill: Any) -> None:
        self.decode, self.prefill = decode, prefill
        self.decode_list: list[Candidate] | None = None

    def choose(self, prompt_blocks: int, candidates: list[Candidate]) -> Decision:
        side = self.decode if candidates is self.decode_list else self.prefill
        return side.choose(prompt_blocks, candidates)


class _Random(SimRouter):
    def side_policies(self) -> tuple[Any, Any]:
        return RandomPolicy(self.cfg.seed), RandomPolicy(self.cfg.seed + 1)

    def route(self, rid: str, req: Request, keys: list[int], now: float) -> int:
        return self.rng.randrange(len(self.engines))


class _RoundRobin(SimRouter):
    n = 0

    def side_policies(self) -> tuple[Any, Any]:
        return RoundRobinPolicy(), RoundRobinPolicy()

    def route(self, rid: str, req: Request, keys: list[int], now: float) -> int:
        e = self.n % len(self.engines)
        self.n += 1
        return e


class _LeastLoad(SimRouter):
    def side_policies(self) -> tuple[Any, Any]:
        return LeastLoadPolicy(self.cfg.seed), LeastLoadPolicy(self.cfg.seed + 1)

    def route(self, rid: str, req: Request, keys: list[int], now: float) -> int:
        loads = [self.loads.load(e.name) for e in self.engines]
        low = min(loads)
        tied = [i for i, v in enumerate(loads) if v <= low + 1e-9]
        e = tied[self.rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
        self.reserve(rid, e, len(keys), 0.0, req, now)
        return e


class _Oracle(SimRouter):
    """The same cost as kvwire, with each engine's cache read directly (no events)."""

    def __init__(self, engines: list[FifoSim], cfg: SimConfig) -> None:
        super().__init__(engines, cfg)
        self.policy = cfg.routing_policy()
        self.index = {e.name: i for i, e in enumerate(engines)}

    def side_policies(self) -> tuple[Any, Any]:
        return self.cfg.routing_policy(), self.cfg.routing_policy()

    def credits(self, req: Request, keys: list[int], now: float) -> dict[str, float]:
        return {e.name: float(e.prefix_hits(keys)) for e in self.engines}

    def route(self, rid: str, req: Request, keys: list[int], now: float) -> int:
        cands = [Candidate(e.name, float(e.prefix_hits(keys)), self.loads.load(e.name),
                           True, self.loads.busy(e.name, now)) for e in self.engines]
        d = self.policy.choose(len(keys), cands)
        e = self.index[d.name]
        self.reserve(rid, e, len(keys), d.overlap[d.name], req, now)
        return e


class _Clairvoyant(SimRouter):
    """What no router can be: it reads every engine's exact state and, for each engine, runs
    a copy of it ahead (:meth:`~kvwire.engine.EngineModel.fork`) with the request added,
    to the request's first token; the earliest wins (within ``CLAIRVOYANT_TIE_S``, the one
    holding most of the prompt). It knows the engines perfectly but not later arrivals, and
    it is greedy: the best first token for each request alone, which is not the shortest
    tail for all (it moves prompts off their caches, and later ones pay; docs/benchmarks.md).
    Batched engine model only."""

    #: first tokens this close count as a tie, broken by cached blocks, then engine order
    CLAIRVOYANT_TIE_S = 0.001

    def __init__(self, engines: list[Any], cfg: SimConfig) -> None:
        super().__init__(engines, cfg)
        if cfg.engine_model != "batched":
            raise SimError("the clairvoyant policy runs ahead on the batched engine model: "
                           "use engine_model='batched'")

    def route(self, rid: str, req: Request, keys: list[int], now: float) -> int:
        er = self.request
        if er is None:
            raise SimError("the clairvoyant policy needs the engine request (run_batched "
                           "sets it)")
        best: list[tuple[float, int, int]] = []
        for k, eng in enumerate(self.engines):
            ahead = eng.model.fork()
            # the request as a new one (its lists are the engine's to grow), one token long
            probe = EngineRequest(er.rid, er.prompt, 1, er.lora_id, er.cache_salt,
                                  hashes=list(er.hashes))
            ahead.add(probe, now)
            while probe.first_token_t is None:
                ahead.step()
            best.append((probe.first_token_t - now, -eng.prefix_hits(keys), k))
        first = min(t for t, _, _ in best)
        return min((c for c in best if c[0] <= first + self.CLAIRVOYANT_TIE_S),
                   key=lambda c: (c[1], c[0], c[2]))[2]


class _Kvwire(SimRouter):
    """Sees the fleet only through Subscriber -> PrefixIndex -> RoutingPolicy."""

    def __init__(self, engines: list[FifoSim], cfg: SimConfig) -> None:
        super().__init__(engines, cfg)
        # (imported when used: only this policy needs the index)
        from ..index import PrefixIndex

        self.now = 0.0
        self.idx = PrefixIndex(predict_ttl=cfg.predict_ttl, clock=lambda: self.now)
        self.policy = cfg.routing_policy()
        specs = [StreamSpec(e.name, e.publisher.endpoint, "", e.publisher.replay_endpoint)
                 for e in engines if e.publisher is not None]
        if len(specs) != len(engines):
            raise SimError("the kvwire policy needs every engine to publish")
        # (in-process publishers that always answer, late on a starved box: with the live
        # defaults, an INFO later than 1 s made a stream "reference", without snapshots,
        # and the bootstrap below waited in vain; the routing is on virtual time, so
        # waiting longer changes no result)
        self.sub = Subscriber(specs, config=StreamConfig(info_timeout=10.0,
                                                         request_timeout=10.0))
        self.applied = {e.name: -1 for e in engines}
        self.live = {e.name: True for e in engines}
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

    def _refresh_alive(self) -> None:
        if self._dirty:  # liveness only changes when the subscriber delivers something
            streams = self.idx.streams()
            self.live = {n: streams[n].alive if n in streams else True for n in self.live}
            self._dirty = False

    def side_policies(self) -> tuple[Any, Any]:
        return self.cfg.routing_policy(), self.cfg.routing_policy()

    def credits(self, req: Request, keys: list[int], now: float) -> dict[str, float]:
        self.now = now
        self._refresh_alive()
        m = self.idx.match(prompt_array(req, len(keys) * self.cfg.block_tokens))
        return {name: sm.credit for name, sm in m.items()}

    def alive(self, name: str) -> bool:
        return self.live[name]

    def predict(self, name: str, req: Request, keys: list[int]) -> None:
        self.idx.predict(name, prompt_array(req, len(keys) * self.cfg.block_tokens))

    def route(self, rid: str, req: Request, keys: list[int], now: float) -> int:
        self.now = now
        tokens = prompt_array(req, len(keys) * self.cfg.block_tokens)
        m = self.idx.match(tokens)
        self._refresh_alive()
        cands = []
        busy = self.loads.busy
        for e in self.engines:
            sm = m.get(e.name)
            cands.append(Candidate(e.name, sm.credit if sm is not None else 0.0,
                                   self.loads.load(e.name), self.live[e.name],
                                   busy(e.name, now)))
        d = self.policy.choose(len(keys), cands)
        self.idx.predict(d.name, tokens)
        e = self.index[d.name]
        self.reserve(rid, e, len(keys), d.overlap[d.name], req, now)
        return e

    def close(self) -> None:
        self.sub.close()


class _KvwireReplicas(_Kvwire):
    """``cfg.replicas`` kvwire routers behind a load balancer that hands them requests in
    turn: one index (all read the same events), a LoadTracker each. With ``share_load``
    each tells the others what it reserved, what reached its first token and what it
    released (the reports ``kvwire serve --nats`` replicas send, applied by the same
    :class:`~kvwire.routing.sharing.PeerLoads`), each arriving ``share_delay`` later."""

    def __init__(self, engines: list[FifoSim], cfg: SimConfig) -> None:
        super().__init__(engines, cfg)
        self.trackers = [self.loads] + [
            LoadTracker(expiry_s=1e12, clock=lambda: self.now, busy_window=cfg.busy_window,
                        drain=cfg.drain) for _ in range(cfg.replicas - 1)]
        self.peers = [PeerLoads(t, f"r{i}", ttl=1e12) for i, t in enumerate(self.trackers)]
        self._in_flight: list[tuple[float, int, int, Any]] = []  # (due, n, to, report)
        self._n = 0
        self._seq = [0] * cfg.replicas
        self._owner: dict[str, int] = {}
        self._turn = 0

    def _send(self, sender: int, op: list[Any]) -> None:
        if not self.cfg.share_load:
            return
        self._seq[sender] += 1
        report = Report(f"r{sender}", self._seq[sender], [op])
        for to in range(len(self.trackers)):
            if to != sender:
                self._n += 1
                heapq.heappush(self._in_flight,
                               (self.now + self.cfg.share_delay, self._n, to, report))

    def _arrive(self) -> None:
        q = self._in_flight
        while q and q[0][0] <= self.now:
            due, _, to, report = heapq.heappop(q)
            self.peers[to].receive(report, due)

    def _as(self, replica: int) -> None:
        self.loads = self.trackers[replica]

    def route(self, rid: str, req: Request, keys: list[int], now: float) -> int:
        self.now = now
        self._arrive()
        r = self._owner[rid] = self._turn % len(self.trackers)  # the balancer's turn
        self._turn += 1
        self._as(r)
        return super().route(rid, req, keys, now)

    def reserve(self, rid: str, e: int, prompt_blocks: int, credit: float, req: Request,
                now: float) -> None:
        super().reserve(rid, e, prompt_blocks, credit, req, now)
        self._send(self._owner[rid], ["r", rid, self.engines[e].name,
                                      self.loads.amount(rid), self._prefill[rid]])

    def first_token(self, rid: str) -> None:
        self._arrive()
        self._as(self._owner[rid])
        if self._prefill.get(rid):
            self._send(self._owner[rid], ["f", rid])
        super().first_token(rid)

    def release(self, rid: str, req: Request) -> None:
        self._arrive()
        r = self._owner.pop(rid)
        self._as(r)
        super().release(rid, req)
        self._send(r, ["x", rid, None])


class _CacheAware(SimRouter):
    """SGLang's router ``cache_aware``: its own tree of what it sent, in-flight counts."""

    def __init__(self, engines: list[FifoSim], cfg: SimConfig) -> None:
        super().__init__(engines, cfg)
        self.index = {e.name: i for i, e in enumerate(engines)}
        self.policy = CacheAwarePolicy([e.name for e in engines], cfg.cache_aware,
                                       unit=cfg.block_tokens)
        self.holder: dict[str, str] = {}

    def route(self, rid: str, req: Request, keys: list[int], now: float) -> int:
        name = self.policy.choose(keys, max(req.input_length, 1), now)
        self.holder[rid] = name
        return self.index[name]

    def release(self, rid: str, req: Request) -> None:
        super().release(rid, req)
        self.policy.complete(self.holder.pop(rid))


def _kvwire(engines: list[FifoSim], cfg: SimConfig) -> SimRouter:
    return _KvwireReplicas(engines, cfg) if cfg.replicas > 1 else _Kvwire(engines, cfg)


ROUTERS: dict[str, Callable[[list[FifoSim], SimConfig], SimRouter]] = {
    "kvwire": _kvwire, "oracle": _Oracle, "random": _Random, "round_robin": _RoundRobin,
    "least_load": _LeastLoad, "sglang": _CacheAware, "clairvoyant": _Clairvoyant,
}


