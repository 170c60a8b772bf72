"""One HTTP request's conversation with Envoy's ``ext_proc`` filter, as a pure state machine
(no gRPC, no protobuf, no asyncio, no clock): :meth:`Stream.receive` takes what one
``ProcessingRequest`` carried and returns a :class:`Step`: the answers to send now, whether
the request is complete and an engine must be picked (:attr:`Step.ask`), and what the load
accounting needs to know (the response's first bytes, its status, its end). The I/O layer
(:mod:`.service`) decodes and encodes the messages (:mod:`.messages`), does the pick
(:mod:`.picker`) and hands the result back with :meth:`Stream.picked` or
:meth:`Stream.refuse`.

What Envoy expects, by the request-body mode its first message announces
(``protocol_config``; the response side likewise):

* ``FULL_DUPLEX_STREAMED`` (the Inference Extension's and llm-d's charts): Envoy sends the
  headers and every body chunk without waiting. Nothing is answered until the body is
  complete (its last chunk, or the trailers); then the headers answer carries the pick and
  the body's ``content-length`` (Envoy drops it in this mode, and Envoy 1.40 drops it again
  after the answer: it also goes as :data:`LENGTH`, which a filter after this one makes
  ``content-length`` again), and the whole body is echoed back in
  ``streamed_response`` pieces of at most :data:`PIECE` bytes, the last one ending the
  stream, then the trailers answer if there were trailers. The response's chunks are each
  echoed as they come (a streamed answer reaches the client chunk by chunk).
* ``BUFFERED`` (and ``BUFFERED_PARTIAL``): Envoy waits for the answer to the headers before it
  sends the body; the headers are answered with CONTINUE, and the answer to the (whole) body
  carries the pick as a header mutation.
* ``NONE``: the request is picked at its headers, by load alone (no prompt to read).
* ``STREAMED``: refused (:class:`Unsupported`): the headers must be answered before the body is
  seen, and the body's answer can no longer set a request header.

A request whose headers end the stream (``GET /v1/models``) is picked at its headers in
every mode. A refusal (:meth:`Stream.refuse`: 400, 429, 503...) is one ``ImmediateResponse``,
after which the stream is over.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any

from ..errors import HttpError

__all__ = ["DESTINATION", "LENGTH", "NAMESPACE", "PIECE", "SERVED", "SUBSET", "SUBSET_NAMESPACE", "Answer",
           "Ask", "Mode", "ProtocolError", "Refusal", "RequestBody", "RequestHeaders",
           "RequestTrailers", "ResponseBody", "ResponseHeaders", "ResponseTrailers", "Step",
           "Stream", "Unsupported"]

#: The header and the ``envoy.lb`` metadata key naming the picked endpoint (``IP:PORT``).
DESTINATION = "x-gateway-destination-endpoint"
#: The dynamic metadata namespace of the pick (Envoy keeps it only where the ext_proc filter's
#: ``metadata_options.receiving_namespaces`` lists it).
NAMESPACE = "envoy.lb"
#: Filter metadata a gateway may send: the endpoints the pick must come from.
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
#: Metadata a gateway may send with the response: the endpoint that served it.
SERVED = "x-gateway-destination-endpoint-served"
#: The request header that carries the body's length past Envoy, which drops content-length
#: in FULL_DUPLEX_STREAMED even when the answer sets it (the printed bootstrap's
#: header_mutation filter makes it content-length again).
LENGTH = "x-kvwire-content-length"
#: The largest body piece echoed in one message (Envoy's default gRPC message limit is 64 KiB
#: for some gateways: this leaves room for the envelope).
PIECE = 62_000

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


class Mode(IntEnum):
    """Envoy's ``ProcessingMode.BodySendMode`` (its numbers)."""

    NONE = 0
    STREAMED = 1
    BUFFERED = 2
    BUFFERED_PARTIAL = 3
    FULL_DUPLEX_STREAMED = 4


class ProtocolError(Exception):
    """A message Envoy should not have sent in this state (the stream is ended with an
    error: Envoy then fails the request, or lets it through with ``failure_mode_allow``)."""


class Unsupported(ProtocolError):
    """A processing mode in which the pick cannot reach Envoy."""


# ---------------------------------------------------------------------------- what comes in


