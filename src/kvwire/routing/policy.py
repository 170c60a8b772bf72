"""The routing policy: pure, I/O-free, shared unchanged by ``kvwire serve`` and the simulator.

Cost of sending a prompt to an engine (lower is better)::

    cost = prefill_weight * max(prompt_blocks - credit, 0) + load_weight * excess
    excess = max(load - least_load - balance_slack, 0)    (balance_slack > 0)
    excess = load                                          (balance_slack == 0: the old cost)

With ``balance_slack > 0`` (the default of ``kvwire serve`` and the simulator) an engine's
queue costs nothing until it exceeds the least-loaded live engine's by the slack: cache first
while queues are close, balance once one pulls ahead, so a prefix stays with its owner unless
the owner's queue is that much longer (docs/decisions/0008-cache-first-balance-slack.md).

``credit`` is the engine's cached prefix in block units (sum of tier credit x matched blocks,
i.e. ``PrefixIndex.match(...)[stream].credit``), so the first term is the prefill work the
engine would still have to do. ``load`` is in the SAME unit, blocks of work: what the router
has reserved on that engine and not yet released (see :class:`~kvwire.routing.load.LoadTracker` and
:func:`request_load`). Both terms are therefore comparable and the weights are plain ratios.

Ties (equal cost within ``1e-9``) go to the lower load, then to a seeded random pick. With
``temperature > 0`` the engine is sampled from ``softmax(-cost / temperature)`` instead. A
dead candidate gets no traffic unless every candidate is dead (then they all compete).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "POLICIES",
    "Candidate",
    "Decision",
    "LeastLoadPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "RoutingPolicy",
    "make_policy",
    "request_load",
]

_TIE_EPS = 1e-9


class Candidate(NamedTuple):
    """One engine (or engine DP rank) the policy may choose.

    ``credit``: cached prefix in blocks (tier-weighted); ``load``: reserved work in blocks;
    ``alive``: whether its event stream is live (dead ones are a last resort); ``busy``:
    how long it has had requests in flight lately (:meth:`~kvwire.routing.load.LoadTracker.busy`), the last
    tie-break before a random pick. A NamedTuple:
    a router builds one per engine per request (64 engines: ~5x cheaper than a frozen
    dataclass)."""

    name: str
    credit: float = 0.0
    load: float = 0.0
    alive: bool = True
    busy: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen engine, and every candidate's cost and overlap (credit) for explanation."""

    name: str
    cost: dict[str, float] = field(default_factory=dict)
    overlap: dict[str, float] = field(default_factory=dict)


def request_load(prompt_blocks: int, credit: float = 0.0, output_blocks: float = 0.0,
                 decode_share: float = 0.0) -> float:
    """The load (in blocks of work) a routed request puts on its engine until released.

    Prefill: the prompt blocks the engine must still compute (``prompt_blocks - credit``);
    decode: ``decode_share`` x the expected output blocks (0 by default: decode is cheap per
    block next to prefill, and the output length is rarely known at routing time)."""
    return max(prompt_blocks - credit, 0.0) + max(decode_share, 0.0) * max(output_blocks, 0.0)


