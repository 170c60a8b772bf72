"""The index's value types and its per-stream state: what ``match`` and ``streams()``
return, the mutable ``_Stream`` record, and the small helpers of keys and bit masks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
from xxhash import xxh3_64_intdigest

from ..wire.events import BlockHash
from . import keys as _k
from .keys import bits64, py_chain_std, token_bytes

__all__ = ["StreamIndexStats", "StreamMatch"]

#: Requests a stream must have seen, all without a single match, before it is called suspect.
SUSPECT_AFTER = 20
#: Predictions are kept in this many dicts, chosen by a key's top bits (``key >> PRED_SHIFT``;
#: own keys are 64-bit hashes). They churn (a prompt's blocks in, expired or confirmed ones
#: out), and CPython rebuilds a dict that churns in one go now and then, under the router's
#: lock: one dict of 384k predictions held a route for 22 ms; a shard's rebuild is 1/64 of
#: that (bench/predictions.py, docs/benchmarks.md).
PRED_SHARDS = 64
PRED_SHIFT = 58


def pred_shards() -> tuple[dict[int, Any], ...]:
    """An empty prediction map: ``PRED_SHARDS`` dicts, key ``k`` in ``[k >> PRED_SHIFT]``."""
    return tuple({} for _ in range(PRED_SHARDS))


_SYNTH = 0x6B76_7769_7265_5F78  # seed for keys of blocks whose tokens are unknown

class StreamMatch(msgspec.Struct, frozen=True, gc=False):
    """One stream's answer to ``match``: leading prompt blocks it holds, by best tier.

    ``blocks`` is the matched prefix length: the ``counts`` of each tier (in the order of
    ``tier_names``, best first) plus ``predicted``. ``credit`` is sum(tier credit x blocks) +
    predicted blocks (at full credit); ``prompt_blocks`` is the prompt's full blocks in this
    stream's block size (0 while the size is unknown). Every field is immutable, so the index
    can hand the same answer out again (a stream that matched nothing costs no allocation);
    ``tiers`` builds the ``{tier: blocks}`` dict on demand.
    """

    stream: str
    prompt_blocks: int
    blocks: int
    predicted: int
    credit: float
    counts: tuple[int, ...]
    tier_names: tuple[str, ...]

    @property
    def tiers(self) -> dict[str, int]:
        """``{tier: blocks}`` for every configured tier (a new dict each time)."""
        return dict(zip(self.tier_names, self.counts))


class StreamIndexStats(msgspec.Struct, frozen=True):
    """What the index knows about one stream, and why it might be useless (``suspect``)."""

    stream: str
    block_size: int | None
    blocks: int
    tiers: dict[str, int]
    events_applied: int
    batches_applied: int
    last_event_time: float | None
    alive: bool
    resets: int
    snapshots: int
    clears: int
    stores_without_tokens: int
    unplaced_blocks: int
    orphan_stores: int
    unknown_removes: int
    bad_events: int
    predicted_blocks: int
    match_requests: int
    matched_requests: int
    suspect: str | None


class _Stream:
    """Mutable per-stream state (internal)."""

    __slots__ = (
        "name", "slot", "bit", "block_size", "sizes_seen", "h2k", "dups", "ghosts", "old_ghosts",
        "pred",
        "events", "batches", "last_time", "alive", "resets", "snapshots", "clears",
        "no_tokens", "unplaced", "orphans", "unknown_removes", "bad", "last_bad",
        "req_base", "matched", "token_blocks", "std_blocks",
    )

    def __init__(self, name: str, slot: int) -> None:
        self.name = name
        self.slot = slot
        self.bit = 1 << slot
        self.block_size: int | None = None
        self.sizes_seen: set[int] = set()
        # per tier, engine hash -> own key: a KeyMap (the C table, or a dict without C)
        self.h2k: dict[int, Any] = {}
        self.dups: dict[int, dict[int, int]] = {}
        self.ghosts: Any = _k.KeyMap()
        self.old_ghosts: Any = _k.KeyMap()
        self.pred = pred_shards()  # own key -> expiry, sharded (PRED_SHARDS)
        self.events = self.batches = 0
        self.last_time: float | None = None
        self.alive = True
        self.resets = self.snapshots = self.clears = 0
        self.no_tokens = self.unplaced = self.orphans = self.unknown_removes = self.bad = 0
        self.last_bad = ""
        self.req_base = 0
        self.matched = 0
        self.token_blocks = 0
        self.std_blocks = 0  # token-less rfc1527 blocks keyed by their standard hashes

    def lookup(self, h: BlockHash) -> int | None:
        for d in self.h2k.values():
            k = d.get(h)
            if k is not None:
                return k
        k = self.ghosts.get(h)
        return self.old_ghosts.get(h) if k is None else k


def _bits(mask: int) -> Iterable[int]:
    """Indices of the set bits of ``mask``, lowest first."""
    if bits64 is not None and 0 <= mask < 1 << 64:
        return bits64(mask)
    return _py_bits(mask)


def _py_bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _synthetic(h: BlockHash, seed: int) -> int:
    """A key for a block whose tokens are unknown: unique, but no prompt will ever hash to it."""
    if isinstance(h, int):
        h = h.to_bytes(16, "little", signed=True)
    return xxh3_64_intdigest(h, seed ^ _SYNTH)


def _as_scannable(token_ids: Any) -> Any:
    """Token ids as something ``scan_tokens`` reads directly: an int64 buffer as is,
    anything else as a list."""
    if not isinstance(token_ids, list | tuple):
        try:
            mv = memoryview(token_ids)
        except TypeError:
            return list(token_ids)
        if mv.itemsize == 8 and mv.ndim == 1 and mv.format.lstrip("<=@") in ("q", "l"):
            return token_ids
        return list(token_ids)
    return token_ids


def _lazy_keys(token_ids: list[int], bs: int, n: int, seed: int | None,
               fold: int | None = None) -> Iterable[int]:
    """Pure-Python keys one block at a time, so a walk that stops early hashes no further
    (``fold``: the standard scheme, see keys.py)."""
    if fold is not None:
        yield from py_chain_std(token_ids, bs, n, seed, fold)
        return
    assert seed is not None
    mv = memoryview(token_bytes(token_ids[: n * bs]))
    step = bs * 8
    k = seed
    for off in range(0, n * step, step):
        k = xxh3_64_intdigest(mv[off : off + step], k)
        yield k


def _salt_from_extra(first: Any, lora_name: str | None) -> Any:
    """The cache salt in a vLLM first block's extra keys: its last string that is not the
    LoRA name (vLLM appends the salt after the LoRA name and multimodal hashes)."""
    if not first:
        return None
    if isinstance(first, str):
        return None if first == lora_name else first
    if isinstance(first, list | tuple):
        for x in reversed(first):
            if isinstance(x, str) and x != lora_name:
                return x
    return None


def suspect(st: _Stream, requests: int) -> str | None:
    """Why a stream is useless or partly so, in a sentence (None when nothing is wrong)."""
    if st.no_tokens and not st.token_blocks and not st.std_blocks and st.events:
        return (f"{st.no_tokens} blocks stored without token ids and none with: the index "
                "cannot compute keys for this stream, so it never matches")
    if st.std_blocks and st.block_size is None:
        return (f"{st.std_blocks} blocks stored by standard hashes without a block size: "
                "the stream is not matched until one is known (predict(..., block_size=))")
    keyed = st.token_blocks + st.std_blocks
    if keyed and requests >= SUSPECT_AFTER and st.matched == 0:
        return (f"{keyed} blocks stored but 0 of {requests} requests matched any: "
                f"block size {st.block_size} (sizes seen {sorted(st.sizes_seen)}), LoRA "
                "name or cache salt may disagree between the engine and the requests")
    if len(st.sizes_seen) > 1:
        return (f"stores with several block sizes {sorted(st.sizes_seen)}: only "
                f"{st.block_size}-token blocks are matched")
    if st.bad:
        return f"{st.bad} events could not be indexed (last: {st.last_bad})"
    return None
