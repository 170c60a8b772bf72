"""The index's pure part: which stream slots hold which own key in which tier (bit masks),
the predictions, the slots' streams and block sizes, and ``match``'s walk over them.

:class:`~kvwire.index.prefix.PrefixIndex` holds one (composition): it decodes deliveries,
maps engine hashes to own keys, keeps the clock and the predictions' TTL queue, and writes
the masks here; this part reads no event and no clock. Kept apart because the walk is the
latency-critical half and the ingest the other.

Layout, chosen so that ``match`` does one dict lookup and two integer ops per prompt block:
``keys: dict[own key, int]`` packs bit masks over *stream slots* (one slot per stream, ``W``
slots per lane). Lane 0 = the stream holds the key in any tier; lane 1 = it holds it, but
not in the best tier (so a GPU-only fleet never leaves the fast path); lane ``2 + t`` = it
holds it in tier ``t``. ``pred`` are the predictions: own key -> slot mask, in
``PRED_SHARDS`` dicts by the key's top bits (``pred[k >> PRED_SHIFT]``)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from . import keys as _k
from .keys import Lanes
from .state import (
    PRED_SHIFT,
    StreamMatch,
    _as_scannable,
    _bits,
    _lazy_keys,
    _Stream,
    pred_shards,
)

try:  # the per-medium walk in C (_tiers.c); without it the Python walk, same answers
    if os.environ.get("KVWIRE_NO_NATIVE"):
        raise ImportError("KVWIRE_NO_NATIVE set")
    from ._tiers import tier_walk, tier_walk_tokens
except ImportError:
    tier_walk = tier_walk_tokens = None
#: Tiers the C walk takes (its lanes are 64-bit words on the stack).
_C_MAX_TIERS = 14

#: Prompt lengths whose no-match answers are kept as templates (then the cache starts over).
_TEMPLATES = 256
#: Matched lengths whose best-tier-only counts tuples are kept (then the cache starts over).
_COUNTS_CACHE = 65_536
#: Blocks off the C scan's fast path before the rest of a prompt is walked in Python.
_MAX_STOPS = 32


class PrefixWalk:
    """Own key -> slot masks, predictions, slots, and ``match`` (no events, no clock)."""

    def __init__(self, tier_credits: dict[str, float], key_scheme: str = "standard") -> None:
        _k.chain_start(key_scheme)  # checks the name
        self.key_scheme = key_scheme
        self.tier_credits = tier_credits
        self.W = 64
        self.keys: dict[int, int] = {}
        # C mirror of lanes 0/1 of ``keys`` for the scan (while W == 64); None without C
        self.lanes: Any = Lanes() if Lanes is not None else None
        self.pred: tuple[dict[int, int], ...] = pred_shards()
        # tiers: configured ones first, best credit first (index 0 is the best tier)
        self.tiers: list[str] = sorted(tier_credits, key=lambda t: -tier_credits[t])
        self.tier_idx: dict[str, int] = {t: i for i, t in enumerate(self.tiers)}
        self.streams: dict[str, _Stream] = {}
        self.by_slot: dict[int, _Stream] = {}
        self.by_bs: dict[int, int] = {}  # block size -> slot mask of streams using it
        self.bs_requests: dict[int, int] = {}  # block size -> match calls with >= 1 block
        self.max_stops = _MAX_STOPS
        # match's answer templates (see _misses): rebuilt when shape moves on, i.e. when
        # streams, block sizes or tiers change
        self.shape = 0
        self.tpl_shape = -1
        self.tpl: dict[Any, dict[str, StreamMatch]] = {}
        self.counts: dict[int, tuple[int, ...]] = {}
        self.names: tuple[str, ...] = ()
        self.zeros: tuple[int, ...] = ()
        #: tier_prefixes walks in C when _tiers is built (False: the Python walk, the
        #: reference the C one is checked against)
        self.c_walk = tier_walk is not None

    def match(self, token_ids: list[int], lora_name: str | None = None,
              salt: Any = None) -> dict[str, StreamMatch]:
        """Leading prompt blocks each known stream holds, by best tier (see StreamMatch);
        predictions as they are now (PrefixIndex.match expires them first)."""
        seed, fold = _k.chain_start(self.key_scheme, lora_name, salt)
        ntok = len(token_ids)
        found: dict[int, int] = {}  # slot -> matched blocks (ints only: nothing for the GC)
        detail: dict[int, tuple[int, dict[int, int] | None]] = {}
        scannable = type(token_ids) is list or type(token_ids) is tuple
        pred = self.pred if any(self.pred) else None  # (looked at once per match)
        for bs, group in self.by_bs.items():
            n = ntok // bs
            if n == 0 or not group:
                continue
            self.bs_requests[bs] = self.bs_requests.get(bs, 0) + 1
            slow: list[tuple[int, int, int, int]] = []
            if _k.NATIVE:
                if not scannable:
                    token_ids = _as_scannable(token_ids)
                    scannable = True
                alive, i = self._scan(token_ids, bs, n, seed, fold, group, found, slow, pred)
            else:
                alive, i = self._walk(_lazy_keys(token_ids, bs, n, seed, fold), group, 0,
                                      found, slow, pred)
            for s in _bits(alive):
                found[s] = i
            if slow:
                self._attribute(slow, found, detail)
        out = self._misses(ntok)
        if not found:
            return out
        names = self.names
        tc = self.tier_credits  # read each time: callers may retune credits live
        credits = [tc[t] for t in names]
        c0 = credits[0]
        zeros = self.zeros
        counts_of = self.counts
        by_slot = self.by_slot
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
        if self.shape != self.tpl_shape:  # streams, block sizes or tiers changed
            self.tpl.clear()
            self.counts.clear()
            self.tpl_shape = self.shape
            self.names = tuple(self.tiers)
            self.zeros = (0,) * len(self.names)
        key = ntok if len(self.by_bs) <= 1 else tuple(ntok // bs for bs in self.by_bs)
        tpl = self.tpl.get(key)
        if tpl is None:
            if len(self.tpl) >= _TEMPLATES:
                self.tpl.clear()
            names, zeros = self.names, self.zeros
            tpl = self.tpl[key] = {
                name: StreamMatch(name, ntok // st.block_size if st.block_size else 0, 0, 0,
                                  0.0, zeros, names)
                for name, st in self.streams.items()
            }
        return tpl.copy()

    def _scan(self, token_ids: Any, bs: int, n: int, seed: int | None, fold: int | None,
              alive: int,
              found: dict[int, int],
              slow: list[tuple[int, int, int, int]],
              pred: tuple[dict[int, int], ...] | None) -> tuple[int, int]:
        """The C walk: ``scan_tokens`` hashes and looks up blocks while every stream in
        ``alive`` holds them in the best tier, and stops at the first block where something
        changes; that block goes through ``_walk``, then the scan goes on. A prompt whose
        blocks keep changing (offload tiers, predictions) is walked in Python after a while."""
        kd = self.keys
        W = self.W
        i, k, stops = 0, seed, 0
        while alive and i < n:
            j, k = _k.scan_tokens(token_ids, bs, n, i, k, kd, alive, alive << W, self.lanes,
                                  fold)
            if j >= n:
                return alive, n
            alive, i = self._walk((k,), alive, j, found, slow, pred)
            stops += 1
            if stops >= self.max_stops and alive and i < n:
                return self._walk(_k.chain_tokens(token_ids, bs, n, k, i, fold), alive, i, found,
                                  slow, pred)
        return alive, i

    def _walk(self, keys: Iterable[int], alive: int, i: int,
              found: dict[int, int],
              slow: list[tuple[int, int, int, int]],
              pred: tuple[dict[int, int], ...] | None) -> tuple[int, int]:
        """Follow the prompt's keys from block ``i`` while any stream in ``alive`` still
        matches; a stream that stops matching gets its matched length in ``found``. Blocks
        not all in the best tier (or predicted) go to ``slow``, run-length coded. ``pred``: the
        predictions, None when there are none."""
        kget = self.keys.get
        W = self.W
        not_best = alive << W  # lane 1 of the streams still matching
        for k in keys:
            v = kget(k, 0)
            if pred is not None:
                p = pred[k >> PRED_SHIFT].get(k, 0) & alive & ~v
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
        return alive, i

    def _attribute(self, slow: list[tuple[int, int, int, int]], found: dict[int, int],
                   detail: dict[int, tuple[int, dict[int, int] | None]]) -> None:
        """Tier attribution of the blocks not all in the best tier, run by run, into
        ``detail``: slot -> (predicted blocks, {tier: blocks} outside the best tier)."""
        W = self.W
        full = (1 << W) - 1
        lanes = 2 + len(self.tiers)
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

    def _lanes_sig(self, alive: list[int]) -> int:
        """``alive`` ([any, tier 0, ...] stream masks) as bits of an entry of ``keys``."""
        W = self.W
        sig = alive[0]
        for lane in range(1, len(alive)):
            sig |= alive[lane] << ((lane + 1) * W)
        return sig

    def tier_prefixes(self, keys: Iterable[int], names: Iterable[str],
                      cumulative: bool = False) -> dict[str, tuple]:
        """Per stream of ``names`` (unknown ones left out): ``(n, alone)``: how many leading
        ``keys`` it holds in any tier, and in each tier alone (``tiers`` order, best first);
        with ``cumulative``, ``(n, alone, cum)``: also in each tier or a better one.
        Predictions are not counted. The indexer API's answers (Mooncake's per medium,
        Dynamo's cumulative), not ``match``'s best-tier split."""
        slots = [st for st in (self.streams.get(n) for n in names) if st is not None]
        if not slots:
            return {}
        nt = len(self.tiers)
        if self.c_walk and self.W == 64 and nt <= _C_MAX_TIERS:
            flat = tier_walk(keys, self.keys, [st.slot for st in slots], nt, cumulative)
            return self.unflatten(flat, [st.name for st in slots], cumulative)
        return self._py_tier_prefixes(keys, slots, cumulative)

    def unflatten(self, flat: tuple[int, ...], names: list[str],
                  cumulative: bool) -> dict[str, tuple]:
        """``tier_walk``'s flat ints (per stream: any, each tier alone, tiers 0..t) as
        ``tier_prefixes`` answers them."""
        nt = len(self.tiers)
        nl = 2 * nt if cumulative else nt + 1
        out: dict[str, tuple] = {}
        for j, name in enumerate(names):
            got = flat[j * nl : (j + 1) * nl]
            alone = got[1 : nt + 1]
            out[name] = ((got[0], alone, alone[:1] + got[nt + 1 :]) if cumulative
                         else (got[0], alone))
        return out

    def walk_tokens(self, tokens: Any, bs: int, n: int, seed: int | None, fold: int | None,
                    slots: list[int]) -> tuple[int, ...] | None:
        """``tier_walk``'s cumulative flat answer over the chained keys of the first ``n``
        blocks of ``tokens`` (an int64 buffer) at ``bs``, hashed as walked (``chain_start``'s seed and fold); None
        when the C walk cannot take this index (then ``tier_prefixes``)."""
        if not self.can_walk_tokens():
            return None
        return tier_walk_tokens(tokens, bs, n, seed, fold, self.keys, slots, len(self.tiers),
                                True)

    def can_walk_tokens(self) -> bool:
        """Whether :meth:`walk_tokens` answers now (C built, 64 slots a lane, <= 14 tiers;
        these change only with ``shape``)."""
        return self.c_walk and self.W == 64 and len(self.tiers) <= _C_MAX_TIERS

    def _py_tier_prefixes(self, keys: Iterable[int], slots: list[_Stream],
                          cumulative: bool) -> dict[str, tuple]:
        W = self.W
        full = (1 << W) - 1
        nt = len(self.tiers)
        mask = 0
        for st in slots:
            mask |= st.bit
        # lanes: [any, tier 0 .. tier nt-1] (+ [tiers 0..1, tiers 0..2, ...]): streams on
        nl = 2 * nt if cumulative else nt + 1
        alive = [mask] * nl
        ends: list[dict[int, int]] = [{} for _ in range(nl)]
        kget = self.keys.get
        # every alive stream in every lane it is alive in: a key holding all of them (the
        # usual case, a shared prefix) changes nothing, so it costs one lookup and one AND.
        # (A cumulative lane "tiers 0..t" is kept by a key while each of its streams holds
        # it in a tier lane 0..t it is on in, so while its streams are on in those, the
        # signature covers it too.)
        sig = self._lanes_sig(alive[: nt + 1])
        i = 0
        for k in keys:
            v = kget(k, 0)
            if sig and v & sig == sig:
                i += 1
                continue
            if not v & mask:  # nobody of ours holds it: every prefix ends here
                break
            held = [v & mask]
            held += [(v >> ((t + 2) * W)) & full for t in range(nt)]
            if cumulative:
                cum = held[1]
                for t in range(1, nt):
                    cum |= held[1 + t]
                    held.append(cum)
            for lane in range(nl):
                a = alive[lane]
                if a:
                    h = held[lane] & a
                    if h != a:
                        for s in _bits(a ^ h):
                            ends[lane][s] = i
                        alive[lane] = h
            i += 1
            if not any(alive):
                break
            sig = self._lanes_sig(alive[: nt + 1])
            if cumulative:
                # cumulative lane "tiers 0..t" (nt + t) is kept by the signature while each
                # of its streams is on in one of the lanes of tiers 0..t (a stream with its
                # prefix on the CPU so far: on in that lane); one that is not (its prefix
                # spread over two tiers): every key is looked at
                tiers = alive[1]
                for t in range(1, nt):
                    tiers |= alive[1 + t]
                    if alive[nt + t] & ~tiers:
                        sig = 0
                        break
        out: dict[str, tuple] = {}
        for st in slots:
            b = st.slot
            got = [ends[lane].get(b, i) for lane in range(nl)]
            alone = tuple(got[1 : nt + 1])
            out[st.name] = ((got[0], alone, alone[:1] + tuple(got[nt + 1 :])) if cumulative
                            else (got[0], alone))
        return out
