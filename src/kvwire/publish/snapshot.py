"""The publisher's snapshot model: the engine's cache as its batches describe it.

Owned by the publisher's sender thread, which applies every batch it sends in seq order.
The model is *exact* (a snapshot of it equals the engine's cache as of ``seq``) or it
knows since which seq it is not, and then snapshots are refused until the engine clears
its whole cache (``AllBlocksCleared``). It becomes inexact when:

* a batch never reached it (the live queue was full: ``note_drop``);
* a batch could be applied only in part (an exception half way: ``model_errors``);
* a batch holds an event it cannot follow (``model_unknown_events``).

Events are followed by their tag and shape, whatever class they come in: an engine's own
``BlockStored`` struct (vLLM's, SGLang's, a newer release's) is read field by field into
kvwire's. Anything else (another kind of event, a shape that does not fit) cannot be
followed, so a snapshot would be wrong: it is counted and logged, never served as exact.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec

from ..index.cache import BlockCache
from ..wire.events import AllBlocksCleared, BlockRemoved, BlockStored, Event

__all__ = ["SnapshotModel", "event_kind", "follow_event"]

log = logging.getLogger("kvwire.publisher")

_KNOWN = frozenset({BlockStored, BlockRemoved, AllBlocksCleared})
_MISSING = object()
#: Fields an event must carry to be followed; the others default to None when absent.
_REQUIRED = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}
_TYPES: dict[str, type] = {
    "BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared,
}


def event_kind(ev: Any) -> str | None:
    """The event's kind by tag: a Struct's string tag, a mapping's ``type``, else its class name."""
    t = type(ev)
    if t in _KNOWN:
        return t.__name__
    if isinstance(ev, dict):
        kind = ev.get("type")
        return kind if isinstance(kind, str) else None
    cfg = getattr(t, "__struct_config__", None)
    tag = cfg.tag if cfg is not None else None
    return tag if isinstance(tag, str) else t.__name__


def follow_event(ev: Any) -> Event | None:
    """kvwire's event for ``ev`` if its kind and shape are understood, else None."""
    if type(ev) in _KNOWN:
        return ev
    kind = event_kind(ev)
    cls = _TYPES.get(kind) if kind is not None else None
    if cls is None:
        return None
    if isinstance(ev, dict):
        def get(name: str) -> Any:
            return ev.get(name, _MISSING)
    else:
        def get(name: str) -> Any:
            return getattr(ev, name, _MISSING)
    fields: dict[str, Any] = {"type": kind}
    required = _REQUIRED[kind]  # type: ignore[index]
    for name in cls.__struct_fields__:
        value = get(name)
        if value is _MISSING:
            if name in required:
                return None
            continue
        fields[name] = value
    try:
        return msgspec.convert(fields, cls)
    except msgspec.ValidationError:
        return None


class _CannotFollow(Exception):
    """An event of a kind or shape the model does not understand."""


class SnapshotModel:
    """The cache model plus what is known about its exactness (see the module docstring).

    ``apply`` runs on the sender thread; ``note_drop`` on the engine's thread under the
    publisher's lock, which ``apply`` also takes whenever it changes the exactness state.
    """

    def __init__(self, lock: threading.Lock, counters: dict[str, int]) -> None:
        self.cache = BlockCache()
        self.seq = -1  # last seq applied (or skipped while inexact)
        self.lost_from: int | None = None  # first seq the model could not follow
        self.reason = ""
        self._last_bad = -1  # last seq dropped or not followed
        self._lock = lock
        self._c = counters

    @property
    def exact(self) -> bool:
        return self.lost_from is None or self.lost_from > self.seq

    def unavailable(self) -> str | None:
        """Why a snapshot cannot be served now, or None when it can."""
        lost = self.lost_from
        if lost is not None and lost <= self.seq:
            return f"snapshot unavailable: {self.reason}; exact again after the engine clears its cache"
        return None

    def note_drop(self, seq: int) -> None:
        """Batch ``seq`` skipped the live queue and never reaches the model (lock held)."""
        self._last_bad = seq
        if self.lost_from is None:
            self.lost_from = seq
            self.reason = f"the live queue overflowed at seq {seq}"

    def apply(self, seq: int, batch: Any) -> None:
        """Apply batch ``seq``; any failure makes the model inexact, counted and logged."""
        self.apply_many(((seq, batch),))

    def apply_many(self, items: Any) -> None:
        """Apply ``(seq, batch)`` pairs in seq order (the sender's chunk: one call for many
        batches); each failure makes the model inexact, counted and logged."""
        apply_known = self.cache.apply_known
        for seq, batch in items:
            lost = self.lost_from  # note_drop may set it from the engine's thread
            try:
                if lost is None or seq < lost:
                    events = batch.events
                    bad = apply_known(events)
                    if bad is not None:
                        self._apply_foreign(events, bad)
                else:
                    self._recover(seq, batch.events)
            except _CannotFollow as e:
                self._fail(seq, "model_unknown_events", str(e))
            except Exception as e:  # half applied: never serve it as exact
                self._fail(seq, "model_errors",
                           f"batch seq {seq} could not be applied ({type(e).__name__}: {e})")
            self.seq = seq

    def _apply_foreign(self, events: list[Any], first: Any) -> None:
        i = next(i for i, ev in enumerate(events) if ev is first)
        for ev in events[i:]:
            conv = follow_event(ev)
            if conv is None:
                raise _CannotFollow(f"cannot follow event {_describe(ev)}")
            self.cache.apply_known((conv,))

    def _recover(self, seq: int, events: list[Any]) -> None:
        """Inexact: only a full clear (after the last bad seq) makes the model exact again."""
        cut = None
        for i, ev in enumerate(events):
            if event_kind(ev) == "AllBlocksCleared":
                cut = i
        if cut is None or seq <= self._last_bad:
            return
        self.cache.clear()
        rest = events[cut + 1 :]
        bad = self.cache.apply_known(rest)
        if bad is not None:
            self._apply_foreign(rest, bad)
        with self._lock:
            if seq > self._last_bad:
                self.lost_from = None
                self.reason = ""
                log.warning("snapshot model exact again at seq %d (cache cleared)", seq)

    def _fail(self, seq: int, counter: str, reason: str) -> None:
        with self._lock:
            self._c[counter] += 1
            self._last_bad = max(self._last_bad, seq)
            if self.lost_from is None or self.lost_from > seq:
                self.lost_from = seq
                self.reason = reason
                log.error("snapshot model inexact from seq %d: %s; snapshots are refused until "
                          "the engine clears its cache", seq, reason)


def _describe(ev: Any) -> str:
    text = repr(ev)
    return text if len(text) <= 200 else text[:197] + "..."
