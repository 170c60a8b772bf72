"""What the router routes to, as names (pure: no I/O, no lock): an engine's targets, one per
DP rank, and which engines a JetStream stream shows that are not routed to yet
(``kvwire serve --nats`` without ``--nats-engine`` follows the fleet as it grows)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..consume.engine_spec import ENGINE_NAME, EngineSpec

__all__ = ["Target", "found_ranks", "targets_of"]

#: An engine's stream name, NAME/dpR.
_RANK_STREAM = re.compile(rf"({ENGINE_NAME})/dp(\d{{1,4}})")


@dataclass
class Target:
    """One routing target: an engine's DP rank."""

    stream: str  # subscriber / index stream name, NAME/dpR
    label: str  # key in answers: NAME, or NAME/dpR for multi-rank engines
    engine: str
    rank: int


def targets_of(e: EngineSpec) -> list[Target]:
    """An engine's routing targets: one per DP rank (labelled NAME, or NAME/dpR)."""
    return [Target(stream, e.name if e.ranks == 1 else stream, e.name, r)
            for r, stream in enumerate(e.stream_names())]


def found_ranks(streams: Iterable[str], withdrawn: set[str]) -> dict[str, int]:
    """Engine name -> DP ranks its streams show (highest rank seen + 1), for the streams
    named NAME/dpR among ``streams`` whose engine is not ``withdrawn`` (removed by an
    operator). Other names (an indexer-API registration's, say) are not engines'."""
    out: dict[str, int] = {}
    for s in streams:
        m = _RANK_STREAM.fullmatch(s)
        if m is None or m.group(1) in withdrawn:
            continue
        out[m.group(1)] = max(out.get(m.group(1), 0), int(m.group(2)) + 1)
    return out
