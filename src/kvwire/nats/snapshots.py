"""Compacted per-stream snapshots in the JetStream object store (bucket ``kvwire-snapshots``).

The bridge writes one object per engine DP rank (``<engine>.<rank>``) every
``--snapshot-interval`` seconds: the blocks of everything it published on that subject up to
and including JetStream stream sequence ``js_seq`` (the batch with engine ``(epoch, seq)``).
A consumer bootstraps by reading it and consuming the subject from ``js_seq + 1``: no central
coordination, and exact because ``js_seq`` is the PubAck of the last message it covers.

Format (fast to decode: a consumer loads 10^6 blocks in well under the 3 s target): one
msgpack document, ``[version, engine, rank, epoch, seq, js_seq, exact, created, blocks,
events]``, where ``events`` are ``BlockStored`` chains (:func:`kvwire.index.cache.chain_events`:
blocks stored together go back out as one event, so the size is about that of the batches
that built them). msgspec decodes it straight into typed structs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec

from ..index.cache import BlockCache, chain_events
from ..wire.events import BlockStored
from .subjects import DEFAULT_SNAPSHOT_BUCKET, check_token, snapshot_object

__all__ = ["FORMAT_VERSION", "StoredSnapshot", "decode_snapshot", "encode_snapshot",
           "SnapshotReadError", "open_bucket", "read_snapshot", "snapshot_of", "write_snapshot"]

FORMAT_VERSION = 1


class StoredSnapshot(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One stream's blocks as of JetStream sequence ``js_seq`` (engine ``(epoch, seq)``).

    ``epoch`` is the subject's epoch (the publisher's, or the bridge's incarnation number for
    reference publishers); ``exact`` is False when the bridge itself started inexact (a
    reference publisher whose history it never saw from seq 0)."""

    version: int
    engine: str
    rank: int
    epoch: int
    seq: int
    js_seq: int
    exact: bool
    created: float
    block_count: int
    blocks: list[BlockStored]

    def cache(self) -> BlockCache:
        """The blocks as a :class:`BlockCache` (e.g. to compare with an engine's truth)."""
        c = BlockCache()
        c.apply_events(self.blocks)
        return c


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StoredSnapshot)


def snapshot_of(cache: BlockCache | list[Any], *, engine: str, rank: int, epoch: int, seq: int,
                js_seq: int, exact: bool = True) -> StoredSnapshot:
    """A snapshot of ``cache`` (or of ``BlockCache.raw_copy()`` records taken earlier, so the
    copy can be made where the cache is consistent and the rest done elsewhere)."""
    records = cache.raw_copy() if isinstance(cache, BlockCache) else cache
    return StoredSnapshot(FORMAT_VERSION, engine, rank, epoch, seq, js_seq, exact, time.time(),
                          len(records), chain_events(records))


def encode_snapshot(snap: StoredSnapshot) -> bytes:
    return _encoder.encode(snap)


def decode_snapshot(data: bytes) -> StoredSnapshot:
    """Decode an object written by :func:`write_snapshot`; ValueError saying what is wrong."""
    try:
        snap = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"not a kvwire snapshot object: {e}") from None
    if snap.version != FORMAT_VERSION:
        raise ValueError(f"snapshot format version {snap.version}, this kvwire reads "
                         f"{FORMAT_VERSION}")
    return snap


async def open_bucket(js: Any, bucket: str = DEFAULT_SNAPSHOT_BUCKET, *, create: bool = False,
                      storage: str = "file") -> Any:
    """The object store bucket; None if it does not exist and ``create`` is False."""
    from nats.js.api import ObjectStoreConfig, StorageType
    from nats.js.errors import BucketNotFoundError, NotFoundError

    check_token(bucket, "snapshot bucket")
    try:
        return await js.object_store(bucket)
    except (BucketNotFoundError, NotFoundError):
        if not create:
            return None
    cfg = ObjectStoreConfig(bucket=bucket, storage=StorageType(storage),
                            description="kvwire per-stream snapshots (kvwire bridge)")
    return await js.create_object_store(bucket, config=cfg)


