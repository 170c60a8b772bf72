"""How vLLM hands a message's content to a chat template, so the router renders what the
engine renders.

An OpenAI message's ``content`` is a string or a list of parts (``{"type": "text", "text":
...}``). transformers passes either to the template as it is; vLLM first decides from the
template itself (``--chat-template-content-format auto``, its default) whether the template
takes parts: it does when it loops over a message's content (``{% for part in
message.content %}``). A template that does not (Qwen3's, Llama's: ``message.content`` used
as a string) is given each message's text parts joined by newlines. Rendered as transformers
would, such a template sees a list where it expects a string and writes something else (an
empty turn, or the list's repr), so a router that tokenizes that way misses the engine's
cache for every request whose content comes in parts: the common shape of OpenAI SDK
clients.

:func:`content_format` is that decision, made on the template's syntax tree as vLLM makes it
(a loop over ``messages`` or a name assigned from it, then a loop over that item's
``content``, directly or as a macro's parameter, or over a variable named ``content``);
tests/test_tokenize_content.py compares the two on every template at hand where vLLM is
installed. :func:`as_engine_messages` applies it, with the rest of what vLLM's chat parser
does to a conversation before the template sees it (tool-call arguments parsed, null
content, the keys it keeps); :func:`as_engine_tools` gives the tools as vLLM re-serialises
them; :func:`engine_template_kwargs` the variables vLLM adds to the request's
``chat_template_kwargs`` (``reasoning_effort`` and ``enable_thinking`` among them). Anything
with a part that is not text (an image) is left as it is.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.nodes

from kvwire.tokenize.errors import TokenizerError
from kvwire.tokenize.template import compile_template

__all__ = ["TEXT_PARTS", "as_engine_messages", "as_engine_tools", "content_format",
           "engine_template_kwargs"]

ContentFormat = Literal["string", "openai"]
#: What vLLM reads as a text part's text, by part type.
_TEXT_KEY = {"text": "text", "input_text": "text", "output_text": "text",
             "thinking": "thinking", "refusal": "refusal"}
#: Part types whose ``text`` vLLM reads as text (the Responses API's included).
TEXT_PARTS = frozenset(k for k, v in _TEXT_KEY.items() if v == "text")


def _unwrap(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """``x | filter``, ``x is test`` and ``x[a:b]`` stand for ``x`` here."""
    while True:
        if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg,
                                                                    jinja2.nodes.Slice):
            node = node.node
        else:
            return node


def _dotted(node: jinja2.nodes.Node) -> str | None:
    """``x`` or ``ns.attr`` (a namespace's attribute), else None."""
    if isinstance(node, jinja2.nodes.Name):
        return node.name
    if isinstance(node, jinja2.nodes.NSRef):
        return f"{node.name}.{node.attr}"
    if isinstance(node, jinja2.nodes.Getattr) and isinstance(node.node, jinja2.nodes.Name):
        return f"{node.node.name}.{node.attr}"
    return None


def _is_name(node: jinja2.nodes.Node, names: set[str]) -> bool:
    return _dotted(_unwrap(node)) in names


def _is_content_of(node: jinja2.nodes.Node, names: set[str]) -> bool:
    """``m.content`` or ``m['content']`` for an ``m`` in ``names`` (through filters)."""
    node = _unwrap(node)
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content" and _is_name(node.node, names)
    if isinstance(node, jinja2.nodes.Getitem):
        return (isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
                and _is_name(node.node, names))
    return False


@lru_cache(maxsize=64)
def content_format(source: str) -> ContentFormat:
    """``"openai"`` if the template loops over a message's content (it takes parts), else
    ``"string"``; a template that does not parse is ``"string"``."""
    try:  # parsed in the renderer's environment: its tags ({% generation %}) included
        root = compile_template(source).environment.parse(source)
    except (TokenizerError, jinja2.TemplateSyntaxError):
        return "string"
    # names that hold the messages: ``messages`` and what is assigned from it (a variable,
    # ``namespace(k=messages)``'s ``ns.k``, or ``{% set ns.k = messages %}``)
    lists = {"messages"}
    grew = True
    while grew:
        grew = False
        for a in root.find_all(jinja2.nodes.Assign):
            target, rhs = _dotted(a.target), a.node
            new: list[str] = []
            if target is not None and _is_name(rhs, lists):
                new.append(target)
            elif (isinstance(a.target, jinja2.nodes.Name) and isinstance(rhs, jinja2.nodes.Call)
                  and isinstance(rhs.node, jinja2.nodes.Name) and rhs.node.name == "namespace"):
                new += [f"{target}.{kw.key}" for kw in rhs.kwargs if _is_name(kw.value, lists)]
            for name in new:
                if name not in lists:
                    lists.add(name)
                    grew = True
    loops = list(root.find_all(jinja2.nodes.For))
    items = {loop.target.name for loop in loops
             if isinstance(loop.target, jinja2.nodes.Name) and _is_name(loop.iter, lists)}
    # a macro given ``message.content`` as an argument: its loops over that parameter
    calls = list(root.find_all(jinja2.nodes.Call))
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        params = [a.name for a in macro.args]
        bound: set[str] = set()
        for call in calls:
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                bound.update(params[i] for i, arg in enumerate(call.args[:len(params)])
                             if _is_content_of(arg, items))
                bound.update(kw.key for kw in call.kwargs
                             if kw.key in params and _is_content_of(kw.value, items))
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name in bound:
                return "openai"
    for loop in loops:
        if _is_content_of(loop.iter, items):
            return "openai"
        it = loop.iter
        if (id(loop) not in in_macros and isinstance(it, jinja2.nodes.Name)
                and it.name == "content"):
            return "openai"
    return "string"


#: Claude Code's attribution line, dropped from system text by vLLM (it changes per request).
_BILLING_HEADER = "x-anthropic-billing-header"
_PLAIN = frozenset(("role", "content"))


def _texts(parts: list[Any], system: bool) -> list[str] | None:
    """The texts of ``parts`` as vLLM reads them, or None if a part is not text (an image:
    vLLM adds placeholders this cannot know) or not of a shape vLLM accepts."""
    out: list[str] = []
    for p in parts:
        if isinstance(p, str):
            text: Any = p
        elif isinstance(p, dict) and p.get("type") in _TEXT_KEY:
            text = p.get(_TEXT_KEY[p["type"]])
            if text is None:
                continue  # vLLM skips a text part without text
        else:
            return None
        if not isinstance(text, str):
            return None
        if system and text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        out.append(text)
    return out


def _message(m: Any, fmt: str) -> Any:
    """One message as vLLM's chat parser hands it to the template; ``m`` unchanged when it
    is not a message vLLM would accept or holds a part that is not text."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return m
    role, content = m["role"], m.get("content")
    if type(content) is str and m.keys() <= _PLAIN and role not in ("tool", "developer") \
            and not (role == "system" and content.startswith(_BILLING_HEADER)):
        # the common turn, quickly (a chat of 16: 2 us instead of 13)
        return m if fmt == "string" else {"role": role,
                                          "content": [{"type": "text", "text": content}]}
    parts = [] if content is None else [content] if isinstance(content, str) else content
    if not isinstance(parts, list):
        return m
    texts = _texts(parts, role == "system")
    if texts is None:
        return m
    if fmt == "string" or role == "tool":  # vLLM gives a tool's text parts as a string
        new: Any = "\n".join(texts)
    else:
        new = [{"type": "text", "text": t} for t in texts]
    out: dict[str, Any] = {"role": role, "content": new}
    if role == "assistant":
        calls = m.get("tool_calls")
        if calls is not None and calls != []:  # an empty list: vLLM drops it
            out["tool_calls"] = _tool_calls(calls)
        # vLLM's request model renames the older ``reasoning_content`` to ``reasoning``
        reasoning = m.get("reasoning")
        if reasoning is None:
            reasoning = m.get("reasoning_content")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in m:
        out["tool_call_id"] = m["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    if role == "developer":
        out["tools"] = m.get("tools")
    return m if out == m else out


def _tool_calls(calls: Any) -> Any:
    """Tool calls as vLLM hands them to templates: ``arguments`` parsed from the JSON string
    OpenAI clients send into an object (``{}`` when empty, not JSON or not an object).
    Not vLLM's shape (it answers 400): as given."""
    if not isinstance(calls, list):
        return calls
    out = []
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or c.get("type", "function") != "function":
            return list(calls)
        args = f.get("arguments")
        if args and isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        out.append({**c, "function": {**f, "arguments": args if isinstance(args, dict)
                                      else {}}})
    return out


def as_engine_messages(messages: Any, fmt: str) -> Any:
    """``messages`` as vLLM (0.33's chat parser) hands them to a template of format ``fmt``:
    content in text parts joined by ``"\\n"`` for ``"string"``, a string wrapped as one text
    part for ``"openai"``, ``None`` as ``""`` (or no parts), a tool's text parts as a string;
    tool-call arguments as objects, an empty ``tool_calls`` dropped; only the keys vLLM
    keeps. A message with a part that is not text is left as it is (vLLM adds placeholders
    this cannot know); so is anything that is not a list of messages (the renderer names
    what is wrong). The caller's objects are never modified."""
    if not isinstance(messages, list):
        return messages
    out = [_message(m, fmt) for m in messages]
    return messages if all(a is b for a, b in zip(out, messages)) else out


def as_engine_tools(tools: Any) -> Any:
    """``tools`` as vLLM hands them to the template: each re-serialised from its request
    model, so ``description`` and ``parameters`` are present (``None`` when not given),
    ``strict`` and ``defer_loading`` only when set, and other keys dropped. A template
    that writes the tools as JSON (Qwen3's) renders those bytes; a router that rendered the
    client's own dicts would miss the engine's cache from the tools block on. A tool vLLM
    would reject (no ``function.name``) is left as given."""
    if not isinstance(tools, list):
        return tools
    out = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            return tools
        fn: dict[str, Any] = {"name": f["name"], "description": f.get("description"),
                              "parameters": f.get("parameters")}
        if f.get("strict") is not None:
            fn["strict"] = f["strict"]
        defer = f.get("defer_loading")
        if defer is None:
            defer = t.get("defer_loading")
        if defer is not None:
            fn["defer_loading"] = defer
        tool: dict[str, Any] = {"type": t.get("type", "function"), "function": fn}
        if t.get("defer_loading") is not None:
            tool["defer_loading"] = t["defer_loading"]
        out.append(tool)
    return out


#: Request values vLLM does not pass on over the request's own ``chat_template_kwargs``.
_UNSET = (None, "auto")


def engine_template_kwargs(chat_template_kwargs: dict[str, Any] | None = None, *,
                           add_generation_prompt: bool = True,
                           continue_final_message: bool = False,
                           reasoning_effort: str | None = None,
                           documents: Any = None) -> dict[str, Any]:
    """The template variables vLLM 0.33 renders a chat request with: the request's
    ``chat_template_kwargs``, overridden by its ``add_generation_prompt``,
    ``continue_final_message``, ``documents`` and ``reasoning_effort`` fields where set,
    plus ``enable_thinking = reasoning_effort != "none"`` when an effort is asked for and
    the kwargs do not set it (Qwen3's template reads it: without it a router renders
    another generation prompt than the engine). The server's own defaults
    (``--default-chat-template-kwargs``, an effort map) are not known to a router."""
    user = chat_template_kwargs if isinstance(chat_template_kwargs, dict) else {}
    extra: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                             "continue_final_message": continue_final_message,
                             "documents": documents, "reasoning_effort": reasoning_effort}
    if reasoning_effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = reasoning_effort != "none"
    return {**user, **{k: v for k, v in extra.items() if v not in _UNSET}}
