"""The routing core behind ``kvwire serve``: a :class:`~.feed.Feed` (a subscriber feeding a
PrefixIndex), the pure :class:`~kvwire.routing.policy.RoutingPolicy` and the load it weighs
(:class:`~kvwire.routing.load.LoadTracker`). One decision (:meth:`RouterCore.decide`) answers
both the decision API (``route()``) and the proxy (``route_proxy()``).

HTTP lives in :mod:`kvwire.serve.app`; this module has no web dependency, so it can be
embedded (and tested) on its own.

Units: the policy compares all streams in *reference blocks* of ``block_size`` tokens
(default 16). A stream whose engine uses another block size has its credit rescaled by the
fraction of the prompt it holds, so engines with different block sizes compete fairly. A
routed request reserves its uncached reference blocks, plus its expected decode work
``decode_share`` x expected output blocks (the mean ``output_tokens`` reported on ``release``
so far; the simulator's model, where decode_share = prefill rate / decode rate), plus
``decode_load`` (default 1 block: a fully cached request still occupies the engine) on the
chosen engine until ``release`` (or ``expiry_s``). Without that constant, a hot prefix would cost nothing after
its first request (predicted entries make every repeat a full hit) and pile onto one engine.

Concurrency: the feed's ingest is the index's only writer; it applies deliveries in small
slices under the feed's lock (``RouterCore.lock``), so a route waits at most one slice (plus,
after a restart, one snapshot), and gives up with :class:`RouteError` 503 after
``lock_timeout``. Besides this module, the lock is taken by the indexer API (its queries read
the index: indexer/indexer.py), the decision API's metrics (serve/app.py), and the load
sharing between replicas (applying the peers' reports: nats/load_channel.py).
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
import uuid
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, overload

from ..consume.engine_spec import EngineSpec
from ..consume.stream import StreamConfig
from ..consume.subscriber import StreamSpec
from ..errors import HttpError
from .feed import Feed
from .ingest import Ingest, stream_counts
from .load import LoadTracker
from .pairs import PairConfig, PairDecision, choose_pair
from .policy import Candidate, Decision, RoutingPolicy, request_load
from .targets import Target, found_ranks, targets_of

__all__ = ["EngineConflict", "EngineSpec", "RouteError", "Routed", "RoutedPair", "RouterCore"]

log = logging.getLogger("kvwire.router")

#: A prediction shared with other replicas names at most its first this many blocks (the
#: prefix is what later prompts match; 32 KB in a report at the most).
SHARED_PREDICTION_KEYS = 4096


_PROXY_IDS = itertools.count()  # route_proxy's request ids: p0, p1, ...


class EngineConflict(ValueError):
    """An engine added at run time whose name (or one of its stream names) is in use."""


#: A request the router cannot serve: kvwire's one error, ``RouteError(status, message,
#: reason)``, which the HTTP side answers with ``status``.
RouteError = HttpError


@dataclass(frozen=True, slots=True)
class Routed:
    """A proxied request's route: where it goes and the load it reserved (``prefill`` is
    the part dropped at its first token)."""

    request_id: str
    engine: str
    rank: int
    label: str
    prefill: float
    overlap: float


class RoutedPair(NamedTuple):
    """A prefill/decode pair's route (:meth:`RouterCore.route_pair`): the decode side, the
    prefill side (None: the prefill is local to the decode engine) and why
    (:data:`kvwire.routing.pairs.WHY`)."""

    decode: Routed
    prefill: Routed | None
    why: str


class RouterCore:
    """Feed + policy + load: everything ``kvwire serve`` answers from.

    One state under one lock (the index, the engines and their streams' liveness, the load),
    with three faces: the feed (held, :class:`~.feed.Feed`) writes the index, the run-time
    membership changes the engines, the routing reads both and reserves load. The feed's
    state is also reachable here by its old names (``index``, ``lock``, ``alive``, ...)."""

    def __init__(
        self,
        engines: Sequence[EngineSpec],
        *,
        policy: RoutingPolicy | None = None,
        block_size: int = 16,
        max_tokens: int = 1 << 20,
        expiry_s: float = 600.0,
        predict_ttl: float = 3.0,
        decode_load: float = 1.0,
        decode_share: float = 50.0,
        stream_config: StreamConfig | None = None,
        lock_timeout: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        index: Any = None,
        nats: Any = None,
        discover: bool = False,
        withdrawn: Iterable[str] = (),
        pairs: PairConfig | None = None,
    ) -> None:
        names = [e.name for e in engines]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"engine names must be unique: {sorted(dup)} given twice")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.engines = list(engines)
        self.policy = policy or RoutingPolicy(load_weight=0.5)
        #: the prefill side's own copy (a stateful policy takes its turns per side)
        self.prefill_policy = copy.deepcopy(self.policy)
        #: the prefill/decode decider's thresholds (:meth:`route_pair`)
        self.pairs = pairs or PairConfig()
        self.roles: dict[str, str] = {}  # engine name -> role (set with the targets)
        self.has_roles = False
        if not decode_load >= 0 or not decode_share >= 0:
            raise ValueError(f"decode_load and decode_share must be >= 0, got "
                             f"{decode_load}, {decode_share}")
        self.decode_share = float(decode_share)
        self._out_sum = 0
        self._out_n = 0
        self.block_size = block_size
        self.decode_load = float(decode_load)
        self.max_tokens = max_tokens
        self.lock_timeout = lock_timeout
        self.clock = clock
        specs: list[StreamSpec] = []
        for e in self.engines:
            if nats is None:  # (with nats, the engines' streams come from JetStream)
                specs += e.streams()
        # the index (a kvwire.index.PrefixIndex or one with its API), its lock, the streams
        self.feed = Feed(specs, index=index, predict_ttl=predict_ttl,
                         stream_config=stream_config, nats=nats, lock_timeout=lock_timeout,
                         clock=clock)
        self.loads = LoadTracker(expiry_s=expiry_s, clock=clock)
        self._set_targets([t for e in self.engines for t in targets_of(e)])
        # --nats without --nats-engine: engines that appear on the stream later are routed
        # to as well (_discover); those an operator removed stay out until added again
        # (``withdrawn``: removed before a restart, kvwire serve --engines-file)
        self.discover = bool(discover) and nats is not None
        self.discovered = 0
        self._withdrawn: set[str] = set(withdrawn)
        if self.discover:
            self.feed.on_new = self._discover
        self.feed.alive.update((t.stream, False) for t in self.targets)
        self.feed.resets.update((t.stream, 0) for t in self.targets)
        self.counts: dict[str, int] = {"routes": 0, "scores": 0, "releases": 0}
        self.on_route: Callable[[str, float, float], None] | None = None  # metrics hook
        # replicas that share their load (nats/load_channel.py): each reservation change
        # is handed to ``share`` (LoadShare.push), called under ``lock``, never waits
        self.share: Callable[[list], None] | None = None
        self.load_share: Any = None  # the LoadShare itself (its counters, for /metrics)

    # ------------------------------------------------------------------ the feed's state

    @property
    def index(self) -> Any:
        """The feed's index."""
        return self.feed.index

    @property
    def lock(self) -> Any:
        """The one lock over the index, the streams' liveness, the engines and the load."""
        return self.feed.lock

    @property
    def ingest(self) -> Ingest:
        return self.feed.ingest

    @property
    def alive(self) -> dict[str, bool]:
        """Stream -> whether it is live."""
        return self.feed.alive

    @alive.setter
    def alive(self, value: dict[str, bool]) -> None:
        self.feed.alive = value

    @property
    def resets(self) -> dict[str, int]:
        return self.feed.resets

    @property
    def last_item(self) -> dict[str, float]:
        return self.feed.last_item

    @property
    def deliveries(self) -> int:
        return self.feed.deliveries

    @property
    def apply_errors(self) -> int:
        return self.feed.apply_errors

    @property
    def extra(self) -> set[str]:
        """Run-time streams (the indexer API's registrations): not routing targets."""
        return self.feed.extra

    @property
    def specs(self) -> list[StreamSpec]:
        return self.feed.specs

    @property
    def stream_config(self) -> StreamConfig | None:
        return self.feed.stream_config

    @property
    def nats(self) -> Any:
        """A kvwire.nats.NatsStreams when the engines' streams come from JetStream."""
        return self.feed.nats

    # ------------------------------------------------------------------ the ingest

    def start(self, timeout: float = 10.0, *, thread: bool = True) -> None:
        """Start following the streams (:meth:`.feed.Feed.start`)."""
        self.feed.start(timeout, thread=thread)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the ingest and close its sockets, and the load sharing with other replicas
        if any."""
        share, self.share, self.load_share = self.load_share, None, None
        if share is not None:
            share.close()
        self.feed.close(timeout)

    @property
    def closed(self) -> bool:
        """``close()`` was called."""
        return self.feed.closed

    @property
    def sub_stats(self) -> dict[str, Any]:
        """The subscriber's per-stream stats (refreshed every 0.25 s)."""
        return self.feed.sub_stats

    @property
    def pumps(self) -> int:
        """Caller-driven ingest turns that applied a piece."""
        return self.feed.pumps

    def pump(self, max_items: int) -> bool:
        """One bounded turn of a caller-driven ingest (:meth:`.feed.Feed.pump`)."""
        return self.feed.pump(max_items)

    # ------------------------------------------------------------------ run-time streams

    def add_stream(self, spec: StreamSpec) -> None:
        """Follow one more stream, not a routing target (:meth:`.feed.Feed.add_stream`)."""
        self.feed.add_stream(spec)

    def remove_stream(self, name: str) -> bool:
        """Stop following a stream added by :meth:`add_stream`
        (:meth:`.feed.Feed.remove_stream`)."""
        return self.feed.remove_stream(name)

    # ------------------------------------------------------------------ run-time engines

    def _set_targets(self, targets: list[Target]) -> None:
        # Copy-on-write: a reader that took ``targets`` (or, under the lock, the maps)
        # keeps a consistent set while an engine is added or removed.
        self.targets = targets
        self.roles = {e.name: e.role for e in self.engines}
        #: an engine has a role other than both: the proxy routes pairs
        self.has_roles = any(r != "both" for r in self.roles.values())
        self._by_label = {t.label: t for t in targets}
        self._by_stream = {t.stream for t in targets}
        self.feed.owned = self._by_stream

    def routes_to(self, name: str) -> bool:
        """Whether an engine of this name is routed to now."""
        return any(e.name == name for e in self.engines)

    def check_unused(self, name: str) -> None:
        """:class:`EngineConflict` if an engine of this name is routed to already."""
        if self.routes_to(name):
            raise EngineConflict(f"engine {name!r} is already routed to")

    def add_engine(self, spec: EngineSpec) -> None:
        """Route to one more engine from now on (any thread). Its streams are followed from
        the subscriber's next poll; until one is live the engine is a candidate of last
        resort, as any engine whose stream is down. With ``--nats`` the engine has no
        endpoint (``EngineSpec.parse_named``): JetStream already carries every engine's
        streams, so its blocks and liveness are known at once if its bridge is writing.
        :class:`EngineConflict` for a name in use; ValueError for an endpoint under
        ``--nats`` or none without it."""
        if self.nats is not None and spec.endpoint is not None:
            raise ValueError(f"engine {spec.name!r}: with --nats the engines' streams come "
                             "from JetStream: give NAME[:RANKS][,url=URL], no endpoint")
        specs = spec.streams() if self.nats is None else []
        new = targets_of(spec)
        with self.ingest.lock:
            self.check_unused(spec.name)
            taken = sorted(t.stream for t in new if t.stream in self.extra
                           or t.stream in self._by_stream)
            if taken:
                raise EngineConflict(f"stream {taken[0]!r} is already followed (registered "
                                     "through the indexer API, or another engine's)")
            with self.lock:
                # (with --nats: what JetStream said of its streams so far, if anything)
                self._install(spec, fresh=self.nats is None)
                self._withdrawn.discard(spec.name)
            feed = self.feed
            if self.ingest.sub is None:
                feed.specs = [*feed.specs, *specs]
                return
            added: list[str] = []
            try:
                for st in specs:
                    self.ingest.sub.add(st)
                    added.append(st.name)
            except BaseException:  # (a closed subscriber): leave no half-added engine
                self._drop_engine(spec.name)
                for name in added:
                    self.ingest.sub.remove(name, then=feed.forget)
                raise

    def remove_engine(self, name: str) -> bool:
        """Stop routing to engine ``name`` (any thread): no later decision picks it, its
        streams are let go and their blocks dropped from the index (in the subscriber's
        thread, after every item of them handed out before). Reservations of requests
        already sent there stay until those requests end. False if no such engine. With
        ``--nats`` its streams keep coming from JetStream with the rest, so its blocks stay
        indexed (and are there at once if it is added again)."""
        with self.ingest.lock:
            gone = self._drop_engine(name)
            if gone is None:
                return False
            if self.nats is not None:
                return True
            feed = self.feed
            for t in gone:
                if self.ingest.sub is None:
                    feed.specs = [s for s in feed.specs if s.name != t.stream]
                    feed.forget(t.stream)
                    continue
                try:
                    self.ingest.sub.remove(t.stream, then=feed.forget)
                except RuntimeError:  # the subscriber closed (stopping): nothing to let go
                    feed.forget(t.stream)
        return True

    def _install(self, spec: EngineSpec, fresh: bool) -> None:
        """Route to ``spec`` in place of any engine of its name (the caller holds ``lock``);
        ``fresh``: its streams start unknown, else they keep what was seen of them."""
        new = targets_of(spec)
        self.engines = [*(e for e in self.engines if e.name != spec.name), spec]
        self._set_targets([*(t for t in self.targets if t.engine != spec.name), *new])
        for t in new:
            if fresh:
                self.alive[t.stream] = False
            else:
                self.alive.setdefault(t.stream, False)
            self.resets.setdefault(t.stream, 0)

    def _drop_engine(self, name: str) -> list[Target] | None:
        if not self.routes_to(name):
            return None
        with self.lock:
            if self.discover:
                self._withdrawn.add(name)
            gone = [t for t in self.targets if t.engine == name]
            self.engines = [e for e in self.engines if e.name != name]
            self._set_targets([t for t in self.targets if t.engine != name])
        return gone

    def stream_problems(self) -> tuple[int, str]:
        """Run-time stream changes the subscriber could not apply (e.g. a collector
        endpoint it could not bind), and the last reason."""
        return self.feed.stream_problems()

    def _discover(self, streams: set[str]) -> None:
        """Route to engines that appear on the JetStream stream after start (a late start,
        a fleet that grows), from their first item, with the DP ranks seen so far; a rank
        seen later widens its engine (its targets are then labelled NAME/dpR). ``streams``:
        what the feed delivered from that is neither routed to nor registered."""
        for name, ranks in found_ranks(streams, self._withdrawn).items():
            with self.ingest.lock, self.lock:
                old = next((e for e in self.engines if e.name == name), None)
                if old is not None and old.ranks >= ranks:
                    continue
                self._install(EngineSpec(name, None, ranks=ranks) if old is None
                              else replace(old, ranks=ranks), fresh=False)
                self.discovered += 1
            log.info("engine %s %s on the stream (%d DP rank%s)", name,
                     "found" if old is None else "widened", ranks, "" if ranks == 1 else "s")

    # ------------------------------------------------------------------ routing

    def check_tokens(self, token_ids: Sequence[int]) -> None:
        """Reject empty or oversized prompts with the reason."""
        if not token_ids:
            raise RouteError(422, "token_ids is empty: nothing to route", "empty_tokens")
        if len(token_ids) > self.max_tokens:
            raise RouteError(413, f"token_ids has {len(token_ids)} tokens, more than the "
                             f"limit of {self.max_tokens} (--max-tokens)", "oversized_tokens")

    def route(self, token_ids: Sequence[int], lora_name: str | None = None,
              salt: str | None = None, reserve: bool = True) -> dict[str, Any]:
        """Choose an engine for the prompt; with ``reserve`` (``/route``) its load is
        reserved under the returned ``request_id`` and its prefix predicted on the engine.
        A fleet with roles (or ``pairs.always``) gets its pair, as :meth:`route_pair`
        chooses it (``engine``: the decode engine; ``prefill``: the prefill engine or None,
        ``why``), each side reserved under its own ``request_id``."""
        self.check_tokens(token_ids)
        if not self.targets:
            raise RouteError(503, "no engine on the JetStream stream yet (each is routed to "
                             "as it appears)" if self.discover else "no engine to route to: "
                             "this kvwire serve has no --engine (it answers the indexer API "
                             "only)", "no_engine")
        blocks: dict[str, int] = {}
        if self.has_roles or self.pairs.always:
            return self._route_pair_api(token_ids, lora_name, salt, reserve, blocks)
        d, target, rid, _ = self.decide(token_ids, lora_name, salt, reserve=reserve,
                                        blocks=blocks)
        out: dict[str, Any] = {"engine": target.engine, "rank": target.rank}
        if rid is not None:
            out["request_id"] = rid
        out["overlap"] = blocks
        out["cost"] = d.cost
        return out

    @overload
    def route_proxy(self, token_ids: Sequence[int], lora_name: str | None,
                    salt: str | None, usable: Callable[[str], bool],
                    up: Callable[[str], bool]) -> Routed: ...

    @overload
    def route_proxy(self, token_ids: Sequence[int], lora_name: str | None,
                    salt: str | None, usable: Callable[[str], bool],
                    up: Callable[[str], bool], total: int) -> Routed | None: ...

    def route_proxy(self, token_ids: Sequence[int], lora_name: str | None,
                    salt: str | None, usable: Callable[[str], bool],
                    up: Callable[[str], bool], total: int | None = None) -> Routed | None:
        """Route a proxied request among the engines ``usable(engine)`` allows (HTTP url,
        breaker closed, not already tried); ``up(engine)``: its HTTP health, which with the
        event stream makes a candidate alive. Empty ``token_ids`` (no tokenizer): by load
        only. Reserves like ``route``; RouteError 503 when no engine is usable.

        ``total``: ``token_ids`` is only the prompt's start, and the prompt about ``total``
        tokens long (a long prompt still being tokenized). It is routed on its start when
        every engine's cached prefix of it ends inside the start (no ids that follow can
        lengthen one), weighed and reserved at ``total``; else None (nothing reserved): route
        it when its whole ids are known (also when ``total`` is over ``max_tokens``: the
        whole ids decide a 413). :meth:`complete` then gives them."""
        if len(token_ids) > self.max_tokens:
            raise RouteError(413, f"the prompt has {len(token_ids)} tokens, more than the "
                             f"limit of {self.max_tokens} (--max-tokens)", "oversized_tokens")
        if total is not None and total > self.max_tokens:
            return None  # (an estimate: the whole ids say whether it is a 413)
        out = self.decide(token_ids, lora_name, salt, usable=usable, up=up, proxied=True,
                          total=total)
        if out is None:
            return None
        d, target, rid, prefill = out
        return Routed(rid, target.engine, target.rank, d.name, prefill, d.overlap[d.name])

    def complete(self, routed: Routed, token_ids: Sequence[int], lora_name: str | None,
                 salt: str | None) -> bool:
        """The whole ids of a prompt routed on its start (:meth:`route_proxy`'s ``total``):
        predicted on its engine, and its reservation set to its true length while its first
        token has not come. False if the request has ended (its reservation is gone)."""
        with self.lock:
            rid, label = routed.request_id, routed.label
            target = self._by_label.get(label)
            if target is None or self.loads.holder(rid) != label:
                return False
            now = self.clock()
            prompt_blocks = len(token_ids) // self.block_size
            amount = self._request_load(prompt_blocks, routed.overlap)
            prefill = max(prompt_blocks - routed.overlap, 0.0)
            if self.loads.resize(rid, amount, prefill, now) and self.share is not None:
                self.share(["r", rid, label, amount, prefill])
            if len(token_ids) <= self.max_tokens:
                self._predict(target.stream, token_ids, lora_name, salt)
        return True

    def route_pair(self, token_ids: Sequence[int], lora_name: str | None, salt: str | None,
                   usable: Callable[[str], bool], up: Callable[[str], bool], *,
                   prefill_usable: Callable[[str], bool] | None = None) -> RoutedPair:
        """Route a proxied request as a prefill/decode pair (:func:`.pairs.choose_pair`):
        the decode engine among the usable engines that decode, then the decider, then the
        prefill engine among those ``prefill_usable`` allows (``usable`` if None) that
        prefill. Each side reserves its own load, under its own id: the prefill side its
        uncached blocks there (plus ``decode_load``, as any request), a prefill share that
        ends with the prefill answer; the decode side as :meth:`route_proxy` does, less the
        prefill share when the prefill is remote. The prefix is predicted on both engines
        (the decode engine caches the blocks it pulls). A local prefill (prefill None) is
        exactly :meth:`route_proxy`'s reservation. RouteError 413 for an oversized prompt,
        503 when no engine may decode."""
        if len(token_ids) > self.max_tokens:
            raise RouteError(413, f"the prompt has {len(token_ids)} tokens, more than the "
                             f"limit of {self.max_tokens} (--max-tokens)", "oversized_tokens")
        p_ok = usable if prefill_usable is None else prefill_usable
        pd, decode, prefill = self._pair(token_ids, lora_name, salt, usable, p_ok, up,
                                         proxied=True, reserve=True)
        assert decode is not None
        return RoutedPair(decode, prefill, pd.why)

    def _route_pair_api(self, token_ids: Sequence[int], lora_name: str | None,
                        salt: str | None, reserve: bool, blocks: dict[str, int]
                        ) -> dict[str, Any]:
        """:meth:`route`'s answer for a fleet with roles: the pair."""
        def every(_: str) -> bool:
            return True

        pd, decode, prefill = self._pair(token_ids, lora_name, salt, every, every, None,
                                         proxied=False, reserve=reserve, blocks=blocks)
        d = self._by_label[pd.decode.name]
        out: dict[str, Any] = {"engine": d.engine, "rank": d.rank}
        if decode is not None:
            out["request_id"] = decode.request_id
        out["overlap"] = blocks
        out["cost"] = pd.decode.cost
        out["why"] = pd.why
        side: dict[str, Any] | None = None
        if pd.prefill is not None:
            p = self._by_label[pd.prefill.name]
            side = {"engine": p.engine, "rank": p.rank}
            if prefill is not None:
                side["request_id"] = prefill.request_id
            side["cost"] = pd.prefill.cost
        out["prefill"] = side
        return out

    def _pair(self, token_ids: Sequence[int], lora_name: str | None, salt: str | None,
              usable: Callable[[str], bool], p_ok: Callable[[str], bool],
              up: Callable[[str], bool] | None, *, proxied: bool, reserve: bool,
              blocks: dict[str, int] | None = None
              ) -> tuple[PairDecision, Routed | None, Routed | None]:
        """The pair decision (under ``lock``) and, with ``reserve``, each side's
        reservation. ``proxied`` as in :meth:`decide`: the proxy's ids and prefill shares
        (its first tokens drop them), its matching of prompts under one block."""
        prompt_blocks = len(token_ids) // self.block_size
        if not self.lock.acquire(timeout=self.lock_timeout):
            raise RouteError(503, "index busy (applying a large snapshot); retry", "busy")
        try:
            targets, roles = self.targets, self.roles
            dec = [t for t in targets if roles.get(t.engine) != "prefill" and usable(t.engine)]
            if not dec:
                raise RouteError(503, "no engine that can decode (role decode or both) is "
                                 "available (all down or already tried)", "no_engine")
            pre = [t for t in targets if roles.get(t.engine) != "decode" and p_ok(t.engine)]
            now = self.clock()
            matches = (self.index.match(token_ids, lora_name=lora_name, salt=salt)
                       if prompt_blocks or not proxied else {})
            self.loads.expire(now)
            seen = {t.label: t for t in (*dec, *pre)}
            cands = {c.name: c for c in self._candidates(list(seen.values()), matches,
                                                         prompt_blocks, now, up, blocks)}
            pd = choose_pair(self.policy, prompt_blocks, [cands[t.label] for t in dec],
                             [cands[t.label] for t in pre], self.pairs, self.prefill_policy)
            d = pd.decode
            d_over = d.overlap[d.name]
            decode = prefill = None
            if reserve:
                remote = pd.prefill is not None
                # (a prefill share only where first tokens are seen to drop it: the proxy)
                share = 1.0 if proxied else 0.0
                d_pre = 0.0 if remote else max(prompt_blocks - d_over, 0.0) * share
                d_amount = self._request_load(prompt_blocks,
                                              prompt_blocks if remote else d_over)
                decode = self._reserve_side(d.name, d_amount, d_pre, d_over, now, matches,
                                            token_ids, lora_name, salt, prompt_blocks,
                                            proxied, blocks)
                if pd.prefill is not None:
                    p = pd.prefill
                    p_over = p.overlap[p.name]
                    p_pre = max(prompt_blocks - p_over, 0.0)
                    prefill = self._reserve_side(p.name, p_pre + self.decode_load,
                                                 p_pre * share, p_over, now, matches,
                                                 token_ids, lora_name, salt, prompt_blocks,
                                                 proxied, blocks)
            else:
                self.counts["scores"] += 1
        finally:
            self.lock.release()
        if self.on_route is not None:
            self.on_route(d.name, d_over, float(prompt_blocks))
            if pd.prefill is not None:
                p = pd.prefill
                self.on_route(p.name, p.overlap[p.name], float(prompt_blocks))
        return pd, decode, prefill

    def _reserve_side(self, label: str, amount: float, prefill: float, overlap: float,
                      now: float, matches: dict[str, Any], token_ids: Sequence[int],
                      lora_name: str | None, salt: str | None, prompt_blocks: int,
                      proxied: bool = True, blocks: dict[str, int] | None = None) -> Routed:
        """One side of a pair: reserve on ``label`` under a new id (the proxy's, or a
        uuid for ``/route``) and predict the prefix there unless it holds the prompt
        (under ``lock``; ``blocks``: the credited matched blocks, for ``/route``, as
        :meth:`decide` judges)."""
        target = self._by_label[label]
        rid = f"p{next(_PROXY_IDS)}" if proxied else uuid.uuid4().hex
        self._reserve(rid, label, amount, now, prefill)
        m = matches.get(target.stream)
        if proxied:
            short = prompt_blocks and (m is None or m.prompt_blocks == 0
                                       or m.blocks < m.prompt_blocks)
        else:
            short = (m is None or m.prompt_blocks == 0
                     or (blocks or {}).get(label, 0) < m.prompt_blocks)
        if short:
            self._predict(target.stream, token_ids, lora_name, salt)
        self.counts["routes"] += 1
        return Routed(rid, target.engine, target.rank, label, prefill, overlap)

    def decide(self, token_ids: Sequence[int], lora_name: str | None, salt: str | None, *,
               usable: Callable[[str], bool] | None = None,
               up: Callable[[str], bool] | None = None, reserve: bool = True,
               proxied: bool = False, blocks: dict[str, int] | None = None,
               total: int | None = None,
               ) -> tuple[Decision, Target, Any, float] | None:
        """The one routing decision (under ``lock``, given up with RouteError 503 after
        ``lock_timeout``): match the prompt, weigh every target ``usable(engine)`` allows
        (all if None; RouteError 503 if none) with ``up(engine)`` as its HTTP health, let
        the policy choose, and with ``reserve`` reserve the request's load on the choice and
        predict its prefix there. Returns the decision, the chosen target, the request id
        (None without ``reserve``) and the prefill share reserved. ``blocks``, if given,
        gets each target's matched blocks in its own block size (where credited).

        ``proxied`` is the one difference between the proxy's requests and the decision
        API's (``route``):

        * ids: ``p0, p1, ...`` (internal, never shown; no urandom per request), not a uuid;
        * the reservation holds the uncached blocks as a prefill share, which the first
          token drops (:meth:`first_token`): a proxy sees first tokens, ``/route`` does not;
        * a prompt under one reference block (or none: no tokenizer) is routed by load
          alone, neither matched nor predicted; the decision API matches it (an engine with
          smaller blocks may hold it);
        * the prefix is predicted on the chosen engine unless its matched blocks (any
          tier) cover the prompt; for the decision API, unless its *credited* matched
          blocks do (blocks held only in tiers worth no credit still get predicted).

        ``total``: see :meth:`route_proxy` (None when the start does not settle it)."""
        ntok = len(token_ids) if total is None else max(total, len(token_ids))
        prompt_blocks = ntok // self.block_size
        if not self.lock.acquire(timeout=self.lock_timeout):
            raise RouteError(503, "index busy (applying a large snapshot); retry", "busy")
        try:
            # (under the lock: the targets and _by_label of one membership)
            targets = self.targets
            if usable is not None:
                targets = [t for t in targets if usable(t.engine)]
                if not targets:
                    raise RouteError(503, "no engine is available (all down or already "
                                     "tried)", "no_engine")
            now = self.clock()
            matches = (self.index.match(token_ids, lora_name=lora_name, salt=salt)
                       if prompt_blocks or not proxied else {})
            if total is not None and not self._settled(targets, matches):
                return None
            self.loads.expire(now)
            if not proxied and blocks is None:
                blocks = {}
            d = self.policy.choose(prompt_blocks, self._candidates(
                targets, matches, prompt_blocks, now, up, blocks,
                ntok / len(token_ids) if token_ids else 1.0))
            target = self._by_label[d.name]
            rid = None
            prefill = 0.0
            if reserve:
                overlap = d.overlap[d.name]
                if proxied:
                    rid = f"p{next(_PROXY_IDS)}"  # internal (never shown)
                    prefill = max(prompt_blocks - overlap, 0.0)
                else:
                    rid = uuid.uuid4().hex
                amount = self._request_load(prompt_blocks, overlap)
                self._reserve(rid, d.name, amount, now, prefill)
                m = matches.get(target.stream)
                if proxied:
                    short = prompt_blocks and (m is None or m.prompt_blocks == 0
                                               or m.blocks < m.prompt_blocks)
                else:  # (blocks: the credited matched blocks, see _candidates)
                    short = (m is None or m.prompt_blocks == 0
                             or blocks[d.name] < m.prompt_blocks)
                if short:  # only a prefix the engine does not already hold needs predicting
                    self._predict(target.stream, token_ids, lora_name, salt)
                self.counts["routes"] += 1
            else:
                self.counts["scores"] += 1
        finally:
            self.lock.release()
        if self.on_route is not None:
            self.on_route(d.name, d.overlap[d.name], float(prompt_blocks))
        return d, target, rid, prefill

    def _request_load(self, prompt_blocks: int, credit: float) -> float:
        """The load a request reserves (under ``lock``): its uncached blocks, its expected
        decode (the mean output learned so far) and ``decode_load``."""
        expect = self._out_sum / self._out_n / self.block_size if self._out_n else 0.0
        return request_load(prompt_blocks, credit, expect, self.decode_share) + self.decode_load

    def _settled(self, targets: list[Target], matches: dict[str, Any]) -> bool:
        """Whether a prompt's start settles its match (under ``lock``): on every target
        whose block size is known, the matched blocks end before the start's last full
        block, so no ids after the start can add to them (a start shorter than a block
        settles nothing there)."""
        for t in targets:
            m = matches.get(t.stream)
            if (m is not None and m.blocks >= m.prompt_blocks
                    and self.index.block_size_of(t.stream)):
                return False
        return True

    def _candidates(self, targets: list[Target], matches: dict[str, Any], prompt_blocks: int,
                    now: float, up: Callable[[str], bool] | None = None,
                    blocks: dict[str, int] | None = None,
                    scale: float = 1.0) -> list[Candidate]:
        """What the policy weighs, per target (under ``lock``): the prompt's blocks it
        holds, as a share of the prompt (engines with another block size compete fairly),
        its load, whether it is live (``up``: and healthy over HTTP), how busy lately.
        ``blocks``, if given, gets each target's matched blocks in its own block size;
        ``scale``: the prompt's length over that of the ids matched (its start)."""
        load, busy, alive = self.loads.load, self.loads.busy, self.alive
        out = []
        for t in targets:
            m = matches.get(t.stream)
            credit = 0.0
            held = 0
            if m is not None and m.credit and m.prompt_blocks:
                credit = min(m.credit / (m.prompt_blocks * scale), 1.0) * prompt_blocks
                held = m.blocks
            if blocks is not None:
                blocks[t.label] = held
            live = alive.get(t.stream, False) and (up is None or up(t.engine))
            out.append(Candidate(t.label, credit, load(t.label, now), live, busy(t.label, now)))
        return out

    def _predict(self, stream: str, token_ids: Sequence[int], lora_name: str | None,
                 salt: str | None) -> None:
        """Count the prompt as held by ``stream`` until its events confirm it (under
        ``lock``); shared, the other replicas count it too (their next prompt with this
        prefix goes where this one went, not where the load alone says)."""
        keys = self.index.prompt_keys(stream, token_ids, lora_name, salt)
        if self.index.predict_keys(stream, keys) and self.share is not None:
            self.share(["p", stream, keys[:SHARED_PREDICTION_KEYS].tobytes()])

    def predicted_by_peer(self, stream: str, keys: bytes) -> bool:
        """Another replica predicted these own keys (8 bytes each) on ``stream`` (under
        ``lock``, from the load sharing's thread); False if it is not a stream routed to
        here or the keys are malformed."""
        if stream not in self._by_stream or len(keys) % 8:
            return False
        k = array("Q")
        k.frombytes(keys)
        self.index.predict_keys(stream, k)
        return True

    def _reserve(self, rid: str, label: str, amount: float, now: float,
                 prefill: float) -> None:
        """Reserve on ``label`` and tell the other replicas, if shared (under ``lock``)."""
        self.loads.reserve(rid, label, amount, now, prefill=prefill)
        if self.share is not None:
            self.share(["r", rid, label, amount, prefill])

    def first_token(self, request_id: str, prefill: float) -> float:
        """Drop a proxied request's prefill share from its reservation (its first token
        came: the prompt is computed); returns what was dropped."""
        with self.lock:
            # (the share reserved now: a prompt routed on its start has it set since)
            taken = self.loads.reduce(request_id, self.loads.prefill(request_id) or prefill)
            if taken and self.share is not None:
                self.share(["f", request_id])
            return taken

    def finish(self, request_id: str, output_tokens: int | None) -> bool:
        """Release a proxied request's reservation (ended, failed or abandoned); False if
        it was already gone (expired). Never raises: the proxy calls it from finally."""
        with self.lock:
            ok = self._release(request_id, output_tokens)
        if ok:
            self.counts["releases"] += 1
        return ok

    def _release(self, request_id: str, output_tokens: int | None) -> bool:
        ok = self.loads.release(request_id)
        if ok:
            if output_tokens is not None:
                self.learn_output(output_tokens)
            if self.share is not None:
                self.share(["x", request_id, output_tokens])
        return ok

    def learn_output(self, tokens: int) -> None:
        """A request ended with ``tokens`` output tokens (here or, shared, at another
        replica): the expected decode work of the next ones (under ``lock``)."""
        self._out_sum += tokens
        self._out_n += 1

    def release(self, request_id: str, output_tokens: int | None = None) -> dict[str, Any]:
        """Release a routed request's load; 404 RouteError if the id is unknown or expired.
        ``output_tokens`` (optional) teaches the expected decode work of later requests.
        A request another replica routed (replicas that share their load) is released by
        asking that replica; the answer then names it (``replica``)."""
        out: dict[str, Any] = {"released": request_id}
        # (the proxy's own ids, p0, p1, ..., are not the decision API's to release)
        ok = not request_id.startswith("p")
        with self.lock:
            if ok:
                name = self.loads.holder(request_id)
                ok = self._release(request_id, output_tokens)
                if not ok and self.load_share is not None:
                    fwd = self.load_share.forward_release(request_id, output_tokens)
                    if fwd is not None:
                        ok = True
                        out["replica"], name = fwd
        if not ok:
            raise RouteError(404, f"unknown request_id {request_id[:80]!r} (never routed, "
                             "already released, or expired)", "unknown_request_id")
        self.counts["releases"] += 1
        out["engine"] = name
        return out

    def release_asked(self, request_id: str, output_tokens: int | None) -> bool:
        """Another replica got the ``/release`` of a request this one routed (under
        ``lock``, from the load sharing's thread); False if it is not held (any more)."""
        return self._release(request_id, output_tokens)  # (counted as load reports)

    # ------------------------------------------------------------------ status

    def engines_status(self) -> dict[str, Any]:
        """Per engine and rank: stream state, blocks per tier, events applied, ages, alive."""
        with self.lock:
            idx = self.index.streams()
            loads = self.loads.loads()
        now = self.clock()
        sub = self.sub_stats
        out: dict[str, Any] = {}
        for t in self.targets:
            st = idx.get(t.stream)
            ss = sub.get(t.stream)
            proto = ss.stream if ss is not None else None
            last = self.last_item.get(t.stream)
            row: dict[str, Any] = {
                "stream": t.stream,
                "rank": t.rank,
                "alive": self.alive.get(t.stream, False),
                "phase": getattr(proto, "phase", "idle"),
                "mode": getattr(proto, "mode", "unknown"),
                "epoch": getattr(proto, "epoch", None),
                "blocks": dict(getattr(st, "tiers", {}) or {}),
                "events_applied": getattr(st, "events_applied", 0),
                "batches_applied": getattr(st, "batches_applied", 0),
                "block_size": getattr(st, "block_size", None),
                "last_event_age_s": None if last is None else round(now - last, 3),
                "resets": self.resets.get(t.stream, 0),
                "load": loads.get(t.label, 0.0),
                "suspect": getattr(st, "suspect", None),
                **stream_counts(ss),  # gaps, replays, lost, restarts, state...: as listen
            }
            out.setdefault(t.engine, {"role": self.roles.get(t.engine, "both"),
                                      "ranks": []})["ranks"].append(row)
        return out

    def healthy(self) -> tuple[bool, str]:
        """At least one stream live and caught up (phase ``live`` and not silent)."""
        live = [t.stream for t in self.targets
                if self.alive.get(t.stream)
                and getattr(getattr(self.sub_stats.get(t.stream), "stream", None),
                            "phase", None) == "live"]
        if not self.ingest.running:
            return False, "the ingest of the streams is not running"
        if not self.targets and self.discover:
            return False, "no engine on the JetStream stream yet"
        if not self.targets:  # the indexer API alone: its streams come and go
            return True, f"no routing engines; {len(self.extra)} registered streams"
        if not live:
            return False, "no stream is live and caught up"
        return True, f"{len(live)}/{len(self.targets)} streams live"
