"""Message content handed to the chat template as vLLM hands it (tokenize/content.py): the
template's content format detected as vLLM detects it, text parts joined for a template
that takes strings, and the proxy and the engine both tokenizing that way."""

from __future__ import annotations

import glob
import json
import lzma
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvwire.consume.engine_spec import EngineSpec
from kvwire.engine.server.app import EngineApp
from kvwire.routing.policy import RoundRobinPolicy
from kvwire.tokenize import TokenizerError, load_tokenizer
from kvwire.tokenize.builtin import CHATML_TEMPLATE
from kvwire.tokenize.content import (
    as_engine_messages,
    as_engine_tools,
    content_format,
    engine_template_kwargs,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_helpers import import_or_skip  # noqa: E402
from test_engine_http import EngineThread, _opts  # noqa: E402
from test_proxy import TIMEOUT, Stack  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "tokenize"


def _bundled() -> dict[str, str]:
    return {
        "qwen3": json.loads((DATA / "qwen3/tokenizer_config.json").read_text())["chat_template"],
        "deepseek_v3": json.loads((DATA / "deepseek_v3/tokenizer_config.json").read_text()
                                  )["chat_template"],
        "mistral_v7": (DATA / "mistral_v7/chat_template.jinja").read_text(),
        "builtin": CHATML_TEMPLATE,
    }


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("qwen3")
    shutil.copy(DATA / "qwen3/tokenizer_config.json", d)
    (d / "tokenizer.json").write_bytes(lzma.decompress(
        (DATA / "qwen3/tokenizer.json.xz").read_bytes()))
    return str(d)


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: str) -> Any:
    return load_tokenizer(qwen3_dir)


def test_bundled_templates_formats() -> None:
    """Qwen3's and DeepSeek-V3's templates use content as a string; Mistral's loops over
    it in a macro it is passed to; kvwire's builtin ChatML loops over it directly."""
    got = {k: content_format(v) for k, v in _bundled().items()}
    assert got == {"qwen3": "string", "deepseek_v3": "string", "mistral_v7": "openai",
                   "builtin": "openai"}


@pytest.mark.parametrize("source, fmt", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
     "openai"),
    ("{% for m in messages %}{% for p in m['content'] | selectattr('type') %}{% endfor %}"
     "{% endfor %}", "openai"),
    ("{% set rest = messages[1:] %}{% for m in rest %}{% for p in m.content %}{% endfor %}"
     "{% endfor %}", "openai"),
    ("{% set ns = namespace(msgs=messages) %}{% for m in ns.msgs %}{% for p in m.content %}"
     "{% endfor %}{% endfor %}", "openai"),
    ("{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ show(m.content) }}{% endfor %}", "openai"),
    ("{% macro show(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ show(m.role) }}{% endfor %}", "string"),
    ("{% for m in messages %}{% set content = m.content %}{% for p in content %}{% endfor %}"
     "{% endfor %}", "openai"),
    ("{% for x in tools %}{% for p in x.content %}{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %}{{ m.content", "string"),  # does not parse: vLLM's default
])
def test_content_format_cases(source: str, fmt: str) -> None:
    assert content_format(source) == fmt


def test_same_decision_as_vllm_on_every_template_at_hand() -> None:
    """The bundled templates and every .jinja template of the installed packages (vLLM's,
    SGLang's, ...), against vLLM's own detection (the engines tier)."""
    import_or_skip("vllm", "vllm")
    hf = import_or_skip("vllm.renderers.hf", "vllm")
    sources = _bundled()
    site = Path(pytest.__file__).resolve().parent.parent  # the venv's site-packages
    for f in glob.glob(str(site / "**" / "*.jinja"), recursive=True):
        sources[f] = Path(f).read_text(errors="replace")
    assert len(sources) > 10, f"too few templates found in {site}"
    differ = {k: (content_format(v), hf._detect_content_format(v, default="string"))
              for k, v in sources.items()}
    differ = {k: v for k, v in differ.items() if v[0] != v[1]}
    assert not differ, differ


