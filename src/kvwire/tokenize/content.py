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
installed. :func:`as_engine_messages`
applies it: for a ``"string"`` template, text parts become one newline-joined string;
anything with a part that is not text (an image) is left as it is.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.nodes

from kvwire.tokenize.base import TokenizerError
from kvwire.tokenize.template import compile_template

__all__ = ["TEXT_PARTS", "as_engine_messages", "content_format"]

ContentFormat = Literal["string", "openai"]
#: Part types whose ``text`` vLLM reads as text (the Responses API's included).
TEXT_PARTS = frozenset(("text", "input_text", "output_text"))


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


def as_engine_messages(messages: Any, fmt: str) -> Any:
    """``messages`` as vLLM hands them to a template of format ``fmt``: for ``"string"``,
    each content given as text parts becomes their texts joined by ``"\\n"``; the rest (and
    every message for ``"openai"``) unchanged. Not a list of dicts: returned as is (the
    renderer names what is wrong)."""
    if fmt != "string" or not isinstance(messages, list):
        return messages
    out = None
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        texts = [p.get("text") for p in content
                 if isinstance(p, dict) and p.get("type") in TEXT_PARTS]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            continue  # a part that is not text: vLLM adds placeholders this cannot know
        if out is None:
            out = list(messages)
        out[i] = {**m, "content": "\n".join(texts)}
    return messages if out is None else out
