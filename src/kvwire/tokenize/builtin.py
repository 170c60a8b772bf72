"""A tokenizer that needs no files, so ``kvwire engine`` runs with no model directory.

Deterministic across processes and machines (no hashing with a per-process seed, no
vocabulary file) and exactly reversible. The text is split into pieces -- a word with the
space before it, a run of punctuation, a run of other whitespace -- and each piece's UTF-8
bytes are cut into 2-byte chunks from the piece's start (a last odd byte alone). So a word
always gives the same ids wherever it stands, and two prompts sharing a prefix of words
share a prefix of ids, which is what prefix caching and KV-aware routing look at.

Ids: 0..15 special tokens (``<|endoftext|>``, ``<s>``, ``</s>``, ``<|im_start|>``,
``<|im_end|>``, ...), 16..271 single bytes, 272..65807 byte pairs; vocab_size 65808.
Special-token strings in the text are matched first and become their ids. About 2 bytes a
token: English prose gives roughly twice the ids a BPE tokenizer would. The chat template
is ChatML (system, user, assistant, tool turns; tools listed in the system turn as JSON),
rendered in the same sandbox as a model's template."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from kvwire.tokenize import native
from kvwire.tokenize.base import Plan, Tokenizer, TokenizerError
from kvwire.tokenize.prefix import BUILTIN_CUTS, PrefixStore
from kvwire.tokenize.segments import Segments
from kvwire.tokenize.template import ChatTemplate

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>", "<unk>",
    "<tool_call>", "</tool_call>", "<think>", "</think>",
)
N_SPECIAL = 16
BYTE_BASE = N_SPECIAL
PAIR_BASE = BYTE_BASE + 256
VOCAB_SIZE = PAIR_BASE + 65536
SEGMENT_CACHE_SIZE = 1024  # text between special tokens (chat turns) kept encoded: ~25 MB at most
#: Characters a chunk of a long text holds at least: re-tokenizing one costs the C encoder
#: microseconds, so fewer, longer chunks (fewer lookups) pay.
BUILTIN_CHUNK = 2048

# <think> etc. are ordinary text to a real ChatML model too (they are added tokens there
# as well); the ones the template writes are the ones that matter.
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in sorted(SPECIAL_TOKENS, key=len,
                                                                   reverse=True)))
_PIECE_RE = re.compile(r" ?\w+| ?[^\w\s]+|\s+")
_SPECIAL_ID = {t: i for i, t in enumerate(SPECIAL_TOKENS)}

CHATML_TEMPLATE = """\
{%- macro text(content) %}{% if content is string %}{{- content }}{% elif content %}{% for part in content %}{% if part.type == 'text' %}{{- part.text }}{% endif %}{% endfor %}{% endif %}{% endmacro %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- text(messages[0].content) + '\\n\\n' }}{% endif %}
{{- 'You may call these tools; reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>:\\n' }}
{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{% endfor %}
{{- '<|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
{{- '<|im_start|>' + message.role + '\\n' }}
{{- text(message.content) }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{{- '<tool_call>' + {'name': fn.name, 'arguments': fn.arguments} | tojson + '</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{% endif %}
{%- endif %}
"""


def chatml_plain(messages: Any, add_generation_prompt: bool) -> str | None:
    """What :data:`CHATML_TEMPLATE` renders for the common chat (each message a ``role``
    and a ``content`` that is a string or text parts, as vLLM hands this "openai"-format
    template every string; no tool calls; no tools or template kwargs), without jinja:
    the sandboxed render cost ~25 us a request, a fifth of the proxy's CPU for a short chat.
    None for anything else (the template renders it). Equality with the template: a
    property test (tests/test_chatml_plain.py)."""
    if type(messages) is not list:
        return None
    parts = []
    for m in messages:
        if type(m) is not dict or "tool_calls" in m:
            return None
        role, content = m.get("role"), m.get("content")
        if type(content) is list:
            texts = []
            for part in content:
                if type(part) is not dict or part.get("type") != "text" \
                        or type(part.get("text")) is not str:
                    return None
                texts.append(part["text"])
            content = "".join(texts)
        if type(role) is not str or type(content) is not str:
            return None
        parts.append("<|im_start|>" + role + "\n" + content + "<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


_WORKER: BuiltinTokenizer | None = None


def encode_texts(texts: list[str], special: bool = False) -> list[Sequence[int]]:
    """The ids of each of ``texts`` (text between special tokens), in a worker process."""
    global _WORKER
    if _WORKER is None:
        _WORKER = BuiltinTokenizer()
    return _WORKER._encode_texts(texts)


class BuiltinTokenizer(Tokenizer):
    """The no-files tokenizer (module docstring: the scheme and the id layout)."""

    def __init__(self) -> None:
        self.name = "builtin"
        self.bos_token_id = _SPECIAL_ID["<s>"]
        self.eos_token_id = _SPECIAL_ID["<|im_end|>"]
        self.vocab_size = VOCAB_SIZE
        self.special_tokens = SPECIAL_TOKENS
        self.chat_template = ChatTemplate(CHATML_TEMPLATE, origin="builtin ChatML template",
                                          variables={"bos_token": "<s>", "eos_token": "<|im_end|>"})
        self._piece_cache: dict[str, tuple[int, ...]] = {}
        self._releases_gil: bool | None = None  # None: as the C encoder is there or not
        # the text between special tokens (a chat turn) encodes on its own: kept encoded,
        # since each request of a conversation repeats its history and a fleet's requests
        # share system prompts; long ones also in chunks, for prompts that extend them
        self.segments = Segments(_SPECIAL_RE, _SPECIAL_ID,
                                 PrefixStore(BUILTIN_CUTS, chunk_chars=BUILTIN_CHUNK),
                                 max_segments=SEGMENT_CACHE_SIZE)

    def use_chat_template(self, source: str, origin: str = "<chat template>") -> None:
        """Render with ``source`` instead of the built-in ChatML template."""
        self.chat_template = ChatTemplate(source, origin=origin,
                                          variables=self.chat_template.variables)

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        ids = self._piece_cache.get(piece)
        if ids is None:
            b = piece.encode("utf-8")
            out = [PAIR_BASE + (b[i] << 8 | b[i + 1]) for i in range(0, len(b) - 1, 2)]
            if len(b) % 2:
                out.append(BYTE_BASE + b[-1])
            ids = tuple(out)
            if len(self._piece_cache) < 1 << 16:  # words repeat; bound the memory
                self._piece_cache[piece] = ids
        return ids

    def _encode_plain(self, text: str, out: list[int]) -> None:
        """The Python loop (the C encoder's reference: tokenize/native.py)."""
        for piece in _PIECE_RE.findall(text):
            out.extend(self._encode_piece(piece))

    def plan(self, text: str, add_special_tokens: bool = False) -> Plan:
        """The known and the new of ``text``; ``add_special_tokens`` puts ``<s>`` first (as
        a Llama-style model does)."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        return self.segments.plan(text, (self.bos_token_id,) if add_special_tokens else ())

    def run(self, plan: Plan) -> list[Sequence[int]]:
        """The ids of each text of ``plan.work`` (text between special tokens)."""
        return self._encode_texts(plan.work)

    def _encode_texts(self, texts: list[str]) -> list[Sequence[int]]:
        # (one switch for both C functions: encode_plain None means the Python loop)
        if native.encode_plain is not None:  # one C call for all: the GIL let go when they
            return native.encode_plain_each(texts)  # are long in all
        out: list[Sequence[int]] = []
        for text in texts:
            buf: list[int] = []
            self._encode_plain(text, buf)
            out.append(buf)
        return out

    @property
    def releases_gil(self) -> bool:  # type: ignore[override]
        """With the C encoder: it lets go of the GIL for a long text (tokenize/_plain.c)."""
        return self._releases_gil if self._releases_gil is not None \
            else native.encode_plain is not None

    @releases_gil.setter
    def releases_gil(self, value: bool) -> None:
        self._releases_gil = value

    @property
    def inline_chars(self) -> int:  # type: ignore[override]
        """The C encoder does 16k characters in ~0.1 ms (and keeps the GIL below that);
        the Python loop ~2k."""
        return native.GIL_THRESHOLD if native.encode_plain is not None else 2048

    def finish(self, plan: Plan, results: Sequence[Sequence[int]]) -> list[int]:
        """The ids of the planned text; keeps the new segments and chunks."""
        return self.segments.finish(plan, results)

    def run_elsewhere(self) -> Callable[[list[str], bool], list[Sequence[int]]]:
        """:func:`encode_texts`: what a worker process runs for :meth:`run`."""
        return encode_texts

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (``decode(encode(t)) == t`` for every str ``t`` with
        ``skip_special_tokens=False``); an id outside the vocabulary -> TokenizerError."""
        parts: list[str] = []
        buf = bytearray()
        for i in ids:
            if not isinstance(i, int) or not 0 <= i < VOCAB_SIZE:
                raise TokenizerError(f"token id {i!r} is outside the builtin vocabulary "
                                     f"[0, {VOCAB_SIZE})")
            if i >= PAIR_BASE:
                buf += (i - PAIR_BASE).to_bytes(2, "big")
            elif i >= BYTE_BASE:
                buf.append(i - BYTE_BASE)
            else:
                if not skip_special_tokens and i < len(SPECIAL_TOKENS):
                    parts.append(buf.decode("utf-8", "replace"))
                    buf.clear()
                    parts.append(SPECIAL_TOKENS[i])
        parts.append(buf.decode("utf-8", "replace"))
        return "".join(parts)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """ChatML text of ``messages``."""
        if not tools and not chat_template_kwargs and not continue_final_message and \
                self.chat_template.source is CHATML_TEMPLATE:
            text = chatml_plain(messages, add_generation_prompt)
            if text is not None:
                return text
        return self.chat_template.render(messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt,
                                         chat_template_kwargs=chat_template_kwargs,
                                         continue_final_message=continue_final_message)
