"""OpenAI/vLLM request and response shapes for ``kvwire engine`` (pure: bytes in, bytes out).

Requests are decoded with msgspec in one pass and checked the way vLLM checks them; every
problem is an :class:`~kvwire.http1.HttpError` carrying vLLM's status and OpenAI's error object, so the
HTTP layer never answers 500 for a client's mistake. Responses are built as bytes: the
streamed chunks from per-request templates (one ``json`` encode of the new text per chunk),
which is what keeps a streamed token cheap.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from ...http1 import HttpError

__all__ = [
    "ApiError", "ChatRequest", "CompletionRequest", "DetokenizeRequest", "StreamOptions",
    "TokenizeRequest", "decode_request", "error_body", "prompt_inputs",
    "KVTransferParams", "Bootstrap", "transfer_params", "bootstrap_params",
]

_json_encode = msgspec.json.Encoder().encode


def ApiError(status: int, message: str, type: str = "BadRequestError",  # noqa: N802
             param: str | None = None) -> HttpError:
    """A request vLLM would refuse: the :class:`~kvwire.http1.HttpError` of ``status`` with
    the ``error`` object vLLM answers with (``type``, ``param``)."""
    return HttpError(status, message, type=type, param=param)


def error_body(status: int, message: str, type: str, param: str | None = None) -> bytes:
    """vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``."""
    return _json_encode({"error": {"message": message, "type": type, "param": param,
                                   "code": status}})


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _Common(msgspec.Struct, kw_only=True):
    """Fields both generation endpoints take (unknown fields are ignored, as vLLM does)."""

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    n: int = 1
    #: kvwire's addition: put the model's own timings in the response (``"kvwire"`` key)
    kvwire_timing: bool = False
    #: vLLM's P/D protocol (NixlConnector): checked by :func:`transfer_params`
    kv_transfer_params: Any = None
    #: SGLang's P/D protocol: one value, or one per prompt (:func:`bootstrap_params`)
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]
    add_special_tokens: bool = True
    echo: bool = False


class ChatRequest(_Common, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


_decoders: dict[type, msgspec.json.Decoder] = {}


def decode_request(body: bytes, kind: type) -> Any:
    """Decode and type-check a JSON body; ApiError 400 naming the field otherwise."""
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        req = dec.decode(body)
    except msgspec.ValidationError as e:
        msg = str(e)
        param = msg.rsplit("at `$.", 1)[-1].rstrip("`") if "at `$." in msg else None
        raise ApiError(400, f"1 validation error:\n  {msg}", "Bad Request", param) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"1 validation error:\n  JSON decode error: {e}", "Bad Request",
                       "body") from None
    if isinstance(req, _Common):
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.",
                           param="stream_options")
        if req.n != 1:
            raise ApiError(400, f"n must be 1 in kvwire engine, got {req.n}.", param="n")
        mt = getattr(req, "max_completion_tokens", None)
        if mt is not None and req.max_tokens is None:
            req.max_tokens = mt
        if req.max_tokens is not None and req.max_tokens < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {req.max_tokens}.",
                           param="max_tokens")
    return req


class KVTransferParams(msgspec.Struct, kw_only=True):
    """vLLM's ``kv_transfer_params`` (NixlConnector), as a request carries them: the
    prefill side gets ``do_remote_decode``, the decode side ``do_remote_prefill`` and where
    the prompt's blocks are held (unknown fields are ignored, as vLLM ignores them)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_num_tokens: int | None = None
    remote_blocks_expiry_time: float | None = None
    tp_size: int = 1
    transfer_mode: str | None = None
    dcp_size: int = 1
    pp_size: int = 1


def _bad_kv(field: str, why: str) -> HttpError:
    return ApiError(400, f"kv_transfer_params.{field}: {why}", param=f"kv_transfer_params.{field}")


