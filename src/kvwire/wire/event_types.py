"""The KV-cache event types: what one decoded event or batch is, in every dialect.

The public Structs carry the union of the fields that vLLM 0.33 and SGLang 0.5.23 put on the
wire, so one decoded value can be re-encoded in any dialect. They live apart from the codecs
so that each dialect's codec (:mod:`.events` for the engines' dialects, :mod:`.rfc1527`)
builds on them without importing the other; users import them from :mod:`kvwire.wire.events`
(or ``kvwire``), which re-exports every name here.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["AllBlocksCleared", "BlockHash", "BlockRemoved", "BlockStored", "Event",
           "EventBatch", "EventError", "KVCacheEvent", "KVEventBatch", "Rfc1527Fields"]

#: An engine's opaque block id: unsigned or signed 64-bit int, or raw bytes (e.g. 32-byte digests).
BlockHash = int | bytes


def _none() -> None:
    """Default factory for fields vLLM always writes, even when nil.

    msgspec's ``omit_defaults`` never omits a field whose default comes from a factory, so
    ``medium`` and ``lora_name`` stay on the wire as vLLM 0.33 puts them, and a public
    struct encodes to vLLM's exact bytes without any conversion.
    """
    return None


_ALWAYS = msgspec.field(default_factory=_none)


class Rfc1527Fields(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """What an RFC #1527 (``rfc1527`` dialect) event carries beyond kvwire's common fields.

    Set on events decoded from that dialect (None on the others); encoding in it writes
    them back. ``timestamp`` is in seconds, like a batch's ``ts`` (the wire has integer
    milliseconds). ``base_block_idx`` is the depth of the event's first block (its
    ``block_hashes`` are then RFC sequence hashes: see :mod:`kvwire.wire.rfc1527`).
    ``block_size``, ``lora_name`` and ``additional_salt`` are kept here only for a
    ``BlockRemoved`` or ``AllBlocksCleared`` (a ``BlockStored`` has its own ``block_size``,
    ``lora_name`` and ``cache_salt``), ``medium`` only for an ``AllBlocksCleared``.
    ``object_key`` is Mooncake Store's key of the object.
    """

    event_id: int | None = None
    timestamp: float | None = None
    base_block_idx: int | None = None
    model_name: str | None = None
    tenant_id: str | None = None
    backend_id: str | None = None
    group_id: int | str | None = None
    dp_rank: int | None = None
    object_key: str | None = None
    block_size: int | None = None
    lora_name: str | None = None
    additional_salt: str | None = None
    medium: str | None = None


class KVCacheEvent(
    msgspec.Struct, tag=True, tag_field="type", omit_defaults=True, frozen=True, gc=False
):
    """Base of all cache events; the msgpack map key ``type`` holds the class name.

    Every event ends with two fields no engine's map dialect writes: ``rfc1527`` (see
    :class:`Rfc1527Fields`) and ``event_type``, which is always None. ``event_type`` is
    declared so that the strict map decoder *refuses* an RFC #1527 event (it has that
    key): otherwise Mooncake's legacy aliases (``type``, signed ``block_hashes``) would
    pass for a vLLM ``BlockRemoved`` and one block would become two.
    """


class BlockStored(KVCacheEvent, frozen=True):
    """A chain of blocks was cached: ``block_hashes[i]`` is the child of ``block_hashes[i-1]``.

    ``token_ids`` holds the tokens of all blocks concatenated (``block_size`` per block).
    Fields past ``medium`` are carried by only some engines and default to None. An
    ``rfc1527`` event without tokens has ``token_ids == []`` and, when its stream's block
    size is only known from registration, ``block_size == 0`` (nil on that wire).
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = _ALWAYS
    lora_name: str | None = _ALWAYS
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[Any] | None = None
    cache_salt: str | None = None
    rfc1527: Rfc1527Fields | None = None
    event_type: None = None


class BlockRemoved(KVCacheEvent, frozen=True):
    """These blocks were evicted from tier ``medium`` (None: unspecified, i.e. GPU)."""

    block_hashes: list[BlockHash]
    medium: str | None = _ALWAYS
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    rfc1527: Rfc1527Fields | None = None
    event_type: None = None


class AllBlocksCleared(KVCacheEvent, frozen=True):
    """The engine reset its whole prefix cache."""

    rfc1527: Rfc1527Fields | None = None
    event_type: None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One engine step: ``[ts, events, data_parallel_rank]`` on the wire.

    Like the events, not tracked by the garbage collector (``gc=False``): a consumer
    decodes hundreds of thousands per second, and tracked ones made GC passes a third of
    its time. Do not build reference cycles through a batch (they would never be freed).
    """

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVEventBatch(EventBatch, frozen=True):
    """A batch of KV-cache events. SGLang's ``attn_dp_rank`` is ``data_parallel_rank``."""

    events: list[Event]


class EventError(msgspec.Struct, frozen=True):
    """One event of a batch that could not be decoded; the rest of the batch still was."""

    index: int
    message: str
    raw: bytes
