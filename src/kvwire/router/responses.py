"""Which engine holds which stored response (OpenAI's Responses API, as vLLM serves it).

vLLM keeps a response it produced (``store``) in that server's memory: a later
``POST /v1/responses`` with ``previous_response_id`` continues the conversation only
there, and ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``,
``GET /v1/responses/{id}/input_items`` and ``DELETE /v1/responses/{id}`` find the response
only there. Routed by load, most of them would reach an engine that answers 404. So the
proxy learns each response's id from the answer that created it (the first
``"id": "resp_..."`` of the body or stream: the response object's own id, which both
vLLM and OpenAI write before its items) and sends what names the id to that engine. The
table is bounded (least recently used forgotten first); an id it does not know (the
proxy restarted, or forgot it) is looked for on each engine in turn, and the one that
does not answer 404 is remembered.

A request that starts a conversation (no ``previous_response_id``) is routed by the cache
like a chat request: :func:`chat_request` turns it into the chat messages and tools that
vLLM renders it as (``instructions`` as the system message, then the input items), so the
proxy tokenizes it with the same chat template.

No I/O here: the proxy (router/forward.py) feeds it what it reads and asks it where to go.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

from ..tokenize.content import TEXT_PARTS

__all__ = ["PREFIX", "RESPONSE_ID", "SCAN_LIMIT", "ResponseOwners", "addressed",
           "chat_request"]

PREFIX = b"/v1/responses/"
#: A response object's id as it appears in an answer (the first one is the response's own).
RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"\\]{1,256})"')
#: How far into an answer the id is looked for (it comes in the first event or field).
SCAN_LIMIT = 64 << 10
#: What may follow ``/v1/responses/{id}``.
_SUFFIXES = (b"", b"/cancel", b"/input_items")


def addressed(path: bytes) -> str | None:
    """The response id of ``/v1/responses/{id}``, ``.../cancel`` or ``.../input_items``;
    None for any other path (``""`` for a path under ``/v1/responses/`` of another form)."""
    if not path.startswith(PREFIX):
        return None
    rest = path[len(PREFIX):]
    rid, slash, tail = rest.partition(b"/")
    if not rid or (b"/" + tail if slash else b"") not in _SUFFIXES:
        return ""
    try:
        return rid.decode("ascii")
    except UnicodeDecodeError:
        return ""


class ResponseOwners:
    """Response id -> the engine that produced it, at most ``capacity`` ids (least
    recently used forgotten first)."""

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._owner: OrderedDict[str, str] = OrderedDict()
        self.forgotten = 0  # pushed out by the bound

    def __len__(self) -> int:
        return len(self._owner)

    def get(self, rid: str) -> str | None:
        engine = self._owner.get(rid)
        if engine is not None:
            self._owner.move_to_end(rid)
        return engine

    def learn(self, rid: str, engine: str) -> None:
        if not self.capacity:
            return
        self._owner[rid] = engine
        self._owner.move_to_end(rid)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
            self.forgotten += 1

    def learn_from(self, data: bytes, engine: str) -> bool:
        """Learn the id of the response in ``data`` (an answer's start); True if found."""
        m = RESPONSE_ID.search(data, 0, SCAN_LIMIT)
        if m is None:
            return False
        self.learn(m.group(1).decode("ascii", "replace"), engine)
        return True

    def forget(self, rid: str) -> None:
        self._owner.pop(rid, None)


def _parts(content: Any) -> str | list[dict[str, str]] | None:
    """A message's content as vLLM reads it: a string as is; text parts (``input_text``,
    ``output_text``, ``text``) as chat text parts, which the proxy then hands to the
    template as the engine does (joined for a template that takes strings:
    tokenize/content.py); None for anything else (an image, a file)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    out = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") in TEXT_PARTS
                and isinstance(part.get("text"), str)):
            return None
        out.append({"type": "text", "text": part["text"]})
    return out


def _message(item: Any) -> dict[str, Any] | None:
    """One input item as the chat message vLLM makes of it; None if not mapped here."""
    if not isinstance(item, dict):
        return None
    kind = item.get("type")
    if kind == "function_call":
        return {"role": "assistant", "tool_calls": [{
            "id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")}}]}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"),
                "tool_call_id": item.get("call_id")}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            return None
        for key in ("summary", "content"):
            parts = item.get(key)
            if isinstance(parts, list) and len(parts) == 1 and isinstance(parts[0], dict):
                return {"role": "assistant", "reasoning": parts[0].get("text", "")}
        return {"role": "assistant", "reasoning": ""}
    if kind not in (None, "message"):
        return None
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        return None
    content = item.get("content")
    if role == "assistant" and kind == "message" and "id" in item:
        # an output message of an earlier response: vLLM keeps its first part's text
        if not (isinstance(content, list) and content and isinstance(content[0], dict)
                and isinstance(content[0].get("text"), str)):
            return None
        return {"role": "assistant", "content": content[0]["text"]}
    parts = _parts(content)
    if parts is None:
        return None
    return {"role": role, "content": parts}


def chat_request(instructions: Any, input_: Any, tools: Any = None
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None] | None:
    """A ``/v1/responses`` request as the chat messages and tools vLLM renders it into:
    ``instructions`` as the system message, then ``input`` (a string is the user's message;
    items: messages with their text parts, function calls and their outputs, reasoning),
    and function tools in the chat shape. None when it holds something this does not map
    (an image, a built-in tool): the proxy then routes it by load."""
    msgs: list[dict[str, Any]] = []
    if instructions:
        if not isinstance(instructions, str):
            return None
        msgs.append({"role": "system", "content": instructions})
    if isinstance(input_, str):
        msgs.append({"role": "user", "content": input_})
    elif isinstance(input_, list) and input_:
        for item in input_:
            m = _message(item)
            if m is None:
                return None
            msgs.append(m)
    else:
        return None
    chat_tools = None
    if tools:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function" for t in tools):
            return None
        chat_tools = [{"type": "function", "function": t} for t in tools]
    return msgs, chat_tools