def transfer_params(raw: Any) -> KVTransferParams | None:
    """A request's ``kv_transfer_params`` checked (None: the field is absent or null, or
    asks for neither side); ApiError 400 naming the field that is wrong otherwise."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ApiError(400, "kv_transfer_params: expected an object, got "
                       f"{type(raw).__name__}", param="kv_transfer_params")
    try:
        kv = msgspec.convert(raw, KVTransferParams)
    except msgspec.ValidationError as e:
        msg = str(e)
        field = msg.rsplit("at `$.", 1)[-1].rstrip("`") if "at `$." in msg else ""
        raise ApiError(400, f"kv_transfer_params: {msg}",
                       param="kv_transfer_params" + (f".{field}" if field else "")) from None
    if kv.do_remote_decode and kv.do_remote_prefill:
        raise _bad_kv("do_remote_prefill", "cannot be true with do_remote_decode")
    if kv.do_remote_prefill:
        for name in ("remote_host", "remote_port", "remote_request_id", "remote_block_ids"):
            if getattr(kv, name) is None:
                raise _bad_kv(name, "required with do_remote_prefill")
        if not 0 < kv.remote_port < 65536:  # type: ignore[operator]
            raise _bad_kv("remote_port", f"not a port: {kv.remote_port}")
        if any(b < 0 for b in kv.remote_block_ids):  # type: ignore[union-attr]
            raise _bad_kv("remote_block_ids", "block ids are >= 0")
        if kv.tp_size != 1 or kv.pp_size != 1 or kv.dcp_size != 1:
            raise _bad_kv("tp_size", "kvwire engines pull from a remote tp/pp/dcp size of 1")
    if not (kv.do_remote_decode or kv.do_remote_prefill):
        return None
    return kv


class Bootstrap(msgspec.Struct, frozen=True):
    """One prompt's SGLang bootstrap: where the prefill engine's bootstrap server is, and
    the room that names this prompt on both engines."""

    host: str
    port: int
    room: int


def _each(value: Any, n: int, name: str, kind: type) -> list[Any]:
    vals = value if isinstance(value, list) else [value] * n
    if len(vals) != n:
        raise ApiError(400, f"{name}: {len(vals)} values for {n} prompts", param=name)
    for v in vals:
        if not isinstance(v, kind) or isinstance(v, bool):
            raise ApiError(400, f"{name}: expected {kind.__name__}, got {type(v).__name__}",
                           param=name)
    return vals


def bootstrap_params(req: Any, n: int) -> list[Bootstrap] | None:
    """SGLang's ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` for ``n`` prompts
    (a value each, or one for all; rooms are integers in [0, 2^63)), or None when absent;
    ApiError 400 naming the field otherwise."""
    if req.bootstrap_room is None and req.bootstrap_host is None:
        return None
    for name in ("bootstrap_host", "bootstrap_room"):
        if getattr(req, name) is None:
            raise ApiError(400, f"{name}: required with the other bootstrap fields", param=name)
    hosts = _each(req.bootstrap_host, n, "bootstrap_host", str)
    ports = _each(8998 if req.bootstrap_port is None else req.bootstrap_port, n,
                  "bootstrap_port", int)
    rooms = _each(req.bootstrap_room, n, "bootstrap_room", int)
    for p in ports:
        if not 0 < p < 65536:
            raise ApiError(400, f"bootstrap_port: not a port: {p}", param="bootstrap_port")
    for r in rooms:
        if not 0 <= r < 1 << 63:
            raise ApiError(400, f"bootstrap_room: {r} is not in [0, 2^63)",
                           param="bootstrap_room")
    if n > 1 and len(set(rooms)) != n:
        raise ApiError(400, "bootstrap_room: one room per prompt", param="bootstrap_room")
    return [Bootstrap(h, p, r) for h, p, r in zip(hosts, ports, rooms)]


def prompt_inputs(prompt: str | list[Any]) -> list[str | list[int]]:
    """The prompts of a completion: text, token ids, or a list of either (vLLM's forms)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty.", param="prompt")
    first = prompt[0]
    try:
        if type(first) is int:
            return [msgspec.convert(prompt, list[int])]
        if isinstance(first, str):
            return list(msgspec.convert(prompt, list[str]))
        if isinstance(first, list):
            return list(msgspec.convert(prompt, list[list[int]]))
    except msgspec.ValidationError as e:
        raise ApiError(400, f"prompt: {e}", param="prompt") from None
    raise ApiError(400, "prompt must be a string, a list of token ids, or a list of either "
                   f"(got a list of {type(first).__name__}).", param="prompt")


# --------------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Shape:
    """How one request's responses look: completion or chat, ids, model; builds the bytes."""

    __slots__ = ("chat", "rid", "created", "model", "_head", "_tail")

    def __init__(self, chat: bool, rid: str, model: str) -> None:
        self.chat = chat
        self.rid = rid
        self.created = int(time.time())
        self.model = model
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = (b'data: {"id":' + _json_encode(rid) + b',"object":"' + obj.encode()
                      + b'","created":' + str(self.created).encode() + b',"model":'
                      + _json_encode(model) + b',"choices":[{"index":')
        self._tail = b',"logprobs":null,"finish_reason":null' \
            + (b'' if chat else b',"stop_reason":null') + b'}]}\n\n'

    def chunk(self, index: int, text: str, first: bool = False) -> bytes:
        """One streamed chunk with new text (chat: the first also carries the role)."""
        if self.chat:
            delta = b'"role":"assistant","content":' if first else b'"content":'
            return (self._head + str(index).encode() + b',"delta":{' + delta
                    + _json_encode(text) + b'}' + self._tail)
        return self._head + str(index).encode() + b',"text":' + _json_encode(text) + self._tail

    def _base(self) -> dict[str, Any]:
        return {"id": self.rid,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model}

    def final_chunk(self, index: int, text: str, finish_reason: str,
                    extra: dict | None = None, top: dict | None = None) -> bytes:
        """The chunk that ends a choice: its last text and its ``finish_reason``."""
        d = self._base()
        if self.chat:
            choice = {"index": index, "delta": {"content": text} if text else {},
                      "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        else:
            choice = {"index": index, "text": text, "logprobs": None,
                      "finish_reason": finish_reason, "stop_reason": None}
        d["choices"] = [choice]
        if extra:
            d["kvwire"] = extra
        if top:
            d.update(top)
        return b"data: " + _json_encode(d) + b"\n\n"

    def usage_chunk(self, u: dict[str, Any]) -> bytes:
        d = self._base()
        d["choices"] = []
        d["usage"] = u
        return b"data: " + _json_encode(d) + b"\n\n"

    def full(self, choices: list[tuple[str, str]], u: dict[str, Any],
             extra: list[dict] | None = None, top: dict | None = None) -> bytes:
        """The non-streamed response: ``choices`` as (text, finish_reason) per index;
        ``top``: top-level fields beside them (vLLM's ``kv_transfer_params``)."""
        d = self._base()
        d["object"] = "chat.completion" if self.chat else "text_completion"
        out = []
        for i, (text, reason) in enumerate(choices):
            if self.chat:
                out.append({"index": i, "message": {"role": "assistant", "content": text,
                                                    "tool_calls": []},
                            "logprobs": None, "finish_reason": reason, "stop_reason": None})
            else:
                out.append({"index": i, "text": text, "logprobs": None, "finish_reason": reason,
                            "stop_reason": None, "prompt_logprobs": None})
        d["choices"] = out
        d["usage"] = u
        if extra:
            d["kvwire"] = extra
        if top:
            d.update(top)
        return _json_encode(d)


DONE = b"data: [DONE]\n\n"
