"""``kvwire serve --nats``: which engines to route to when their streams come from
JetStream (:mod:`.build` asks)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ..nats.subjects import parse_subject

__all__ = ["nats_engines"]


def nats_engines(url: str, stream: str, subject: str | None, named: Sequence[Any],
                 connect_timeout: float, say: Callable[[str], None]
                 ) -> tuple[Any, list[Any]]:
    """The NatsStreams spec and the EngineSpecs (``named``: ``--nats-engine
    NAME[:RANKS][,url=URL]``, else every engine with a subject on the stream now: maybe none
    yet, as the router finds the others as they appear). The server is reached first either
    way, so a wrong URL fails here: NatsConnectError (an OSError) if it does not answer
    within ``connect_timeout``; ValueError for anything wrong in the flags, or a server
    without JetStream. A stream that does not exist yet is waited for (a router may start
    before the bridge that creates it), and ``say`` names the streams that do exist, so a
    misspelt ``--stream`` is seen at once."""
    from ..consume.engine_spec import EngineSpec
    from ..nats.streams import NatsStreams

    spec = NatsStreams(url, stream=stream, subject=subject)
    if named:
        names = [e.name for e in named]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"--nats-engine: {dup} given twice")
        asyncio.run(_discover(spec, connect_timeout, read=False))
        return spec, list(named)
    found = asyncio.run(_discover(spec, connect_timeout, read=True))
    if isinstance(found, _NoStream):
        there = ", ".join(found.others) if found.others else "none"
        say(f"stream {stream} does not exist at {url} yet (streams there: {there}): "
            "waiting for a bridge to create it; each engine is routed to as it appears")
        return spec, []
    ranks: dict[str, int] = {}
    for engine, rank in found:
        ranks[engine] = max(ranks.get(engine, 0), rank + 1)
    if not ranks:  # (a bridge up, its engines not yet: each is routed to as it appears)
        say(f"no engine on stream {stream} yet: each is routed to as it appears")
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

