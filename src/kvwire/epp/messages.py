"""Envoy's ``ext_proc`` messages (protobuf, from ``xds-protos``) to and from the pure
machine's values (:mod:`.machine`): no gRPC here. Header values come in ``raw_value`` (what
Envoy sends) or ``value``; they go out in ``raw_value``."""

from __future__ import annotations

from typing import Any

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct

from .machine import (
    Answer,
    Phase,
    Refusal,
    RequestBody,
    RequestHeaders,
    RequestTrailers,
    ResponseBody,
    ResponseHeaders,
    ResponseTrailers,
)

__all__ = ["ProcessingRequest", "ProcessingResponse", "decode", "encode", "encode_kept",
           "modes", "serialize"]

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse


def _headers(hm: Any) -> tuple[tuple[str, str], ...]:
    return tuple((h.key, h.raw_value.decode("latin-1") if h.raw_value else h.value)
                 for h in hm.headers)


def _metadata(msg: Any) -> dict[str, Any]:
    if not msg.HasField("metadata_context"):
        return {}
    fm = msg.metadata_context.filter_metadata
    return {ns: MessageToDict(fm[ns]) for ns in fm} if fm else {}


def modes(msg: Any) -> tuple[int, int] | None:
    """The (request, response) body modes of a first message's ``protocol_config``."""
    if not msg.HasField("protocol_config"):
        return None
    pc = msg.protocol_config
    return pc.request_body_mode, pc.response_body_mode


def decode(msg: Any) -> Any:
    """A ``ProcessingRequest`` as the machine's event."""
    kind = msg.WhichOneof("request")
    if kind == "request_headers":
        h = msg.request_headers
        return RequestHeaders(_headers(h.headers), h.end_of_stream, _metadata(msg))
    if kind == "request_body":
        return RequestBody(msg.request_body.body, msg.request_body.end_of_stream)
    if kind == "response_headers":
        h = msg.response_headers
        return ResponseHeaders(_headers(h.headers), h.end_of_stream, _metadata(msg))
    if kind == "response_body":
        return ResponseBody(msg.response_body.body, msg.response_body.end_of_stream)
    if kind == "request_trailers":
        return RequestTrailers()
    if kind == "response_trailers":
        return ResponseTrailers()
    raise ValueError(f"a ProcessingRequest with no request member ({kind!r})")


def _set(headers: tuple[tuple[str, str], ...]) -> list[Any]:
    return [HeaderValueOption(header=HeaderValue(key=k, raw_value=v.encode("latin-1")))
            for k, v in headers]


#: the bytes of answers that recur (a CONTINUE, the pick of one endpoint): most of a light
#: stream's answers are built once
_KEPT: dict[Answer, bytes] = {}
_KEEP = 4096


def serialize(m: Any) -> bytes:
    """The gRPC response serializer: kept bytes as they are, a message encoded."""
    return m if type(m) is bytes else m.SerializeToString()


def encode_kept(a: Answer | Refusal) -> Any:
    """:func:`encode`, from the bytes kept for an answer that recurs (not a body piece)."""
    if type(a) is not Answer or a.streamed:
        return encode(a)
    raw = _KEPT.get(a)
    if raw is None:
        if len(_KEPT) >= _KEEP:
            _KEPT.clear()
        raw = _KEPT[a] = encode(a).SerializeToString()
    return raw


def encode(a: Answer | Refusal) -> Any:
    """The machine's answer as a ``ProcessingResponse``."""
    if isinstance(a, Refusal):
        return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
            status={"code": a.status},
            headers=pb.HeaderMutation(set_headers=_set(
                (("content-type", "application/json"), *a.headers))),
            body=a.body, details=f"kvwire_epp_{a.status}"))
    phase = a.phase
    if phase is Phase.REQUEST_TRAILERS or phase is Phase.RESPONSE_TRAILERS:
        out = pb.ProcessingResponse(**{phase.value: pb.TrailersResponse()})
    else:
        common = pb.CommonResponse()
        if a.set_headers:
            common.header_mutation.set_headers.extend(_set(a.set_headers))
        if a.streamed:
            sr = common.body_mutation.streamed_response
            sr.body = a.body
            sr.end_of_stream = a.end
        wrap = pb.HeadersResponse if phase in (Phase.REQUEST_HEADERS,
                                               Phase.RESPONSE_HEADERS) else pb.BodyResponse
        out = pb.ProcessingResponse(**{phase.value: wrap(response=common)})
    if a.metadata:
        meta: dict[str, dict[str, str]] = {}
        for ns, k, v in a.metadata:
            meta.setdefault(ns, {})[k] = v
        s = Struct()
        s.update(meta)
        out.dynamic_metadata.CopyFrom(s)
    return out