def test_as_engine_messages() -> None:
    parts = [{"role": "system", "content": "sys"},
             {"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "input_text", "text": "b"}]},
             {"role": "user", "content": [{"type": "text", "text": "c"},
                                          {"type": "image_url", "image_url": {"url": "x"}}]},
             {"role": "assistant", "content": None, "tool_calls": []}]
    out = as_engine_messages(parts, "string")
    assert out[1] == {"role": "user", "content": "a\nb"}
    assert out[0] is parts[0] and out[2] is parts[2]  # as they were (an image: left as is)
    assert out[3] == {"role": "assistant", "content": ""}  # None as "", no empty tool_calls
    assert parts[1]["content"][0] == {"type": "text", "text": "a"}  # the caller's: untouched
    assert parts[3] == {"role": "assistant", "content": None, "tool_calls": []}
    out = as_engine_messages(parts, "openai")
    assert out[0] == {"role": "system", "content": [{"type": "text", "text": "sys"}]}
    assert out[1]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert out[2] is parts[2] and out[3] == {"role": "assistant", "content": []}
    plain = [{"role": "user", "content": "hi"}]
    assert as_engine_messages(plain, "string") is plain  # nothing to change: the same list
    assert as_engine_messages("not a list", "string") == "not a list"


def test_engine_messages_tool_calls_keys_and_tool_turns() -> None:
    """What else vLLM's chat parser changes before the template sees a conversation:
    tool-call arguments (a JSON string from OpenAI clients) become an object, a tool's
    text parts a string, reasoning is given under both names, keys it does not read are
    dropped, and Claude Code's per-request billing line leaves the system prompt."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    bad = [{"id": "c2", "type": "function", "function": {"name": "g", "arguments": a}}
           for a in ("not json", "[1, 2]", "", None)]
    msgs = [{"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-"
                                            "header: cch=42\nbe brief"}]},
            {"role": "user", "content": "hi", "name": "ann", "extra": 1},
            {"role": "assistant", "content": None, "tool_calls": [call, *bad],
             "reasoning": "think"},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "1"},
                                                               {"type": "text", "text": "2"}]}]
    for fmt in ("string", "openai"):
        out = as_engine_messages(msgs, fmt)
        wrap = (lambda t: t) if fmt == "string" else (lambda t: [{"type": "text", "text": t}])
        assert out[0] == {"role": "system", "content": wrap("be brief")}
        assert out[1] == {"role": "user", "content": wrap("hi"), "name": "ann"}
        assert out[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
        assert [c["function"]["arguments"] for c in out[2]["tool_calls"][1:]] == [{}] * 4
        assert out[2]["reasoning"] == out[2]["reasoning_content"] == "think"
        assert out[2]["content"] == ("" if fmt == "string" else [])
        assert out[3] == {"role": "tool", "content": "1\n2", "tool_call_id": "c1"}
    assert call["function"]["arguments"] == '{"x": 1}'  # the caller's objects: untouched
    older = [{"role": "assistant", "content": "a", "reasoning_content": "r"}]  # vLLM's request
    assert as_engine_messages(older, "string")[0]["reasoning"] == "r"  # model renames it


def test_engine_tools_as_vllm_serialises_them() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                               "x-extra": 1}},
             {"type": "function", "function": {"name": "g", "description": "d",
                                               "strict": True}, "defer_loading": False}]
    assert as_engine_tools(tools) == [
        {"type": "function", "function": {"name": "f", "description": None,
                                          "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g", "description": "d", "parameters": None,
                                          "strict": True, "defer_loading": False},
         "defer_loading": False}]
    assert tools[0]["function"]["x-extra"] == 1  # the caller's: untouched
    odd = [{"type": "function", "function": {"description": "no name"}}]
    assert as_engine_tools(odd) is odd and as_engine_tools(None) is None


# A corpus of conversations for the comparison with vLLM's own parser (below).
_CORPUS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "input_text", "text": "b"},
        {"type": "text", "text": None}]}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}},
        {"id": "2", "type": "function", "function": {"name": "g", "arguments": "nope"}},
        {"id": "3", "type": "function", "function": {"name": "h", "arguments": ""}}]},
     {"role": "tool", "tool_call_id": "1", "content": "r1"},
     {"role": "tool", "tool_call_id": "2", "content": [{"type": "text", "text": "r2"},
                                                       {"type": "text", "text": "r3"}]}],
    [{"role": "assistant", "content": "a", "tool_calls": [], "reasoning": "r", "x": 1},
     {"role": "user", "content": "u", "name": "n", "task": "t"},
     {"role": "developer", "content": "d"}],
    [{"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: "
                                                              "cch=1\nrest"}]},
     {"role": "user", "content": [{"type": "output_text", "text": "o"}]}],
]


def test_engine_messages_equal_vllms_own_parse() -> None:
    """Every conversation of the corpus, in both content formats, against vLLM 0.33's
    ``parse_chat_messages`` (the engines tier). vLLM's function needs its model config for
    two flags only (prompt embeds, multimodal); a stand-in object gives them, the one part
    of this test that is not vLLM's own."""
    import_or_skip("vllm", "vllm")
    cm = import_or_skip("vllm.renderers.chat_utils.chat_message", "vllm")
    import copy
    import types

    cfg = types.SimpleNamespace(enable_prompt_embeds=False, multimodal_config=None,
                                is_multimodal_model=False)
    for msgs in _CORPUS:
        for fmt in ("string", "openai"):
            want, _, _ = cm.parse_chat_messages(copy.deepcopy(msgs), cfg, fmt)
            assert as_engine_messages(msgs, fmt) == want, (fmt, msgs)


def test_engine_tools_equal_vllms_request_model() -> None:
    proto = import_or_skip("vllm.entrypoints.openai.chat_completion.protocol", "vllm")
    tools = [{"type": "function", "function": {"name": "f"}},
             {"type": "function", "function": {"name": "g", "description": "d", "parameters": {
                 "type": "object", "properties": {"x": {"type": "string"}}}, "strict": False,
                 "other": 1}, "defer_loading": True}]
    want = [proto.ChatCompletionToolsParam(**t).model_dump() for t in tools]
    assert as_engine_tools(tools) == want


def _parts_chat(system: str, user: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": [{"type": "text", "text": user},
                                         {"type": "text", "text": "thanks"}]}]


