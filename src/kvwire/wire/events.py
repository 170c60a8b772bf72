"""KV-cache events and their wire codec: the dialect table (``DIALECTS``), decoding and
encoding. The event types are defined in :mod:`.event_types` and re-exported here, the path
users import them from.

The public Structs carry the union of the fields that vLLM 0.33 and SGLang 0.5.23 put on
the wire, so one decoded value can be re-encoded in any dialect. Each dialect has private
Structs whose field order, defaults and array/map shape reproduce that engine's bytes
exactly; msgspec does the byte work, so decoding stays at strict-msgspec speed on the
common path and only falls back to per-event decoding when a batch mixes shapes or holds
a malformed event. :func:`decode_fast` (a subscriber's live path) makes a large batch's
token ids (a long prompt's) a list in C, of one shared int object per value.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from operator import attrgetter
from typing import Any, Literal

import msgspec

from . import rfc1527 as _rfc
from .event_types import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    EventError,
    KVCacheEvent,
    KVEventBatch,
    Rfc1527Fields,
)

__all__ = [
    "AllBlocksCleared",
    "BatchDecoder",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "DIALECTS",
    "DecodeError",
    "Dialect",
    "EventBatch",
    "EventError",
    "KVCacheEvent",
    "KVEventBatch",
    "Rfc1527Fields",
    "decode_batch",
    "decode_fast",
    "FAST_DECODE_ERRORS",
    "encode_batch",
    "to_jsonable",
]

log = logging.getLogger("kvwire.events")

Dialect = Literal["vllm", "sglang", "vllm-legacy", "vllm-legacy-v0", "rfc1527"]
DIALECTS: tuple[str, ...] = ("vllm", "sglang", "vllm-legacy", "vllm-legacy-v0", "rfc1527")


class DecodeError(ValueError):
    """The payload is not a KV event batch at all (one bad event never raises this)."""


# --------------------------------------------------------------------------- dialect shapes
# Map dialects: omit_defaults drops exactly the fields the engine leaves out when nil;
# fields the engine always writes have no default here.


class _VllmStored(msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[Any] | None = None


class _VllmRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _MapCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _SglangStored(msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class _SglangRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


# Positional dialects. One decoding shape serves both: v0 simply lacks the trailing medium.


class _LegacyStored(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class _LegacyRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class _LegacyCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


class _V0Stored(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class _V0Removed(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[BlockHash]


_LegacyEvent = _LegacyStored | _LegacyRemoved | _LegacyCleared

# --------------------------------------------------------------------------- decoding


# The slow paths accept the same batch shapes as the fast one: ``[ts, events]`` without a
# rank, and trailing elements a newer engine may add, are fine whatever the events look like.


class _LegacyBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_LegacyEvent]
    rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    rank: int | None = None


_map_batch = msgspec.msgpack.Decoder(KVEventBatch)
_legacy_batch = msgspec.msgpack.Decoder(_LegacyBatch)
_raw_batch = msgspec.msgpack.Decoder(_RawBatch)
# msgspec also raises UnicodeDecodeError (a str that is not UTF-8) and RecursionError
# (absurd nesting): for kvwire those are just more malformed input.
_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)

FAST_DECODE_ERRORS = _ERRORS


def _twin(cls: Any, name: str, changed: dict[str, Any], **config: Any) -> Any:
    """A Struct decoding like ``cls`` but for the field types in ``changed``."""
    fields = []
    for f in msgspec.structs.fields(cls):
        t = changed.get(f.name, f.type)
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, t, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, t, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, t))
    return msgspec.defstruct(name, fields, frozen=True, gc=False, **config)


# Large batches (a long prompt's BlockStored: 15k token ids in ~50 kB) decode with their
# token ids left raw, then made a list of shared int objects in C (_ids.c): msgspec makes a
# new int per id, most of the decoding's and of the batch's freeing cost. Same values, same
# types, and anything _ids.c does not take (not an array of integers) is decoded whole by
# msgspec as before, errors included.
_IDS_AT = list(msgspec.structs.fields(BlockStored)).index(
    next(f for f in msgspec.structs.fields(BlockStored) if f.name == "token_ids"))
_RawIdsStored = _twin(BlockStored, "_RawIdsStored", {"token_ids": msgspec.Raw},
                      tag="BlockStored", tag_field="type", omit_defaults=True)
_RawIdsBatch = _twin(KVEventBatch, "_RawIdsBatch",
                     {"events": list[_RawIdsStored | BlockRemoved | AllBlocksCleared]},  # type: ignore[valid-type]
                     array_like=True)
_raw_ids_batch = msgspec.msgpack.Decoder(_RawIdsBatch)
#: Payloads this long or longer take the raw-ids path (when _ids.c is built).
RAW_IDS_BYTES = 8192
_int_list: Any = None  # not built (or KVWIRE_NO_NATIVE): msgspec's ints, the same values
if not os.environ.get("KVWIRE_NO_NATIVE"):
    try:
        from ._ids import int_list as _int_list  # type: ignore[import-not-found,no-redef]
    except ImportError:
        pass
_astuple = msgspec.structs.astuple


def _decode_raw_ids(payload: bytes) -> KVEventBatch:
    b = _raw_ids_batch.decode(payload)
    events: list[Any] = []
    add = events.append
    try:
        for ev in b.events:
            if type(ev) is _RawIdsStored:
                t = _astuple(ev)
                ev = BlockStored(*t[:_IDS_AT], _int_list(t[_IDS_AT]), *t[_IDS_AT + 1:])
            add(ev)
    except ValueError:  # token ids that are not all integers: msgspec says what is wrong
        return _map_batch.decode(payload)
    return KVEventBatch(b.ts, events, b.data_parallel_rank)


def decode_fast(payload: bytes) -> KVEventBatch:
    """The short path of :class:`BatchDecoder` alone: today's map-shaped batches (vLLM >=
    0.9, SGLang), strictly. For hot loops that fall back to a BatchDecoder on
    :data:`FAST_DECODE_ERRORS` (other dialects, malformed events)."""
    if len(payload) < RAW_IDS_BYTES or _int_list is None:
        return _map_batch.decode(payload)
    try:
        return _decode_raw_ids(payload)
    except _ERRORS:
        return _map_batch.decode(payload)  # the same error, or none: msgspec decides


_map_event = msgspec.msgpack.Decoder(Event)
_legacy_event = msgspec.msgpack.Decoder(_LegacyEvent)
_any = msgspec.msgpack.Decoder()


def _from_legacy(ev: _LegacyStored | _LegacyRemoved | _LegacyCleared) -> Event:
    if type(ev) is _LegacyStored:
        return BlockStored(
            ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.lora_id,
            ev.medium,
        )
    if type(ev) is _LegacyRemoved:
        return BlockRemoved(ev.block_hashes, ev.medium)
    return AllBlocksCleared()


def _is_array(raw: bytes) -> bool:
    b = raw[0] if raw else 0
    return 0x90 <= b <= 0x9F or b in (0xDC, 0xDD)


#: The msgpack key ``event_type`` (fixstr): only rfc1527 events have it.
_RFC_KEY = b"\xaaevent_type"


def _decode_event(raw: bytes) -> tuple[Event, bool]:
    """The event, and whether it is an rfc1527 one (also True when it fails as one)."""
    if _is_array(raw):
        return _from_legacy(_legacy_event.decode(raw)), False
    try:
        return _map_event.decode(raw), False
    except _ERRORS:
        if _RFC_KEY not in raw:
            raise
    return _rfc.decode_event(raw), True


def _explain_not_batch(payload: bytes) -> str:
    try:
        obj = _any.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        return f"not valid msgpack ({e}); {len(payload)} bytes starting {payload[:16].hex()}"
    if not isinstance(obj, (list, tuple)):
        return f"expected a msgpack array [ts, events, rank], got {type(obj).__name__}"
    if len(obj) < 2:
        return f"expected a msgpack array [ts, events, rank], got an array of {len(obj)}"
    if not isinstance(obj[0], (int, float)) or isinstance(obj[0], bool):
        return f"batch ts must be a number, got {type(obj[0]).__name__}"
    if not isinstance(obj[1], (list, tuple)):
        return f"batch events must be an array, got {type(obj[1]).__name__}"
    if len(obj) > 2 and obj[2] is not None and not isinstance(obj[2], int):
        return f"batch rank must be an int or nil, got {type(obj[2]).__name__}"
    return "malformed batch"


class BatchDecoder:
    """Decodes batches of any dialect and keeps counters; reuse one per stream.

    A malformed event is isolated: the batch comes back without it, and an
    :class:`EventError` is passed to ``on_error`` (and kept in :attr:`last_errors`).
    """

    __slots__ = ("on_error", "batches", "events", "bad_events", "bad_payloads", "last_errors")

    def __init__(self, on_error: Callable[[EventError], None] | None = None) -> None:
        self.on_error = on_error
        self.batches = 0
        self.events = 0
        self.bad_events = 0
        self.bad_payloads = 0
        self.last_errors: list[EventError] = []

    def decode(self, payload: bytes | memoryview) -> KVEventBatch:
        """Decode one batch payload; raises :class:`DecodeError` only if it is not a batch."""
        if self.last_errors:
            self.last_errors = []
        try:
            batch = _map_batch.decode(payload)
        except _ERRORS:
            batch = self._decode_slow(bytes(payload))
        self.batches += 1
        self.events += len(batch.events)
        return batch

    def _decode_slow(self, payload: bytes) -> KVEventBatch:
        try:
            lb = _legacy_batch.decode(payload)
            return KVEventBatch(lb.ts, [_from_legacy(e) for e in lb.events], lb.rank)
        except _ERRORS:
            pass
        # The strict map decoder refuses every rfc1527 event (see KVCacheEvent), so a
        # batch of them lands here; one that mixes dialects or holds a bad event is
        # taken apart below.
        if _RFC_KEY in payload:
            try:
                return _rfc.decode_batch(payload)
            except _ERRORS:
                pass
        try:
            rb = _raw_batch.decode(payload)
        except _ERRORS:
            self.bad_payloads += 1
            raise DecodeError(_explain_not_batch(payload)) from None
        events: list[Event] = []
        ms = False  # a batch holding an rfc1527 event has its ts in milliseconds
        for i, raw in enumerate(rb.events):
            raw_b = bytes(raw)
            try:
                ev, rfc = _decode_event(raw_b)
                events.append(ev)
                ms = ms or rfc
            except _ERRORS as e:
                if _RFC_KEY in raw_b and not _is_array(raw_b):
                    ms = True
                    e = f"rfc1527: {e}"
                self._bad_event(EventError(i, f"event {i}: {e}", raw_b))
        return KVEventBatch(rb.ts / 1000 if ms else rb.ts, events, rb.rank)

    def _bad_event(self, err: EventError) -> None:
        self.bad_events += 1
        self.last_errors.append(err)
        if self.on_error is not None:
            self.on_error(err)
        else:
            log.warning("skipped malformed KV event: %s", err.message)


def decode_batch(
    payload: bytes | memoryview, on_error: Callable[[EventError], None] | None = None
) -> KVEventBatch:
    """Decode a batch payload of any dialect (also mixed within the batch).

    Unknown map keys are ignored. A malformed event is left out and reported to
    ``on_error`` (logged as a warning when no callback is given); :class:`DecodeError`
    is raised only when the payload is not a batch at all.
    """
    return BatchDecoder(on_error).decode(payload)


# --------------------------------------------------------------------------- encoding

_encoder = msgspec.msgpack.Encoder()


class _Shape:
    """One dialect's private Structs; converts a public event by copying its fields.

    The dialect Structs name their fields after the public ones, so one attrgetter per
    shape copies exactly the fields that dialect carries (and drops the rest).
    """

    def __init__(self, stored: type, removed: type, cleared: type) -> None:
        self.stored, self.removed, self.cleared = stored, removed, cleared
        self._stored_fields = attrgetter(*stored.__struct_fields__)
        removed_fields = removed.__struct_fields__
        self._removed_fields = (
            attrgetter(*removed_fields) if len(removed_fields) > 1
            else lambda ev: (ev.block_hashes,)
        )

    def convert(self, ev: Event) -> Any:
        t = type(ev)
        if t is BlockStored:
            return self.stored(*self._stored_fields(ev))
        if t is BlockRemoved:
            return self.removed(*self._removed_fields(ev))
        if t is AllBlocksCleared:
            return self.cleared()
        raise TypeError(f"not a KV cache event: {ev!r}")


_SHAPES: dict[str, _Shape] = {
    "vllm": _Shape(_VllmStored, _VllmRemoved, _MapCleared),
    "sglang": _Shape(_SglangStored, _SglangRemoved, _MapCleared),
    "vllm-legacy": _Shape(_LegacyStored, _LegacyRemoved, _LegacyCleared),
    "vllm-legacy-v0": _Shape(_V0Stored, _V0Removed, _LegacyCleared),
}


def check_dialect(dialect: str) -> str:
    """Return ``dialect`` if kvwire can encode it, else raise ValueError naming the choices."""
    if dialect not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r}; expected one of {', '.join(DIALECTS)}")
    return dialect


def encode_batch(batch: EventBatch, dialect: str = "vllm") -> bytes:
    """Encode ``batch`` exactly as the engine behind ``dialect`` would.

    Fields a dialect cannot carry are dropped: ``vllm`` drops ``cache_salt``; ``sglang``
    keeps only its own fields (``medium``, ``cache_salt``, ``session_id``, ``lora_name``
    beyond the core five); ``vllm-legacy`` keeps the core five plus ``medium``;
    ``vllm-legacy-v0`` keeps only the core five. ``rfc1527`` writes Mooncake Store's
    layout (see :func:`kvwire.wire.rfc1527.encode_batch`); no other dialect writes
    ``rfc1527`` fields.
    """
    if dialect == "vllm":
        # The public structs are laid out as vLLM's: encode them directly unless an
        # SGLang-only or rfc1527 field would leak into the bytes.
        for e in batch.events:
            t = type(e)
            if t is BlockStored:
                if e.cache_salt is not None or e.rfc1527 is not None:
                    break
            elif t is BlockRemoved or t is AllBlocksCleared:
                if e.rfc1527 is not None:
                    break
            else:
                break  # not one of ours: the converting path raises TypeError
        else:
            return _encoder.encode(batch)
    try:
        convert = _SHAPES[dialect].convert
    except KeyError:
        if dialect == "rfc1527":
            return _rfc.encode_batch(batch)
        check_dialect(dialect)
        raise
    return _encoder.encode(
        (batch.ts, [convert(e) for e in batch.events], batch.data_parallel_rank)
    )


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return {"hex": obj.hex()}
    if isinstance(obj, list):
        return [_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    return obj


def to_jsonable(batch: EventBatch) -> dict[str, Any]:
    """A JSON-ready dict of a batch; bytes hashes become ``{"hex": ...}`` as in the vectors."""
    return {
        "ts": batch.ts,
        "data_parallel_rank": batch.data_parallel_rank,
        "events": [
            _jsonable(msgspec.to_builtins(e, builtin_types=(bytes,))) for e in batch.events
        ],
    }
