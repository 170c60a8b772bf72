"""How kvwire's exact streams are laid out on NATS JetStream: names, headers, message ids.

This module is the contract between :mod:`kvwire.nats.bridge` (writer) and
:mod:`kvwire.nats.consumer` (reader); it does no I/O. See docs/scale-out.md.

* One JetStream stream (default ``KVWIRE``) captures ``<prefix>.>``; each engine DP rank has
  one subject ``<prefix>.<engine>.<rank>``, so per-subject order is the engine's order and
  per-subject limits bound each engine's history on its own.
* Every message carries ``Kvwire-Kind`` (``batch``, ``batches``, ``reset`` or ``snapshot``),
  ``Kvwire-Epoch`` and ``Kvwire-Seq``. ``Nats-Msg-Id`` is ``engine/rank/epoch/seq`` (batches)
  or ``engine/rank/epoch/<kind>-seq[-chunk]`` (markers), so JetStream drops the second copy a
  restarted or redundant bridge writes within the stream's duplicate window; outside it the
  bridge's own check (the subject's last message) keeps it exact.
* A ``batches`` message (a bridge run with ``--pack N``, N > 1) carries a run of 2..N
  consecutive batches of one epoch: ``Kvwire-First-Seq`` is the first seq, ``Kvwire-Seq`` the
  last (so ``Kvwire-Seq`` is always the last seq a message covers), ``Nats-Msg-Id`` is
  ``engine/rank/epoch/first-last``. Its body is a msgpack array of the batches, each in
  vLLM's wire format (the array header followed by the batch encodings). The id names the
  whole run, so Msg-Id dedupe cannot settle runs two redundant bridges cut differently: the
  guard does (``Nats-Expected-Last-Subject-Sequence``, :mod:`kvwire.nats.writer`), and of
  two packing bridges' runs only one is ever stored. A ``--pack 1`` bridge writes without
  a guard: beside a packing one, a batch it sends after the other's run covered it is stored
  again (tests/test_nats_redundant.py). Readers drop seqs they already have (only the new
  tail of a message that overlaps what was delivered counts).
* ``epoch`` is the publisher's epoch when it has one (kvwire publishers); reference publishers
  have none, so the bridge numbers their incarnations itself: ``0`` first, ``+1`` per reset,
  recovered after a bridge restart from the subject's last message.
* A ``batch`` body is the batch encoded as vLLM's wire format (:func:`kvwire.wire.encode_batch`).
  A ``reset`` body is empty (its reason is in ``Kvwire-Reason``); a ``snapshot`` (the blocks
  after every batch with seq <= ``Kvwire-Seq``) is a msgpack list of ``BlockStored`` events,
  split into ``Kvwire-Chunk: i/n`` messages when larger than the server's max payload.
* Compacted snapshots for bootstrapping live in the object store bucket ``kvwire-snapshots``,
  object ``<engine>.<rank>``, with the JetStream sequence they correspond to.
"""

from __future__ import annotations

import re

__all__ = [
    "DEFAULT_LEASE_BUCKET", "DEFAULT_PREFIX", "DEFAULT_SNAPSHOT_BUCKET", "DEFAULT_STREAM",
    "H_CHUNK", "H_EPOCH", "H_FIRST_SEQ", "H_KIND", "H_MSG_ID", "H_REASON", "H_SEQ", "KINDS",
    "check_token", "header_int", "msg_id", "run_msg_id", "parse_subject", "snapshot_object", "stream_name", "subject_for",
]

DEFAULT_STREAM = "KVWIRE"
DEFAULT_PREFIX = "kvwire.events"
DEFAULT_SNAPSHOT_BUCKET = "kvwire-snapshots"
DEFAULT_LEASE_BUCKET = "kvwire-leases"

H_KIND = "Kvwire-Kind"
H_EPOCH = "Kvwire-Epoch"
H_SEQ = "Kvwire-Seq"
H_FIRST_SEQ = "Kvwire-First-Seq"  # on ``batches`` messages: the first seq of the run
H_REASON = "Kvwire-Reason"
H_CHUNK = "Kvwire-Chunk"
H_MSG_ID = "Nats-Msg-Id"

KINDS = ("batch", "batches", "reset", "snapshot")

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def header_int(text: str | None) -> int | None:
    """A header value as an int; None when absent or not a number (callers say why)."""
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def check_token(value: str, what: str) -> str:
    """A NATS subject token: no dots, wildcards or spaces (they would change the subject)."""
    if not isinstance(value, str) or not _TOKEN.match(value):
        raise ValueError(
            f"{what} {value!r} cannot be a NATS subject token: use letters, digits, '_' or '-'")
    return value


def subject_for(prefix: str, engine: str, rank: int) -> str:
    """``<prefix>.<engine>.<rank>``: the one subject of an engine DP rank."""
    for part in prefix.split("."):
        check_token(part, "subject prefix part")
    check_token(engine, "engine name")
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0, got {rank!r}")
    return f"{prefix}.{engine}.{rank}"


def parse_subject(prefix: str, subject: str) -> tuple[str, int]:
    """``(engine, rank)`` of a subject written by :func:`subject_for`; ValueError otherwise."""
    head = prefix + "."
    rest = subject[len(head):] if subject.startswith(head) else None
    parts = rest.split(".") if rest else []
    if len(parts) != 2 or not _TOKEN.match(parts[0]) or not parts[1].isdigit():
        raise ValueError(f"subject {subject!r} is not {prefix}.<engine>.<rank>")
    return parts[0], int(parts[1])


def stream_name(engine: str, rank: int) -> str:
    """The stream name consumers deliver under: the same as ``StreamSpec.for_ranks`` uses."""
    return f"{engine}/dp{rank}"


def msg_id(engine: str, rank: int, epoch: int, seq: int, kind: str = "batch",
           chunk: int | None = None, first: int | None = None) -> str:
    """``Nats-Msg-Id``: equal for the same item however many bridges write it. The one place
    its format is made: ``engine/rank/epoch/`` then ``seq`` (a batch), ``first-seq`` (a
    ``batches`` run), ``kind-seq[-chunk]`` (a marker)."""
    if kind == "batch":  # (first: one per batch sent, on the bridge's hot path)
        return f"{engine}/{rank}/{epoch}/{seq}"
    if kind == "batches":
        if first is None or seq <= first:
            raise ValueError(f"a run covers at least two seqs, got {first}..{seq}")
        tail = f"{first}-{seq}"
    elif kind in KINDS:
        tail = f"{kind}-{seq}" if chunk is None else f"{kind}-{seq}-{chunk}"
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return f"{engine}/{rank}/{epoch}/{tail}"


def run_msg_id(engine: str, rank: int, epoch: int, first: int, last: int) -> str:
    """``Nats-Msg-Id`` of a ``batches`` message: the run ``first..last`` (a one-batch run is
    an ordinary ``batch`` message with :func:`msg_id`)."""
    return msg_id(engine, rank, epoch, last, "batches", first=first)


def snapshot_object(engine: str, rank: int) -> str:
    """Object name of an engine rank's compacted snapshot in the snapshot bucket."""
    return f"{check_token(engine, 'engine name')}.{rank}"
