"""The ``rfc1527`` dialect: the KV Events API of Mooncake's RFC #1527, and its block hash.

Written from the wire description (docs/protocol.md, "rfc1527") and the vectors Mooncake
Store's own publisher produced. On the wire, unlike the other dialects:

* a batch's ``ts`` and each event's ``timestamp`` are integer **milliseconds**; kvwire's
  values are seconds (``ts / 1000``), and encoding writes ``round(ts * 1000)``;
* each event is a map keyed by ``event_type`` (``stored``/``removed``/``cleared``) with an
  envelope of which many fields are nil, lower-case ``medium`` (kvwire: upper case, as
  the other dialects write it, so ``cpu`` and ``CPU`` are one tier);
* block identity is ``seq_hashes`` (u64 rolling sequence hashes). Mooncake also writes
  the legacy aliases ``type``, ``block_hashes`` (the same values cast to signed 64-bit)
  and ``parent_block_hash``: the decoder reads the RFC fields and falls back on an alias
  (cast back to u64) only when the RFC field is absent, so a block has one hash whichever
  the publisher sent;
* ``token_ids`` and ``block_size`` may be nil: kvwire's ``BlockStored`` then has
  ``token_ids == []`` and ``block_size == 0``, and encoding writes nil for those.

What the common event fields cannot hold goes to :class:`~kvwire.wire.events.Rfc1527Fields`
(``event.rfc1527``). Encoding writes Mooncake Store's layout: every envelope key, nil or
not, in its order, plus ``object_key`` and the aliases. An event with no ``rfc1527`` fields
(e.g. kvwire's own) gets nil ``event_id``/``object_key``/``base_block_idx`` and the batch's
timestamp. A batch with no events (kvwire's heartbeat; Mooncake sends none) keeps a float
seconds ``ts``: decoders could not tell an integer one from another dialect's.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import msgspec
from xxhash import xxh3_64_intdigest

from . import event_types as _ev

__all__ = ["STANDARD_SEED", "decode_batch", "decode_event", "encode_batch",
           "standard_block_hashes", "standard_local_hashes", "standard_seed",
           "standard_sequence_hashes"]

U64 = (1 << 64) - 1
_I64_MAX = (1 << 63) - 1

# --------------------------------------------------------------------------- decoding
# Every key is optional: publishers leave out what they do not know, and the RFC fields
# win over the legacy aliases (``block_hashes``, ``parent_block_hash``; ``type`` is ignored).


class _Cleared(msgspec.Struct, tag="cleared", tag_field="event_type"):
    event_id: int | None = None
    timestamp: int | float | None = None
    model_name: str | None = None
    block_size: int | None = None
    additional_salt: str | None = None
    lora_name: str | None = None
    tenant_id: str | None = None
    backend_id: str | None = None
    group_id: int | str | None = None
    medium: str | None = None
    dp_rank: int | None = None


# Each kind extends the one before it: msgspec keeps a base's fields first, in order. The
# decoder tells them apart by ``type(e) is``, never ``isinstance``.


class _Removed(_Cleared, tag="removed", tag_field="event_type"):
    object_key: str | None = None
    seq_hashes: list[int] | None = None
    block_hashes: list[int] | None = None
    base_block_idx: int | None = None


class _Stored(_Removed, tag="stored", tag_field="event_type"):
    parent_hash: int | None = None
    token_ids: list[int] | None = None
    parent_block_hash: int | None = None


_Event = _Stored | _Removed | _Cleared


class _Batch(msgspec.Struct, array_like=True):
    ts: int | float
    events: list[_Event]
    rank: int | None = None


_batch_dec = msgspec.msgpack.Decoder(_Batch)
_event_dec = msgspec.msgpack.Decoder(_Event)


def _u64s(hashes: list[int]) -> list[int]:
    for h in hashes:
        if h < 0:
            return [h & U64 for h in hashes]
    return hashes


def _seconds(ms: int | float | None) -> float | None:
    return None if ms is None else ms / 1000


def _upper(medium: str | None) -> str | None:
    return None if medium is None else medium.upper()


def _convert(e: _Stored | _Removed | _Cleared) -> _ev.Event:
    t = type(e)
    if t is _Cleared:
        return _ev.AllBlocksCleared(rfc1527=_ev.Rfc1527Fields(
            e.event_id, _seconds(e.timestamp), None, e.model_name, e.tenant_id,
            e.backend_id, e.group_id, e.dp_rank, None, e.block_size, e.lora_name,
            e.additional_salt, _upper(e.medium),
        ))
    hashes = e.seq_hashes if e.seq_hashes is not None else e.block_hashes
    if hashes is None:
        kind = "stored" if t is _Stored else "removed"
        raise msgspec.ValidationError(
            f"a `{kind}` event needs `seq_hashes` (or the alias `block_hashes`)"
        )
    hashes = _u64s(hashes)
    if t is _Removed:
        return _ev.BlockRemoved(hashes, _upper(e.medium), rfc1527=_ev.Rfc1527Fields(
            e.event_id, _seconds(e.timestamp), e.base_block_idx, e.model_name, e.tenant_id,
            e.backend_id, e.group_id, e.dp_rank, e.object_key, e.block_size, e.lora_name,
            e.additional_salt,
        ))
    parent = e.parent_hash
    if parent is None:
        parent = e.parent_block_hash
    if parent is not None and parent < 0:
        parent &= U64
    bs = e.block_size
    if bs is not None and bs < 0:
        raise msgspec.ValidationError(f"block_size must be >= 0, got {bs}")
    return _ev.BlockStored(
        hashes, parent, [] if e.token_ids is None else e.token_ids,
        0 if bs is None else bs, None, _upper(e.medium), e.lora_name,
        cache_salt=e.additional_salt,
        rfc1527=_ev.Rfc1527Fields(
            e.event_id, _seconds(e.timestamp), e.base_block_idx, e.model_name, e.tenant_id,
            e.backend_id, e.group_id, e.dp_rank, e.object_key,
        ),
    )


def decode_batch(payload: bytes) -> _ev.KVEventBatch:
    """A batch whose events are all rfc1527 ones; msgspec errors (or ValidationError for
    an event without hashes) otherwise: the caller then decodes event by event."""
    b = _batch_dec.decode(payload)
    return _ev.KVEventBatch(b.ts / 1000, [_convert(e) for e in b.events], b.rank)


def decode_event(raw: bytes) -> _ev.Event:
    """One rfc1527 event map."""
    return _convert(_event_dec.decode(raw))


# --------------------------------------------------------------------------- encoding
# Mooncake Store's layout: every key written, nil or not, in this order.


class _ClearedOut(msgspec.Struct):
    event_id: int | None
    timestamp: int
    event_type: str
    type: str
    model_name: str | None
    block_size: int | None
    additional_salt: str | None
    lora_name: str | None
    tenant_id: str | None
    backend_id: str | None
    group_id: int | str | None
    medium: str | None
    dp_rank: int | None


# As on the decoding side, each kind appends its keys to the one before it.


class _RemovedOut(_ClearedOut):
    object_key: str | None
    seq_hashes: list[int]
    block_hashes: list[int]
    base_block_idx: int | None


class _StoredOut(_RemovedOut):
    parent_hash: int | None
    token_ids: list[int] | None
    parent_block_hash: int | None


_encoder = msgspec.msgpack.Encoder()
_NO_FIELDS = _ev.Rfc1527Fields()


def _u64(h: Any) -> int:
    if type(h) is int:
        if 0 <= h <= U64:
            return h
        if -(1 << 63) <= h < 0:
            return h & U64
    elif type(h) is bytes:
        # vLLM's byte hashes (32-byte digests): the wire has u64 only, so the last 8
        # bytes, big-endian. The same digest always gives the same id (stores and removes
        # agree); the bytes themselves do not come back.
        return int.from_bytes(h[-8:], "big")
    raise ValueError(f"rfc1527 block hashes are 64-bit integers or bytes, got {h!r}")


def _seq(hashes: list[Any]) -> list[int]:
    for h in hashes:
        if type(h) is not int or h < 0 or h > U64:
            return [_u64(h) for h in hashes]
    return hashes


def _signed(seq: list[int]) -> list[int]:
    return [h - (1 << 64) if h > _I64_MAX else h for h in seq]


def _lower(medium: str | None) -> str | None:
    return None if medium is None else medium.lower()


def _ms(seconds: float | None, default: int) -> int:
    return default if seconds is None else round(seconds * 1000)


def _out(ev: Any, ts_ms: int) -> Any:
    t = type(ev)
    if t is not _ev.BlockStored and t is not _ev.BlockRemoved and t is not _ev.AllBlocksCleared:
        raise TypeError(f"not a KV cache event: {ev!r}")
    r = ev.rfc1527
    if r is None:
        r = _NO_FIELDS
    if t is _ev.BlockStored:
        seq = _seq(ev.block_hashes)
        parent = ev.parent_block_hash
        if parent is not None:
            parent = _u64(parent)
        return _StoredOut(
            r.event_id, _ms(r.timestamp, ts_ms), "stored", "BlockStored", r.model_name,
            ev.block_size or None, ev.cache_salt, ev.lora_name, r.tenant_id, r.backend_id,
            r.group_id, _lower(ev.medium), r.dp_rank, r.object_key, seq, _signed(seq),
            r.base_block_idx, parent, ev.token_ids or None,
            None if parent is None else _signed([parent])[0],
        )
    if t is _ev.BlockRemoved:
        seq = _seq(ev.block_hashes)
        return _RemovedOut(
            r.event_id, _ms(r.timestamp, ts_ms), "removed", "BlockRemoved", r.model_name,
            r.block_size, r.additional_salt, r.lora_name, r.tenant_id, r.backend_id,
            r.group_id, _lower(ev.medium), r.dp_rank, r.object_key, seq, _signed(seq),
            r.base_block_idx,
        )
    return _ClearedOut(
        r.event_id, _ms(r.timestamp, ts_ms), "cleared", "AllBlocksCleared", r.model_name,
        r.block_size, r.additional_salt, r.lora_name, r.tenant_id, r.backend_id,
        r.group_id, _lower(r.medium), r.dp_rank,
    )


def encode_batch(batch: _ev.EventBatch) -> bytes:
    """``batch`` as Mooncake Store's publisher writes it: ``[ts_ms, events, rank]``.

    Block hashes are u64 on this wire: a signed one is written as its two's complement
    (which is what it decodes back as), a byte string as its last 8 bytes (big-endian);
    anything else raises ValueError.
    """
    if not batch.events:
        return _encoder.encode((float(batch.ts), [], batch.data_parallel_rank))
    ts_ms = round(batch.ts * 1000)
    return _encoder.encode(
        (ts_ms, [_out(e, ts_ms) for e in batch.events], batch.data_parallel_rank)
    )


# --------------------------------------------------------------------------- block hash

#: The seed Dynamo uses for the standard block hash: the sequence hashes' chain always, the
#: local hashes before folding in a LoRA name or a cache namespace (which the RFC leaves to
#: the deployment).
STANDARD_SEED = 1337
_QQ = struct.Struct("<QQ")


def standard_seed(lora_name: str | None = None,
                  cache_namespace: str | bytes | None = None) -> int:
    """The seed ``S`` of the standard block hash for a LoRA name and a cache namespace, as
    Dynamo folds them (found by experiment against ``dynamo._core.compute_block_hash_for_seq``
    of ai-dynamo-runtime 1.6.1, tests/test_index_standard.py checks it for any values):
    ``S = 1337 + XXH3_64(utf8(lora_name), seed 0) + XXH3_64(utf8(cache_namespace), seed 1)``
    modulo 2**64, where a missing or empty name adds nothing. A bytes namespace is hashed
    as it is (what the UTF-8 string of the same bytes gives)."""
    s = STANDARD_SEED
    if lora_name:
        s += xxh3_64_intdigest(lora_name.encode("utf-8", "surrogatepass"))
    if cache_namespace:
        if isinstance(cache_namespace, str):
            cache_namespace = cache_namespace.encode("utf-8", "surrogatepass")
        s += xxh3_64_intdigest(cache_namespace, 1)
    return s & U64


def standard_local_hashes(
    token_ids: Sequence[int], block_size: int, seed: int = STANDARD_SEED
) -> list[int]:
    """``XXH3_64`` of each full ``block_size``-token block, tokens as little-endian u32."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size!r}")
    n = len(token_ids) // block_size
    data = struct.pack(f"<{n * block_size}I", *token_ids[: n * block_size])
    step = 4 * block_size
    return [xxh3_64_intdigest(data[i * step : (i + 1) * step], seed) for i in range(n)]


