"""Tokenization shared by ``kvwire engine`` and the router: chats rendered with the model's
chat template exactly as transformers renders them, then token ids from ``tokenizer.json``
(docs/tokenize.md). ``load_tokenizer(None)`` is a built-in tokenizer that needs no files."""

from __future__ import annotations

import os
from pathlib import Path

from kvwire.tokenize.base import Tokenizer, TokenizerError
from kvwire.tokenize.builtin import BuiltinTokenizer
from kvwire.tokenize.hf import HFTokenizer
from kvwire.tokenize.template import ChatTemplate, load_template_arg

__all__ = ["CONTENT_FORMATS", "BuiltinTokenizer", "ChatTemplate", "HFTokenizer", "Tokenizer",
           "TokenizerError", "load_tokenizer"]


#: ``--chat-template-content-format`` values (vLLM's).
CONTENT_FORMATS = ("auto", "string", "openai")


def load_tokenizer(path: str | os.PathLike[str] | None, *, chat_template: str | None = None,
                   content_format: str = "auto") -> Tokenizer:
    """``None`` -> the built-in tokenizer; a model directory holding ``tokenizer.json`` ->
    HFTokenizer. Anything else -> TokenizerError naming the path and what is missing.

    ``chat_template`` and ``content_format`` are an engine's ``--chat-template`` (a file, or
    a template given inline: vLLM's rule, ``load_template_arg``) and
    ``--chat-template-content-format``: given the same, the router renders what that
    engine renders."""
    if content_format not in CONTENT_FORMATS:
        raise TokenizerError(f"chat template content format {content_format!r} is not one of "
                             f"{', '.join(CONTENT_FORMATS)}")
    tok = _load(path)
    if chat_template is not None:
        tok.use_chat_template(*load_template_arg(chat_template))
    tok.content_format_option = content_format
    return tok


def _load(path: str | os.PathLike[str] | None) -> Tokenizer:
    if path is None:
        return BuiltinTokenizer()
    if not isinstance(path, (str, os.PathLike)):
        raise TokenizerError(f"tokenizer path must be a str or path, got {type(path).__name__}")
    p = Path(path)
    if not p.exists():
        raise TokenizerError(f"tokenizer path {str(p)!r} does not exist")
    if p.is_file() and p.name == "tokenizer.json":
        p = p.parent
    if not p.is_dir():
        raise TokenizerError(f"tokenizer path {str(p)!r} is not a directory (expected a model "
                             "directory holding tokenizer.json)")
    if not (p / "tokenizer.json").is_file():
        raise TokenizerError(f"tokenizer path {str(p)!r} has no tokenizer.json (a Hugging Face "
                             "model directory needs tokenizer.json; tokenizer_config.json or "
                             "chat_template.jinja for the chat template)")
    return HFTokenizer(p)
