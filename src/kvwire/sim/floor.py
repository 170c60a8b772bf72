"""The first tokens no router can beat, for a trace on the batched engine model.

Each request runs alone on one engine whose cache holds every earlier prompt of the trace:
an unbounded cache shared by the whole fleet, no queue, no other request in its steps. A
router can only do worse for each request: its engine holds a subset of those blocks (one
engine's share, after evictions), and any other request in the engine's steps takes part of
the token budget. So request by request, the floor's TTFT is at most any policy's, and so is
each percentile. It shows where a target stops being reachable: a TTFT p99 below the
floor's is out of reach for every router (docs/sim.md, "The floor").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..engine import EngineModel
from .batched import engine_config, make_request
from .quantile import percentile
from .trace import Request
from .types import SimConfig

__all__ = ["Floor", "ttft_floor"]


@dataclass(frozen=True)
class Floor:
    """Per request, in trace order, and summed: what the unbounded cache gives."""

    ttft_s: list[float]  # model seconds from arrival to the first token
    hit_blocks: int
    prompt_blocks: int

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    def ttft_pct(self, q: float) -> float:
        """The nearest-rank ``q`` quantile, the simulator's definition."""
        return percentile(self.ttft_s, q)


def ttft_floor(reqs: Sequence[Request], cfg: SimConfig | None = None) -> Floor:
    """Run ``reqs`` one at a time, in order, on one engine model of ``cfg``'s kind (block
    size, token budget, step cost) with room for every block of every prompt. Arrival
    times play no part: nothing waits. Each request generates one token (its first)."""
    cfg = cfg or SimConfig()
    bs = cfg.block_tokens
    room = sum(-(-max(r.input_length, 1) // bs) + 1 for r in reqs)
    model = EngineModel(replace(engine_config(cfg), num_gpu_blocks=max(room, 1)))
    ttft: list[float] = []
    hits = blocks = 0
    for i, r in enumerate(reqs):
        er, named = make_request(i, r, bs)
        one = replace(er, max_tokens=1)  # keeps the block hashes make_request computed
        model.add(one)
        start = model.now
        while not model.idle:
            model.step()
        assert one.first_token_t is not None
        ttft.append(one.first_token_t - start)
        hits += min(one.cached_tokens // bs, named)
        blocks += named
    return Floor(ttft, hits, blocks)
