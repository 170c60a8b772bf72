"""A request's prompt as token ids, computed as the engine will compute them, for routing
by the cache: by a local tokenizer (``--tokenizer DIR|builtin``), by asking an engine's
``/tokenize`` (``--tokenizer engine``), or not at all (no ``--tokenizer``: every request is
routed by load only and the ids are ``()``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from ..http1 import HttpError
from ..http1.client import UpstreamError
from ..index.keys import TokenId
from ..tokenize.content import engine_template_kwargs
from ..tokenize.errors import TokenizerError
from .body import Body, PassBody
from .fleet import Fleet
from .offload import Offload, Partial
from .responses import chat_request

__all__ = ["Tokens"]

_enc = msgspec.json.Encoder()
_IDS = list[TokenId]
#: What tokenizing a request's text raises when the text or template cannot be tokenized
#: (a 400 naming it)
TOKENIZING_ERRORS = (TokenizerError, TypeError, KeyError, AttributeError, ValueError)


def _ids(prompt: list[Any]) -> list[int]:
    """``prompt`` checked as token ids (in C: a 30k-id prompt in a fraction of a
    millisecond, where a Python loop over it took 1.5 ms of the router's loop)."""
    try:
        return msgspec.convert(prompt, _IDS)
    except msgspec.ValidationError as e:
        raise HttpError(400, f"`prompt` token ids must be integers from 0 to 2^32 - 1: {e}",
                        param="prompt") from None


class Tokens:
    """``mode``: ``"local"`` (``tokenizer`` given), ``"engine"`` (an engine's
    ``/tokenize``, given ``timeout`` s) or ``"none"``. Failures the engine would judge
    differently are counted in the fleet's ``counts`` and routed by load."""

    def __init__(self, fleet: Fleet, tokenizer: Any, mode: str, timeout: float,
                 offload: Offload | None = None) -> None:
        self.fleet = fleet
        self.tok = tokenizer
        self.mode = mode
        self.timeout = timeout
        self.observe = fleet.metrics.tokenize.observe
        #: where a long prompt's new text is encoded (off the event loop)
        self.offload = offload or Offload(tokenizer if mode == "local" else None, 0)

    async def prompt(self, req: Body, chat: bool, shed: bool = True,
                     start: bool = False) -> Sequence[int] | Partial:
        """The prompt's token ids as the engine will compute them ([] when unknown: the
        request is routed by load only). A full tokenizer queue is a 429, counted as shed
        unless ``shed`` is false (the caller routes the request by load instead). With
        ``start``, a long prompt's new text may come as a :class:`~.offload.Partial` (its
        start now, to route it on)."""
        prompt = req.prompt
        if not chat:
            if isinstance(prompt, list):
                if not prompt:
                    raise HttpError(400, "`prompt` is empty", param="prompt")
                first = prompt[0]
                if isinstance(first, int) and not isinstance(first, bool):
                    return _ids(prompt)  # token ids: no tokenizing
                if isinstance(first, list):
                    return _ids(first)
                if not isinstance(first, str):
                    raise HttpError(400, "`prompt` must be a string, token ids, or a list "
                                    "of either", param="prompt")
                prompt = first
        if self.mode == "none":
            return ()
        t0 = time.perf_counter()
        if self.mode == "engine":
            toks = await self._engine(req, chat, prompt)
            self.observe(time.perf_counter() - t0)
            return toks
        encode = self.offload.encode_start if start else self.offload.encode
        try:
            if chat:
                text = self.tok.render_engine_chat(  # rendered as the engine renders it
                    req.messages, tools=req.tools,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    reasoning_effort=req.reasoning_effort, documents=req.documents,
                    chat_template_kwargs=req.chat_template_kwargs)
                toks = await encode(text, False, shed)
            else:
                toks = await encode(prompt, req.add_special_tokens, shed)
        except HttpError:
            raise  # the tokenizer's queue is full: 429
        except TOKENIZING_ERRORS as e:
            raise HttpError(400, f"cannot tokenize the request: {e}",
                            param="messages" if chat else "prompt") from None
        self.observe(time.perf_counter() - t0)
        return toks

    async def response(self, body: PassBody) -> Sequence[int]:
        """A ``/v1/responses`` request's token ids, rendered as the chat vLLM makes of it
        (proxy/responses.py); [] (routed by load, counted) when it holds what that does
        not map or cannot be tokenized here: the engine judges it."""
        if self.mode == "none":
            return ()
        conv = chat_request(body.instructions, body.input, body.tools, body.reasoning)
        if conv is not None and (body.chat_template_kwargs is None
                                 or isinstance(body.chat_template_kwargs, dict)):
            try:
                return await self.prompt(Body(
                    model=body.model, messages=conv.messages, tools=conv.tools,
                    add_generation_prompt=not conv.continue_final_message,
                    continue_final_message=conv.continue_final_message,
                    reasoning_effort=conv.reasoning_effort,
                    chat_template_kwargs=body.chat_template_kwargs), True, shed=False)
            except HttpError:  # (a full tokenizer queue too: routed by load, not refused)
                pass
        self.fleet.counts["responses_by_load"] += 1
        return ()

    async def _engine(self, req: Body, chat: bool, prompt: Any) -> Sequence[int]:
        q: dict[str, Any] = {"model": req.model}
        if chat:  # /tokenize takes no effort or documents: they go as template variables
            kw = engine_template_kwargs(req.chat_template_kwargs,
                                        add_generation_prompt=req.add_generation_prompt,
                                        continue_final_message=req.continue_final_message,
                                        reasoning_effort=req.reasoning_effort,
                                        documents=req.documents)
            q.update(messages=req.messages, tools=req.tools)
            # The defaults are left out: vLLM's are the same, and SGLang renders messages
            # "as for a chat completion" only when add_generation_prompt is absent (given,
            # it renders them as given, and only with a jinja template).
            if not kw.pop("add_generation_prompt"):
                q["add_generation_prompt"] = False
            if kw.pop("continue_final_message"):
                q["continue_final_message"] = True
            q["chat_template_kwargs"] = kw or None
        else:
            q.update(prompt=prompt, add_special_tokens=req.add_special_tokens)
        timeout = self.timeout
        for link in self.fleet.links.values():
            if not link.up:
                continue
            try:
                r = await asyncio.wait_for(link.client().request(
                    b"POST", b"/tokenize", [(b"content-type", b"application/json")],
                    _enc.encode(q)), timeout)
                payload = await asyncio.wait_for(r.read(), timeout)
            except (UpstreamError, asyncio.TimeoutError):
                continue
            if r.status == 200:
                try:
                    toks = msgspec.json.decode(payload).get("tokens")
                except (msgspec.DecodeError, AttributeError):
                    toks = None
                if isinstance(toks, list):
                    return toks
            break  # the engine refused it: it will refuse the request too, with reasons
        self.fleet.counts["tokenize_failures"] += 1
        return ()
