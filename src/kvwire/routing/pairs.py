"""Prefill/decode pairs (pure, no I/O): which decode engine, whether to disaggregate at all,
and which prefill engine; shared unchanged by ``kvwire serve`` and the simulator.

Decode first: the decode engine keeps the request for its whole output, and what it already
holds of the prompt is not transferred, so it is chosen by the policy over the engines that
can decode (role ``decode`` or ``both``), by overlap and load. Then the decider keeps the
prefill local to that engine (as Dynamo's conditional disaggregation and llm-d's decider do)
when a remote prefill would not pay:

* ``"cached"``: the decode engine misses fewer than ``min_disagg_blocks`` of the prompt
  (computing a little there costs less than a transfer);
* ``"no_prefill"``: no engine can prefill (role ``prefill`` or ``both``);
* ``"prefill_busy"``: every prefill candidate's load is past ``prefill_busy`` (blocks);
* ``"local"``: the policy chose the decode engine itself (a ``both`` engine) for the
  prefill too, which is a local prefill (no transfer).

Otherwise (``"disagg"``) the prefill engine is chosen by the policy over the prefill
candidates, by their own overlap and load: a prefill sent where its prefix is cached saves
the most compute.

Candidates are :class:`~kvwire.routing.policy.Candidate` s; a ``both`` engine appears in
both lists under the same name. Dead candidates count as the policy counts them: a last
resort, so the busy check looks at the live ones (all, if none is live).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .policy import Candidate, Decision

__all__ = ["FALLBACK", "ROLES", "WHY", "PairConfig", "PairDecision", "choose_pair"]

#: An engine's roles: ``both`` serves either side.
ROLES = ("prefill", "decode", "both")
#: Why a pair decision went the way it did (``PairDecision.why``).
WHY = ("disagg", "cached", "prefill_busy", "no_prefill", "local")
#: what follows a prefill that failed on every prefill engine tried: a prefill on the
#: decode engine, or the request fails
FALLBACK = ("local", "fail")


@dataclass(frozen=True)
class PairConfig:
    """The decider's thresholds. ``min_disagg_blocks``: a prompt missing fewer blocks
    than this on its decode engine is prefilled there (0: always disaggregate);
    ``prefill_busy``: when every prefill candidate's load exceeds this many blocks, the
    prefill is local (inf: never); ``always``: every request is routed as a pair, also in
    a fleet of ``both`` engines only (a P/D protocol was asked for)."""

    min_disagg_blocks: float = 0.0
    prefill_busy: float = math.inf
    always: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.min_disagg_blocks, (int, float))
                and math.isfinite(self.min_disagg_blocks) and self.min_disagg_blocks >= 0):
            raise ValueError(f"min_disagg_blocks must be a finite number >= 0, got "
                             f"{self.min_disagg_blocks!r}")
        if not (isinstance(self.prefill_busy, (int, float))
                and not math.isnan(self.prefill_busy) and self.prefill_busy >= 0):
            raise ValueError(f"prefill_busy must be a number >= 0 (inf: never busy), got "
                             f"{self.prefill_busy!r}")


@dataclass(frozen=True)
class PairDecision:
    """The decode engine's decision, the prefill engine's (None: the prefill is local to
    the decode engine) and why (one of :data:`WHY`)."""

    decode: Decision
    prefill: Decision | None
    why: str

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


def choose_pair(policy: Any, prompt_blocks: int, decode_candidates: Sequence[Candidate],
                prefill_candidates: Sequence[Candidate],
                cfg: PairConfig | None = None, prefill_policy: Any = None) -> PairDecision:
    """Choose the decode engine, decide whether to disaggregate, then choose the prefill
    engine (module docstring). ``policy``: anything with the policies' ``choose``;
    ``prefill_policy`` (default: ``policy``) chooses the prefill side. A policy with state
    of its own (round robin's turn) needs one per side: shared, its turns alternate
    between the sides, and with 2 decode and 4 prefill engines every decode lands on the
    same engine and every prefill on two of the four. ValueError if there is no decode
    candidate."""
    cfg = cfg or PairConfig()
    if not decode_candidates:
        raise ValueError("no engine can decode (role decode or both)")
    d = policy.choose(prompt_blocks, decode_candidates)
    uncached = max(prompt_blocks - d.overlap.get(d.name, 0.0), 0.0)
    if uncached < cfg.min_disagg_blocks:
        return PairDecision(d, None, "cached")
    if not prefill_candidates:
        return PairDecision(d, None, "no_prefill")
    pool = [c for c in prefill_candidates if c.alive] or list(prefill_candidates)
    if all(c.load > cfg.prefill_busy for c in pool):
        return PairDecision(d, None, "prefill_busy")
    p = (prefill_policy or policy).choose(prompt_blocks, prefill_candidates)
    if p.name == d.name:
        return PairDecision(d, None, "local")
    return PairDecision(d, p, "disagg")
