"""Known chat templates rendered without jinja (kvwire.tokenize.known): for every chat the
plain renderer answers, its text is the jinja render's, byte for byte (hypothesis, with
contents built to trip it: think tags, turn markers, tool-response wrappers, newlines at the
edges, empty strings, unicode, runs of tool turns), for every known template; it answers for
the common shapes; it is used only for a template whose text is exactly the known one."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import jinja2.meta
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.tokenize import ChatTemplate, TokenizerError, load_tokenizer
from kvwire.tokenize.content import as_engine_messages
from kvwire.tokenize.known import (
    DEEPSEEK_V3_UNREAD,
    MISTRAL_V7_UNREAD,
    QWEN3_UNREAD,
    deepseek_v3_plain,
    mistral_v7_plain,
    plain_renderer,
    qwen3_plain,
)
from kvwire.tokenize.template import compile_template

DATA = Path(__file__).resolve().parent / "data" / "tokenize"
CONFIG = json.loads((DATA / "qwen3" / "tokenizer_config.json").read_text(encoding="utf-8"))
QWEN3 = CONFIG["chat_template"]
VARIABLES = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
DEEPSEEK = json.loads((DATA / "deepseek_v3" / "tokenizer_config.json").read_text(
    encoding="utf-8"))["chat_template"]
DS_VARIABLES = {"bos_token": "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
                "eos_token": "<\uff5cend\u2581of\u2581sentence\uff5c>"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
MISTRAL = (DATA / "mistral_v7" / "chat_template.jinja").read_text(encoding="utf-8")
MS_VARIABLES = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
CALLS = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
# name -> (source, variables, renderer, tools it answers for, what the render may read
# from the variables, what it refuses to)
TEMPLATES: dict[str, tuple[str, dict[str, str], Any, list[Any], set[str], frozenset[str]]] = {
    "qwen3": (QWEN3, VARIABLES, qwen3_plain, [None, []], {"enable_thinking"}, QWEN3_UNREAD),
    "deepseek_v3": (DEEPSEEK, DS_VARIABLES, deepseek_v3_plain, [None, [], [WEATHER]],
                    {"bos_token"}, DEEPSEEK_V3_UNREAD),
    "mistral_v7": (MISTRAL, MS_VARIABLES, mistral_v7_plain, [None, []],
                   {"bos_token", "eos_token"}, MISTRAL_V7_UNREAD),
}
# each template's text, and the same with or without the newline at its end that a
# chat_template.jinja file may have and a tokenizer_config.json string may not
SOURCES = {f"{name} {how}": (name, src) for name, (t, *_) in TEMPLATES.items()
           for how, src in (("exact", t), ("newline at end or not",
                                          t[:-1] if t.endswith("\n") else t + "\n"))}

_piece = st.sampled_from([
    "<think>", "</think>", "<|im_start|>", "<|im_end|>", "<tool_response>",
    "</tool_response>", "<tool_call>", "\n", "\n\n", " ", "", "\t", "{{ x }}", "{% raw %}",
    "user", "assistant", "naïve 東京 🙂", "\r\n", DS_VARIABLES["eos_token"],
    "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>", "<\uff5ctool\u2581outputs\u2581end\uff5c>",
    "[INST]", "[/INST]", "</s>", "[SYSTEM_PROMPT]", "[TOOL_CALLS]"]) | st.text(
    alphabet=st.characters(codec="utf-8"), max_size=10)
_text = st.lists(_piece, max_size=6).map("".join)
# a user turn that is a tool's answer in disguise (the template's last-query rule skips
# it), and reasoning inline (the template splits an assistant turn at its "</think>")
_content = _text | _text.map(lambda c: f"<tool_response>{c}</tool_response>") | st.tuples(
    _text, _text, _text).map(lambda t: f"{t[0]}<think>{t[1]}</think>{t[2]}")
# mostly the template's four roles (so runs of tool turns and assistant turns after the
# last query are common), sometimes one it does not know
_role = st.sampled_from(["system", "user", "user", "assistant", "assistant", "assistant",
                         "tool", "tool", "developer", "", "User", None]).flatmap(
    lambda r: st.text(max_size=4) if r is None else st.just(r))
_plain_message = st.fixed_dictionaries(
    {"role": _role, "content": _content},
    optional={"reasoning_content": st.none() | _text, "tool_calls": st.sampled_from([None, []]),
              "name": st.text(max_size=4), "tool_call_id": st.text(max_size=4)})
# DeepSeek-V3's template reads an assistant's tool calls only when its content is null
_ds_message = st.fixed_dictionaries(
    {"role": _role, "content": _content},
    optional={"tool_calls": st.sampled_from([None, [], CALLS]), "name": st.text(max_size=4)})
# Mistral v7's: its three roles, merged when repeated; it refuses some orders (an assistant
# first, a system turn after an assistant's) and an empty assistant text
_ms_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "user", "assistant", "assistant"]),
     "content": _content | _piece.filter(bool)},
    optional={"tool_calls": st.sampled_from([None, []]), "name": st.text(max_size=4)})
_ms_chat = st.tuples(st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]),
                                            "content": _content}),
                     st.lists(_ms_message, max_size=7)).map(lambda t: [t[0], *t[1]])
PLAIN_CHATS = {"qwen3": st.lists(_plain_message, min_size=1, max_size=8),
               "deepseek_v3": st.lists(_ds_message, min_size=1, max_size=8),
               "mistral_v7": _ms_chat}
_plain_kwargs = st.none() | st.fixed_dictionaries({}, optional={
    "enable_thinking": st.sampled_from([True, False, None, 0, 1, "false", "False"]),
    "reasoning_effort": st.sampled_from(["low", "none"]),
    "bos_token": st.text(max_size=3), "eos_token": st.text(max_size=3),
    # the render sets these itself: a kwarg of the same name must change nothing
    "messages": st.just([]), "tools": st.just([WEATHER]), "add_generation_prompt": st.booleans(),
    "documents": st.just([{"text": "d"}])})

# what the plain renderer leaves to jinja, mixed in
_odd_message = st.fixed_dictionaries(
    {"role": _role | st.none() | st.integers()},
    optional={"content": st.none() | st.integers() | st.just([{"type": "text", "text": "x"}])
              | _content,
              "reasoning_content": st.integers() | st.just(["r"]) | _text,
              "tool_calls": st.just([{"function": {"name": "f", "arguments": {"a": 1}}}])
              | st.just({}) | st.just("")})
_any_kwargs = _plain_kwargs | st.fixed_dictionaries({"content": st.just("c")}) \
    | st.fixed_dictionaries({"reasoning_content": st.just("r")}) \
    | st.fixed_dictionaries({"namespace": st.just("n")}) \
    | st.fixed_dictionaries({"bos_token": st.none() | st.integers()})


def _jinja(source: str, messages: Any, tools: Any, agp: Any, kwargs: Any,
           variables: dict[str, str] = VARIABLES) -> str:
    return ChatTemplate(source, variables=variables, fast=False).render(
        messages, tools=tools, add_generation_prompt=agp, chat_template_kwargs=kwargs)


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        return ("text", fn())
    except TokenizerError as e:
        return ("error", str(e))


@pytest.mark.parametrize("case", list(SOURCES), ids=list(SOURCES))
@settings(max_examples=600, deadline=None)
@given(data=st.data(), agp=st.booleans(), kwargs=_plain_kwargs)
def test_plain_chats_render_as_jinja_does(case: str, data: st.DataObject, agp: bool,
                                          kwargs: Any) -> None:
    name, src = SOURCES[case]
    _, variables, plain, tool_sets, _, _ = TEMPLATES[name]
    messages = data.draw(PLAIN_CHATS[name])
    tools = data.draw(st.sampled_from(tool_sets))
    fast = plain(messages, tools, agp, {**variables, **(kwargs or {})})
    ref = _outcome(lambda: _jinja(src, messages, tools, agp, kwargs, variables))
    # these shapes are all its own: it answers whenever the template renders (and only
    # then: a chat the template refuses is left to it, to raise its error)
    assert ref == ("text", fast) if fast is not None else ref[0] == "error", (fast, ref)
    ct = ChatTemplate(src, variables=variables)
    assert ct.fast_path == name
    assert _outcome(lambda: ct.render(messages, tools=tools, add_generation_prompt=agp,
                                      chat_template_kwargs=kwargs)) == ref


@pytest.mark.parametrize("name", list(TEMPLATES))
@settings(max_examples=600, deadline=None)
@given(messages=st.lists(_plain_message | _ds_message | _ms_message | _odd_message, max_size=6),
       tools=st.sampled_from([None, [], [WEATHER]]), agp=st.booleans(), kwargs=_any_kwargs)
def test_any_chat_renders_as_jinja_does(name: str, messages: list, tools: Any, agp: bool,
                                        kwargs: Any) -> None:
    """Whatever the chat, the template object answers as jinja does (text or error), and
    the plain renderer, when it answers, answers jinja's text."""
    src, variables, plain, _, _, _ = TEMPLATES[name]
    fast = plain(messages, tools, agp, {**variables, **(kwargs or {})})
    ref = _outcome(lambda: _jinja(src, messages, tools, agp, kwargs, variables))
    if fast is not None:
        assert ref == ("text", fast)
    ct = ChatTemplate(src, variables=variables)
    assert _outcome(lambda: ct.render(messages, tools=tools, add_generation_prompt=agp,
                                      chat_template_kwargs=kwargs)) == ref


