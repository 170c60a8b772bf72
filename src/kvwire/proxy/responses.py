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

No I/O here: the proxy (proxy/handler.py, proxy/relay.py) feeds it what it reads and asks
it where to go.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any, NamedTuple

from ..tokenize.content import TEXT_PARTS, as_engine_tools

__all__ = ["PREFIX", "RESPONSE_ID", "SCAN_LIMIT", "ResponseChat", "ResponseOwners", "addressed",
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


class ResponseChat(NamedTuple):
    """A ``/v1/responses`` request as the chat vLLM renders: its messages, tools (chat
    shape) and the template settings the request implies."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    #: the last input item is an unfinished assistant message or reasoning (``status``
    #: ``in_progress``/``incomplete``): rendered to be continued, no generation prompt
    continue_final_message: bool = False
    reasoning_effort: str | None = None


#: vLLM's name for a namespace's function (``<namespace>__<name>``).
_NAMESPACE_SEP = "__"
#: The single-string function a ``custom`` tool is shown to the model as (vLLM's shim).
_CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string",
                             "description": "The freeform text payload for this tool."}},
    "required": ["input"],
    "additionalProperties": False,
}


def _text_of(content: Any) -> str | None:
    """What vLLM keeps of an assistant item's content: a string, or its first part's text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _tool_call(item: dict[str, Any]) -> dict[str, Any] | None:
    """A ``function_call`` / ``custom_tool_call`` item as a chat tool call (None if it
    is neither, or not well formed)."""
    kind, cid, name = item.get("type"), item.get("call_id"), item.get("name")
    if kind not in ("function_call", "custom_tool_call") or not (
            isinstance(cid, str) and isinstance(name, str)):
        return None
    if kind == "function_call":
        args = item.get("arguments")
        if not isinstance(args, str):
            return None
        ns = item.get("namespace")
        if isinstance(ns, str) and ns:
            name = f"{ns}{_NAMESPACE_SEP}{name}"
    else:
        payload = item.get("input") or ""
        if not isinstance(payload, str):
            return None
        args = json.dumps({"input": payload}, ensure_ascii=False)
    return {"id": cid, "function": {"name": name, "arguments": args}, "type": "function"}


_DROP = object()  # merged into the previous message: nothing to append


def _message(item: Any, prev: dict[str, Any] | None) -> Any:
    """One input item as vLLM 0.33 makes it a chat message: a new message, ``_DROP`` when
    it went into ``prev`` (the previous message, when it is the assistant's: a
    reasoning item, an output message and the function calls after it make ONE assistant
    turn, as the template is shown it), or None when it is not mapped here (the proxy
    routes it by load; vLLM refuses most of those)."""
    if not isinstance(item, dict):
        return None
    kind = item.get("type")
    call = _tool_call(item)
    if call is not None:
        if prev is not None:
            calls = prev.get("tool_calls")
            if calls is None:
                prev["tool_calls"] = [call]
                return _DROP
            if isinstance(calls, list):
                prev["tool_calls"] = [*calls, call]  # a new list: the client's is not touched
                return _DROP
        return {"role": "assistant", "tool_calls": [call]}
    if kind in ("function_call", "custom_tool_call"):
        return None
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"),
                "tool_call_id": item.get("call_id")}
    if kind == "reasoning":
        if item.get("encrypted_content") or not isinstance(item.get("id"), str):
            return None
        text = ""
        for key in ("content", "summary"):  # vLLM reads the reasoning text first
            parts = item.get(key)
            if isinstance(parts, list) and parts:
                if not (isinstance(parts[0], dict) and isinstance(parts[0].get("text"), str)):
                    return None
                text = parts[0]["text"]
                break
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = text
            return _DROP
        return {"role": "assistant", "reasoning": text}
    if kind not in (None, "message"):
        return None
    role = item.get("role")
    if not isinstance(role, str):
        return None
    content = item.get("content")
    if role == "assistant":
        text = _text_of(content)
        if text is not None:
            if prev is not None and prev.get("content") is None:
                prev["content"] = text
                return _DROP
            return {"role": "assistant", "content": text}
    if isinstance(content, list) and not all(
            isinstance(p, dict) and p.get("type") in TEXT_PARTS for p in content):
        return None  # an image, a file: not tokenized here
    return dict(item)  # as vLLM passes it on: its chat parser keeps what it reads


def _continues(input_: Any) -> bool:
    """vLLM's test for a request that continues its last item (an unfinished message)."""
    if not isinstance(input_, list) or not input_ or not isinstance(input_[-1], dict):
        return False
    last = input_[-1]
    return (last.get("type", "message") in ("message", "reasoning")
            and last.get("status") in ("in_progress", "incomplete"))


def _function_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The tools vLLM shows the template (``construct_tool_dicts``): functions as given,
    a namespace's functions as ``<namespace>__<name>``, a custom tool as vLLM's
    single-string function; built-in tools (web search, ...) are not shown. None when a
    tool is not well formed (the proxy routes by load; the engine judges it)."""
    out: list[dict[str, Any]] = []
    for t in tools:
        if not isinstance(t, dict):
            return None
        kind = t.get("type")
        if kind == "function":
            fns = [t]
        elif kind == "namespace":
            subs = t.get("tools")
            if not (isinstance(t.get("name"), str) and isinstance(subs, list)):
                return None
            fns = [{**f, "name": f"{t['name']}{_NAMESPACE_SEP}{f.get('name')}"}
                   for f in subs if isinstance(f, dict) and f.get("type") == "function"]
        elif kind == "custom":
            fns = [{"name": t.get("name"), "description": t.get("description"),
                    "parameters": _CUSTOM_PARAMETERS}]
        else:
            continue
        for f in fns:
            if not isinstance(f.get("name"), str):
                return None
            out.append({"type": "function", "function": f})
    return as_engine_tools(out)  # re-serialised as vLLM's request model does, like chat's


def chat_request(instructions: Any, input_: Any, tools: Any = None,
                 reasoning: Any = None) -> ResponseChat | None:
    """A ``/v1/responses`` request as the chat vLLM 0.33 renders it (its
    ``construct_input_messages`` and ``construct_tool_dicts``): ``instructions`` as the
    system message, then ``input`` (a string is the user's message; items as
    :func:`_message` maps them, consecutive assistant items merged into one turn), the
    function tools in the chat shape (also with ``tool_choice: "none"``: vLLM drops them
    then only when its server is told to), and ``reasoning.effort`` for the template. None
    when it holds something this does not map (an image, an encrypted reasoning item):
    the proxy then routes it by load. tests/test_proxy_responses.py compares it with
    vLLM's own functions."""
    msgs: list[dict[str, Any]] = []
    if instructions:
        if not isinstance(instructions, str):
            return None
        msgs.append({"role": "system", "content": instructions})
    if isinstance(input_, str):
        msgs.append({"role": "user", "content": input_})
    elif isinstance(input_, list) and input_:
        turns: list[dict[str, Any]] = []  # vLLM merges within the input, not into instructions
        for item in input_:
            prev = turns[-1] if turns and turns[-1].get("role") == "assistant" else None
            m = _message(item, prev)
            if m is None:
                return None
            if m is not _DROP:
                turns.append(m)
        msgs.extend(turns)
    else:
        return None
    chat_tools = None
    if tools:
        if not isinstance(tools, list):
            return None
        chat_tools = _function_tools(tools)
        if chat_tools is None:
            return None
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if effort is not None and not isinstance(effort, str):
        return None
    return ResponseChat(msgs, chat_tools, _continues(input_), effort)
