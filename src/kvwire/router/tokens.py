"""The optional C parser of a /route body's token ids (``_tokens.c``): JSON digits straight
to int64s, no Python int per token. Kept apart from the HTTP app so that
``kvwire.native_status()`` can report it without importing FastAPI."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["REASON", "parse_token_ids"]

#: ``parse_token_ids(raw) -> bytes | None`` (see _tokens.c), or None when not built.
parse_token_ids: Any = None
#: Why the C parser is not used (empty when it is).
REASON = ""
if os.environ.get("KVWIRE_NO_NATIVE"):
    REASON = "KVWIRE_NO_NATIVE set"
else:
    try:
        from ._tokens import parse_token_ids
    except ImportError as e:  # not built: bodies go the msgspec way (same answers, slower)
        REASON = f"not built ({e})"
