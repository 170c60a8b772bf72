"""``kvwire serve --nats``: which engines to route to when their streams come from JetStream."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any, NamedTuple

from ..nats.subjects import parse_subject

__all__ = ["nats_engines"]


def nats_engines(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    """The NatsStreams spec and the EngineSpecs (``--nats-engine NAME[:RANKS][,url=URL]``,
    else every engine with a subject on the stream now: maybe none yet, as the router finds
    the others as they appear). The server is reached first either way, so a wrong URL
    fails here: NatsConnectError (an OSError) if it does not answer within
    ``--connect-timeout``; ValueError for anything wrong in the flags, or a server without
    JetStream. A stream that does not exist yet is waited for (a router may start before
    the bridge that creates it), and stderr names the streams that do exist, so a misspelt
    ``--stream`` is seen at once."""
    from ..consume.engine_spec import EngineSpec
    from ..nats.streams import NatsStreams

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
    if isinstance(found, _NoStream):
        there = ", ".join(found.others) if found.others else "none"
        print(f"kvwire serve: stream {args.stream} does not exist at {args.nats} yet "
              f"(streams there: {there}): waiting for a bridge to create it; each engine is "
              "routed to as it appears", file=sys.stderr, flush=True)
        return spec, []
    ranks: dict[str, int] = {}
    for engine, rank in found:
        ranks[engine] = max(ranks.get(engine, 0), rank + 1)
    if not ranks:  # (a bridge up, its engines not yet: each is routed to as it appears)
        print(f"kvwire serve: no engine on stream {args.stream} yet: each is routed to as "
              "it appears", file=sys.stderr, flush=True)
    return spec, [EngineSpec(name, None, ranks=n) for name, n in ranks.items()]


class _NoStream(NamedTuple):
    """The stream does not exist (yet); ``others``: the streams the server has."""

    others: list[str]


async def _discover(spec: Any, timeout: float,
                    read: bool) -> list[tuple[str, int]] | _NoStream:
    from nats.js.errors import NotFoundError

    from ..nats.connect import connect

    nc = await connect(spec.url, timeout=timeout, name="kvwire-serve-discover")
    try:
        if not read:
            return []
        js = nc.jetstream()
        try:
            info = await js.stream_info(spec.stream, subjects_filter=spec.filter)
        except NotFoundError:
            try:
                others = sorted(s.config.name for s in await js.streams_info())
            except Exception:  # noqa: BLE001 - the list only helps the reader
                others = []
            return _NoStream(others)
        except Exception as e:  # noqa: BLE001 - no JetStream, no permission: say which
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

