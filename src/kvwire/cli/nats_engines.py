"""``kvwire serve --nats``: which engines to route to when their streams come from JetStream."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

from ..nats.subjects import parse_subject

__all__ = ["discover", "nats_engines"]


def nats_engines(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    """The NatsStreams spec and the EngineSpecs (``--nats-engine NAME[:RANKS]``, else every
    engine with a subject on the stream now). ValueError says what is wrong."""
    from ..nats.consumer import NatsStreams
    from ..nats.subjects import check_token
    from ..router.service import EngineSpec

    if args.engine:
        raise ValueError("--engine and --nats exclude each other (with --nats the engines' "
                         "streams come from JetStream; name them with --nats-engine)")
    spec = NatsStreams(args.nats, stream=args.stream, subject=args.subject)
    ranks: dict[str, int] = {}
    if args.nats_engine:
        for text in args.nats_engine:
            name, _, n = text.partition(":")
            check_token(name, "--nats-engine name")
            if n and (not n.isdigit() or not 1 <= int(n) <= 1024):
                raise ValueError(f"--nats-engine {text!r}: RANKS must be 1..1024")
            ranks[name] = int(n) if n else 1
    else:
        try:
            found = discover(spec)
        except Exception as e:
            raise ValueError(f"cannot read stream {args.stream} at {args.nats}: {e}") from None
        for engine, rank in found:
            ranks[engine] = max(ranks.get(engine, 0), rank + 1)
        if not ranks:
            raise ValueError(f"no engine subjects on stream {args.stream} yet: start "
                             "kvwire bridge first, or name them with --nats-engine NAME[:RANKS]")
    engines = [EngineSpec(name, spec.url, ranks=n) for name, n in ranks.items()]
    return spec, engines


async def _discover(url: str, stream: str, subject: str, prefix: str) -> list[tuple[str, int]]:
    import nats

    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0)
    try:
        info = await nc.jetstream().stream_info(stream, subjects_filter=subject)
    finally:
        await nc.close()
    out = []
    for s in sorted((info.state.subjects or {}).keys()):
        with contextlib.suppress(ValueError):
            out.append(parse_subject(prefix, s))
    return out


def discover(spec: Any) -> list[tuple[str, int]]:
    """``(engine, rank)`` of every subject the stream holds now (for ``kvwire serve``)."""
    return asyncio.run(_discover(spec.url, spec.stream, spec.filter, spec.prefix))
