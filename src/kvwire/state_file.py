"""How ``kvwire serve`` keeps run-time state on disk (the indexer API's registrations, the
engines added and removed at run time): each file written whole to a temporary file beside
it, flushed to disk and renamed over the old one, so a crash leaves the old file or the new
one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_atomically"]


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path``'s content with ``data`` (OSError if it cannot be written: the old
    file is then left as it was)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
