"""kvwire.tokenize: chats rendered and tokenized exactly as transformers' apply_chat_template
does it (real chat templates, a real tokenizer.json: tests/data/tokenize/README.md), the
built-in tokenizer's determinism and round trip, and clear errors for bad input."""

from __future__ import annotations

import json
import lzma
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import import_or_skip

from kvwire.tokenize import (
    BuiltinTokenizer,
    ChatTemplate,
    HFTokenizer,
    TokenizerError,
    load_tokenizer,
)

DATA = Path(__file__).resolve().parent / "data" / "tokenize"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city <b>now</b> & later; \"quoted\"",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Zürich"},
        "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}


def _call(name: str, args: dict[str, Any], i: int, content: str | None) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": [{
        "id": f"call{i}abcd", "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}]}


# (name, messages, tools, add_generation_prompt, chat_template_kwargs). Every case runs on
# every template: where transformers renders it, the ids must be equal; where transformers
# raises (a template that has no tool turns, say), kvwire must raise TokenizerError.
CORPUS: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None, bool,
                   dict[str, Any] | None]] = [
    ("single", [{"role": "user", "content": "Hello!"}], None, True, None),
    ("system", [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "  Why is the sky blue?\n"}], None, True, None),
    ("multi_turn", [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another, in words, with unicode: naïve façade 東京 🙂"},
        {"role": "assistant", "content": "Eleven."},
        {"role": "user", "content": "And one with <|im_end|> and <|eot_id|> inside?"},
    ], None, True, None),
    ("no_generation_prompt_prefill", [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Autumn moonlight"},
    ], None, False, None),
    ("tools_defined", [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Zürich?"},
    ], [WEATHER, SEARCH], True, None),
    ("tool_round_trip", [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        _call("get_weather", {"city": "Paris"}, 0, ""),
        {"role": "tool", "tool_call_id": "call0abcd", "content": "{\"temp\": 18}"},
        {"role": "tool", "tool_call_id": "call1abcd", "content": "{\"temp\": 24}"},
    ], [WEATHER], True, None),
    ("tool_round_trip_null_content", [
        {"role": "user", "content": "Weather in Oslo?"},
        _call("get_weather", {"city": "Oslo", "unit": "c"}, 0, None),
        {"role": "tool", "tool_call_id": "call0abcd", "content": "{\"temp\": -3}"},
        {"role": "assistant", "content": "It is -3 C in Oslo."},
        {"role": "user", "content": "Thanks"},
    ], [WEATHER], True, None),
    ("thinking_off", [{"role": "user", "content": "2+2?"}], None, True, {"enable_thinking": False}),
    ("thinking_on", [{"role": "user", "content": "2+2?"}], None, True, {"enable_thinking": True}),
    ("reasoning_history", [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "add again"},
    ], None, False, {"enable_thinking": True}),
]


def _reference(transformers: Any, directory: Path) -> Any:
    """transformers' tokenizer for ``directory``, built from tokenizer.json and the config's
    template and special tokens (PreTrainedTokenizerFast: no model-class rewriting)."""
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    specials = {k: (v["content"] if isinstance(v, dict) else v) for k, v in config.items()
                if k.endswith("_token") and isinstance(v, (str, dict))}
    jinja = directory / "chat_template.jinja"
    template = jinja.read_text(encoding="utf-8") if jinja.is_file() else config["chat_template"]
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), chat_template=template, **specials)


def _ref_ids(ref: Any, messages: list[dict[str, Any]], tools: Any, agp: bool,
             kwargs: dict[str, Any] | None) -> list[int]:
    out = ref.apply_chat_template(messages, tools=tools, add_generation_prompt=agp, tokenize=True,
                                  **(kwargs or {}))
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def transformers() -> Any:
    return import_or_skip("transformers", "transformers")


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3's tokenizer.json, decompressed from the vendored .xz."""
    p = tmp_path_factory.mktemp("qwen3") / "tokenizer.json"
    p.write_bytes(lzma.decompress((DATA / "qwen3" / "tokenizer.json.xz").read_bytes()))
    return p


