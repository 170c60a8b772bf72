"""Chat templates known by their exact text, rendered without jinja for the common chat.

A router renders the whole conversation on every request, and a long one (86 turns, 120k
characters) costs jinja milliseconds, which no cache of token ids skips. For a template whose
source text is one of these, byte for byte (its sha256; a name or a look-alike never
counts), a plain Python function writes what the template writes, for the inputs it was
written and proven for, and answers None for anything else (the template then renders it).
tests/test_tokenize_known.py checks every function against the jinja render with
hypothesis, adversarial contents included. Known: Qwen3's, DeepSeek-V3's and Mistral v7's
templates, as tests/data/tokenize vendors them (their publishers' text).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["KNOWN", "PlainRenderer", "deepseek_v3_plain", "mistral_v7_plain", "plain_renderer",
           "qwen3_plain"]

#: ``(messages, tools, add_generation_prompt, variables) -> text or None``: ``variables``
#: are the render's template variables (the tokenizer's special tokens and the caller's
#: ``chat_template_kwargs``), without ``messages``/``tools``/``add_generation_prompt``.
PlainRenderer = Callable[[Any, Any, Any, Mapping[str, Any]], "str | None"]

# Names Qwen3's template could take from the variables besides ``enable_thinking`` (and the
# three the render sets itself): ``content``/``reasoning_content`` are set before use but
# jinja would resolve them from the context otherwise, ``namespace`` is a global a variable
# of that name would replace. A render given any of them is left to jinja.
QWEN3_UNREAD = frozenset(("content", "reasoning_content", "namespace"))


def _string_turns(messages: Any) -> bool:
    """Whether ``messages`` is a list of dicts whose ``role`` and ``content`` are strings:
    what every renderer here needs before it reads anything else."""
    return type(messages) is list and all(
        type(m) is dict and type(m.get("role")) is str and type(m.get("content")) is str
        for m in messages)


def _plain_tool_calls(value: Any) -> bool:
    """Whether the template's ``{% if message.tool_calls %}`` is false for ``value``."""
    return value is None or (type(value) is list and not value)