def standard_sequence_hashes(local: Sequence[int]) -> list[int]:
    """The RFC #1527 rolling sequence hashes of a prompt's local block hashes, as Dynamo
    chains them: ``seq[0] = local[0]``, ``seq[i] = XXH3_64(le_u64(seq[i-1]) ||
    le_u64(local[i]), 1337)``. The chain's seed is always :data:`STANDARD_SEED`: a LoRA name
    or a cache namespace is folded into the local hashes' seed only, so it reaches every
    sequence hash through them."""
    seq: list[int] = []
    prev = None
    pack = _QQ.pack
    for h in local:
        prev = h if prev is None else xxh3_64_intdigest(pack(prev, h), STANDARD_SEED)
        seq.append(prev)
    return seq


def standard_block_hashes(
    token_ids: Sequence[int], block_size: int, seed: int = STANDARD_SEED
) -> list[int]:
    """The RFC #1527 sequence hash of each full block of a prompt: what an rfc1527
    ``BlockStored`` without tokens carries as its ``block_hashes`` (block ``i`` of the
    prompt is at depth ``i``, i.e. at ``rfc1527.base_block_idx + k`` for the ``k``-th hash
    of an event). ``seed`` is the local hashes' seed ``S`` (:func:`standard_seed`); the
    chain over them uses 1337 whatever ``S`` is (:func:`standard_sequence_hashes`)."""
    return standard_sequence_hashes(standard_local_hashes(token_ids, block_size, seed))