@pytest.fixture(scope="module")
def tiny_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real tokenizers file, for tests of loading rather than of ids."""
    from tokenizers import Tokenizer as _Fast
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    t = _Fast(WordLevel({"[UNK]": 0, "x": 1, "E": 2}, unk_token="[UNK]"))
    t.pre_tokenizer = Whitespace()
    p = tmp_path_factory.mktemp("tiny") / "tokenizer.json"
    t.save(str(p))
    return p


def _vllm_chatml() -> Path | None:
    """vLLM's shipped ChatML template, found without importing vLLM (engines tier)."""
    import importlib.util
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0], "transformers_utils", "chat_templates",
             "template_chatml.jinja")
    return p if p.is_file() else None


def _model_dir(root: Path, tokenizer_json: Path, template: str) -> Path:
    """A model directory: the real tokenizer.json plus one real template's config."""
    d = root / template
    d.mkdir()
    os.symlink(tokenizer_json, d / "tokenizer.json")
    if template == "vllm_chatml":
        src = _vllm_chatml()
        if src is None:
            pytest.skip("vllm is missing (its template_chatml.jinja); `make test` installs it "
                        "(the ENGINES stamp)")
        cfg = {"eos_token": "<|im_end|>", "chat_template": src.read_text(encoding="utf-8")}
        (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    else:
        for f in (DATA / template).iterdir():
            (d / f.name).write_bytes(f.read_bytes())
    return d


@pytest.mark.parametrize("template", ["qwen3", "deepseek_v3", "mistral_v7", "vllm_chatml"])
def test_corpus_equals_transformers(template: str, transformers: Any, tokenizer_json: Path,
                                    tmp_path: Path) -> None:
    """Qwen3's own directory against AutoTokenizer (its Qwen2Tokenizer class); the other
    templates, paired with the same tokenizer.json, against PreTrainedTokenizerFast."""
    d = _model_dir(tmp_path, tokenizer_json, template)
    if template == "qwen3":
        ref = transformers.AutoTokenizer.from_pretrained(str(d))
    else:
        ref = _reference(transformers, d)
    tok = load_tokenizer(d)
    assert isinstance(tok, HFTokenizer)
    assert (tok.eos_token_id, tok.vocab_size) == (ref.eos_token_id, len(ref))
    rendered = 0
    for name, messages, tools, agp, kwargs in CORPUS:
        try:
            want = _ref_ids(ref, messages, tools, agp, kwargs)
        except Exception as e:  # the template cannot render this case: neither may we
            with pytest.raises(TokenizerError):
                tok.encode_chat(messages, tools=tools, add_generation_prompt=agp,
                                chat_template_kwargs=kwargs)
            print(f"{template}/{name}: both raise ({type(e).__name__})")
            continue
        text = tok.render_chat(messages, tools=tools, add_generation_prompt=agp,
                               chat_template_kwargs=kwargs)
        assert text == ref.apply_chat_template(messages, tools=tools, add_generation_prompt=agp,
                                               tokenize=False, **(kwargs or {})), (template, name)
        assert tok.encode_chat(messages, tools=tools, add_generation_prompt=agp,
                               chat_template_kwargs=kwargs) == want, (template, name)
        rendered += 1
    assert rendered >= 6, f"{template}: only {rendered} of {len(CORPUS)} cases rendered"
    text = "Hello <|im_start|>wörld\n\n  code:  x = 1 # 🙂 <｜User｜>"
    ids = tok.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == ref.encode(text, add_special_tokens=True)
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == text


#: Chats whose last (assistant) message is continued: a string, parts, trailing space.
_CONTINUED = [
    [{"role": "user", "content": "tell a story"}, {"role": "assistant", "content": "Once upon"}],
    [{"role": "system", "content": "brief"}, {"role": "user", "content": "q"},
     {"role": "assistant", "content": "The answer is "}],
    [{"role": "user", "content": "q"},
     {"role": "assistant", "content": [{"type": "text", "text": "part one"},
                                       {"type": "text", "text": "part two"}]}],
]


@pytest.mark.parametrize("template", ["qwen3", "deepseek_v3", "mistral_v7", "vllm_chatml"])
def test_continue_final_message_equals_transformers(template: str, transformers: Any,
                                                    tokenizer_json: Path,
                                                    tmp_path: Path) -> None:
    """``continue_final_message``: the text ends where the last message's content does, cut
    where transformers cuts it (vLLM's ``continue_final_message`` goes to it)."""
    d = _model_dir(tmp_path, tokenizer_json, template)
    ref = (transformers.AutoTokenizer.from_pretrained(str(d)) if template == "qwen3"
           else _reference(transformers, d))
    tok = load_tokenizer(d)
    compared = 0
    for messages in _CONTINUED:
        try:
            want = ref.apply_chat_template(messages, add_generation_prompt=False,
                                           continue_final_message=True, tokenize=False)
        except Exception:  # the template cannot render it (parts): neither may we
            with pytest.raises(TokenizerError):
                tok.render_chat(messages, add_generation_prompt=False,
                                continue_final_message=True)
            continue
        got = tok.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
        assert got == want, (template, messages)
        if template == "qwen3":  # it ends every turn, the last one included
            assert got != tok.render_chat(messages, add_generation_prompt=False)
        compared += 1
    assert compared >= 2, template
    with pytest.raises(TokenizerError, match="no content"):
        tok.render_chat([{"role": "user", "content": "q"}, {"role": "assistant"}],
                        add_generation_prompt=False, continue_final_message=True)


@pytest.mark.parametrize("template", ["deepseek_v3", "mistral_v7"])
def test_a_given_chat_template_renders_as_transformers_given_it(
        template: str, transformers: Any, tokenizer_json: Path, tmp_path: Path) -> None:
    """``--chat-template`` (vLLM's): Qwen3's directory rendered with another model's
    template, given as a file and inline, equals transformers' ``apply_chat_template(
    chat_template=...)`` with the directory's special tokens."""
    d = _model_dir(tmp_path, tokenizer_json, "qwen3")
    jinja = DATA / template / "chat_template.jinja"
    src = jinja.read_text(encoding="utf-8") if jinja.is_file() else json.loads(
        (DATA / template / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    f = tmp_path / "given.jinja"
    f.write_text(src, encoding="utf-8")
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    for tok in (load_tokenizer(d, chat_template=str(f)), load_tokenizer(d, chat_template=src)):
        assert tok.chat_template().source == src
        rendered = 0
        for name, messages, tools, agp, kwargs in CORPUS:
            try:
                want = ref.apply_chat_template(messages, tools=tools, add_generation_prompt=agp,
                                               tokenize=False, chat_template=src,
                                               **(kwargs or {}))
            except Exception:  # noqa: BLE001 - the template cannot render it: skip
                continue
            assert tok.render_chat(messages, tools=tools, add_generation_prompt=agp,
                                   chat_template_kwargs=kwargs) == want, (template, name)
            rendered += 1
        assert rendered >= 6, template


def test_chat_template_options_and_their_errors(tmp_path: Path) -> None:
    """A path that cannot be read, a template that does not compile, an unknown content
    format: each a TokenizerError naming it. The content format given wins over the
    template's own (vLLM's --chat-template-content-format)."""
    with pytest.raises(TokenizerError, match="nope.jinja. looks like a file path"):
        load_tokenizer(None, chat_template=str(tmp_path / "nope.jinja"))
    with pytest.raises(TokenizerError, match="inline chat template.*does not compile"):
        load_tokenizer(None, chat_template="{{ broken")
    with pytest.raises(TokenizerError, match="content format 'markdown'"):
        load_tokenizer(None, content_format="markdown")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    assert load_tokenizer(None).content_format() == "openai"
    joined = load_tokenizer(None, content_format="string")
    assert joined.content_format() == "string"
    assert joined.engine_messages(parts) == [{"role": "user", "content": "a\nb"}]
    plain = load_tokenizer(None, chat_template="{% for m in messages %}[{{ m.role }}] "
                                               "{{ m.content }}\n{% endfor %}")
    assert plain.render_chat([{"role": "user", "content": "hi"}]) == "[user] hi\n"


def test_turn_cache_equals_whole_text_encode(tokenizer_json: Path, tiny_json: Path,
                                             tmp_path: Path) -> None:
    """encode() caches the pieces between added tokens; ids must equal one tokenizers
    encode of the whole text, for random texts full of added tokens, cold and warm."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as _Fast
    d = tmp_path / "q"
    d.mkdir()
    os.symlink(tokenizer_json, d / "tokenizer.json")
    tok = load_tokenizer(d)
    whole = _Fast.from_file(str(tokenizer_json))
    rng = random.Random(5)
    alphabet = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<|endoftext|>",
                "<|im_start", "|>", "<", "user", " hello", "\n", "\n\n", " ", "  ", "é", "́",
                "東京", "🙂", "'s", "123", "x"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(300)]
    for _ in range(2):  # cold, then from the cache
        for t in texts:
            assert tok.encode(t) == whole.encode(t, add_special_tokens=False).ids, repr(t)
    assert tok.segments._whole, "the turn cache was never used"
    # An added token that strips the space before it: only a whole-text encode is exact.
    d2 = tmp_path / "lstrip"
    d2.mkdir()
    t2 = _Fast.from_file(str(tiny_json))
    t2.add_special_tokens([AddedToken("<E>", lstrip=True)])
    t2.save(str(d2 / "tokenizer.json"))
    tok2 = load_tokenizer(d2)
    assert tok2.encode("x   <E> x") == t2.encode("x   <E> x", add_special_tokens=False).ids
    assert tok2.segments.splitter is None and tok2.segments.store is None
    assert "whole texts only" in tok2.prefix_reason


# Environment features no real template above exercises, each compared with transformers.
FEATURES = {
    "tojson_options": "{{ tools | tojson(indent=2) }}|{{ tools[0] | tojson(separators=(',', ':'),"
                      " sort_keys=true) }}|{{ {'a': '<é>'} | tojson }}",
    "loopcontrols": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                    "{{ m.content }}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}",
    "generation_tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                      "{{ m.content }}{% endgeneration %}{% else %}[{{ m.content }}]{% endif %}"
                      "{% endfor %}",
    "strftime_and_specials": "{{ strftime_now('%Y') }} {{ bos_token }}|{{ eos_token }}|"
                             "{{ custom }}|{{ add_generation_prompt }}",
    "trim_and_lstrip_blocks": "  {% if true %}\n{{ messages[0].content }}\n  {% endif %}\nend",
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_environment_features_equal_transformers(feature: str, transformers: Any) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template
    source = FEATURES[feature]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    variables = {"bos_token": "<s>", "eos_token": "<|im_end|>"}
    kwargs = {"custom": "c<&>"}
    (want,), _ = render_jinja_template(conversations=[messages], tools=[WEATHER],
                                       chat_template=source, add_generation_prompt=True,
                                       **variables, **kwargs)
    ours = ChatTemplate(source, variables=variables)
    assert ours.render(messages, tools=[WEATHER], chat_template_kwargs=kwargs) == want


def test_template_errors_and_sandbox() -> None:
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(TokenizerError, match="only user turns please"):
        ChatTemplate("{{ raise_exception('only user turns please') }}").render(msgs)
    with pytest.raises(TokenizerError, match="line 1"):
        ChatTemplate("{% for m in messages %}", origin="broken.jinja")
    # ImmutableSandboxedEnvironment: no mutating the caller's list, no dunder escapes.
    with pytest.raises(TokenizerError, match="unsafe|not safely|access"):
        ChatTemplate("{{ messages.append(1) }}").render(msgs)
    with pytest.raises(TokenizerError, match="unsafe|not safely|access"):
        ChatTemplate("{{ ''.__class__.__mro__ }}").render(msgs)
    assert msgs == [{"role": "user", "content": "x"}]
    with pytest.raises(TokenizerError, match="messages must be a list of dicts"):
        ChatTemplate("{{ messages }}").render("hello")  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match="chat_template_kwargs must be a dict"):
        ChatTemplate("x").render(msgs, chat_template_kwargs=["enable_thinking"])  # type: ignore[arg-type]


def test_bad_paths(tmp_path: Path, tiny_json: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist") as e:
        load_tokenizer(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(e.value)
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(TokenizerError, match="not a directory"):
        load_tokenizer(tmp_path / "notes.txt")
    with pytest.raises(TokenizerError, match="must be a str or path"):
        load_tokenizer(42)  # type: ignore[arg-type]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{\"model\": 1}")
    with pytest.raises(TokenizerError, match="not a loadable tokenizers file"):
        load_tokenizer(bad)
    # A good tokenizer.json with a broken or missing template: loading or rendering says so.
    d = tmp_path / "model"
    d.mkdir()
    os.symlink(tiny_json, d / "tokenizer.json")
    assert isinstance(load_tokenizer(d / "tokenizer.json"), HFTokenizer)  # the file names its dir
    with pytest.raises(TokenizerError, match="no chat template"):
        load_tokenizer(d).render_chat([{"role": "user", "content": "x"}])
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(TokenizerError, match="chat_template must be a string or a list"):
        load_tokenizer(d)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: cannot read JSON"):
        load_tokenizer(d)
    (d / "tokenizer_config.json").unlink()
    (d / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(TokenizerError, match="chat_template.jinja: chat template does not compile"):
        load_tokenizer(d)


def test_named_templates_and_jinja_file_precedence(tmp_path: Path, tiny_json: Path) -> None:
    """As transformers picks: chat_template.jinja over the config; tool_use when tools."""
    d = tmp_path / "m"
    d.mkdir()
    os.symlink(tiny_json, d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "E", "chat_template": [
        {"name": "default", "template": "D{{ eos_token }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"}]}))
    tok = load_tokenizer(d)
    assert tok.render_chat([]) == "DE"
    assert tok.render_chat([], tools=[WEATHER]) == "T1"
    (d / "chat_template.jinja").write_text("J{{ eos_token }}")
    assert load_tokenizer(d).render_chat([], tools=[WEATHER]) == "JE"


def test_encode_chat_adds_no_special_tokens(tmp_path: Path, tiny_json: Path) -> None:
    """The template writes BOS itself: encode_chat must not let the post-processor add a
    second one; plain encode(add_special_tokens=True) does add it. chat_template_kwargs
    override the config's special tokens, as in transformers."""
    from tokenizers import Tokenizer as _Fast
    from tokenizers.processors import TemplateProcessing
    t = _Fast.from_file(str(tiny_json))
    t.post_processor = TemplateProcessing(single="E $A", special_tokens=[("E", 2)])
    d = tmp_path / "bos"
    d.mkdir()
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "E", "chat_template": "{{ bos_token }} {% for m in messages %}{{ m.content }} {% endfor %}"}))
    tok = load_tokenizer(d)
    assert tok.bos_token_id == 2
    msgs = [{"role": "user", "content": "x x"}]
    assert tok.encode_chat(msgs) == [2, 1, 1]
    assert tok.encode("x", add_special_tokens=True) == [2, 1]
    assert tok.render_chat(msgs, chat_template_kwargs={"bos_token": "B"}) == "B x x "


