"""The gRPC face of the endpoint picker, on kvwire's own HTTP/2 gRPC server
(:mod:`kvwire.h2.grpc`: grpc.aio's stack cost more CPU per stream than the whole decision)
and the serving event loop: Envoy's
``envoy.service.ext_proc.v3.ExternalProcessor/Process`` (one bidirectional stream per HTTP
request, driven through the pure :class:`~.machine.Stream` and the :class:`~.picker.Picker`)
and ``grpc.health.v1.Health/Check`` on the same port: the services ``""`` and ``liveness``
(the process answers), ``readiness`` and the ext_proc service's name (every engine probed
once: a pick is then meaningful; Envoy's health check asks for the latter).

A stream Envoy resets (the client went away, the request ended) cancels its handler; its
``finally`` releases the request's load, so no reservation outlives its stream."""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..errors import HttpError
from ..h2.grpc import Server, StatusCode, stream_stream, unary_unary
from . import messages
from .machine import ProtocolError, Stream, Unsupported
from .metrics import EppMetrics
from .picker import Picker, Ticket

__all__ = ["EXT_PROC", "HEALTH", "Service"]

log = logging.getLogger("kvwire.epp")

EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH = "grpc.health.v1.Health"
_SERVING, _NOT_SERVING = 1, 2  # grpc.health.v1.HealthCheckResponse.ServingStatus


def _service_name(raw: bytes) -> str:
    """``HealthCheckRequest.service`` (field 1, a string) from its wire bytes."""
    i = 0
    while i < len(raw):
        tag = raw[i]
        i += 1
        n = shift = 0
        while True:  # a varint: the length (wire type 2) or the value (wire type 0)
            b = raw[i]
            i += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if tag & 7 == 2:
            if tag >> 3 == 1:
                return raw[i:i + n].decode()
            i += n
        elif tag & 7 != 0:
            raise ValueError("not a HealthCheckRequest")
    return ""


class Service:
    """The ext_proc and health services over one :class:`Picker`. ``ready()``: whether
    the picker can decide (readiness); ``max_body``: a longer request body is refused with
    413; ``counts``: what happened to the streams (``/metrics`` reads them through the
    fleet's counters)."""

    def __init__(self, picker: Picker, ready: Callable[[], bool], max_body: int = 32 << 20
                 ) -> None:
        self.picker = picker
        self.ready = ready
        self.max_body = max_body
        self.counts = picker.fleet.counts
        self.metrics = EppMetrics(self.counts)
        self.server: Any = None
        self.port: int | None = None

    # ------------------------------------------------------------------ ext_proc

    async def process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        """One ``Process`` stream: one HTTP request and its answer."""
        picker = self.picker
        counts = self.counts
        encode = messages.encode_kept
        stream = Stream(self.max_body)
        ticket: Ticket | None = None
        first = True
        counted = False  # (a request refused at once was never active)
        sent = received = 0
        observe = self.metrics.pick.observe
        counts["epp_streams"] += 1
        try:
            async for msg in requests:
                received += 1
                if first:
                    first = False
                    m = messages.modes(msg)
                    if m is not None:
                        stream.configure(*m)
                    if picker.full():  # refused whole, before any work: the client retries
                        e = picker.fleet.overloaded("kvwire epp")
                        for a in stream.refuse(e.status, e.openai(), _str_headers(e)):
                            sent += 1
                            yield encode(a)
                        return
                    picker.began()
                    counted = True
                try:
                    step = stream.receive(messages.decode(msg))
                except Unsupported as e:
                    if not counts["epp_unsupported"]:  # (once: each stream would say it)
                        log.error("%s", e)
                    counts["epp_unsupported"] += 1
                    await context.abort(StatusCode.INVALID_ARGUMENT, str(e))
                    return
                except (ProtocolError, ValueError) as e:
                    counts["epp_protocol_errors"] += 1
                    await context.abort(StatusCode.FAILED_PRECONDITION, str(e))
                    return
                for a in step.answers:
                    sent += 1
                    yield encode(a)
                if step.ask is not None:
                    t0 = time.perf_counter()
                    try:
                        ticket = await picker.pick(step.ask)
                    except HttpError as e:
                        picker.fleet.refused(e)
                        for a in stream.refuse(e.status, e.openai(), _str_headers(e)):
                            sent += 1
                            yield encode(a)
                        return
                    observe(time.perf_counter() - t0)
                    for a in stream.picked(ticket.endpoint, answer_headers=(
                            ("x-kvwire-engine", ticket.engine),)):
                        sent += 1
                        yield encode(a)
                    continue
                if ticket is None:
                    if stream.done:  # refused (413): Envoy ends the stream
                        return
                    continue
                if step.status is not None:
                    picker.answered(ticket, step.status)
                    if step.served is not None:
                        counts["epp_served_reported"] += 1
                        if step.served != ticket.endpoint:
                            counts["epp_served_elsewhere"] += 1
                if step.first_byte:
                    picker.first_byte(ticket)
                if step.over:
                    picker.end(ticket, step.out_tokens)
                if stream.done:
                    return
        finally:
            counts["epp_messages_in"] += received
            counts["epp_messages_out"] += sent
            if not stream.done:  # reset by Envoy (the client went away), or an answer
                counts["epp_streams_cut"] += 1  # whose end is not sent here (mode NONE)
            if counted:
                picker.ended(ticket)

    # ------------------------------------------------------------------ health

    async def check(self, raw: bytes, context: Any) -> bytes:
        try:
            name = _service_name(raw)
        except (ValueError, IndexError, UnicodeDecodeError):
            await context.abort(StatusCode.INVALID_ARGUMENT, "not a HealthCheckRequest")
        if name in ("", "liveness"):
            status = _SERVING
        elif name in ("readiness", EXT_PROC):
            status = _SERVING if self.ready() else _NOT_SERVING
        else:
            await context.abort(StatusCode.NOT_FOUND, f"unknown service {name!r}")
        return bytes((0x08, status))

    # ------------------------------------------------------------------ the server

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        """Listen on ``host:port`` (0: any free port) on the running loop; the port. ``tls``:
        serve over TLS (:func:`kvwire.h2.grpc.context` makes one from PEM files)."""
        server = Server({
            f"/{EXT_PROC}/Process": stream_stream(
                self.process, messages.ProcessingRequest.FromString, messages.serialize),
            f"/{HEALTH}/Check": unary_unary(self.check),
        }, max_message=64 << 20)
        try:
            bound = await server.start(host, port, tls)
        except OSError:
            addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            raise OSError(f"cannot listen on {addr} (gRPC): in use or not an address here"
                          ) from None
        self.server, self.port = server, bound
        return bound

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving (GOAWAY): streams under way get ``grace`` seconds (None: cut now)."""
        if self.server is not None:
            server, self.server = self.server, None
            await server.stop(grace)


def _str_headers(e: HttpError) -> tuple[tuple[str, str], ...]:
    return tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in e.headers)