@dataclass(frozen=True, slots=True)
class RequestHeaders:
    """``headers``: (lower-case name, value) in Envoy's order, pseudo-headers included;
    ``metadata``: the filter metadata Envoy forwarded (namespace -> plain dict)."""

    headers: tuple[tuple[str, str], ...]
    end: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestBody:
    data: bytes
    end: bool = False


@dataclass(frozen=True, slots=True)
class RequestTrailers:
    pass


@dataclass(frozen=True, slots=True)
class ResponseHeaders:
    headers: tuple[tuple[str, str], ...]
    end: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ResponseBody:
    data: bytes
    end: bool = False


@dataclass(frozen=True, slots=True)
class ResponseTrailers:
    pass


# ---------------------------------------------------------------------------- what goes out


class Phase(Enum):
    """Which ``ProcessingResponse`` member an answer fills."""

    REQUEST_HEADERS = "request_headers"
    REQUEST_BODY = "request_body"
    REQUEST_TRAILERS = "request_trailers"
    RESPONSE_HEADERS = "response_headers"
    RESPONSE_BODY = "response_body"
    RESPONSE_TRAILERS = "response_trailers"


@dataclass(frozen=True, slots=True)
class Answer:
    """One ``ProcessingResponse``: CONTINUE with ``set_headers``; with ``streamed`` a
    ``streamed_response`` body piece (``body``, ``end``); ``metadata``: dynamic metadata as
    (namespace, key, string value) triples. Hashable: the codec keeps the bytes of answers
    that recur (the same pick, the same CONTINUE)."""

    phase: Phase
    set_headers: tuple[tuple[str, str], ...] = ()
    streamed: bool = False
    body: bytes = b""
    end: bool = False
    metadata: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Refusal:
    """An ``ImmediateResponse``: the client gets ``status`` with ``body`` (JSON)."""

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Ask:
    """A complete request to pick an engine for: ``body`` is None when the request has none
    (or its body is not sent to the picker); ``subset``: the endpoints allowed (None: any)."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes | None
    subset: frozenset[str] | None


@dataclass(slots=True)
class Step:
    """What one message led to. ``answers``: send them, in order. ``ask``: pick now, then
    call :meth:`Stream.picked` or :meth:`Stream.refuse`. ``first_byte``: the response began
    (its prefill is done). ``status``: the response's status, at its headers. ``out_tokens``:
    ``completion_tokens`` seen in the response. ``over``: the response ended."""

    answers: list[Answer | Refusal] = field(default_factory=list)
    ask: Ask | None = None
    first_byte: bool = False
    status: int | None = None
    served: str | None = None
    out_tokens: int | None = None
    over: bool = False


class State(Enum):
    HEADERS = "headers"  # waiting for the request headers
    BODY = "body"  # reading the request body
    PICKING = "picking"  # waiting for picked() / refuse()
    REQUEST_TAIL = "request_tail"  # picked; BUFFERED: the request's trailers may follow
    RESPONSE = "response"  # waiting for the response headers
    RESPONSE_BODY = "response_body"
    DONE = "done"


class Stream:
    """One ``Process`` stream (one HTTP request and its response). ``modes``: the request
    and response body modes when the first message has no ``protocol_config``;
    ``max_body``: a longer request body is refused with 413."""

    def __init__(self, max_body: int = 32 << 20,
                 modes: tuple[Mode, Mode] = (Mode.NONE, Mode.NONE)) -> None:
        self.max_body = max_body
        self.request_mode, self.response_mode = modes
        self.state = State.HEADERS
        self.headers: tuple[tuple[str, str], ...] = ()
        self.subset: frozenset[str] | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.trailers = False  # the request ended with trailers (FULL_DUPLEX_STREAMED)
        self.read_body = False  # the request had a body stage (its headers did not end it)
        self.pick_at: Phase | None = None  # the phase whose answer carries the pick
        self.endpoint: str | None = None
        self.answer_headers: tuple[tuple[str, str], ...] = ()
        self.began = False  # the response's first bytes were reported
        self.tail = b""  # the end of the response seen so far (usage is near the end)

    def configure(self, request_mode: int, response_mode: int) -> None:
        """The first message's ``protocol_config``."""
        self.request_mode, self.response_mode = Mode(request_mode), Mode(response_mode)

    @property
    def done(self) -> bool:
        return self.state is State.DONE

    # ------------------------------------------------------------------ the request

    def receive(self, event: Any) -> Step:
        """One message's content; ProtocolError if it does not fit the state. After a
        refusal Envoy may still deliver messages already under way: they are ignored."""
        if self.state is State.DONE:
            return Step()
        kind = type(event)
        if kind is RequestHeaders:
            return self._request_headers(event)
        if kind is RequestBody:
            return self._request_body(event)
        if kind is RequestTrailers:
            return self._request_trailers()
        if kind is ResponseHeaders:
            return self._response_headers(event)
        if kind is ResponseBody:
            return self._response_body(event)
        if kind is ResponseTrailers:
            return self._response_trailers()
        raise TypeError(f"not a message: {event!r}")

    def _expect(self, *states: State, what: str) -> None:
        if self.state not in states:
            raise ProtocolError(f"{what} while {self.state.value}")

    def _request_headers(self, ev: RequestHeaders) -> Step:
        self._expect(State.HEADERS, what="request headers")
        self.headers = ev.headers
        self.subset = subset_of(ev.metadata)
        if ev.end or self.request_mode is Mode.NONE:
            self.pick_at = Phase.REQUEST_HEADERS
            self.state = State.PICKING
            return Step(ask=self._ask(None))
        if self.request_mode is Mode.STREAMED:
            raise Unsupported("request_body_mode STREAMED: the headers are answered before "
                              "the body is seen, so the pick cannot be set; configure "
                              "FULL_DUPLEX_STREAMED or BUFFERED")
        self.state = State.BODY
        self.read_body = True
        if self.request_mode is Mode.FULL_DUPLEX_STREAMED:
            return Step()  # answered once the body is complete
        self.pick_at = Phase.REQUEST_BODY  # BUFFERED: the headers go on, the body is held
        return Step([Answer(Phase.REQUEST_HEADERS)])

    def _request_body(self, ev: RequestBody) -> Step:
        self._expect(State.BODY, what="a request body chunk")
        self.size += len(ev.data)
        if self.size > self.max_body:
            return Step(self.refuse(413, _error(413, f"request body over {self.max_body} "
                                                "bytes", "body")))
        if ev.data:
            self.chunks.append(ev.data)
        if self.request_mode is Mode.FULL_DUPLEX_STREAMED:
            if not ev.end:
                return Step()
            self.pick_at = Phase.REQUEST_HEADERS
        # BUFFERED: one message holds the whole body (trailers, if any, come after its answer)
        self.state = State.PICKING
        return Step(ask=self._ask(b"".join(self.chunks)))

    def _request_trailers(self) -> Step:
        if self.state is State.REQUEST_TAIL or (self.state is State.RESPONSE
                                                and self.request_mode is not
                                                Mode.FULL_DUPLEX_STREAMED):
            return Step([Answer(Phase.REQUEST_TRAILERS)])
        self._expect(State.BODY, what="request trailers")
        if self.request_mode is not Mode.FULL_DUPLEX_STREAMED:
            raise ProtocolError("request trailers before the body's answer")
        self.trailers = True
        self.pick_at = Phase.REQUEST_HEADERS
        self.state = State.PICKING
        return Step(ask=self._ask(b"".join(self.chunks)))

    def _ask(self, body: bytes | None) -> Ask:
        method = path = ""
        for k, v in self.headers:
            if k == ":method":
                method = v
            elif k == ":path":
                path = v
        return Ask(method, path, self.headers, body, self.subset)

    def picked(self, endpoint: str, extra: tuple[tuple[str, str], ...] = (),
               answer_headers: tuple[tuple[str, str], ...] = ()) -> list[Answer]:
        """The answers that carry the pick (``endpoint``: ``IP:PORT``; ``extra``: more
        request headers to set; ``answer_headers``: headers to set on the answer, when its
        headers come), to send in order."""
        if self.state is not State.PICKING:
            raise ProtocolError(f"picked while {self.state.value}")
        self.endpoint = endpoint
        self.answer_headers = answer_headers
        meta = ((NAMESPACE, DESTINATION, endpoint),)
        pick = ((DESTINATION, endpoint), *extra)
        body = b"".join(self.chunks)
        self.chunks = []
        if self.pick_at is Phase.REQUEST_BODY:  # BUFFERED: the held headers change
            self.state = State.REQUEST_TAIL
            return [Answer(Phase.REQUEST_BODY, set_headers=pick, metadata=meta)]
        self.state = State.RESPONSE
        if self.request_mode is not Mode.FULL_DUPLEX_STREAMED or not self.read_body:
            return [Answer(Phase.REQUEST_HEADERS, set_headers=pick, metadata=meta)]
        # FULL_DUPLEX_STREAMED: Envoy dropped content-length; the body goes back in pieces.
        # The length is set again (a body with trailers stays chunked), and as LENGTH for a
        # filter after this one to restore (Envoy 1.40 drops content-length again)
        length = () if self.trailers else (("content-length", str(len(body))),
                                           (LENGTH, str(len(body))))
        out = [Answer(Phase.REQUEST_HEADERS, set_headers=(*pick, *length), metadata=meta)]
        last = not self.trailers
        for i in range(0, max(len(body), 1), PIECE):
            piece = body[i:i + PIECE]
            out.append(Answer(Phase.REQUEST_BODY, streamed=True, body=piece,
                              end=last and i + PIECE >= len(body)))
        if self.trailers:
            out.append(Answer(Phase.REQUEST_TRAILERS))
        return out

    def refuse(self, status: int, body: bytes,
               headers: tuple[tuple[str, str], ...] = ()) -> list[Refusal]:
        """Answer the client with ``status`` now (before the request went anywhere)."""
        if self.state not in (State.HEADERS, State.BODY, State.PICKING):
            raise ProtocolError(f"a refusal while {self.state.value}")
        self.state = State.DONE
        self.chunks = []
        return [Refusal(status, body, headers)]

    # ------------------------------------------------------------------ the response

    def _response_headers(self, ev: ResponseHeaders) -> Step:
        if self.state is State.REQUEST_TAIL:
            self.state = State.RESPONSE  # (no request trailers came)
        self._expect(State.RESPONSE, what="response headers")
        status = None
        for k, v in ev.headers:
            if k == ":status":
                status = int(v) if v.isdigit() else None
                break
        served = None
        lb = ev.metadata.get(NAMESPACE)
        if isinstance(lb, dict) and isinstance(lb.get(SERVED), str):
            served = lb[SERVED]
        step = Step([Answer(Phase.RESPONSE_HEADERS, set_headers=self.answer_headers)],
                    status=status, served=served)
        if ev.end or self.response_mode is Mode.NONE:
            step.first_byte = self._begin()
        if ev.end:
            self.state = State.DONE
            step.over = True
        else:
            self.state = State.RESPONSE_BODY
        return step

    def _begin(self) -> bool:
        first, self.began = not self.began, True
        return first

    def _response_body(self, ev: ResponseBody) -> Step:
        self._expect(State.RESPONSE_BODY, what="a response body chunk")
        if self.response_mode is Mode.FULL_DUPLEX_STREAMED:
            answer = Answer(Phase.RESPONSE_BODY, streamed=True, body=ev.data, end=ev.end)
        else:
            answer = Answer(Phase.RESPONSE_BODY)
        step = Step([answer], first_byte=self._begin())
        if ev.data:
            self.tail = (self.tail + ev.data)[-4096:]
        if ev.end:
            self.state = State.DONE
            step.over = True
            step.out_tokens = completion_tokens(self.tail)
        return step

    def _response_trailers(self) -> Step:
        self._expect(State.RESPONSE_BODY, what="response trailers")
        self.state = State.DONE
        return Step([Answer(Phase.RESPONSE_TRAILERS)], first_byte=self._begin(), over=True,
                    out_tokens=completion_tokens(self.tail))


def completion_tokens(tail: bytes) -> int | None:
    """The last ``completion_tokens`` in the end of an answer (its ``usage``), or None."""
    found = _COMPLETION_TOKENS.findall(tail)
    return int(found[-1]) if found else None


def subset_of(metadata: dict[str, Any]) -> frozenset[str] | None:
    """The endpoints a gateway allows (``envoy.lb.subset_hint``), or None when it says
    nothing. A list of ``IP:PORT`` or one comma-separated string; empty: none allowed."""
    ns = metadata.get(SUBSET_NAMESPACE)
    if not isinstance(ns, dict) or SUBSET not in ns:
        return None
    raw = ns[SUBSET]
    items = raw if isinstance(raw, list) else [raw]
    out = set()
    for item in items:
        if isinstance(item, str):
            out.update(p.strip() for p in item.split(",") if p.strip())
    return frozenset(out)


def _error(status: int, message: str, param: str | None = None) -> bytes:
    return HttpError(status, message, param=param).openai()