def _joined_chat(system: str, user: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"{user}\nthanks"}]


def test_qwen3_parts_tokenize_as_vllm_joins_them(qwen3: Any) -> None:
    """Rendered as transformers does, Qwen3's template writes empty turns for content in
    parts; handed over as vLLM does, the ids equal the joined text's."""
    parts, joined = _parts_chat("be brief", "hello"), _joined_chat("be brief", "hello")
    assert qwen3.content_format() == "string"
    want = qwen3.encode_chat(joined)
    assert qwen3.encode_chat(qwen3.engine_messages(parts)) == want
    try:  # what the router tokenized before: Qwen3's template fails on a list (the proxy
        before = qwen3.encode_chat(parts)  # answered 400), or other ids
    except TokenizerError:
        before = None
    assert before != want


def _parses(fn: Callable[[], Any]) -> int:
    """How many chat templates ``fn`` parsed to read how they take content."""
    before = content_format.cache_info().misses
    fn()
    return content_format.cache_info().misses - before


def test_warm_reads_the_template_before_the_first_chat(qwen3_dir: str) -> None:
    """``warm()`` does the chat path's one-time work (the template parsed for its content
    format: 20-50 ms for Qwen3's), so the first chat rendered after it parses nothing."""
    chat = [{"role": "user", "content": "hello"}]
    content_format.cache_clear()
    cold = load_tokenizer(qwen3_dir)
    assert _parses(lambda: cold.render_engine_chat(chat)) == 1
    content_format.cache_clear()
    tok = load_tokenizer(qwen3_dir)
    assert _parses(tok.warm) == 1
    assert _parses(lambda: tok.render_engine_chat(chat)) == 0
    assert tok.render_engine_chat(chat) == cold.render_engine_chat(chat)


def test_servers_warm_their_tokenizer_before_they_serve(qwen3_dir: str) -> None:
    """``kvwire engine``'s app and ``kvwire serve``'s service (its proxy) read their
    template when they are built, before they serve: a fleet's first requests (a burst to
    every engine at once) waited for it, in the router and in each engine."""
    from kvwire.serve.build import ServeConfig, build

    content_format.cache_clear()
    EngineApp(_opts(), load_tokenizer(qwen3_dir))
    assert content_format.cache_info().currsize == 1
    content_format.cache_clear()
    svc = build(ServeConfig(engines=[EngineSpec("h", "tcp://127.0.0.1:9",
                                                url="http://127.0.0.1:9")],
                            port=0, tokenizer=qwen3_dir))
    try:
        assert content_format.cache_info().currsize == 1
    finally:
        svc.close()


def test_template_kwargs_equal_vllms_chat_request() -> None:
    """The template variables of a chat request (its kwargs overridden by its fields,
    ``enable_thinking`` from an effort) equal vLLM 0.33's ``build_chat_params``."""
    proto = import_or_skip("vllm.entrypoints.openai.chat_completion.protocol", "vllm")
    cases: list[dict[str, Any]] = [
        {}, {"reasoning_effort": "none"}, {"reasoning_effort": "high"},
        {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False, "x": 1}},
        {"add_generation_prompt": False, "continue_final_message": True},
        {"documents": [{"title": "t", "text": "x"}]},
        {"chat_template_kwargs": {"add_generation_prompt": False, "reasoning_effort": "low",
                                  "documents": "d"}},
    ]
    for extra in cases:
        req = proto.ChatCompletionRequest(model="m", messages=[{"role": "user",
                                                                "content": "hi"}], **extra)
        want = req.build_chat_params(None, "auto").chat_template_kwargs
        got = engine_template_kwargs(
            extra.get("chat_template_kwargs"),
            add_generation_prompt=extra.get("add_generation_prompt", True),
            continue_final_message=extra.get("continue_final_message", False),
            reasoning_effort=extra.get("reasoning_effort"), documents=extra.get("documents"))
        assert got == want, extra


