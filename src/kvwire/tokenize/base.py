"""The interface the engine and the router share: text and chats to token ids and back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


class TokenizerError(ValueError):
    """A tokenizer could not be loaded or a chat could not be rendered; the message says
    which path, file or template and what was wrong."""


class Tokenizer(ABC):
    """Text <-> token ids, and chats (OpenAI-style message dicts) -> prompt text -> ids.

    ``encode_chat`` renders then encodes with ``add_special_tokens=False``, as vLLM's chat
    path and transformers' ``apply_chat_template(tokenize=True)`` do: the template already
    writes BOS and the turn markers, so adding them again would double BOS."""

    name: str
    eos_token_id: int | None
    bos_token_id: int | None
    vocab_size: int

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their ids."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``."""

    @abstractmethod
    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text of ``messages`` under this tokenizer's chat template."""

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat (no special tokens added: the template has them)."""
        text = self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                chat_template_kwargs=chat_template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
