"""Where a request goes, decided as ``kvwire serve``'s proxy decides it (no gRPC here): the
body's routing fields and prompt tokens (the proxy's :mod:`~kvwire.proxy.body` and
:class:`~kvwire.proxy.tokens.Tokens`), the engines the proxy's
:class:`~kvwire.proxy.fleet.Fleet` says are usable (health probes, breakers, models), and
:meth:`RouterCore.route_proxy <kvwire.routing.core.RouterCore.route_proxy>` among them,
which reserves the request's load (a long prompt with much new text is picked on its
start, :mod:`~kvwire.proxy.start`, its rest tokenized while the engine works). The
reservation then follows the answer through Envoy: :meth:`Picker.first_byte` drops its
prefill share, :meth:`Picker.end` releases it, on every path (an answer that ends, fails,
or a stream that Envoy resets).

Everything runs on the serving event loop (the fleet's counters are that loop's)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import HttpError
from ..proxy.body import generation, passthrough
from ..proxy.decisions import Lifecycle
from ..proxy.fleet import Fleet, Link
from ..proxy.handler import PASS, PATHS
from ..proxy.offload import Partial
from ..proxy.start import route_on_start
from ..proxy.tokens import Tokens
from ..routing.core import RouterCore
from .machine import Ask

__all__ = ["Picker", "Ticket", "endpoint_of"]

_RESPONSES = "/v1/responses"


@dataclass(slots=True)
class Ticket:
    """One picked request: its engine, the ``IP:PORT`` Envoy connects to, its load."""

    engine: str
    endpoint: str
    lc: Lifecycle
    status: int | None = None


def endpoint_of(link: Link) -> str:
    """``IP:PORT`` of an engine's ``url=`` (Envoy's ORIGINAL_DST cluster takes an address,
    not a name: a host name is resolved here, once per URL)."""
    host = link.host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = ipaddress.ip_address(socket.gethostbyname(host))
    return f"[{ip}]:{link.port}" if ip.version == 6 else f"{ip}:{link.port}"


class Picker:
    """The pick of each request and its load's lifecycle, over the proxy's fleet and
    tokens and the routing core. ``max_in_flight``: requests being answered at once (0: no
    limit); past it :meth:`full` is true and the request is refused with 429."""

    def __init__(self, core: RouterCore, fleet: Fleet, tokens: Tokens,
                 max_in_flight: int = 4096) -> None:
        self.core = core
        self.fleet = fleet
        self.tokens = tokens
        self.max_in_flight = max_in_flight
        self._endpoints: dict[tuple[str, str], str] = {}  # (engine, url) -> IP:PORT

    # ------------------------------------------------------------------ admission

    def full(self) -> bool:
        cap = self.max_in_flight
        return bool(cap) and self.fleet.active >= cap

    def began(self) -> None:
        """A request arrived (its stream's first message): one more active."""
        self.fleet.began()

    def ended(self, ticket: Ticket | None) -> None:
        """Its stream is over, however it ended: the load is released if it was not."""
        if ticket is not None:
            self.end(ticket, None)
        self.fleet.ended()

    # ------------------------------------------------------------------ the pick

    def endpoint(self, link: Link) -> str:
        key = (link.name, link.url)
        ep = self._endpoints.get(key)
        if ep is None:
            ep = self._endpoints[key] = endpoint_of(link)
        return ep

    async def pick(self, ask: Ask) -> Ticket:
        """Choose the engine for ``ask`` and reserve its load; HttpError (400 unparseable
        body, 404 unknown model, 503 no engine, ...) when it cannot go anywhere."""
        fleet = self.fleet
        path = ask.path.partition("?")[0]
        chat = PATHS.get(path.encode("latin-1"))
        tokens: Sequence[int] = ()
        model = salt = None
        if ask.body is not None and ask.method == "POST" and chat is not None:
            body = generation(ask.body, chat)
            model, salt = body.model, body.cache_salt
            self.fleet.check_model(model)
            tokens = await self.tokens.prompt(body, chat, start=True)
        elif ask.body is not None and ask.method == "POST" and path.encode() in PASS:
            pbody = passthrough(ask.body)
            model, salt = pbody.model, pbody.cache_salt
            self.fleet.check_model(model)
            if path == _RESPONSES and not pbody.previous_response_id:
                tokens = await self.tokens.response(pbody)
        usable = fleet.usable(model, set())
        if ask.subset is not None:
            usable = {n for n in usable if self.endpoint(fleet.links[n]) in ask.subset}
            if not usable:
                raise HttpError(503, "no engine of the gateway's subset "
                                f"({', '.join(sorted(ask.subset)) or 'empty'}) is available",
                                type="ServiceUnavailable")
        if not usable:
            raise HttpError(503, "no engine is available (all down)", type="ServiceUnavailable")
        known = fleet.known_models()
        lora = model if model is not None and known.get(model) else None
        if type(tokens) is Partial:  # a long prompt: picked on its start
            routed, _ = await route_on_start(self.core, fleet.counts, tokens, lora, salt,
                                             usable.__contains__, fleet.up)
        else:
            routed = self.core.route_proxy(tokens, lora, salt, usable.__contains__,
                                           fleet.up)
        name = routed.engine
        fleet.sending(name)
        return Ticket(name, self.endpoint(fleet.links[name]),
                      Lifecycle(routed.request_id, routed.prefill))

    # ------------------------------------------------------------------ the answer

    def answered(self, ticket: Ticket, status: int | None) -> None:
        """The engine's (or Envoy's) response headers: counted; a 5xx opens the engine's
        breaker as a failed attempt of the proxy's does."""
        if status is None:
            return
        ticket.status = status
        self.fleet.requests[ticket.engine, status] += 1
        if status >= 500:
            self.fleet.failed(ticket.engine)

    def first_byte(self, ticket: Ticket) -> None:
        """The answer began: the prompt is computed, its prefill share is dropped."""
        drop = ticket.lc.first_token()
        if drop:
            self.core.first_token(ticket.lc.request_id, drop)

    def end(self, ticket: Ticket, out_tokens: int | None) -> None:
        """The answer ended (or failed, or its stream was reset): the load is released,
        once."""
        if ticket.lc.end():
            self.core.finish(ticket.lc.request_id, out_tokens)
            self.fleet.settled(ticket.engine)
