"""The interface the engine and the router share: text and chats to token ids and back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from kvwire.tokenize.errors import TokenizerError
from kvwire.tokenize.segments import Plan

__all__ = ["Plan", "Tokenizer", "TokenizerError"]


class Tokenizer(ABC):
    """Text <-> token ids, and chats (OpenAI-style message dicts) -> prompt text -> ids.

    ``encode_chat`` renders then encodes with ``add_special_tokens=False``, as vLLM's chat
    path and transformers' ``apply_chat_template(tokenize=True)`` do: the template already
    writes BOS and the turn markers, so adding them again would double BOS."""

    name: str
    eos_token_id: int | None
    bos_token_id: int | None
    vocab_size: int
    #: ``"auto"`` (decide from the template, as vLLM's default), ``"string"`` or
    #: ``"openai"``: an engine's ``--chat-template-content-format``, matched here.
    content_format_option: str = "auto"
    #: Why a prompt extending one seen before is tokenized whole per segment rather than from
    #: where the known part ends (prefix.py); empty when it is not.
    prefix_reason: str = ""
    #: Whether :meth:`run` lets other threads run while it works (no GIL held): then a thread
    #: can take it off an event loop; else only a process can.
    releases_gil: bool = False
    #: Work of at most this many characters costs less than handing it to another thread.
    inline_chars: int = 2048

    def inline(self, plan: Plan) -> bool:
        """Whether ``plan``'s work costs less encoded here than handed to another thread."""
        return plan.chars <= self.inline_chars

    def use_chat_template(self, source: str, origin: str = "<chat template>") -> None:
        """Render every chat with ``source`` from now on, whatever the model directory
        holds: what an engine started with ``--chat-template`` renders. A template that does
        not compile -> TokenizerError naming ``origin``."""
        raise TokenizerError(f"{type(self).__name__} cannot take another chat template")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their ids."""
        plan = self.plan(text, add_special_tokens)
        return self.finish(plan, self.run(plan))

    @abstractmethod
    def plan(self, text: str, add_special_tokens: bool = False) -> Plan:
        """What of ``text`` is known and what must be encoded (``plan.work``): quick, on the
        caller's thread, which also calls :meth:`finish`."""

    @abstractmethod
    def run(self, plan: Plan) -> list[Sequence[int]]:
        """The ids of each of ``plan.work``: the slow step, on any thread; touches no cache."""

    def run_elsewhere(self) -> Callable[[list[str], bool], list[Sequence[int]]] | None:
        """A module-level function a worker process can run for :meth:`run` (given
        ``plan.work`` and ``plan.special``), for a tokenizer that holds the GIL while it
        encodes; None: none (threads, or the caller's thread)."""
        return None

    @abstractmethod
    def finish(self, plan: Plan, results: Sequence[Sequence[int]]) -> list[int]:
        """The ids of the planned text; keeps what ``results`` taught."""

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
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text of ``messages`` under this tokenizer's chat template."""

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of the rendered chat (no special tokens added: the template has them)."""
        text = self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                chat_template_kwargs=chat_template_kwargs,
                                continue_final_message=continue_final_message)
        return self.encode(text, add_special_tokens=False)

    def encode_engine_chat(
        self,
        messages: Any,
        *,
        tools: Any = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        reasoning_effort: str | None = None,
        documents: Any = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a chat request as vLLM renders it (:meth:`render_engine_chat`).
        The router and ``kvwire engine`` both tokenize through this, so they cannot drift
        apart."""
        return self.encode(self.render_engine_chat(
            messages, tools=tools, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, reasoning_effort=reasoning_effort,
            documents=documents, chat_template_kwargs=chat_template_kwargs))

    def render_engine_chat(
        self,
        messages: Any,
        *,
        tools: Any = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        reasoning_effort: str | None = None,
        documents: Any = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text of a chat request as vLLM renders it: its messages and tools
        handed over as vLLM hands them (:meth:`engine_messages`, :meth:`engine_tools`) and
        its fields made template variables as vLLM makes them (tokenize/content.py's
        ``engine_template_kwargs``); encoded without added special tokens."""
        from kvwire.tokenize.content import engine_template_kwargs

        kw = engine_template_kwargs(chat_template_kwargs,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    reasoning_effort=reasoning_effort, documents=documents)
        agp = bool(kw.pop("add_generation_prompt", add_generation_prompt))
        cont = bool(kw.pop("continue_final_message", continue_final_message))
        return self.render_chat(self.engine_messages(messages, tools),
                                tools=self.engine_tools(tools), add_generation_prompt=agp,
                                chat_template_kwargs=kw or None, continue_final_message=cont)

    def content_format(self, tools: list[dict[str, Any]] | None = None) -> str:
        """``"string"`` or ``"openai"``: how vLLM hands message content to this tokenizer's
        chat template (for a chat with/without ``tools``); tokenize/content.py."""
        from kvwire.tokenize.content import content_format

        if self.content_format_option in ("string", "openai"):
            return self.content_format_option
        ct = getattr(self, "chat_template", None)
        try:
            ct = ct(tools) if callable(ct) else ct
        except TokenizerError:
            return "string"
        return content_format(ct.source) if ct is not None else "string"

    def warm(self) -> None:
        """Do the chat path's one-time work now, before a server says it is ready: how the
        template takes message content is read from the template itself (parsed: 20-50 ms
        for Qwen3's), which the first chat request would otherwise wait for, in an engine
        and in the router in front of it."""
        self.content_format()

    def engine_messages(self, messages: Any,
                        tools: list[dict[str, Any]] | None = None) -> Any:
        """``messages`` as vLLM hands them to this tokenizer's chat template (text parts
        joined for a template that takes strings, strings wrapped for one that takes parts,
        tool-call arguments parsed): what a router renders to match the engine's tokens.
        ``encode_chat`` itself renders as transformers does."""
        from kvwire.tokenize.content import as_engine_messages

        return as_engine_messages(messages, self.content_format(tools))

    def engine_tools(self, tools: Any) -> Any:
        """``tools`` as vLLM hands them to the template (re-serialised from its request
        model: tokenize/content.py's ``as_engine_tools``)."""
        from kvwire.tokenize.content import as_engine_tools

        return as_engine_tools(tools)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
