"""Chat templates rendered as transformers renders them, in a jinja2 sandbox.

Same environment as ``apply_chat_template``: ``ImmutableSandboxedEnvironment`` with
``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}``
tag (rendered as its body), ``raise_exception``, ``strftime_now``, and a ``tojson`` filter
that is plain ``json.dumps`` (no HTML escaping, ``ensure_ascii=False``, keys unsorted,
``indent``/``separators`` passed through) -- jinja's own ``tojson`` escapes ``<>&'`` and
sorts keys, which would change the prompt and so the token ids. Templates are compiled once
per distinct source (an LRU cache), so a server pays only the render. A template whose text
is exactly one known.py knows renders the common chat without jinja, to the same text."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvwire.tokenize.errors import TokenizerError
from kvwire.tokenize.known import plain_renderer


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks
    in transformers); for a prompt only its body matters."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=64)
def compile_template(source: str, origin: str = "<chat template>") -> jinja2.Template:
    """The compiled template of ``source`` (cached); a syntax error -> TokenizerError
    naming ``origin`` and the line."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{origin}: chat template does not compile: line {e.lineno}: "
                             f"{e.message}") from None


class ChatTemplate:
    """One compiled chat template plus the variables its model's tokenizer_config gives
    every render (``bos_token``, ``eos_token``, ...).

    ``fast_path``: the name of the known template (known.py) whose exact text this is, whose
    plain renderer writes the common chat without jinja; None when it is no known one, or
    when built with ``fast=False`` (jinja renders every chat)."""

    def __init__(self, source: str, *, origin: str = "<chat template>",
                 variables: dict[str, Any] | None = None, fast: bool = True) -> None:
        self.source = source
        self.origin = origin
        self.variables = dict(variables or {})
        self._template = compile_template(source, origin)
        known = plain_renderer(source) if fast else None
        self.fast_path = known[0] if known is not None else None
        self._plain = known[1] if known is not None else None

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text; a template's ``raise_exception`` or a runtime error ->
        TokenizerError naming the template. ``continue_final_message``: the text ends
        where the last message's content does (no end of turn), as transformers cuts it."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TokenizerError(f"messages must be a list of dicts, got {type(messages).__name__}"
                                 + ("" if not isinstance(messages, list) else " with a non-dict item"))
        if tools is not None and (not isinstance(tools, list)
                                  or not all(isinstance(t, dict) for t in tools)):
            raise TokenizerError("tools must be a list of JSON-schema dicts or None")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TokenizerError("chat_template_kwargs must be a dict or None, got "
                                 f"{type(chat_template_kwargs).__name__}")
        # The same order of precedence as transformers: the tokenizer's special tokens, then
        # the caller's kwargs, with messages/tools/add_generation_prompt fixed.
        ctx = {**self.variables, **(chat_template_kwargs or {})}
        if self._plain is not None and not continue_final_message:
            text = self._plain(messages, tools, add_generation_prompt, ctx)
            if text is not None:
                return text
        final = None
        if continue_final_message:
            messages, final = self._tagged(messages)
        ctx.update(messages=messages, tools=tools, documents=ctx.get("documents"),
                   add_generation_prompt=add_generation_prompt)
        try:
            text = self._template.render(ctx)
            return text if final is None else self._cut(text, final)
        except TokenizerError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError,
                IndexError) as e:  # raise_exception, the sandbox, or a message it can't take
            raise TokenizerError(f"{self.origin}: chat template failed: "
                                 f"{type(e).__name__}: {e}") from None

    def _tagged(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
        """``messages`` with a tag after the last message's text (its last text part):
        where the render is cut. transformers' way, so the cut lands where it lands."""
        last = messages[-1] if messages else {}
        content = last.get("content")
        if content is None:
            raise TokenizerError("continue_final_message: the final message has no content "
                                 "to continue")
        if "content" not in self.source:
            raise TokenizerError(f"{self.origin}: continue_final_message needs a template "
                                 "that renders message content")
        last = dict(last)
        if isinstance(content, (list, tuple)):
            parts = [dict(p) if isinstance(p, dict) else p for p in content]
            for p in reversed(parts):
                if isinstance(p, dict) and "text" in p:
                    final = p["text"]
                    p["text"] = f"{final}{_CONTINUE_TAG}"
                    break
            else:
                raise TokenizerError("continue_final_message: the final message has no text "
                                     "to continue")
            last["content"] = parts
        else:
            final = content
            last["content"] = f"{content}{_CONTINUE_TAG}"
        return [*messages[:-1], last], str(final)

    def _cut(self, text: str, final: str) -> str:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise TokenizerError(f"{self.origin}: continue_final_message: the final message "
                                 "does not appear in the rendered chat")
        at = text.rindex(tag)
        if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return text[:at]
        return text[:at].rstrip()  # the template trimmed the content's trailing space


#: Marks where a continued final message ends (transformers uses the same tag).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


#: Characters that make a ``--chat-template`` value a template rather than a path (vLLM's rule).
_JINJA_CHARS = "{}\n"


def load_template_arg(value: str) -> tuple[str, str]:
    """A ``--chat-template`` value as vLLM reads its own: the text of the file it names, or
    the value itself when it is no file and holds ``{``, ``}`` or a newline (a template
    given inline). ``(source, origin)``; a value that looks like a path but cannot be read
    -> TokenizerError naming it and why."""
    try:
        with open(value, encoding="utf-8") as f:
            return f.read(), value
    except OSError as e:
        if not any(c in value for c in _JINJA_CHARS):
            raise TokenizerError(f"chat template {value!r} looks like a file path, but it "
                                 f"cannot be opened: {e.strerror or e}") from None
        return value, "<inline chat template>"
    except UnicodeDecodeError as e:
        raise TokenizerError(f"chat template {value!r} is not UTF-8 text: {e}") from None
