"""Engines added and removed while ``kvwire serve`` runs (``POST /engines``,
``DELETE /engines/{name}``): a fleet that scales, or an engine drained for maintenance,
without restarting the router and losing its index. With ``--nats`` too: there the engine
is named (``NAME[:RANKS][,url=URL]``), and its streams already come from JetStream.

Off unless the server has an admin token (``kvwire serve --admin-token`` or
``KVWIRE_ADMIN_TOKEN``): an engine added here receives the clients' requests, headers
(``authorization`` included) and prompts, so only someone holding the token may add one.
Every answer is JSON; every refusal says why and is counted in
``kvwire_router_bad_requests_total{reason}`` with the other bad requests. With
``--engines-file`` the changes outlive a restart (:mod:`~kvwire.router.engines_file`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import Counter

from ..consume.engine_spec import EngineSpec
from ..routing.core import EngineConflict, RouterCore
from .engines_file import EngineChanges, EnginesFile

__all__ = ["TOKEN_ENV", "add_membership_routes"]

log = logging.getLogger("kvwire.router.membership")

#: The environment variable ``kvwire serve`` reads the admin token from (kept off the
#: command line, where any user of the host can read it).
TOKEN_ENV = "KVWIRE_ADMIN_TOKEN"


class AddBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /engines``: the engine in ``--engine``'s syntax."""

    engine: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


_add_dec = msgspec.json.Decoder(AddBody)


def add_membership_routes(app: FastAPI, core: RouterCore, proxy: Any, token: str | None,
                          answer: Callable[..., Response],
                          bad: Callable[[int, str, str], Response],
                          kept: EnginesFile | None = None) -> None:
    """Register the two admin routes on ``app``. ``answer(obj, status)`` and
    ``bad(status, message, reason)`` answer (and count a refusal) as the app's other routes
    do. With ``kept`` (``--engines-file``) each change is written there before it is made:
    one that cannot be written is refused (507) and nothing changes."""
    changes = Counter("kvwire_router_engine_changes", "Engines added and removed at run "
                      "time (POST/DELETE /engines)", ["op"],
                      registry=app.state.metrics.registry)
    want = token.encode() if token else None

    def refused(request: Request) -> Response | None:
        if want is None:
            return bad(403, "changing engines at run time is off: start kvwire serve with "
                       f"--admin-token (or {TOKEN_ENV}) to allow it", "admin_off")
        got = request.headers.get("authorization", "")
        scheme, _, value = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), want):
            return bad(401, "this needs the admin token: Authorization: Bearer TOKEN",
                       "admin_token")
        return None

    # With a file, each change is written (fsync included) in a thread, so the requests in
    # flight on this loop do not wait for the disk; the lock keeps one change at a time
    # between its checks, its write and its making.
    lock = asyncio.Lock()

    async def keep(new: EngineChanges) -> Response | None:
        """Write the changes to come; a 507 answer if they cannot be written."""
        assert kept is not None
        try:
            await asyncio.to_thread(kept.commit, new)
        except OSError as e:
            return bad(507, f"engines file {kept.path} could not be written ({e}): nothing "
                       "changed", "engines_file")
        return None

    async def unkeep(old: EngineChanges | None) -> None:
        """A change written but not made after all: the file says what is true again."""
        if kept is None or old is None:
            return
        try:
            await asyncio.to_thread(kept.commit, old)
        except OSError as e:
            log.error("engines file %s could not be written back (%s): it names a change "
                      "that was not made", kept.path, e)

    @app.post("/engines")
    async def add_engine(request: Request) -> Response:
        """Route to one more engine: ``{"engine": "NAME=EVENTS[,replay=..][,url=..]"}``
        (with ``--nats``: ``"NAME[:RANKS][,url=URL]"``, ``--nats-engine``'s syntax)."""
        if (no := refused(request)) is not None:
            return no
        raw = await request.body()
        async with lock:
            return await _add(raw)

    async def _add(raw: bytes) -> Response:
        try:
            body = _add_dec.decode(raw)
        except msgspec.DecodeError as e:  # (ValidationError included)
            syntax = ("NAME=ENDPOINT[,replay=ENDPOINT][,ranks=N][,topic=T][,url=URL]"
                      if core.nats is None else "NAME[:RANKS][,url=URL]")
            return bad(400, f"invalid body: {e}; expected {{\"engine\": \"{syntax}\"}}",
                       "bad_engine")
        try:
            spec = (EngineSpec.parse(body.engine) if core.nats is None
                    else EngineSpec.parse_named(body.engine, "engine"))
            if spec.url is not None and proxy is None:
                raise ValueError("url= given, but this kvwire serve does not proxy (no "
                                 "--engine or --nats-engine had url= at start): route with "
                                 "/route instead")
            old = None
            if kept is not None:
                core.check_unused(spec.name)  # (refused before the file is written)
                old = kept.changes
                if (no := await keep(old.add(spec.name, body.engine))) is not None:
                    return no
            try:
                if proxy is not None:
                    proxy.add_engine(spec)
                else:
                    core.add_engine(spec)
            except Exception:  # (a closed subscriber too: no engine is half added)
                await unkeep(old)
                raise
        except EngineConflict as e:
            return bad(409, str(e), "engine_exists")
        except ValueError as e:
            return bad(400, str(e), "bad_engine")
        except RuntimeError as e:  # the subscriber closed: the router is stopping
            return bad(503, f"engine {spec.name!r} not added, the router is stopping ({e})",
                       "stopping")
        changes.labels("add").inc()
        log.info("engine %s added at run time: %s", spec.name, body.engine)
        return answer({"added": spec.name, "streams": spec.stream_names(),
                       "url": spec.url}, 201)

    @app.delete("/engines/{name}")
    async def remove_engine(request: Request, name: str) -> Response:
        """Stop routing to an engine; requests already sent there run to their end."""
        if (no := refused(request)) is not None:
            return no
        async with lock:
            return await _remove(name)

    async def _remove(name: str) -> Response:
        old = None
        if kept is not None and core.routes_to(name):
            old = kept.changes
            if (no := await keep(old.remove(name))) is not None:
                return no
        if proxy is not None:
            in_flight = proxy.remove_engine(name)
            gone = in_flight is None
        else:
            in_flight, gone = 0, not core.remove_engine(name)
        if gone:  # (never after routes_to(): engines leave only here, under the lock)
            return bad(404, f"no engine named {name[:80]!r} is routed to", "unknown_engine")
        changes.labels("remove").inc()
        log.info("engine %s removed at run time (%d requests in flight there)", name,
                 in_flight)
        return answer({"removed": name, "in_flight": in_flight})
