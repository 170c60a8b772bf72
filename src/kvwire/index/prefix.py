"""PrefixIndex: which stream (engine x DP rank) holds which prefix, fed by live events.

Layout, chosen so that ``match`` does one dict lookup and two integer ops per prompt block:

* ``_keys: dict[own key, int]`` packs bit masks over *stream slots* (one slot per stream,
  ``W`` slots per lane). Lane 0 = the stream holds the key in any tier; lane 1 = it holds
  it, but not in the best tier (so a GPU-only fleet never leaves the fast path); lane
  ``2 + t`` = it holds it in tier ``t``.
* per stream and tier, ``engine hash -> own key`` (the engine's hashes are only ids: this
  is how ``BlockRemoved`` finds the key), plus a rarely used duplicate count for two engine
  hashes that map to one own key.
* predictions: ``_pred: dict[own key, slot mask]`` with a TTL queue.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..consume.stream import Batch, Liveness, Reset, Snapshot
from ..wire.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored
from .keys import NATIVE, Lanes, add_bits, chain_tokens, insert_new, root_seed, scan_tokens
from .state import (
    StreamIndexStats,
    StreamMatch,
    _as_scannable,
    _bits,
    _lazy_keys,
    _salt_from_extra,
    _Stream,
    _synthetic,
    suspect,
)

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
#: Blocks off the C scan's fast path before the rest of a prompt is walked in Python.
_MAX_STOPS = 32
#: Prompt lengths whose no-match answers are kept as templates (then the cache starts over).
_TEMPLATES = 256
#: Matched lengths whose best-tier-only counts tuples are kept (then the cache starts over).
_COUNTS_CACHE = 65_536


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
    ) -> None:
        self.tier_credits = dict(DEFAULT_TIER_CREDITS if tier_credits is None else tier_credits)
        if not self.tier_credits:
            raise ValueError("tier_credits must name at least one tier")
        for name, c in self.tier_credits.items():
            if not isinstance(c, int | float) or c < 0:
                raise ValueError(f"tier credit for {name!r} must be a number >= 0, got {c!r}")
        self.tier_aliases = dict(DEFAULT_TIER_ALIASES if tier_aliases is None else tier_aliases)
        if predict_ttl < 0:
            raise ValueError(f"predict_ttl must be >= 0, got {predict_ttl!r}")
        self.predict_ttl = float(predict_ttl)
        self.clock = clock
        #: engine hashes of removed blocks remembered per stream (between this and twice it)
        self.remember_removed = max(0, int(remember_removed))
        self._W = 64
        self._keys: dict[int, int] = {}
        # C mirror of lanes 0/1 of ``_keys`` for the scan (while W == 64); None without C
        self._lanes: Any = Lanes() if Lanes is not None else None
        self._pred: dict[int, int] = {}
        # (expiry, stream, keys): keys as an array, which the cyclic GC never walks (a list
        # per routed request, held for the TTL, made every full collection of a busy router
        # visit millions of ints)
        self._pred_queue: deque[tuple[float, _Stream, array[int]]] = deque()
        # tiers: configured ones first, best credit first (index 0 is the best tier)
        self._tiers: list[str] = sorted(self.tier_credits, key=lambda t: -self.tier_credits[t])
        self._tier_idx: dict[str, int] = {t: i for i, t in enumerate(self._tiers)}
        self._medium_cache: dict[str | None, int] = {}
        self._streams: dict[str, _Stream] = {}
        self._by_slot: dict[int, _Stream] = {}
        self._free: list[int] = []
        self._next_slot = 0
        self._by_bs: dict[int, int] = {}  # block size -> slot mask of streams using it
        self._bs_requests: dict[int, int] = {}  # block size -> match calls with >= 1 block
        #: Items ``apply`` could not use (wrong type), counted; see ``last_error``.
        self.bad_items = 0
        self.last_error = ""
        self._max_stops = _MAX_STOPS
        self._last = 0  # the last key a walk looked at (where a second chunk continues)
        # match's answer templates (see _misses): rebuilt when _shape moves on, i.e. when
        # streams, block sizes or tiers change
        self._shape = 0
        self._tpl_shape = -1
        self._tpl: dict[Any, dict[str, StreamMatch]] = {}
        self._counts: dict[int, tuple[int, ...]] = {}
        self._names: tuple[str, ...] = ()
        self._zeros: tuple[int, ...] = ()

    # ------------------------------------------------------------------ streams and tiers

    def _stream(self, name: str) -> _Stream:
        st = self._streams.get(name)
        if st is None:
            if self._free:
                slot = self._free.pop()
            else:
                slot = self._next_slot
                self._next_slot += 1
                if slot >= self._W:
                    self._grow()
            st = self._streams[name] = _Stream(name, slot)
            self._by_slot[slot] = st
            self._shape += 1
        return st

    def _grow(self) -> None:
        """Double the slots per lane and repack every key's masks (rare: every 64 streams)."""
        old, new = self._W, self._W * 2
        full = (1 << old) - 1
        lanes = 2 + len(self._tiers)

        def repack(v: int) -> int:
            out = 0
            for lane in range(lanes):
                out |= ((v >> (lane * old)) & full) << (lane * new)
            return out

        self._keys = {k: repack(v) for k, v in self._keys.items()}
        self._W = new
        self._lanes = None  # the mirror holds 64 slots per lane: the scan reads the dict now

    def _tier(self, medium: str | None) -> int:
        t = self._medium_cache.get(medium)
        if t is None:
            name = "GPU" if medium is None else self.tier_aliases.get(medium, medium)
            t = self._tier_idx.get(name)
            if t is None:  # a tier nobody configured: indexed, credit 0, worst rank
                t = self._tier_idx[name] = len(self._tiers)
                self._tiers.append(name)
                self.tier_credits.setdefault(name, 0.0)
                self._shape += 1
            self._medium_cache[medium] = t
        return t

    def _learn_block_size(self, st: _Stream, bs: int) -> None:
        if st.block_size == bs:
            return
        if st.block_size is not None:
            self._by_bs[st.block_size] &= ~st.bit
        st.block_size = bs
        self._by_bs[bs] = self._by_bs.get(bs, 0) | st.bit
        self._shape += 1
        st.req_base = self._bs_requests.get(bs, 0)

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
            if parent is None:
                salt = ev.cache_salt
                if salt is None and ev.extra_keys:
                    salt = _salt_from_extra(ev.extra_keys[0], ev.lora_name)
                lora = ev.lora_name
                if lora is None and ev.lora_id is not None:
                    lora = str(ev.lora_id)
                seed = root_seed(lora, salt)
            else:
                seed = st.lookup(parent)
                if seed is None:
                    st.orphans += 1
                    seed = _synthetic(parent, 0)
            try:
                keys = chain_tokens(toks, bs, n, seed)
            except ValueError as e:
                st.bad += 1
                st.last_bad = f"BlockStored token ids: {e}"
                return
            if st.block_size != bs:
                st.sizes_seen.add(bs)
                self._learn_block_size(st, bs)
            st.token_blocks += n
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
            d = st.h2k[t] = {}
        W = self._W
        bit = st.bit
        nb = bit << W
        tb = bit << ((2 + t) * W)
        kd = self._keys
        kget = kd.get
        lanes = self._lanes
        pred = st.pred
        dget = d.get
        if t == 0 and not pred:
            # the common case: new blocks in the best tier, no predictions to confirm
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
                if pred and k in pred:  # events confirm the prediction: they decide now
                    self._unpredict(st, k)
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
                if pred and k in pred:
                    self._unpredict(st, k)
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
        W = self._W
        bit = st.bit
        tb = bit << ((2 + t) * W)
        nb = bit << W
        lanes = 2 + len(self._tiers)
        kd = self._keys
        mirror = self._lanes
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
        if len(ghosts) >= self.remember_removed:  # two generations: bounded, O(1) per removal
            st.old_ghosts = ghosts
            st.ghosts = {}

    def _clear(self, st: _Stream) -> None:
        """Drop every block of the stream (predictions stay: they are routing decisions)."""
        mask = ~(st.bit * self._lane_ones())
        kd = self._keys
        lanes = self._lanes
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
        st.h2k = {}
        st.dups = {}
        st.ghosts = {}
        st.old_ghosts = {}

    def _lane_ones(self) -> int:
        """An int with bit 0 of every lane set: ``bit * this`` is the bit in every lane."""
        W = self._W
        return sum(1 << (lane * W) for lane in range(2 + len(self._tiers)))

    def remove_stream(self, stream: str) -> None:
        """Forget a stream entirely (blocks, predictions, counters); its slot is reused."""
        st = self._streams.pop(stream, None)
        if st is None:
            return
        self._clear(st)
        for k in st.pred:
            self._clear_pred_bit(k, st.bit)
        st.pred = {}
        if st.block_size is not None:
            self._by_bs[st.block_size] &= ~st.bit
            if not self._by_bs[st.block_size]:
                del self._by_bs[st.block_size]
        del self._by_slot[st.slot]
        self._free.append(st.slot)
        self._shape += 1

    # ------------------------------------------------------------------ predictions

    def predict(self, stream: str, token_ids: list[int], lora_name: str | None = None,
                salt: Any = None, block_size: int | None = None) -> int:
        """Count the prompt's blocks as held by ``stream`` for ``predict_ttl`` seconds (or until
        events store them): the gap between routing a request and the events confirming it.

        Uses the stream's learned block size (or ``block_size`` while none is known); returns
        the number of blocks predicted (0 when no block size is known).
        """
        st = self._stream(stream)
        if st.block_size is None and block_size:
            self._learn_block_size(st, block_size)  # until its events say otherwise
        bs = st.block_size
        if not bs or self.predict_ttl <= 0:
            return 0
        n = len(token_ids) // bs
        if n == 0:
            return 0
        keys = chain_tokens(token_ids, bs, n, root_seed(lora_name, salt))
        now = self.clock()
        self._expire(now)
        exp = now + self.predict_ttl
        pred = self._pred
        bit = st.bit
        sp = st.pred
        for k in keys:
            sp[k] = exp
            pred[k] = pred.get(k, 0) | bit
        self._pred_queue.append((exp, st, array("Q", keys)))
        return n

    def _unpredict(self, st: _Stream, k: int) -> None:
        del st.pred[k]
        self._clear_pred_bit(k, st.bit)

    def _clear_pred_bit(self, k: int, bit: int) -> None:
        v = self._pred.get(k, 0) & ~bit
        if v:
            self._pred[k] = v
        else:
            self._pred.pop(k, None)

    def _expire(self, now: float) -> None:
        q = self._pred_queue
        while q and q[0][0] <= now:
            _, st, keys = q.popleft()
            sp = st.pred
            if self._streams.get(st.name) is not st:
                continue  # removed stream: its predictions went with it
            for k in keys:
                e = sp.get(k)
                if e is not None and e <= now:
                    del sp[k]
                    self._clear_pred_bit(k, st.bit)

    # ------------------------------------------------------------------ match

    def match(self, token_ids: list[int], lora_name: str | None = None,
              salt: Any = None) -> dict[str, StreamMatch]:
        """Leading prompt blocks each known stream holds, by best tier (see StreamMatch)."""
        if self._pred_queue:
            self._expire(self.clock())
        seed = root_seed(lora_name, salt)
        ntok = len(token_ids)
        found: dict[int, int] = {}  # slot -> matched blocks (ints only: nothing for the GC)
        detail: dict[int, tuple[int, dict[int, int] | None]] = {}
        scannable = type(token_ids) is list or type(token_ids) is tuple
        for bs, group in self._by_bs.items():
            n = ntok // bs
            if n == 0 or not group:
                continue
            self._bs_requests[bs] = self._bs_requests.get(bs, 0) + 1
            slow: list[tuple[int, int, int, int]] = []
            if NATIVE:
                if not scannable:
                    token_ids = _as_scannable(token_ids)
                    scannable = True
                alive, i = self._scan(token_ids, bs, n, seed, group, found, slow)
            else:
                alive, i = self._walk(_lazy_keys(token_ids, bs, n, seed), group, 0, found,
                                      slow)
            for s in _bits(alive):
                found[s] = i
            if slow:
                self._attribute(slow, found, detail)
        out = self._misses(ntok)
        if not found:
            return out
        names = self._names
        tc = self.tier_credits  # read each time: callers may retune credits live
        credits = [tc[t] for t in names]
        c0 = credits[0]
        zeros = self._zeros
        counts_of = self._counts
        by_slot = self._by_slot
        for s, matched in found.items():
            st = by_slot[s]
            d = detail.get(s)
            if d is None:
                counts_t = counts_of.get(matched)
                if counts_t is None:
                    if len(counts_of) >= _COUNTS_CACHE:
                        counts_of.clear()
                    counts_t = counts_of[matched] = (matched, *zeros[1:])
                predicted, credit = 0, c0 * matched
            else:
                predicted, extra = d
                rest = matched - predicted
                counts = list(zeros)
                credit = float(predicted)
                if extra:
                    for t, c in extra.items():
                        counts[t] = c
                        credit += credits[t] * c
                        rest -= c
                counts[0] = rest
                credit += c0 * rest
                counts_t = tuple(counts)
            if matched - predicted > 0:
                st.matched += 1
            bs = st.block_size
            out[st.name] = StreamMatch(st.name, ntok // bs if bs else 0, matched, predicted,
                                       credit, counts_t, names)
        return out

    def _misses(self, ntok: int) -> dict[str, StreamMatch]:
        """A fresh dict of every stream's no-match answer for a prompt of ``ntok`` tokens:
        a copy of a cached template (``match`` then overwrites only the streams that
        matched), so a fleet of streams costs one dict copy, not a Python loop per stream."""
        if self._shape != self._tpl_shape:  # streams, block sizes or tiers changed
            self._tpl.clear()
            self._counts.clear()
            self._tpl_shape = self._shape
            self._names = tuple(self._tiers)
            self._zeros = (0,) * len(self._names)
        key = ntok if len(self._by_bs) <= 1 else tuple(ntok // bs for bs in self._by_bs)
        tpl = self._tpl.get(key)
        if tpl is None:
            if len(self._tpl) >= _TEMPLATES:
                self._tpl.clear()
            names, zeros = self._names, self._zeros
            tpl = self._tpl[key] = {
                name: StreamMatch(name, ntok // st.block_size if st.block_size else 0, 0, 0,
                                  0.0, zeros, names)
                for name, st in self._streams.items()
            }
        return tpl.copy()

    def _scan(self, token_ids: Any, bs: int, n: int, seed: int, alive: int,
              found: dict[int, int],
              slow: list[tuple[int, int, int, int]]) -> tuple[int, int]:
        """The C walk: ``scan_tokens`` hashes and looks up blocks while every stream in
        ``alive`` holds them in the best tier, and stops at the first block where something
        changes; that block goes through ``_walk``, then the scan goes on. A prompt whose
        blocks keep changing (offload tiers, predictions) is walked in Python after a while."""
        kd = self._keys
        pred = self._pred
        W = self._W
        i, k, stops = 0, seed, 0
        while alive and i < n:
            j, k = scan_tokens(token_ids, bs, n, i, k, kd, alive, alive << W, pred, self._lanes)
            if j >= n:
                return alive, n
            alive, i = self._walk((k,), alive, j, found, slow)
            stops += 1
            if stops >= self._max_stops and alive and i < n:
                return self._walk(chain_tokens(token_ids, bs, n, k, i), alive, i, found, slow)
        return alive, i

    def _walk(self, keys: Iterable[int], alive: int, i: int,
              found: dict[int, int],
              slow: list[tuple[int, int, int, int]]) -> tuple[int, int]:
        """Follow the prompt's keys from block ``i`` while any stream in ``alive`` still
        matches; a stream that stops matching gets its matched length in ``found``. Blocks
        not all in the best tier (or predicted) go to ``slow``, run-length coded."""
        kget = self._keys.get
        pred = self._pred
        pget = pred.get
        W = self._W
        not_best = alive << W  # lane 1 of the streams still matching
        k = 0
        for k in keys:
            v = kget(k, 0)
            if pred:
                p = pget(k, 0) & alive & ~v
                hit = (v & alive) | p
            else:
                p = 0
                hit = v & alive
            if hit != alive:
                if i:  # streams that drop out at block 0 matched nothing: left out of found
                    for s in _bits(alive ^ hit):
                        found[s] = i
                alive = hit
                if not alive:
                    break
                not_best = alive << W
            if v & not_best or p:
                if slow and slow[-1][:3] == (v, p, alive):
                    last = slow[-1]
                    slow[-1] = (v, p, alive, last[3] + 1)
                else:
                    slow.append((v, p, alive, 1))
            i += 1
        self._last = k
        return alive, i

    def _attribute(self, slow: list[tuple[int, int, int, int]], found: dict[int, int],
                   detail: dict[int, tuple[int, dict[int, int] | None]]) -> None:
        """Tier attribution of the blocks not all in the best tier, run by run, into
        ``detail``: slot -> (predicted blocks, {tier: blocks} outside the best tier)."""
        W = self._W
        full = (1 << W) - 1
        lanes = 2 + len(self._tiers)
        extra: dict[int, dict[int, int]] = {}
        predicted: dict[int, int] = {}
        for v, p, alv, run in slow:
            rest = alv & ~p & ~((v >> (2 * W)) & full)  # held, not in the best tier
            for lane in range(3, lanes):
                m = (v >> (lane * W)) & rest
                if m:
                    rest &= ~m
                    t = lane - 2
                    for s in _bits(m):
                        e = extra.setdefault(s, {})
                        e[t] = e.get(t, 0) + run
            for s in _bits(p):
                predicted[s] = predicted.get(s, 0) + run
        for s in found:
            if s in extra or s in predicted:
                # runs count blocks walked while the stream was alive, all within `matched`
                detail[s] = (predicted.get(s, 0), extra.get(s))

    # ------------------------------------------------------------------ diagnostics

    def streams(self) -> dict[str, StreamIndexStats]:
        """Per-stream state and diagnostics (see :class:`StreamIndexStats`)."""
        return {name: self._stats(st) for name, st in self._streams.items()}

    def _stats(self, st: _Stream) -> StreamIndexStats:
        tiers = dict.fromkeys(self._tiers, 0)
        for t, d in st.h2k.items():
            tiers[self._tiers[t]] = len(d)
        requests = (
            self._bs_requests.get(st.block_size, 0) - st.req_base
            if st.block_size is not None else 0
        )
        blocks = sum(tiers.values())
        return StreamIndexStats(
            stream=st.name, block_size=st.block_size, blocks=blocks, tiers=tiers,
            events_applied=st.events, batches_applied=st.batches, last_event_time=st.last_time,
            alive=st.alive, resets=st.resets, snapshots=st.snapshots, clears=st.clears,
            stores_without_tokens=st.no_tokens, unplaced_blocks=st.unplaced,
            orphan_stores=st.orphans, unknown_removes=st.unknown_removes, bad_events=st.bad,
            predicted_blocks=len(st.pred), match_requests=requests,
            matched_requests=st.matched, suspect=suspect(st, requests),
        )
