"""``kvwire serve --nats``: which engines to route to when their streams come from JetStream."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any

from ..nats.subjects import parse_subject

__all__ = ["discover", "nats_engines"]


def nats_engines(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    """The NatsStreams spec and the EngineSpecs (``--nats-engine NAME[:RANKS][,url=URL]``,
    else every engine with a subject on the stream now: maybe none yet, as the router finds
    the others as they appear). The server is reached first either way, so a wrong URL
    fails here: NatsConnectError (an OSError) if it does not answer within
    ``--connect-timeout``; ValueError for anything wrong in the flags, or a stream that
    cannot be read (a misspelt ``--stream``, or no bridge has created it yet)."""
    from ..consume.engine_spec import EngineSpec
    from ..nats.consumer import NatsStreams

    if args.engine:
        raise ValueError("--engine and --nats exclude each other (with --nats the engines' "
                         "streams come from JetStream; name them with --nats-engine)")
    spec = NatsStreams(args.nats, stream=args.stream, subject=args.subject)
    if args.nats_engine:
        names = [e.name for e in args.nats_engine]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"--nats-engine: {dup} given twice")
        asyncio.run(_discover(spec, args.connect_timeout, read=False))
        return spec, list(args.nats_engine)
    found = asyncio.run(_discover(spec, args.connect_timeout, read=True))
    ranks: dict[str, int] = {}
    for engine, rank in found:
        ranks[engine] = max(ranks.get(engine, 0), rank + 1)
    if not ranks:  # (a bridge up, its engines not yet: each is routed to as it appears)
        print(f"kvwire serve: no engine on stream {args.stream} yet: each is routed to as "
              "it appears", file=sys.stderr, flush=True)
    return spec, [EngineSpec(name, None, ranks=n) for name, n in ranks.items()]


async def _discover(spec: Any, timeout: float, read: bool) -> list[tuple[str, int]]:
    from ..nats.connect import connect

    nc = await connect(spec.url, timeout=timeout, name="kvwire-serve-discover")
    try:
        if not read:
            return []
        try:
            info = await nc.jetstream().stream_info(spec.stream, subjects_filter=spec.filter)
        except Exception as e:  # noqa: BLE001 - no such stream, no JetStream: say which
            raise ValueError(f"cannot read stream {spec.stream} at {spec.url}: "
                             f"{type(e).__name__}: {e}") from None
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 5)
    out = []
    for s in sorted((info.state.subjects or {}).keys()):
        with contextlib.suppress(ValueError):
            out.append(parse_subject(spec.prefix, s))
    return out


def discover(spec: Any, timeout: float = 10.0) -> list[tuple[str, int]]:
    """``(engine, rank)`` of every subject the stream holds now (for ``kvwire serve``)."""
    return asyncio.run(_discover(spec, timeout, read=True))
