"""The optional C encoder of the builtin tokenizer's plain text (``_plain.c``): the same ids
as its Python loop for a tenth to a fiftieth of the CPU (30k ids: well under 1 ms against
5-12 ms), with the GIL released while a long text is scanned. Kept apart so that
``kvwire.native_status()`` can report it."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["GIL_THRESHOLD", "REASON", "encode_plain", "encode_plain_each"]

#: ``encode_plain(text) -> list[int]`` (see _plain.c), or None when not built.
encode_plain: Any = None
#: ``encode_plain_each(texts) -> list[list[int]]``: each text's ids, scanned in one go (the
#: GIL let go when they are long in all), or None when not built.
encode_plain_each: Any = None
#: Texts of this many code points or more are encoded with the GIL released.
GIL_THRESHOLD = 16384
#: Why the C encoder is not used (empty when it is).
REASON = ""
if os.environ.get("KVWIRE_NO_NATIVE"):
    REASON = "KVWIRE_NO_NATIVE set"
else:
    try:
        from ._plain import GIL_THRESHOLD, encode_plain, encode_plain_each
    except ImportError as e:  # not built: the Python loop (same ids, slower)
        REASON = f"not built ({e})"