async def write_snapshot(js: Any, snap: StoredSnapshot, bucket: str = DEFAULT_SNAPSHOT_BUCKET,
                         store: Any = None) -> int:
    """Put ``snap`` as object ``<engine>.<rank>`` (replacing the previous one); bytes written."""
    if store is None:
        store = await open_bucket(js, bucket, create=True)
    data = encode_snapshot(snap)
    await store.put(snapshot_object(snap.engine, snap.rank), data)
    return len(data)


class SnapshotReadError(RuntimeError):
    """The snapshot object could not be read whole (replaced while being read, every try)."""


#: Longest wait for the next chunk of an object: the bridge replacing the object purges the
#: old version's chunks, and a reader of that version would otherwise wait forever.
CHUNK_TIMEOUT = 5.0
#: Tries, each with the object's current version, before SnapshotReadError.
READ_ATTEMPTS = 3


async def read_snapshot(js: Any, engine: str, rank: int,
                        bucket: str = DEFAULT_SNAPSHOT_BUCKET, *,
                        chunk_timeout: float = CHUNK_TIMEOUT,
                        attempts: int = READ_ATTEMPTS) -> StoredSnapshot | None:
    """The latest snapshot of ``<engine>.<rank>``, or None (no bucket, no object yet).

    A read that stalls (no chunk for ``chunk_timeout`` s) or comes out short or corrupt is
    retried with the object's current version (the bridge may have replaced it meanwhile);
    after ``attempts`` tries, :class:`SnapshotReadError`. Never waits without bound."""
    from nats.js.errors import NotFoundError, ObjectNotFoundError

    store = await open_bucket(js, bucket)
    if store is None:
        return None
    why = ""
    for _ in range(max(1, attempts)):
        try:
            info = await store.get_info(snapshot_object(engine, rank))
        except (ObjectNotFoundError, NotFoundError):
            return None
        try:
            return decode_snapshot(await _fetch(js, bucket, info, chunk_timeout))
        except _Incomplete as e:
            why = str(e)
    raise SnapshotReadError(
        f"snapshot {snapshot_object(engine, rank)} in bucket {bucket!r} not read whole in "
        f"{attempts} tries (last: {why})")


class _Incomplete(Exception):
    pass


async def _fetch(js: Any, bucket: str, info: Any, chunk_timeout: float = CHUNK_TIMEOUT) -> bytes:
    """The object's chunks, joined once. (nats-py's ``ObjectStore.get`` appends each chunk
    to a bytes object: quadratic, 3.5 s for a 35 MB snapshot instead of a fraction.)"""
    import base64
    from hashlib import sha256

    from nats.errors import TimeoutError as NatsTimeout

    if not info.size:
        return b""
    sub = await js.subscribe(subject=f"$O.{bucket}.C.{info.nuid}", ordered_consumer=True)
    parts: list[bytes] = []
    h = sha256()
    got = 0
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=chunk_timeout)
            except (NatsTimeout, asyncio.TimeoutError):
                raise _Incomplete(f"no chunk for {chunk_timeout:g}s after {got} of "
                                  f"{info.size} bytes (object replaced?)") from None
            parts.append(msg.data)
            h.update(msg.data)
            got += len(msg.data)
            if msg.metadata.num_pending == 0 or got >= info.size:
                break
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    digest = info.digest.split("=", 1)[1] if "=" in info.digest else info.digest
    if got != info.size or h.digest() != base64.urlsafe_b64decode(digest):
        raise _Incomplete(f"{got} bytes of {info.size}, or digest mismatch")
    return b"".join(parts)


class SubjectState(msgspec.Struct):
    """A subject's state as rebuilt by :func:`rebuild_subject`."""

    cache: BlockCache
    epoch: int | None  # of the last message (None: the subject is empty)
    seq: int | None
    js_seq: int | None  # stream sequence of the last message read
    exact: bool  # False: history before the rebuild was discarded (or an inexact snapshot)
    complete: bool  # False: the last message is a reset or a snapshot chunk short of n/n
    messages: int = 0


