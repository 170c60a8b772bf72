"""Engines added and removed while ``kvwire serve`` runs (``POST /engines``,
``DELETE /engines/{name}``): a fleet that scales, or an engine drained for maintenance,
without restarting the router and losing its index. With ``--nats`` too: there the engine
is named (``NAME[:RANKS][,url=URL]``), and its streams already come from JetStream.

Off unless the server has an admin token (``kvwire serve --admin-token`` or
``KVWIRE_ADMIN_TOKEN``): an engine added here receives the clients' requests, headers
(``authorization`` included) and prompts, so only someone holding the token may add one.
Every answer is JSON; every refusal says why and is counted in
``kvwire_router_bad_requests_total{reason}`` with the other bad requests. With
``--engines-file`` the changes outlive a restart (:mod:`~kvwire.serve.engines_file`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Annotated, Any

import msgspec
from prometheus_client import Counter

from ..consume.engine_spec import EngineSpec
from ..http1 import HttpError
from ..http1.server import Request, Routes
from ..routing.core import EngineConflict, RouterCore
from .engines_file import EngineChanges, EnginesFile

__all__ = ["TOKEN_ENV", "add_membership_routes"]

log = logging.getLogger("kvwire.serve.admin")

#: The environment variable ``kvwire serve`` reads the admin token from (kept off the
#: command line, where any user of the host can read it).
TOKEN_ENV = "KVWIRE_ADMIN_TOKEN"


class AddBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /engines``: the engine in ``--engine``'s syntax."""

    engine: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


_add_dec = msgspec.json.Decoder(AddBody)
_enc = msgspec.json.Encoder()


def add_membership_routes(app: Routes, core: RouterCore, proxy: Any, token: str | None,
                          kept: EnginesFile | None = None) -> None:
    """Register the two admin routes on ``app`` (whose ``metrics.registry`` takes their
    counter). A refusal is an :class:`~kvwire.http1.HttpError`, answered and counted as the
    app's other bad requests are. With ``kept`` (``--engines-file``) each change is written
    there before it is made: one that cannot be written is refused (507) and nothing
    changes."""
    changes = Counter("kvwire_router_engine_changes", "Engines added and removed at run "
                      "time (POST/DELETE /engines)", ["op"],
                      registry=app.metrics.registry)  # type: ignore[attr-defined]
    want = token.encode() if token else None

    def check(request: Request) -> None:
        if want is None:
            raise HttpError(403, "changing engines at run time is off: start kvwire serve "
                            f"with --admin-token (or {TOKEN_ENV}) to allow it", "admin_off")
        got = (request.header(b"authorization") or b"").decode("latin-1")
        scheme, _, value = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), want):
            raise HttpError(401, "this needs the admin token: Authorization: Bearer TOKEN",
                            "admin_token")

    # With a file, each change is written (fsync included) in a thread, so the requests in
    # flight on this loop do not wait for the disk; the lock keeps one change at a time
    # between its checks, its write and its making.
    lock = asyncio.Lock()

    async def keep(new: EngineChanges) -> None:
        """Write the changes to come; HttpError 507 if they cannot be written."""
        assert kept is not None
        try:
            await asyncio.to_thread(kept.commit, new)
        except OSError as e:
            raise HttpError(507, f"engines file {kept.path} could not be written ({e}): "
                            "nothing changed", "engines_file") from None

    async def unkeep(old: EngineChanges | None) -> None:
        """A change written but not made after all: the file says what is true again."""
        if kept is None or old is None:
            return
        try:
            await asyncio.to_thread(kept.commit, old)
        except OSError as e:
            log.error("engines file %s could not be written back (%s): it names a change "
                      "that was not made", kept.path, e)

    @app.route("POST", "/engines")
    async def add_engine(request: Request) -> None:
        """Route to one more engine: ``{"engine": "NAME=EVENTS[,replay=..][,url=..]"}``
        (with ``--nats``: ``"NAME[:RANKS][,url=URL]"``, ``--nats-engine``'s syntax)."""
        check(request)
        async with lock:
            await _add(request, request.body)

    async def _add(request: Request, raw: bytes) -> None:
        try:
            body = _add_dec.decode(raw)
        except msgspec.DecodeError as e:  # (ValidationError included)
            syntax = ("NAME=ENDPOINT[,replay=ENDPOINT][,ranks=N][,topic=T][,url=URL]"
                      if core.nats is None else "NAME[:RANKS][,url=URL]")
            raise HttpError(400, f"invalid body: {e}; expected {{\"engine\": \"{syntax}\"}}",
                            "bad_engine") from None
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
                await keep(old.add(spec.name, body.engine))
            try:
                if proxy is not None:
                    proxy.add_engine(spec)
                else:
                    core.add_engine(spec)
            except Exception:  # (a closed subscriber too: no engine is half added)
                await unkeep(old)
                raise
        except EngineConflict as e:
            raise HttpError(409, str(e), "engine_exists") from None
        except HttpError:
            raise
        except ValueError as e:
            raise HttpError(400, str(e), "bad_engine") from None
        except RuntimeError as e:  # the subscriber closed: the router is stopping
            raise HttpError(503, f"engine {spec.name!r} not added, the router is stopping "
                            f"({e})", "stopping") from None
        changes.labels("add").inc()
        log.info("engine %s added at run time: %s", spec.name, body.engine)
        request.respond(201, _enc.encode({"added": spec.name, "streams": spec.stream_names(),
                                          "url": spec.url}))

    @app.route("DELETE", "/engines/{name}")
    async def remove_engine(request: Request) -> None:
        """Stop routing to an engine; requests already sent there run to their end."""
        check(request)
        async with lock:
            await _remove(request, (request.params or {})["name"])

    async def _remove(request: Request, name: str) -> None:
        old = None
        if kept is not None and core.routes_to(name):
            old = kept.changes
            await keep(old.remove(name))
        if proxy is not None:
            in_flight = proxy.remove_engine(name)
            gone = in_flight is None
        else:
            in_flight, gone = 0, not core.remove_engine(name)
        if gone:  # (never after routes_to(): engines leave only here, under the lock)
            raise HttpError(404, f"no engine named {name[:80]!r} is routed to",
                            "unknown_engine")
        changes.labels("remove").inc()
        log.info("engine %s removed at run time (%d requests in flight there)", name,
                 in_flight)
        request.respond(200, _enc.encode({"removed": name, "in_flight": in_flight}))