class RoutingPolicy:
    """Choose an engine by cost = prefill_weight x uncached blocks + load_weight x load.

    Deterministic for a given ``seed`` (the rng breaks exact ties and samples when
    ``temperature > 0``)."""

    def __init__(self, prefill_weight: float = 1.0, load_weight: float = 1.0,
                 temperature: float = 0.0, seed: int | None = None,
                 balance_slack: float = 0.0) -> None:
        for label, v in (("prefill_weight", prefill_weight), ("load_weight", load_weight),
                         ("temperature", temperature), ("balance_slack", balance_slack)):
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{label} must be a finite number >= 0, got {v!r}")
        self.prefill_weight = float(prefill_weight)
        self.load_weight = float(load_weight)
        self.temperature = float(temperature)
        self.balance_slack = float(balance_slack)
        self._rng = random.Random(seed)

    def cost(self, prompt_blocks: int, c: Candidate, least_load: float = 0.0) -> float:
        """The cost of sending a ``prompt_blocks`` prompt to candidate ``c`` (``least_load``:
        the least load among the live candidates, used with ``balance_slack``)."""
        return (self.prefill_weight * max(prompt_blocks - c.credit, 0.0)
                + self.load_weight * self._excess(c.load, least_load))

    def _excess(self, load: float, least: float) -> float:
        if self.balance_slack <= 0:
            return load
        over = load - least - self.balance_slack
        return over if over > 0 else 0.0

    def choose(self, prompt_blocks: int, candidates: Sequence[Candidate]) -> Decision:
        """Pick one candidate; raises ValueError if there are none."""
        if not candidates:
            raise ValueError("no candidates to route to")
        pw, lw = self.prefill_weight, self.load_weight
        costs: dict[str, float] = {}
        overlap: dict[str, float] = {}
        pool = [c for c in candidates if c.alive] or list(candidates)
        slack = self.balance_slack
        least = min([c.load for c in pool]) if slack > 0 else 0.0
        for name, credit, load, _, _ in candidates:  # the cost formula, inlined (hot path)
            uncached = prompt_blocks - credit
            if slack > 0:
                load = load - least - slack
                load = load if load > 0 else 0.0
            costs[name] = (pw * uncached if uncached > 0 else 0.0) + lw * load
            overlap[name] = float(credit)
        if self.temperature > 0 and len(pool) > 1:
            name = self._sample(pool, costs)
        else:
            name = self._best(pool, costs)
        return Decision(name=name, cost=costs, overlap=overlap)

    def _best(self, pool: Sequence[Candidate], costs: dict[str, float]) -> str:
        # (each step keeps the set it narrows if a NaN, which compares false with
        # everything, would leave it empty)
        best_cost = min([costs[c.name] for c in pool])
        tied = [c for c in pool if costs[c.name] <= best_cost + _TIE_EPS] or list(pool)
        if len(tied) == 1:
            return tied[0].name
        least = min([c.load for c in tied])
        tied = [c for c in tied if c.load <= least + _TIE_EPS] or tied
        if len(tied) == 1:
            return tied[0].name
        # Still tied (typically a new prefix, engines idle): the one busy least lately, so
        # new conversations even out the engines' work over time, not only their queues.
        low = min([c.busy for c in tied])
        tied = [c for c in tied if c.busy <= low + _TIE_EPS] or tied
        if len(tied) == 1:
            return tied[0].name
        return tied[self._rng.randrange(len(tied))].name

    def _sample(self, pool: Sequence[Candidate], costs: dict[str, float]) -> str:
        lo = min(costs[c.name] for c in pool)
        weights = [math.exp(-(costs[c.name] - lo) / self.temperature) for c in pool]
        return self._rng.choices(pool, weights=weights, k=1)[0].name


class _Baseline:
    """A cache-blind baseline (``serve --policy``): the same ``choose`` interface, so one
    process can be its own baseline. Dead candidates are a last resort, as in RoutingPolicy."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, prompt_blocks: int, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise ValueError("no candidates to route to")
        pool = [c for c in candidates if c.alive] or list(candidates)
        return Decision(name=self._pick(pool).name,
                        cost={c.name: float(c.load) for c in candidates},
                        overlap={c.name: float(c.credit) for c in candidates})

    def _pick(self, pool: list[Candidate]) -> Candidate:
        raise NotImplementedError


class RoundRobinPolicy(_Baseline):
    """Each request to the next candidate in turn."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self._turn = 0

    def _pick(self, pool: list[Candidate]) -> Candidate:
        self._turn += 1
        return pool[self._turn % len(pool)]


class LeastLoadPolicy(_Baseline):
    """The candidate with the least reserved load (ties: seeded random)."""

    def _pick(self, pool: list[Candidate]) -> Candidate:
        least = min(c.load for c in pool)
        tied = [c for c in pool if c.load <= least + _TIE_EPS]
        return tied[self._rng.randrange(len(tied))] if len(tied) > 1 else tied[0]


class RandomPolicy(_Baseline):
    """A uniformly random candidate."""

    def _pick(self, pool: list[Candidate]) -> Candidate:
        return pool[self._rng.randrange(len(pool))]


#: ``serve --policy`` names.
POLICIES = ("kvwire", "random", "round_robin", "least_load")


def make_policy(name: str, prefill_weight: float = 1.0, load_weight: float = 0.5,
                temperature: float = 0.0, seed: int | None = None,
                balance_slack: float = 0.0) -> Any:
    """The policy ``serve --policy NAME`` uses; ValueError for an unknown name."""
    if name == "kvwire":
        return RoutingPolicy(prefill_weight, load_weight, temperature, seed, balance_slack)
    cls = {"round_robin": RoundRobinPolicy, "least_load": LeastLoadPolicy,
           "random": RandomPolicy}.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r} (expected one of {', '.join(POLICIES)})")
    return cls(seed)