def _fleet_tokenizes_as(qwen3: Any, body: dict[str, Any], want: list[int],
                        tokenize: dict[str, Any] | None = None) -> None:
    """Both sides of a kvwire fleet with Qwen3's tokenizer give ``body`` the ids ``want``:
    the engine's /tokenize (of ``tokenize``, default ``body``), the ids the proxy routes
    the chat completion with (a spy on the real route_proxy) with its own tokenizer and
    with ``--tokenizer engine`` (the engine's /tokenize), and the prompt tokens the engine
    reports for it."""
    engines = [EngineThread(_opts(model="m"), qwen3) for _ in range(2)]
    try:
        r = httpx.post(engines[0].url + "/tokenize", json=tokenize or body, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["tokens"] == want, r.text
        for mode in (qwen3, "engine"):
            s = Stack(engines, tokenizer=mode, policy=RoundRobinPolicy())
            try:
                seen: list[list[int]] = []
                real = s.core.route_proxy

                def spy(tokens: Any, *a: Any, seen: list[Any] = seen, real: Any = real) -> Any:
                    seen.append(list(tokens))
                    return real(tokens, *a)

                s.core.route_proxy = spy  # type: ignore[method-assign]
                r = httpx.post(s.url + "/v1/chat/completions", timeout=TIMEOUT,
                               json={**body, "max_tokens": 2})
                assert r.status_code == 200, r.text
                assert seen == [want], mode
                assert r.json()["usage"]["prompt_tokens"] == len(want)  # the engine's count
            finally:
                s.close()
    finally:
        for e in engines:
            e.close()


def test_proxy_and_engine_tokenize_parts_as_vllm(qwen3: Any) -> None:
    """Content in parts, handed to Qwen3's template joined, as vLLM does, on both sides."""
    parts, joined = _parts_chat("be brief", "hello"), _joined_chat("be brief", "hello")
    _fleet_tokenizes_as(qwen3, {"model": "m", "messages": parts}, qwen3.encode_chat(joined))


def test_proxy_and_engine_tokenize_a_tool_chat_as_vllm(qwen3: Any) -> None:
    """An agent's turn as OpenAI clients send it (tools with only a name and parameters,
    tool-call arguments as a compact JSON string): Qwen3's template writes the tools and
    the arguments as JSON, so what vLLM hands it (tools re-serialised, arguments parsed)
    is other text than the client's dicts; the proxy routes with, and the engine counts,
    vLLM's ids."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]
    msgs = [{"role": "user", "content": "add 1"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "add", "arguments": '{"a":1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    want = qwen3.encode_chat(as_engine_messages(msgs, "string"), tools=as_engine_tools(tools))
    raw = [{**m, "content": m["content"] or ""} for m in msgs]  # (None: the template fails)
    assert want != qwen3.encode_chat(raw, tools=tools)  # the client's dicts: other ids
    _fleet_tokenizes_as(qwen3, {"model": "m", "messages": msgs, "tools": tools}, want)


def test_proxy_and_engine_render_a_reasoning_effort_as_vllm(qwen3: Any) -> None:
    """``reasoning_effort: "none"`` is ``enable_thinking=False`` for the template in vLLM:
    Qwen3's writes an empty think block into the generation prompt. The proxy routes with,
    and the engine counts, those ids; an unfinished answer is continued, not re-opened."""
    msgs = [{"role": "user", "content": "hi"}]
    want = qwen3.encode_chat(msgs, chat_template_kwargs={"enable_thinking": False})
    assert want != qwen3.encode_chat(msgs)
    _fleet_tokenizes_as(qwen3, {"model": "m", "messages": msgs, "reasoning_effort": "none"},
                        want, tokenize={"model": "m", "messages": msgs, "chat_template_kwargs":
                                        {"enable_thinking": False}})
    cont = [*msgs, {"role": "assistant", "content": "Hello the"}]
    want = qwen3.encode_chat(cont, add_generation_prompt=False, continue_final_message=True)
    assert want == qwen3.encode_chat(cont, add_generation_prompt=False)[:len(want)]
    _fleet_tokenizes_as(qwen3, {"model": "m", "messages": cont, "add_generation_prompt": False,
                                "continue_final_message": True}, want)


def test_builtin_template_takes_every_turn_in_parts() -> None:
    """kvwire engine's ChatML template ("openai" format: vLLM would hand it parts) renders a
    conversation in parts, system turn and tools included, as the same one in strings."""
    tok = load_tokenizer(None)
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in plain]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for t in (None, tools):
        assert tok.encode_chat(parts, tools=t) == tok.encode_chat(plain, tools=t)