async def rebuild_subject(js: Any, stream: str, subject: str, engine: str, rank: int, *,
                          bucket: str = DEFAULT_SNAPSHOT_BUCKET,
                          timeout: float = 10.0) -> SubjectState:
    """The state of ``subject`` now: its object-store snapshot, then its messages from the
    snapshot's ``js_seq + 1`` (the bridge's own cache after a restart or a takeover).

    Continuity is checked as a consumer would: after the snapshot (or from the first
    message, which must be a reset marker) each message is ``(epoch, seq + 1)``, a reset
    marker or a snapshot chunk; anything else means history was discarded: ``exact=False``.
    """
    import asyncio

    from nats.js.api import ConsumerConfig, DeliverPolicy
    from nats.js.errors import NotFoundError

    from ..wire.events import BatchDecoder
    from .subjects import H_CHUNK, H_EPOCH, H_FIRST_SEQ, H_KIND, H_SEQ

    try:
        last = await js.get_last_msg(stream, subject)
    except NotFoundError:
        return SubjectState(BlockCache(), None, None, None, True, True)
    snap = await read_snapshot(js, engine, rank, bucket)
    if snap is not None and snap.js_seq > last.seq:
        snap = None  # from an earlier life of the stream (purged or recreated)
    cache = snap.cache() if snap is not None else BlockCache()
    st = SubjectState(cache, None if snap is None else snap.epoch,
                      None if snap is None else snap.seq, None if snap is None else snap.js_seq,
                      True if snap is None else snap.exact, True)
    if snap is not None and snap.js_seq == last.seq:
        return st
    start = 1 if snap is None else snap.js_seq + 1
    sub = await js.subscribe(subject, ordered_consumer=True, config=ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start))
    decoder = BatchDecoder(on_error=lambda err: None)
    chunk_list = msgspec.msgpack.Decoder(list[BlockStored])
    run_list = msgspec.msgpack.Decoder(list[msgspec.Raw])
    first = snap is None
    try:
        while True:
            msg = await asyncio.wait_for(sub.next_msg(timeout), timeout + 1)
            h = msg.headers or {}
            kind, epoch, seq = h.get(H_KIND), int(h.get(H_EPOCH, -1)), int(h.get(H_SEQ, -1))
            chunk = h.get(H_CHUNK, "0/1")
            if kind == "reset":
                cache.clear()
                st.complete, st.exact = False, True  # the snapshot after it decides
            elif kind == "snapshot":
                i, n = (int(x) for x in chunk.split("/"))
                if first or (st.epoch, st.seq) != (epoch, seq):
                    st.exact = False  # a chunk without its reset: its start was discarded
                cache.apply_events(chunk_list.decode(msg.data))
                st.complete = i == n - 1
                st.exact = st.exact and h.get("Kvwire-Exact", "1") not in ("0", "false")
            elif (not first and st.seq is not None and st.epoch == epoch and seq <= st.seq
                  and st.complete):
                # A batch (or run) already applied: redundant packing bridges cut runs
                # differently. The position stays where it is.
                epoch, seq = st.epoch, st.seq
            else:
                lo = int(h.get(H_FIRST_SEQ, seq)) if kind == "batches" else seq
                if first or st.seq is None or st.epoch != epoch or not lo <= st.seq + 1 <= seq:
                    st.exact = False
                if kind == "batches":
                    skip = 0 if st.seq is None or st.epoch != epoch else max(0, st.seq + 1 - lo)
                    for part in run_list.decode(msg.data)[skip:]:
                        cache.apply(decoder.decode(part))
                else:
                    cache.apply(decoder.decode(msg.data))
                st.complete = True
            first = False
            st.epoch, st.seq, st.js_seq = epoch, seq, msg.metadata.sequence.stream
            st.messages += 1
            if st.js_seq >= last.seq:
                return st
    finally:
        await sub.unsubscribe()
