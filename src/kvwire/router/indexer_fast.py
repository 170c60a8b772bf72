"""Kept for its importers (``kvwire index``): the C-parsed ``/query`` token ids now live in
:meth:`Indexer._query <kvwire.router.indexer.Indexer>` itself, so ``kvwire serve``'s indexer
gets them too; ``fast_handle(ix)`` is ``ix.handle``."""

from __future__ import annotations

from typing import Any

from .indexer import Indexer

__all__ = ["fast_handle"]


def fast_handle(ix: Indexer) -> Any:
    """``ix.handle`` (its /query parses token ids in C when built)."""
    return ix.handle
