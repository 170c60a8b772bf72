"""What the proxy reads of a request's JSON body: the few fields routing needs (the body
itself is forwarded unchanged). Decoding errors become kvwire's one HTTP error, 400, with
the field at fault as ``param`` (OpenAI's error shape)."""

from __future__ import annotations

from typing import Any

import msgspec

from ..http1 import HttpError

__all__ = ["NO_BODY", "Body", "PassBody", "body_dec", "decode", "generation", "pass_dec",
           "passthrough"]


class Body(msgspec.Struct):
    """The fields of a generation request the proxy reads (others are ignored here and
    forwarded untouched)."""

    model: str | None = None
    prompt: str | list[Any] | None = None
    messages: list[dict[str, Any]] | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None
    documents: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    cache_salt: str | None = None


body_dec = msgspec.json.Decoder(Body)


class PassBody(msgspec.Struct):
    """What the proxy reads of a pass-through request (``handler.PASS``): which engines
    serve its model, and whether the answer streams."""

    model: str | None = None
    stream: bool | None = False
    cache_salt: str | None = None
    previous_response_id: str | None = None  # /v1/responses: goes where that response is
    # /v1/responses without one: routed by the cache as the chat it renders to
    instructions: Any = None
    input: Any = None
    tools: Any = None
    reasoning: Any = None
    chat_template_kwargs: Any = None


pass_dec = msgspec.json.Decoder(PassBody)

#: what a request with no body of its own (``GET /v1/responses/{id}``) reads as
NO_BODY = PassBody()


def decode(dec: msgspec.json.Decoder, body: bytes) -> Any:
    try:
        return dec.decode(body)
    except msgspec.ValidationError as e:
        msg = str(e)
        param = msg.rsplit("at `$.", 1)[-1].rstrip("`") if "at `$." in msg else None
        raise HttpError(400, f"invalid request body: {msg}", param=param) from None
    except msgspec.DecodeError as e:
        raise HttpError(400, f"malformed JSON body: {e}", param="body") from None


def generation(body: bytes, chat: bool) -> Body:
    """A completion (``chat`` false) or chat request's body, with the field it needs."""
    req = decode(body_dec, body)
    if chat and req.messages is None:
        raise HttpError(400, "`messages` is required", param="messages")
    if not chat and req.prompt is None:
        raise HttpError(400, "`prompt` is required", param="prompt")
    return req


def passthrough(body: bytes) -> PassBody:
    """A pass-through body: a JSON object; the rest is the engine's to judge (its errors
    pass through with their status)."""
    return decode(pass_dec, body)
