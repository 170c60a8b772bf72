"""The optional C parser of a /route body's token ids (``_tokens.c``): JSON digits straight
to int64s, no Python int per token and no second pass over the array. Kept apart from the HTTP app so that
``kvwire.native_status()`` can report it without importing the HTTP app."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["REASON", "parse_route_body"]

#: ``parse_route_body(body) -> (int64 bytes, rest JSON | None) | None`` (see _tokens.c), or
#: None when not built.
parse_route_body: Any = None
#: Why the C parser is not used (empty when it is).
REASON = ""
if os.environ.get("KVWIRE_NO_NATIVE"):
    REASON = "KVWIRE_NO_NATIVE set"
else:
    try:
        from ._tokens import parse_route_body
    except ImportError as e:  # not built: bodies go the msgspec way (same answers, slower)
        REASON = f"not built ({e})"
