"""The builtin tokenizer's jinja-free ChatML rendering (``chatml_plain``) equals what its
chat template renders, for every chat it takes; everything else still goes to the template."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.tokenize.builtin import SPECIAL_TOKENS, BuiltinTokenizer, chatml_plain

TOK = BuiltinTokenizer()
_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=40) | st.sampled_from(
    ["", "\n", " ", "{{ x }}", "{% raw %}", *SPECIAL_TOKENS])
# a string, or text parts (what vLLM hands this "openai"-format template for every string)
_content = st.lists(_text, max_size=4).map("".join) | st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": _text}), max_size=3)
_role = st.sampled_from(["system", "user", "assistant", "tool", "developer"]) | _text
_message = st.fixed_dictionaries({"role": _role, "content": _content},
                                 optional={"name": _text, "extra": st.integers()})


@settings(max_examples=400, deadline=None)
@given(st.lists(_message, max_size=6), st.booleans())
def test_plain_chats_render_as_the_template_does(messages: list, gen: bool) -> None:
    fast = chatml_plain(messages, gen)
    assert fast is not None
    assert fast == TOK.chat_template.render(messages, add_generation_prompt=gen)
    assert TOK.render_chat(messages, add_generation_prompt=gen) == fast


def test_other_chats_go_to_the_template() -> None:
    calls = [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": {"a": 1}}}]}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                          {"type": "image_url", "image_url": {"url": "x"}}]}]
    for msgs in (calls, parts, [{"content": "no role"}], [{"role": 3, "content": "x"}],
                 [{"role": "user", "content": [{"type": "text", "text": 3}]}]):
        assert chatml_plain(msgs, True) is None
    assert "<tool_call>" in TOK.render_chat(calls)
    assert TOK.render_chat(parts) == TOK.chat_template.render(parts)
    tools = [{"type": "function", "function": {"name": "f"}}]
    msgs = [{"role": "user", "content": "x"}]
    assert TOK.render_chat(msgs, tools=tools) == TOK.chat_template.render(msgs, tools=tools)
    assert "<think>" in TOK.render_chat(msgs, chat_template_kwargs={"enable_thinking": False})