def qwen3_plain(messages: Any, tools: Any, add_generation_prompt: Any,
                variables: Mapping[str, Any]) -> str | None:
    """What Qwen3's chat template renders, for: no tools; messages that are dicts whose
    ``role`` and ``content`` are strings (any role: the template writes nothing for one it
    does not know, but its neighbours still see it); an assistant's ``reasoning_content`` a
    string or None and its ``tool_calls`` None or ``[]``; ``enable_thinking`` any value.
    None for anything else (tool calls, tools, content parts or null, a non-dict, no
    messages, a variable in ``QWEN3_UNREAD``)."""
    if tools or not messages or not _string_turns(messages) \
            or not QWEN3_UNREAD.isdisjoint(variables):
        return None
    roles: list[str] = []
    for m in messages:
        role = m["role"]
        if role == "assistant":
            if not _plain_tool_calls(m.get("tool_calls")):
                return None
            reasoning = m.get("reasoning_content")
            if reasoning is not None and type(reasoning) is not str:
                return None
        roles.append(role)
    n = len(messages)
    # the last user turn that is not a tool's answer sent as a user turn: assistant turns
    # after it keep their reasoning
    last_query = n - 1
    for i in range(n - 1, -1, -1):
        if roles[i] == "user":
            c = messages[i]["content"]
            if not (c.startswith("<tool_response>") and c.endswith("</tool_response>")):
                last_query = i
                break
    out: list[str] = []
    if roles[0] == "system":
        out.append("<|im_start|>system\n" + messages[0]["content"] + "<|im_end|>\n")
    for i, m in enumerate(messages):
        role, content = roles[i], m["content"]
        if role == "user" or (role == "system" and i):
            out.append("<|im_start|>" + role + "\n" + content + "<|im_end|>\n")
        elif role == "assistant":
            reasoning = m.get("reasoning_content")
            if reasoning is None:
                reasoning = ""
                if "</think>" in content:
                    reasoning = content.split("</think>")[0].rstrip("\n") \
                        .split("<think>")[-1].lstrip("\n")
                    content = content.split("</think>")[-1].lstrip("\n")
            if i > last_query and (i == n - 1 or reasoning):
                out.append("<|im_start|>assistant\n<think>\n" + reasoning.strip("\n")
                           + "\n</think>\n\n" + content.lstrip("\n") + "<|im_end|>\n")
            else:
                out.append("<|im_start|>assistant\n" + content + "<|im_end|>\n")
        elif role == "tool":
            if i == 0 or roles[i - 1] != "tool":
                out.append("<|im_start|>user")
            out.append("\n<tool_response>\n" + content + "\n</tool_response>")
            if i == n - 1 or roles[i + 1] != "tool":
                out.append("<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
        if variables.get("enable_thinking") is False:
            out.append("<think>\n\n</think>\n\n")
    return "".join(out)


#: Names DeepSeek-V3's template could take from the variables besides ``bos_token``.
DEEPSEEK_V3_UNREAD = frozenset(("namespace",))


def deepseek_v3_plain(messages: Any, tools: Any, add_generation_prompt: Any,
                      variables: Mapping[str, Any]) -> str | None:
    """What DeepSeek-V3's chat template renders, for: messages that are dicts whose
    ``role`` and ``content`` are strings (any role); a ``bos_token`` that is a string; tools
    or not (the template does not read them), and an assistant's ``tool_calls`` whatever
    they are when its content is a string (the template writes them only for null
    content). None for anything else (null or non-string content, a non-dict, a variable in
    ``DEEPSEEK_V3_UNREAD``)."""
    bos = variables.get("bos_token")
    if type(bos) is not str or not _string_turns(messages) \
            or not DEEPSEEK_V3_UNREAD.isdisjoint(variables):
        return None
    system = [m["content"] for m in messages if m["role"] == "system"]
    out = [bos, "\n\n".join(system)]
    is_tool, first_output = False, True  # (the template never sets the second back)
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "user":
            is_tool = False
            out.append("<\uff5cUser\uff5c>" + content)
        elif role == "assistant":
            if is_tool:
                out.append("<\uff5ctool\u2581outputs\u2581end\uff5c>" + content
                           + "<\uff5cend\u2581of\u2581sentence\uff5c>")
                is_tool = False
            else:
                out.append("<\uff5cAssistant\uff5c>" + content
                           + "<\uff5cend\u2581of\u2581sentence\uff5c>")
        elif role == "tool":
            is_tool = True
            if first_output:
                out.append("<\uff5ctool\u2581outputs\u2581begin\uff5c>"
                           "<\uff5ctool\u2581output\u2581begin\uff5c>" + content
                           + "<\uff5ctool\u2581output\u2581end\uff5c>")
                first_output = False
            else:
                out.append("\n<\uff5ctool\u2581output\u2581begin\uff5c>" + content
                           + "<\uff5ctool\u2581output\u2581end\uff5c>")
    if is_tool:
        out.append("<\uff5ctool\u2581outputs\u2581end\uff5c>")
    if add_generation_prompt and not is_tool:
        out.append("<\uff5cAssistant\uff5c>")
    return "".join(out)


#: Names Mistral v7's template could take from the variables besides ``bos_token`` and
#: ``eos_token`` (set before use, but resolved from the context otherwise, or globals).
MISTRAL_V7_UNREAD = frozenset(("ns_c", "tool_id", "merged_content", "namespace",
                               "raise_exception"))
_MISTRAL_NEXT = {"system": ("user", "assistant", "system"), "user": ("assistant", "system", "user"),
                 "assistant": ("assistant", "user", "tool")}


def mistral_v7_plain(messages: Any, tools: Any, add_generation_prompt: Any,
                     variables: Mapping[str, Any]) -> str | None:
    """What Mistral's v7 chat template renders, for: no tools; messages that are dicts with
    a ``role`` of system, user or assistant and a string ``content``, no ``tool_calls``
    (None or ``[]``); string ``bos_token`` and ``eos_token``. Consecutive user (or assistant)
    turns are merged with a blank line as the template merges them. None for anything else,
    and for every chat the template refuses (it starts with an assistant turn, a system turn
    follows an assistant's, an assistant's merged text is empty): jinja raises then.
    ``add_generation_prompt`` is not read by this template."""
    bos, eos = variables.get("bos_token"), variables.get("eos_token")
    if tools or not messages or type(bos) is not str or type(eos) is not str \
            or not _string_turns(messages) or not MISTRAL_V7_UNREAD.isdisjoint(variables):
        return None
    merged: list[tuple[str, list[str]]] = []  # (role, contents): the template's groups
    for m in messages:
        role, content = m["role"], m["content"]
        if role not in _MISTRAL_NEXT or not _plain_tool_calls(m.get("tool_calls")):
            return None
        if merged and role != "system" and merged[-1][0] == role:
            merged[-1][1].append(content)
        else:
            merged.append((role, [content]))
    if merged[0][0] not in ("user", "system"):
        return None
    out = [bos]
    previous = None
    for role, contents in merged:
        if previous is not None and role not in _MISTRAL_NEXT[previous]:
            return None
        previous = role
        text = "\n\n".join(contents)
        if role == "user":
            out.append("[INST]" + text + "[/INST]")
        elif role == "assistant":
            if not text:
                return None
            out.append(text + eos)
        else:
            out.append("[SYSTEM_PROMPT]" + text + "[/SYSTEM_PROMPT]")
    return "".join(out)


def _sha256(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


#: Qwen3's chat template (tests/data/tokenize/qwen3/tokenizer_config.json, as Qwen ships it).
QWEN3_SHA256 = "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"
#: The same text with one newline at its end, as a ``chat_template.jinja`` file may hold
#: it: jinja drops one trailing newline of a template, so it renders the same.
QWEN3_NL_SHA256 = "c945a4a87850dd79827191150be98539a7a5e7da0689f3550d880f8dcc95b856"

#: DeepSeek-V3's (tests/data/tokenize/deepseek_v3/tokenizer_config.json), and with a newline.
DEEPSEEK_V3_SHA256 = "3b8267e54b67df6500f231ffa969955cc9d26b3444a291ced4eb96ca7d3ca1ea"
DEEPSEEK_V3_NL_SHA256 = "ab0ff5420b868930f174d45fd397a10183e6d6603e41851b40b7d35857c111d0"

#: Mistral's v7 (tests/data/tokenize/mistral_v7/chat_template.jinja, which ends in a
#: newline), and the same without it.
MISTRAL_V7_SHA256 = "5af6733dbf44d9b6f920cb8cdf9fb5e6f771d81e08bd0aa821d1ec5289f12462"
MISTRAL_V7_NO_NL_SHA256 = "165382433e4b79ea9fb6b75f1789089ee8582107ec09af5763ec58adf324f991"

#: sha256 of a template's source -> (name, renderer).
KNOWN: dict[str, tuple[str, PlainRenderer]] = {
    QWEN3_SHA256: ("qwen3", qwen3_plain),
    QWEN3_NL_SHA256: ("qwen3", qwen3_plain),
    DEEPSEEK_V3_SHA256: ("deepseek_v3", deepseek_v3_plain),
    DEEPSEEK_V3_NL_SHA256: ("deepseek_v3", deepseek_v3_plain),
    MISTRAL_V7_SHA256: ("mistral_v7", mistral_v7_plain),
    MISTRAL_V7_NO_NL_SHA256: ("mistral_v7", mistral_v7_plain),
}


def plain_renderer(source: str) -> tuple[str, PlainRenderer] | None:
    """``(name, renderer)`` for a template whose text is a known one exactly, else None."""
    return KNOWN.get(_sha256(source))