def _chat(n: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for i in range(n):
        msgs.append({"role": "user", "content": f"question {i}\n"})
        msgs.append({"role": "assistant", "content": f"<think>\nhm {i}\n</think>\n\nanswer {i}"})
    return msgs + [{"role": "user", "content": "last"}]


COMMON = {
    "one user turn": ([{"role": "user", "content": "hi"}], None, True, None),
    "a long conversation": (_chat(40), None, True, None),
    "thinking off": (_chat(2), None, True, {"enable_thinking": False}),
    "thinking on": (_chat(2), [], True, {"enable_thinking": True}),
    "reasoning given": ([{"role": "user", "content": "q"}, {
        "role": "assistant", "content": "a", "reasoning_content": "r", "tool_calls": None}],
        None, False, None),
    "tool turns": ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "calling"},
                    {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"},
                    {"role": "assistant", "content": "done"}], None, True, None),
    "as vLLM hands a request over": (as_engine_messages([*_chat(3), {
        "role": "assistant", "content": None, "reasoning_content": "r"}, {
        "role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]}],
        "string"), None, True, {"reasoning_effort": "low", "enable_thinking": True}),
}


@pytest.mark.parametrize(("name", "case"), [
    (name, case) for name in TEMPLATES for case in COMMON
    # Mistral's renderer takes no tool turns (the template checks their ids)
    if name != "mistral_v7" or all(m["role"] != "tool" for m in COMMON[case][0])])
def test_common_chats_take_the_plain_path(name: str, case: str) -> None:
    src, variables, plain, _, _, _ = TEMPLATES[name]
    messages, tools, agp, kwargs = COMMON[case]
    fast = plain(messages, tools, agp, {**variables, **(kwargs or {})})
    assert fast is not None
    assert fast == _jinja(src, messages, tools, agp, kwargs, variables)


def test_deepseek_v3_answers_with_tools_and_leaves_null_content_to_jinja() -> None:
    """Its template reads no tools and writes tool calls only for a null content."""
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": CALLS},
            {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    fast = deepseek_v3_plain(msgs, [WEATHER], True, DS_VARIABLES)
    assert fast is not None and fast == _jinja(DEEPSEEK, msgs, [WEATHER], True, None,
                                               DS_VARIABLES)
    msgs[1]["content"] = None
    assert deepseek_v3_plain(msgs, None, True, DS_VARIABLES) is None
    assert "tool\u2581calls\u2581begin" in ChatTemplate(DEEPSEEK, variables=DS_VARIABLES) \
        .render(msgs)
    assert deepseek_v3_plain(msgs[:1], None, True, {}) is None  # no bos_token: jinja


def test_other_chats_are_left_to_jinja() -> None:
    user = {"role": "user", "content": "q"}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": {"a": 1}}}]}
    for messages, tools, kwargs in (
            ([user], [WEATHER], None),                                # tools
            ([user, call], None, None),                               # tool calls
            ([{"role": "user", "content": [{"type": "text", "text": "q"}]}], None, None),
            ([{"role": "user", "content": None}], None, None),
            ([{"role": "assistant", "content": "a", "reasoning_content": 3}], None, None),
            ([], None, None), ("not a list", None, None),
            ([user], None, {"content": "x"}), ([user], None, {"namespace": "x"})):
        assert qwen3_plain(messages, tools, True, {**VARIABLES, **(kwargs or {})}) is None
    ct = ChatTemplate(QWEN3, variables=VARIABLES)
    assert "<tool_call>" in ct.render([user, call])
    assert "# Tools" in ct.render([user], tools=[WEATHER])
    # continue_final_message: transformers' cut, done on jinja's text
    msgs = [user, {"role": "assistant", "content": "partial"}]
    assert ct.render(msgs, add_generation_prompt=False, continue_final_message=True) == \
        ChatTemplate(QWEN3, fast=False).render(msgs, add_generation_prompt=False,
                                               continue_final_message=True)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_template_reads_no_other_variable(name: str) -> None:
    """Every name the template could take from its variables is one the plain renderer
    reads or refuses, or one the render sets itself."""
    src, _, _, _, reads, unread = TEMPLATES[name]
    free = jinja2.meta.find_undeclared_variables(compile_template(src).environment.parse(src))
    assert free <= {"messages", "tools", "add_generation_prompt"} | reads | unread


def _model(root: Path, name: str, template: str | None = None) -> Path:
    """A model directory: a small real tokenizer.json, Qwen3's config (its template, or
    ``template`` in a chat_template.jinja that wins over it)."""
    from tokenizers import Tokenizer as _Fast
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    d = root / name
    d.mkdir()
    t = _Fast(WordLevel({"[UNK]": 0, "x": 1}, unk_token="[UNK]"))
    t.pre_tokenizer = Whitespace()
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(CONFIG), encoding="utf-8")
    if template is not None:
        (d / "chat_template.jinja").write_text(template, encoding="utf-8")
    return d


def test_recognized_by_exact_text_only(tmp_path: Path) -> None:
    assert plain_renderer(QWEN3) is not None and plain_renderer(QWEN3 + "\n") is not None
    # the same template to jinja (one more space inside a tag), but not the same text
    lookalike = QWEN3.replace("{%- if tools %}", "{%- if tools  %}", 1)
    assert lookalike != QWEN3 and plain_renderer(lookalike) is None
    msgs = _chat(2)
    assert load_tokenizer(_model(tmp_path, "qwen3")).chat_template().fast_path == "qwen3"
    jinja_file = load_tokenizer(_model(tmp_path, "file", QWEN3 + "\n"))
    assert jinja_file.chat_template().fast_path == "qwen3"
    other = load_tokenizer(_model(tmp_path, "other", lookalike))
    assert other.chat_template().fast_path is None
    assert other.render_chat(msgs) == jinja_file.render_chat(msgs)
    # an engine's --chat-template: another text keeps jinja, the same text is fast
    over = tmp_path / "over.jinja"
    over.write_text(lookalike, encoding="utf-8")
    assert load_tokenizer(_model(tmp_path, "o1"), chat_template=str(over)) \
        .chat_template().fast_path is None
    over.write_text(QWEN3, encoding="utf-8")
    assert load_tokenizer(_model(tmp_path, "o2"), chat_template=str(over)) \
        .chat_template().fast_path == "qwen3"
    builtin = load_tokenizer(None, chat_template=str(over))
    assert builtin.chat_template.fast_path == "qwen3"
    assert builtin.render_chat(msgs) == _jinja(QWEN3, msgs, None, True, None)


def test_the_plain_path_is_the_one_taken() -> None:
    """A long chat renders many times faster through the known template than through jinja
    (best of 5 each; ~50x here): the fast path is really used, not merely equal."""
    msgs = _chat(43)
    fast, slow = ChatTemplate(QWEN3, variables=VARIABLES), \
        ChatTemplate(QWEN3, variables=VARIABLES, fast=False)

    def best(ct: ChatTemplate) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            ct.render(msgs)
            times.append(time.perf_counter() - t0)
        return min(times)

    assert fast.render(msgs) == slow.render(msgs)
    assert best(fast) * 5 < best(slow), (best(fast), best(slow))


def test_qwen3_real_tokenizer_ids_through_the_plain_path(tmp_path: Path) -> None:
    """The router's call (encode_engine_chat) with Qwen3's real tokenizer.json: the ids of
    jinja's text."""
    import lzma
    d = tmp_path / "q"
    d.mkdir()
    (d / "tokenizer.json").write_bytes(
        lzma.decompress((DATA / "qwen3" / "tokenizer.json.xz").read_bytes()))
    os.symlink(DATA / "qwen3" / "tokenizer_config.json", d / "tokenizer_config.json")
    tok = load_tokenizer(d)
    msgs = _chat(5)
    for kw in (None, {"enable_thinking": False}):
        text = _jinja(QWEN3, msgs, None, True, kw)
        assert tok.encode_engine_chat(msgs, chat_template_kwargs=kw) == tok.encode(text)