TEXTS = ["", "a", "Hello, world!", "  leading and trailing  \n\t", "naïve façade 東京 🙂 \x00\x7f",
         "<|im_start|>user\nhi<|im_end|>\n", "odd bytes: é", "x" * 1001, "<s></s><unk>"]


def test_builtin_round_trip_and_specials() -> None:
    tok = load_tokenizer(None)
    assert isinstance(tok, BuiltinTokenizer)
    for t in TEXTS:
        ids = tok.encode(t)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids, skip_special_tokens=False) == t
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 3 and ids[-1] == tok.eos_token_id
    assert tok.decode(ids) == "user\nhi"
    assert tok.encode("hi", add_special_tokens=True)[0] == tok.bos_token_id
    assert len(tok.encode("The quick brown fox jumps")) == 13  # ~2 bytes a token
    with pytest.raises(TokenizerError, match="outside the builtin vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TokenizerError, match="encode takes a str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_builtin_chat_prefix_stable() -> None:
    """A longer conversation's ids extend the shorter one's: what prefix caching needs."""
    tok = BuiltinTokenizer()
    name, msgs, *_ = CORPUS[2]
    for k in range(1, len(msgs)):
        short = tok.encode_chat(msgs[:k], add_generation_prompt=False)
        assert tok.encode_chat(msgs[:k + 1])[:len(short)] == short
    text = tok.render_chat(CORPUS[5][1], tools=[WEATHER], chat_template_kwargs={"enable_thinking": False})
    assert "<tool_call>{\"name\": \"get_weather\"" in text and text.endswith("<think>\n\n</think>\n\n")
    assert "\"description\": \"Weather for a city <b>now</b> & later" in text  # tojson unescaped


def test_builtin_deterministic_across_processes() -> None:
    tok = BuiltinTokenizer()
    msgs = CORPUS[2][1]
    code = ("import json,sys; from kvwire.tokenize import load_tokenizer; t=load_tokenizer(None); "
            "print(json.dumps([t.encode(x) for x in json.loads(sys.argv[1])] + "
            "[t.encode_chat(json.loads(sys.argv[2]))]))")
    want = [tok.encode(t) for t in TEXTS] + [tok.encode_chat(msgs)]
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code, json.dumps(TEXTS), json.dumps(msgs)],
                             capture_output=True, text=True, timeout=60, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert json.loads(out.stdout) == want
