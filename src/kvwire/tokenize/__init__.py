"""Tokenization shared by ``kvwire engine`` and the router: chats rendered with the model's
chat template exactly as transformers renders them, then token ids from ``tokenizer.json``
(docs/tokenize.md). ``load_tokenizer(None)`` is a built-in tokenizer that needs no files."""

from __future__ import annotations

import os
from pathlib import Path

from kvwire.tokenize.base import Tokenizer, TokenizerError
from kvwire.tokenize.builtin import BuiltinTokenizer
from kvwire.tokenize.hf import HFTokenizer
from kvwire.tokenize.template import ChatTemplate

__all__ = ["BuiltinTokenizer", "ChatTemplate", "HFTokenizer", "Tokenizer", "TokenizerError",
           "load_tokenizer"]


def load_tokenizer(path: str | os.PathLike[str] | None) -> Tokenizer:
    """``None`` -> the built-in tokenizer; a model directory holding ``tokenizer.json`` ->
    HFTokenizer. Anything else -> TokenizerError naming the path and what is missing."""
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
