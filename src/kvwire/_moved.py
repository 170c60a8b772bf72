"""Old import paths kept for one release: a module that moved leaves behind a small module
whose names resolve, on first use, to the same objects at the new path, with a
DeprecationWarning pointing at the line that used the old one."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Iterable
from typing import Any


def moved(old: str, new: str, names: Iterable[str] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old``: each of ``names`` (None: every public name of
    ``new``) is ``new``'s object."""
    known = None if names is None else frozenset(names)

    def __getattr__(name: str) -> Any:
        if name.startswith("_") if known is None else name not in known:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(f"{old} moved to {new}: import {name} from there ({old} goes in the "
                      "next release)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)

    return __getattr__
