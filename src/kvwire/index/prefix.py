"""PrefixIndex: which stream (engine x DP rank) holds which prefix, fed by live events.

The part that takes the deliveries; it holds the pure part, :class:`~.walk.PrefixWalk`
(own key -> slot masks by tier, predictions, slots, ``match``'s walk), and keeps beside it:

* per stream and tier, ``engine hash -> own key`` (the engine's hashes are only ids: this
  is how ``BlockRemoved`` finds the key), in a ``KeyMap`` (the C table, 17 bytes a slot;
  a dict without C), plus a rarely used duplicate count for two engine hashes that map to
  one own key, and the recently removed hashes;
* the clock and the predictions' TTL queue.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..consume.stream import Batch, Liveness, Reset, Snapshot
from ..wire.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored
from ..wire.rfc1527 import STANDARD_SEED
from . import keys as _k
from .keys import (
    add_bits,
    chain_start,
    chain_tokens,
    insert_new,
    pred_add,
    pred_expire,
    root_seed,
    standard_fold,
)
from .state import (
    PRED_SHIFT,
    StreamIndexStats,
    StreamMatch,
    _salt_from_extra,
    _Stream,
    _synthetic,
    pred_shards,
    suspect,
)
from .walk import PrefixWalk

__all__ = [
    "DEFAULT_TIER_ALIASES", "DEFAULT_TIER_CREDITS", "PrefixIndex", "StreamIndexStats",
    "StreamMatch",
]


#: Credit of one matched block per tier: a CPU hit saves most of the prefill, a disk hit less.
DEFAULT_TIER_CREDITS: dict[str, float] = {"GPU": 1.0, "CPU": 0.75, "DISK": 0.25}
#: Engine ``medium`` names folded into the canonical tiers (nil is GPU).
DEFAULT_TIER_ALIASES: dict[str, str] = {
    "CPU_PINNED": "CPU", "STORAGE": "DISK", "EXTERNAL": "DISK",
}
#: Recently removed engine hashes remembered per stream (GHOSTS to 2x GHOSTS), so that a token-less store on an
#: offload tier right after the GPU eviction still finds its key.
GHOSTS = 65_536


class PrefixIndex:
    """Prefix index over many streams, fed by :mod:`kvwire.consume` deliveries.

    Not thread-safe: one writer (the subscriber loop) and readers on the same thread, or a
    lock around it (what the routing service does).
    """

    def __init__(
        self,
        tier_credits: Mapping[str, float] | None = None,
        tier_aliases: Mapping[str, str] | None = None,
        predict_ttl: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        remember_removed: int = GHOSTS,
        key_scheme: str = "standard",
    ) -> None:
        credits = dict(DEFAULT_TIER_CREDITS if tier_credits is None else tier_credits)
        if not credits:
            raise ValueError("tier_credits must name at least one tier")
        for name, c in credits.items():
            if not isinstance(c, int | float) or c < 0:
                raise ValueError(f"tier credit for {name!r} must be a number >= 0, got {c!r}")
        self.tier_aliases = dict(DEFAULT_TIER_ALIASES if tier_aliases is None else tier_aliases)
        if predict_ttl < 0:
            raise ValueError(f"predict_ttl must be >= 0, got {predict_ttl!r}")
        self.predict_ttl = float(predict_ttl)
        self.clock = clock
        #: engine hashes of removed blocks remembered per stream (between this and twice it)
        self.remember_removed = max(0, int(remember_removed))
        # the pure part: own key -> slot masks, predictions, slots, and match's walk
        self._h = PrefixWalk(credits, key_scheme)
        #: "standard" (RFC #1527 sequence hashes, the default) or "kvwire" (docs/prefix-index.md)
        self.key_scheme = key_scheme
        self._std = key_scheme == "standard"
        # standard scheme: own key -> its seed S where S is not the plain 1337 (a LoRA or a
        # salt), so that a continuation event, which may not repeat the salt, hashes its
        # blocks with its parent's S; dropped with the key
        self._folds: dict[int, int] = {}
        # (expiry, stream, keys): keys as an array, which the cyclic GC never walks (a list
        # per routed request, held for the TTL, made every full collection of a busy router
        # visit millions of ints)
        self._pred_queue: deque[tuple[float, _Stream, array[int]]] = deque()
        self._medium_cache: dict[str | None, int] = {}
        self._free: list[int] = []
        self._next_slot = 0
        #: Items ``apply`` could not use (wrong type), counted; see ``last_error``.
        self.bad_items = 0
        self.last_error = ""

    @property
    def walk(self) -> PrefixWalk:
        """The pure part (the indexer API's /query reads it under the caller's lock)."""
        return self._h

    @property
    def tier_credits(self) -> dict[str, float]:
        """Credit of one matched block per tier (may be retuned live: match reads it)."""
        return self._h.tier_credits

    @tier_credits.setter
    def tier_credits(self, credits: dict[str, float]) -> None:
        self._h.tier_credits = credits

    def match(self, token_ids: list[int], lora_name: str | None = None,
              salt: Any = None) -> dict[str, StreamMatch]:
        """Leading prompt blocks each known stream holds, by best tier (see StreamMatch)."""
        if self._pred_queue:
            self._expire(self.clock())
        return self._h.match(token_ids, lora_name, salt)

    # ------------------------------------------------------------------ streams and tiers

    def _stream(self, name: str) -> _Stream:
        st = self._h.streams.get(name)
        if st is None:
            if self._free:
                slot = self._free.pop()
            else:
                slot = self._next_slot
                self._next_slot += 1
                if slot >= self._h.W:
                    self._grow()
            st = self._h.streams[name] = _Stream(name, slot)
            self._h.by_slot[slot] = st
            self._h.shape += 1
        return st

    def _grow(self) -> None:
        """Double the slots per lane and repack every key's masks (rare: every 64 streams)."""
        old, new = self._h.W, self._h.W * 2
        full = (1 << old) - 1
        lanes = 2 + len(self._h.tiers)

        def repack(v: int) -> int:
            out = 0
            for lane in range(lanes):
                out |= ((v >> (lane * old)) & full) << (lane * new)
            return out

        self._h.keys = {k: repack(v) for k, v in self._h.keys.items()}
        self._h.W = new
        self._h.lanes = None  # the mirror holds 64 slots per lane: the scan reads the dict now

    def _tier(self, medium: str | None) -> int:
        t = self._medium_cache.get(medium)
        if t is None:
            name = "GPU" if medium is None else self.tier_aliases.get(medium, medium)
            t = self._h.tier_idx.get(name)
            if t is None:  # a tier nobody configured: indexed, credit 0, worst rank
                t = self._h.tier_idx[name] = len(self._h.tiers)
                self._h.tiers.append(name)
                self.tier_credits.setdefault(name, 0.0)
                self._h.shape += 1
            self._medium_cache[medium] = t
        return t

    def _learn_block_size(self, st: _Stream, bs: int) -> None:
        if st.block_size == bs:
            return
        if st.block_size is not None:
            self._h.by_bs[st.block_size] &= ~st.bit
        st.block_size = bs
        self._h.by_bs[bs] = self._h.by_bs.get(bs, 0) | st.bit
        self._h.shape += 1
        st.req_base = self._h.bs_requests.get(bs, 0)

    # ------------------------------------------------------------------ ingest

    def apply(self, item: Any) -> None:
        """Apply one subscriber delivery (``Batch``, ``Reset``, ``Snapshot``, ``Liveness``)."""
        tp = type(item)
        if tp is Batch:
            st = self._stream(item.stream)
            self._apply_events(st, item.batch.events)
            st.batches += 1
            st.last_time = self.clock()
        elif tp is Snapshot:
            st = self._stream(item.stream)
            self._clear(st)
            st.snapshots += 1
            self._apply_events(st, item.blocks)
            st.last_time = self.clock()
        elif tp is Reset:
            st = self._stream(item.stream)
            self._clear(st)
            st.resets += 1
        elif tp is Liveness:
            self._stream(item.stream).alive = bool(item.alive)
        else:
            self.bad_items += 1
            self.last_error = f"apply() got {tp.__name__}, expected Batch/Reset/Snapshot/Liveness"
            raise TypeError(self.last_error)

    def apply_many(self, items: Iterable[Any]) -> None:
        """Apply a list of deliveries in order (``Subscriber.poll_many`` output)."""
        for item in items:
            self.apply(item)

    def _apply_events(self, st: _Stream, events: Iterable[Any]) -> None:
        for ev in events:
            tp = type(ev)
            if tp is BlockStored:
                self._store(st, ev)
            elif tp is BlockRemoved:
                self._remove(st, ev.block_hashes, ev.medium)
            elif tp is AllBlocksCleared:
                self._clear(st)
                st.clears += 1
            else:
                st.bad += 1
                st.last_bad = f"unknown event type {tp.__name__}"
                continue
            st.events += 1

    def _store(self, st: _Stream, ev: BlockStored) -> None:
        hs = ev.block_hashes
        n = len(hs)
        if n == 0:
            return
        bs = ev.block_size
        toks = ev.token_ids
        parent = ev.parent_block_hash
        if toks and isinstance(bs, int) and bs > 0 and len(toks) == n * bs:
            fold = None
            lora = ev.lora_name
            if lora is None and ev.lora_id is not None:
                lora = str(ev.lora_id)
            if parent is None:
                salt = ev.cache_salt
                if salt is None and ev.extra_keys:
                    salt = _salt_from_extra(ev.extra_keys[0], ev.lora_name)
                if self._std:
                    seed = None
                    fold = STANDARD_SEED if lora is None and salt is None else (
                        standard_fold(lora, salt))
                else:
                    seed = root_seed(lora, salt)
            else:
                seed = st.lookup(parent)
                if seed is None:
                    st.orphans += 1
                    seed = _synthetic(parent, 0)
                if self._std:  # the parent's S, else this event's
                    fold = self._folds.get(seed) if self._folds else None
                    if fold is None:
                        salt = ev.cache_salt
                        fold = STANDARD_SEED if lora is None and salt is None else (
                            standard_fold(lora, salt))
            try:
                keys = chain_tokens(toks, bs, n, seed, 0, fold)
            except ValueError as e:
                st.bad += 1
                st.last_bad = f"BlockStored token ids: {e}"
                return
            if st.block_size != bs:
                st.sizes_seen.add(bs)
                self._learn_block_size(st, bs)
            st.token_blocks += n
            if fold is not None and fold != STANDARD_SEED:
                self._folds.update(dict.fromkeys(keys, fold))
        elif not toks and self._std and ev.rfc1527 is not None:
            # RFC #1527 blocks announced by their standard sequence hashes only: under the
            # standard scheme those ARE the own keys (block k at depth base_block_idx + k,
            # chained on parent_block_hash), so a prompt hashed here matches them directly
            st.no_tokens += n
            st.std_blocks += n
            keys = hs if type(hs) is list else list(hs)
            if isinstance(bs, int) and bs > 0 and st.block_size != bs:
                st.sizes_seen.add(bs)
                self._learn_block_size(st, bs)
        elif not toks:
            st.no_tokens += n
            keys = []
            prev = None if parent is None else st.lookup(parent)
            for h in hs:
                k = st.lookup(h)
                if k is None:
                    if prev is None:
                        st.unplaced += 1
                        k = _synthetic(h, 1)
                    else:
                        k = _synthetic(h, prev)
                keys.append(k)
                prev = k
        else:
            st.bad += 1
            st.last_bad = (
                f"BlockStored with {len(toks)} token ids for {n} blocks of block_size {bs!r}"
            )
            return
        self._add(st, self._tier(ev.medium), hs, keys)

    def _add(self, st: _Stream, t: int, hs: list[BlockHash], keys: list[int]) -> None:
        d = st.h2k.get(t)
        if d is None:
            d = st.h2k[t] = _k.KeyMap()
        W = self._h.W
        bit = st.bit
        nb = bit << W
        tb = bit << ((2 + t) * W)
        kd = self._h.keys
        kget = kd.get
        lanes = self._h.lanes
        sp = st.pred
        if any(sp):  # events confirm the predictions they store: they decide from now on
            for k in keys:
                if k in sp[k >> PRED_SHIFT]:
                    self._unpredict(st, k)
        dget = d.get
        if t == 0:
            # the common case: new blocks in the best tier, in C
            if type(hs) is not list:
                hs = list(hs)
            done = insert_new(d, hs, keys)
            if done == len(hs):
                for k in add_bits(kd, keys, bit | tb, ~nb, tb, lanes):
                    self._dup(st, t, k)
                return
            for h in hs[:done]:  # a hash known already (or twice in the event): undo,
                del d[h]  # take the careful path
        if t == 0:  # the best tier: any-lane and tier lane set, not-best lane cleared
            setb = bit | tb
            for h, k in zip(hs, keys):
                old = dget(h)
                if old is not None:
                    if old != k:
                        self._replace(st, t, h, k)
                    continue  # the same block stored again: idempotent
                d[h] = k
                v = kget(k, 0)
                if v & tb:
                    self._dup(st, t, k)
                else:
                    v = kd[k] = (v | setb) & ~nb
                    if lanes is not None:
                        lanes.set(k, v)
        else:
            best = bit << (2 * W)
            for h, k in zip(hs, keys):
                old = dget(h)
                if old is not None:
                    if old != k:
                        self._replace(st, t, h, k)
                    continue
                d[h] = k
                v = kget(k, 0)
                if v & tb:
                    self._dup(st, t, k)
                else:
                    v |= bit | tb
                    if not v & best:
                        v |= nb
                    kd[k] = v
                    if lanes is not None:
                        lanes.set(k, v)

    def _dup(self, st: _Stream, t: int, k: int) -> None:
        """A second engine hash for a key the stream already holds in tier ``t``."""
        dd = st.dups.setdefault(t, {})
        dd[k] = dd.get(k, 0) + 1

    def _replace(self, st: _Stream, t: int, h: BlockHash, k: int) -> None:
        """An engine hash re-stored with other tokens: move it to its new key."""
        self._remove(st, [h], None, t)
        self._add(st, t, [h], [k])

    def _remove(self, st: _Stream, hs: list[BlockHash], medium: str | None,
                t: int | None = None) -> None:
        if t is None:
            t = self._tier(medium)
        d = st.h2k.get(t)
        if d is None:
            st.unknown_removes += len(hs)
            return
        W = self._h.W
        bit = st.bit
        tb = bit << ((2 + t) * W)
        nb = bit << W
        lanes = 2 + len(self._h.tiers)
        kd = self._h.keys
        mirror = self._h.lanes
        dups = st.dups.get(t)
        ghosts = st.ghosts
        pop = d.pop
        for h in hs:
            k = pop(h, None)
            if k is None:
                st.unknown_removes += 1
                continue
            ghosts[h] = k
            if dups:
                c = dups.get(k)
                if c:
                    if c == 1:
                        del dups[k]
                    else:
                        dups[k] = c - 1
                    continue
            v = kd[k] & ~tb
            if lanes == 3:  # one tier: the stream holds nothing else of this key
                v &= ~(bit | nb)
            else:
                held = 0
                for lane in range(2, lanes):
                    held |= v >> (lane * W)
                if not held & bit:
                    v &= ~(bit | nb)
                elif t == 0:
                    v |= nb
            if v:
                kd[k] = v
                if mirror is not None:
                    mirror.set(k, v)
            else:
                del kd[k]
                if mirror is not None:
                    mirror.discard(k)
                if self._folds:
                    self._folds.pop(k, None)
        if len(ghosts) >= self.remember_removed:  # two generations: bounded, O(1) per removal
            st.old_ghosts = ghosts
            st.ghosts = _k.KeyMap()

    def _clear(self, st: _Stream) -> None:
        """Drop every block of the stream (predictions stay: they are routing decisions)."""
        mask = ~(st.bit * self._lane_ones())
        kd = self._h.keys
        lanes = self._h.lanes
        for d in st.h2k.values():
            for k in d.values():
                v = kd.get(k)
                if v is not None:
                    v &= mask
                    if v:
                        kd[k] = v
                        if lanes is not None:
                            lanes.set(k, v)
                    else:
                        del kd[k]
                        if lanes is not None:
                            lanes.discard(k)
                        if self._folds:
                            self._folds.pop(k, None)
        st.h2k = {}
        st.dups = {}
        st.ghosts = _k.KeyMap()
        st.old_ghosts = _k.KeyMap()

    def _lane_ones(self) -> int:
        """An int with bit 0 of every lane set: ``bit * this`` is the bit in every lane."""
        W = self._h.W
        return sum(1 << (lane * W) for lane in range(2 + len(self._h.tiers)))

    def remove_stream(self, stream: str) -> None:
        """Forget a stream entirely (blocks, predictions, counters); its slot is reused."""
        st = self._h.streams.pop(stream, None)
        if st is None:
            return
        self._clear(st)
        for shard in st.pred:
            for k in shard:
                self._clear_pred_bit(k, st.bit)
        st.pred = pred_shards()
        if st.block_size is not None:
            self._h.by_bs[st.block_size] &= ~st.bit
            if not self._h.by_bs[st.block_size]:
                del self._h.by_bs[st.block_size]
        del self._h.by_slot[st.slot]
        self._free.append(st.slot)
        self._h.shape += 1

    # ------------------------------------------------------------------ predictions

    def predict(self, stream: str, token_ids: list[int], lora_name: str | None = None,
                salt: Any = None, block_size: int | None = None) -> int:
        """Count the prompt's blocks as held by ``stream`` for ``predict_ttl`` seconds (or until
        events store them): the gap between routing a request and the events confirming it.

        Uses the stream's learned block size (or ``block_size`` while none is known); returns
        the number of blocks predicted (0 when no block size is known).
        """
        return self.predict_keys(stream, self.prompt_keys(stream, token_ids, lora_name, salt,
                                                          block_size))

    def prompt_keys(self, stream: str, token_ids: list[int], lora_name: str | None = None,
                    salt: Any = None, block_size: int | None = None) -> array:
        """The own keys of the prompt's full blocks at ``stream``'s block size (learning
        ``block_size`` while none is known); empty when no block size is known or
        predictions are off. What :meth:`predict` predicts, for :meth:`predict_keys` on
        another index (router replicas share their predictions)."""
        st = self._stream(stream)
        if st.block_size is None and block_size:
            self._learn_block_size(st, block_size)  # until its events say otherwise
        bs = st.block_size
        if not bs or self.predict_ttl <= 0 or len(token_ids) < bs:
            return array("Q")
        seed, fold = chain_start(self.key_scheme, lora_name, salt)
        return array("Q", chain_tokens(token_ids, bs, len(token_ids) // bs, seed, 0, fold))

    def predict_keys(self, stream: str, keys: array) -> int:
        """Count these own keys (:meth:`prompt_keys`) as held by ``stream`` for
        ``predict_ttl`` seconds (or until events store them); how many."""
        if not keys or self.predict_ttl <= 0:
            return 0
        st = self._stream(stream)
        now = self.clock()
        self._expire(now)
        exp = now + self.predict_ttl
        if type(keys) is not array or keys.typecode != "Q":
            keys = array("Q", keys)
        pred_add(keys, st.pred, self._h.pred, exp, st.bit)
        self._pred_queue.append((exp, st, keys))
        return len(keys)

    def _unpredict(self, st: _Stream, k: int) -> None:
        del st.pred[k >> PRED_SHIFT][k]
        self._clear_pred_bit(k, st.bit)

    def _clear_pred_bit(self, k: int, bit: int) -> None:
        d = self._h.pred[k >> PRED_SHIFT]
        v = d.get(k, 0) & ~bit
        if v:
            d[k] = v
        else:
            d.pop(k, None)

    def _expire(self, now: float) -> None:
        q = self._pred_queue
        while q and q[0][0] <= now:
            _, st, keys = q.popleft()
            if self._h.streams.get(st.name) is not st:
                continue  # removed stream: its predictions went with it
            pred_expire(keys, st.pred, self._h.pred, now, st.bit)

    # ------------------------------------------------------------------ per-medium answers

    def tier_prefixes(self, keys: Iterable[int], streams: Iterable[str],
                      cumulative: bool = False) -> dict[str, tuple]:
        """Per known stream of ``streams``: ``(n, alone)``: leading ``keys`` (own keys, e.g.
        a prompt's :func:`~kvwire.index.block_keys` at that stream's block size) it holds
        in any tier, and ``{tier: leading keys held in that tier alone}``; with
        ``cumulative``, ``(n, alone, cum)``, ``cum`` = ``{tier: ... in that tier or a
        better one}``. No predictions."""
        names = self._h.tiers
        out = self._h.tier_prefixes(keys, streams, cumulative)
        if cumulative:
            return {s: (n, dict(zip(names, alone)), dict(zip(names, cum)))
                    for s, (n, alone, cum) in out.items()}
        return {s: (n, dict(zip(names, alone))) for s, (n, alone) in out.items()}

    def block_size_of(self, stream: str) -> int | None:
        """The block size the stream's events use (None: unknown stream or none seen)."""
        st = self._h.streams.get(stream)
        return None if st is None else st.block_size

    def held_keys(self, stream: str) -> dict[str, list[int]]:
        """``{tier: own keys}`` the stream holds (for a dump; empty for an unknown one)."""
        st = self._h.streams.get(stream)
        if st is None:
            return {}
        return {self._h.tiers[t]: sorted(set(d.values())) for t, d in st.h2k.items() if len(d)}

    # ------------------------------------------------------------------ diagnostics

    def streams(self) -> dict[str, StreamIndexStats]:
        """Per-stream state and diagnostics (see :class:`StreamIndexStats`)."""
        return {name: self._stats(st) for name, st in self._h.streams.items()}

    def _stats(self, st: _Stream) -> StreamIndexStats:
        tiers = dict.fromkeys(self._h.tiers, 0)
        for t, d in st.h2k.items():
            tiers[self._h.tiers[t]] = len(d)
        requests = (
            self._h.bs_requests.get(st.block_size, 0) - st.req_base
            if st.block_size is not None else 0
        )
        blocks = sum(tiers.values())
        return StreamIndexStats(
            stream=st.name, block_size=st.block_size, blocks=blocks, tiers=tiers,
            events_applied=st.events, batches_applied=st.batches, last_event_time=st.last_time,
            alive=st.alive, resets=st.resets, snapshots=st.snapshots, clears=st.clears,
            stores_without_tokens=st.no_tokens, unplaced_blocks=st.unplaced,
            orphan_stores=st.orphans, unknown_removes=st.unknown_removes, bad_events=st.bad,
            predicted_blocks=sum(map(len, st.pred)), match_requests=requests,
            matched_requests=st.matched, suspect=suspect(st, requests),
        )
