"""kvwire.index: the prefix index against a brute-force model (hypothesis, stateful), its
rules one by one, memory flatness under churn, and a real publisher -> subscriber -> index
feed over loopback for every kvwire dialect and for byte hashes."""

from __future__ import annotations

import gc
import hashlib
import sys
import time
import tracemalloc
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvwire.consume.stream import Batch, Liveness, Reset, Snapshot
from kvwire.consume.subscriber import StreamSpec, Subscriber
from kvwire.index import DEFAULT_TIER_CREDITS, PrefixIndex, block_keys
from kvwire.index import keys as keys_mod
from kvwire.index import prefix as prefix_mod
from kvwire.publish.publisher import ZmqEventPublisher
from kvwire.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventBatch,
)


class Clock:
    """A settable clock: prediction TTLs are tested without sleeping."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def ehash(prefix: tuple, lora: str | None, salt: str | None, as_bytes: bool) -> int | bytes:
    """An engine-style opaque hash of a block (SHA-256 of its whole prefix), int or bytes."""
    d = hashlib.sha256(repr((lora, salt, prefix)).encode()).digest()
    return d if as_bytes else int.from_bytes(d[:8], "little")


def batch(stream: str, *events, seq: int = 0) -> Batch:
    return Batch(stream, seq, KVEventBatch(time.time(), list(events)))


def stored(tokens: list[int], bs: int, start: int, count: int, *, medium=None, lora=None,
           salt=None, as_bytes=False, with_tokens=True) -> BlockStored:
    """A BlockStored of blocks ``start..start+count-1`` of ``tokens``, engine-hashed."""
    hs = [ehash(tuple(tokens[: (i + 1) * bs]), lora, salt, as_bytes)
          for i in range(start, start + count)]
    parent = None if start == 0 else ehash(tuple(tokens[: start * bs]), lora, salt, as_bytes)
    toks = tokens[start * bs : (start + count) * bs] if with_tokens else []
    return BlockStored(hs, parent, toks, bs, None, medium, lora, cache_salt=salt)


# --------------------------------------------------------------------------- keys


def test_block_keys_chain_and_seed():
    toks = list(range(40))
    k16 = block_keys(toks, 16)
    assert len(k16) == 2  # the partial last block has no key
    assert block_keys(toks[:32], 16) == k16
    assert block_keys(toks[:16], 16) == k16[:1]
    # chained: the second key depends on the first block too
    other = block_keys([7] + toks[1:32], 16)
    assert other[0] != k16[0] and other[1] != k16[1]
    # LoRA and salt change every key, and differ from each other
    seeds = {tuple(block_keys(toks, 16, lora, salt))
             for lora, salt in [(None, None), ("a", None), (None, "a"), ("a", "a"), ("b", None)]}
    assert len(seeds) == 5
    assert block_keys(toks, 16, salt=["x", 1]) == block_keys(toks, 16, salt=("x", 1))
    with pytest.raises(ValueError, match="block_size"):
        block_keys(toks, 0)
    with pytest.raises(ValueError, match="64-bit"):
        block_keys([2**64] * 16, 16, scheme="kvwire")
    with pytest.raises(ValueError, match="bit integer"):  # the standard scheme: u32 tokens
        block_keys([2**64] * 16, 16)
    with pytest.raises(ValueError, match="32-bit"):
        block_keys([2**32] * 16, 16)


@pytest.mark.skipif(not keys_mod.NATIVE, reason=f"C keys not built: {keys_mod.REASON}")
@settings(max_examples=300, deadline=None)
@given(toks=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=200),
       bs=st.integers(1, 40), seed=st.integers(0, 2**64 - 1), start=st.integers(0, 8))
def test_native_keys_equal_pure_python(toks, bs, seed, start):
    n = len(toks) // bs
    whole = keys_mod.chain_tokens(toks, bs, n, seed)
    assert whole == keys_mod.py_chain_tokens(toks, bs, n, seed)
    # a later chunk, chained from the key before it, continues the same chain
    s = min(start, n)
    mid = whole[s - 1] if s else seed
    assert keys_mod.chain_tokens(toks, bs, n, mid, s) == whole[s:]
    assert keys_mod.py_chain_tokens(toks, bs, n, mid, s) == whole[s:]
    # an int64 buffer (what the simulator passes) hashes the same as the list
    arr = array("q", toks)
    assert keys_mod.chain_tokens(arr, bs, n, mid, s) == whole[s:]
    assert keys_mod.py_chain_tokens(arr, bs, n, mid, s) == whole[s:]


@pytest.mark.skipif(not keys_mod.NATIVE, reason=f"C keys not built: {keys_mod.REASON}")
@settings(max_examples=200, deadline=None)
@given(start=st.dictionaries(st.integers(0, 20), st.integers(1, 2**200)),
       keys=st.lists(st.integers(0, 20)), slot=st.integers(0, 400),
       lane=st.integers(1, 6))
def test_native_add_bits_equals_pure_python(start, keys, slot, lane):
    # slots far apart (several 30-bit digits) exercise the C digit-level update
    far = slot * lane + 7
    setb, keep, tb = 1 << slot | 1 << far, ~(1 << (slot + 3)), 1 << far
    a, b = dict(start), dict(start)
    assert keys_mod.add_bits(a, keys, setb, keep, tb) == keys_mod.py_add_bits(b, keys, setb,
                                                                              keep, tb)
    assert a == b
    assert all(type(v) is int for v in a.values())


@pytest.mark.skipif(not keys_mod.NATIVE, reason=f"C keys not built: {keys_mod.REASON}")
@settings(max_examples=200, deadline=None)
@given(start=st.dictionaries(st.integers(0, 30), st.integers(0, 300)),
       hashes=st.lists(st.integers(0, 30), max_size=12))
def test_native_insert_new_equals_pure_python(start, hashes):
    keys = [h * 7 for h in hashes]  # small ints too: same objects as values already there
    a, b = dict(start), dict(start)
    assert keys_mod.insert_new(a, hashes, keys) == keys_mod.py_insert_new(b, hashes, keys)
    assert a == b


@pytest.mark.parametrize("impl", ["native", "python"])
def test_key_errors_are_named(impl):
    chain = keys_mod.chain_tokens if impl == "native" else keys_mod.py_chain_tokens
    with pytest.raises(ValueError, match="64-bit"):
        chain([2**63] * 4, 4, 1, 0)
    with pytest.raises(ValueError, match="sequence of integers"):
        chain(["a"] * 4, 4, 1, 0)
    with pytest.raises(ValueError, match="fewer token ids"):
        chain([1] * 4, 4, 2, 0)


@pytest.fixture(params=["native", "python"])
def key_impl(request, monkeypatch):
    """Run a test with the C keys and with the pure-Python keys (the fallback when the C
    module is not built): the implementation is chosen, nothing is faked."""
    if request.param == "python":
        monkeypatch.setattr(keys_mod, "NATIVE", False)  # read by index.walk at each match
        monkeypatch.setattr(keys_mod, "chain_tokens", keys_mod.py_chain_tokens)
        monkeypatch.setattr(prefix_mod, "chain_tokens", keys_mod.py_chain_tokens)
        monkeypatch.setattr(prefix_mod, "add_bits", keys_mod.py_add_bits)
        monkeypatch.setattr(prefix_mod, "insert_new", keys_mod.py_insert_new)
        monkeypatch.setattr(keys_mod, "KeyMap", dict)  # read when a stream's map is made
    elif not keys_mod.NATIVE:
        pytest.skip(f"C keys not built: {keys_mod.REASON}")
    return request.param


# --------------------------------------------------------------------------- brute-force model

PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
    [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23, 24, 25, 26, 27],
    [1, 2, 3, 4, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41],
    [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9],
]
#: stream -> (block size, byte hashes?)
STREAMS = {"a/dp0": (2, False), "a/dp1": (2, True), "b/dp0": (4, False)}
MEDIA = [None, "GPU", "CPU", "CPU_PINNED", "DISK", "STORAGE"]
CANON = {None: "GPU", "GPU": "GPU", "CPU": "CPU", "CPU_PINNED": "CPU", "DISK": "DISK",
         "STORAGE": "DISK"}
ORDER = sorted(DEFAULT_TIER_CREDITS, key=lambda t: -DEFAULT_TIER_CREDITS[t])
TTL = 3.0


class Model:
    """What each stream holds: per tier, engine hash -> (lora, salt, full prefix tokens)."""

    def __init__(self) -> None:
        self.held = {s: {t: {} for t in ORDER} for s in STREAMS}
        self.learned: dict[str, int] = {}
        self.pred: dict[str, dict[tuple, float]] = {s: {} for s in STREAMS}
        self.unknown_removes = {s: 0 for s in STREAMS}

    def holds(self, s: str, ident: tuple) -> str | None:
        for t in ORDER:
            if ident in self.held[s][t].values():
                return t
        return None

    def match(self, s: str, prompt: list[int], lora, salt, now: float) -> tuple:
        bs = self.learned.get(s)
        if bs is None:
            return 0, {t: 0 for t in ORDER}, 0
        counts = {t: 0 for t in ORDER}
        predicted = 0
        for i in range(len(prompt) // bs):
            ident = (lora, salt, tuple(prompt[: (i + 1) * bs]))
            t = self.holds(s, ident)
            if t is not None:
                counts[t] += 1
            elif self.pred[s].get(ident, -1.0) > now:
                predicted += 1
            else:
                break
        return len(prompt) // bs, counts, predicted


class IndexMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.clock = Clock()
        self.idx = PrefixIndex(predict_ttl=TTL, clock=self.clock)
        self.idx._h.max_stops = 2  # short prompts: make match leave the C scan for Python too
        self.m = Model()
        self.seq = 0

    def _store(self, s, p, start, count, medium, lora, salt, with_tokens=True) -> BlockStored:
        bs, as_bytes = STREAMS[s]
        prompt = PROMPTS[p]
        ev = stored(prompt, bs, start, count, medium=medium, lora=lora, salt=salt,
                    as_bytes=as_bytes, with_tokens=with_tokens)
        tier = CANON[medium]
        for i, h in enumerate(ev.block_hashes):
            ident = (lora, salt, tuple(prompt[: (start + i + 1) * bs]))
            self.m.held[s][tier][h] = ident
            self.m.pred[s].pop(ident, None)  # events confirm the prediction
        if with_tokens:
            self.m.learned[s] = bs
        return ev

    def _can_chain(self, s, p, start, lora, salt) -> bool:
        """Engines store a block after its parent: only generate stores whose parent is held."""
        if start == 0:
            return True
        bs = STREAMS[s][0]
        return self.m.holds(s, (lora, salt, tuple(PROMPTS[p][: start * bs]))) is not None

    @rule(s=st.sampled_from(sorted(STREAMS)), p=st.integers(0, len(PROMPTS) - 1),
          start=st.integers(0, 3), count=st.integers(1, 4), medium=st.sampled_from(MEDIA),
          lora=st.sampled_from([None, None, "ad"]), salt=st.sampled_from([None, None, "t1"]))
    def store(self, s, p, start, count, medium, lora, salt) -> None:
        bs = STREAMS[s][0]
        nblocks = len(PROMPTS[p]) // bs
        start = min(start, nblocks - 1)
        count = min(count, nblocks - start)
        if not self._can_chain(s, p, start, lora, salt):
            return
        self.idx.apply(batch(s, self._store(s, p, start, count, medium, lora, salt)))

    @rule(s=st.sampled_from(sorted(STREAMS)), data=st.data())
    def offload_without_tokens(self, s, data) -> None:
        """A token-less store on CPU/DISK of a block the stream holds on GPU (offload)."""
        gpu = self.m.held[s]["GPU"]
        if not gpu:
            return
        h = data.draw(st.sampled_from(sorted(gpu, key=repr)))
        lora, salt, prefix = gpu[h]
        tier = data.draw(st.sampled_from(["CPU", "DISK"]))
        self.m.held[s][tier][h] = gpu[h]
        self.m.pred[s].pop(gpu[h], None)  # any store of the block confirms it
        ev = BlockStored([h], None, [], STREAMS[s][0], None, tier, lora)
        self.idx.apply(batch(s, ev))

    @rule(s=st.sampled_from(sorted(STREAMS)), data=st.data(), medium=st.sampled_from(MEDIA))
    def remove(self, s, data, medium) -> None:
        tier = CANON[medium]
        held = self.m.held[s][tier]
        if held and data.draw(st.booleans()):
            h = data.draw(st.sampled_from(sorted(held, key=repr)))
            del held[h]
        else:
            h = b"\x01" * 32 if STREAMS[s][1] else 12345  # never stored
            self.m.unknown_removes[s] += 1
        self.idx.apply(batch(s, BlockRemoved([h], medium)))

    @rule(s=st.sampled_from(sorted(STREAMS)), p=st.integers(0, len(PROMPTS) - 1))
    def clear_then_store(self, s, p) -> None:
        """AllBlocksCleared inside a batch: what comes after it in the batch still counts."""
        for t in ORDER:
            self.m.held[s][t].clear()
        ev = self._store(s, p, 0, 2, None, None, None)
        self.idx.apply(batch(s, AllBlocksCleared(), ev))

    @rule(s=st.sampled_from(sorted(STREAMS)))
    def reset(self, s) -> None:
        for t in ORDER:
            self.m.held[s][t].clear()
        self.idx.apply(Reset(s, "test"))

    @rule(s=st.sampled_from(sorted(STREAMS)), p=st.integers(0, len(PROMPTS) - 1),
          q=st.integers(0, len(PROMPTS) - 1), n=st.integers(1, 4),
          medium=st.sampled_from(MEDIA))
    def snapshot(self, s, p, q, n, medium) -> None:
        for t in ORDER:
            self.m.held[s][t].clear()
        bs = STREAMS[s][0]
        blocks = [self._store(s, p, 0, min(n, len(PROMPTS[p]) // bs), medium, None, None),
                  self._store(s, q, 0, 1, None, None, None)]
        self.idx.apply(Snapshot(s, self.seq, blocks))

    @rule(s=st.sampled_from(sorted(STREAMS)), p=st.integers(0, len(PROMPTS) - 1),
          lora=st.sampled_from([None, "ad"]))
    def predict(self, s, p, lora) -> None:
        n = self.idx.predict(s, PROMPTS[p], lora)
        bs = self.m.learned.get(s)
        if bs is None:
            assert n == 0
            return
        assert n == len(PROMPTS[p]) // bs
        for i in range(n):
            self.m.pred[s][(lora, None, tuple(PROMPTS[p][: (i + 1) * bs]))] = self.clock.t + TTL

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0]))
    def advance(self, dt) -> None:
        self.clock.t += dt

    @rule(s=st.sampled_from(sorted(STREAMS)), alive=st.booleans())
    def liveness(self, s, alive) -> None:
        self.idx.apply(Liveness(s, alive, "test"))
        assert self.idx.streams()[s].alive is alive

    @invariant()
    def matches_agree(self) -> None:
        if not hasattr(self, "idx"):
            return
        for prompt in PROMPTS + [PROMPTS[1][:7], []]:
            for lora, salt in [(None, None), ("ad", None), (None, "t1"), ("ad", "t1")]:
                got = self.idx.match(prompt, lora, salt)
                for s in got:
                    pb, counts, predicted = self.m.match(s, prompt, lora, salt, self.clock.t)
                    g = got[s]
                    assert (g.prompt_blocks, g.tiers, g.predicted) == (pb, counts, predicted), (
                        s, prompt, lora, salt)
                    credit = predicted + sum(DEFAULT_TIER_CREDITS[t] * c
                                             for t, c in counts.items())
                    assert g.credit == pytest.approx(credit)

    @invariant()
    def mirror_agrees(self) -> None:
        """The C scan's mirror of lanes 0/1 holds exactly the dict's keys and lanes."""
        lanes = getattr(getattr(getattr(self, "idx", None), "_h", None), "lanes", None)
        if lanes is None:
            return
        full = (1 << 64) - 1
        kd = self.idx._h.keys
        assert len(lanes) == sum(1 for v in kd.values() if v & full)
        for k, v in kd.items():
            want = (v & full, (v >> 64) & full) if v & full else None
            assert lanes.get(k) == want, (k, v)

    @invariant()
    def stats_agree(self) -> None:
        if not hasattr(self, "idx"):
            return
        for s, stt in self.idx.streams().items():
            assert stt.tiers == {t: len(self.m.held[s][t]) for t in ORDER}
            assert stt.unknown_removes == self.m.unknown_removes[s]
            assert stt.block_size == self.m.learned.get(s)


IndexMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexAgainstModel = IndexMachine.TestCase


# --------------------------------------------------------------------------- rules, one by one


def test_two_block_sizes_both_match(key_impl):
    idx = PrefixIndex()
    toks = list(range(100, 228))
    idx.apply(batch("e16", stored(toks, 16, 0, 8)))
    idx.apply(batch("e32", stored(toks, 32, 0, 2)))
    m = idx.match(toks + [1, 2, 3])
    assert (m["e16"].prompt_blocks, m["e16"].tiers["GPU"]) == (8, 8)
    assert (m["e32"].prompt_blocks, m["e32"].tiers["GPU"]) == (4, 2)
    assert m["e32"].credit == 2.0


def test_lora_and_salt_separate_prefixes():
    idx = PrefixIndex()
    toks = list(range(64))
    idx.apply(batch("e", stored(toks, 16, 0, 4, lora="ad", salt="tenant")))
    assert idx.match(toks)["e"].blocks == 0
    assert idx.match(toks, lora_name="ad")["e"].blocks == 0
    assert idx.match(toks, lora_name="ad", salt="tenant")["e"].blocks == 4


def test_vllm_extra_keys_salt_and_lora_id():
    """vLLM carries the cache salt in the first block's extra keys; older events a lora_id."""
    idx = PrefixIndex()
    toks = list(range(32))
    hs = [11, 12]
    idx.apply(batch("e", BlockStored(hs, None, toks, 16, None, None, "ad",
                                     extra_keys=[["ad", "s1"], None])))
    idx.apply(batch("f", BlockStored(hs, None, toks, 16, 7, None, None)))
    assert idx.match(toks, "ad", "s1")["e"].blocks == 2
    assert idx.match(toks, "7")["f"].blocks == 2
    assert idx.match(toks)["f"].blocks == 0


def test_offload_tiers_and_best_tier_attribution(key_impl):
    idx = PrefixIndex(tier_aliases={"CPU_PINNED": "CPU", "NVME": "DISK"})
    toks = list(range(64))
    ev = stored(toks, 16, 0, 4)
    idx.apply(batch("e", ev))
    # CPU store of blocks known on GPU, without token ids: mapped by engine hash
    idx.apply(batch("e", BlockStored(ev.block_hashes[:3], None, [], 16, None, "CPU_PINNED",
                                     None)))
    idx.apply(batch("e", BlockRemoved(ev.block_hashes[1:], "GPU")))
    m = idx.match(toks)["e"]
    assert m.tiers == {"GPU": 1, "CPU": 2, "DISK": 0} and m.credit == 1 + 2 * 0.75
    # a DISK copy after the GPU eviction still finds its key (recently removed hashes)
    idx.apply(batch("e", BlockStored([ev.block_hashes[3]], ev.block_hashes[2], [], 16, None,
                                     "NVME", None)))
    m = idx.match(toks)["e"]
    assert m.tiers == {"GPU": 1, "CPU": 2, "DISK": 1}
    stats = idx.streams()["e"]
    assert stats.stores_without_tokens == 4 and stats.unplaced_blocks == 0
    # unknown tiers are indexed with credit 0, and a store with no known hash is counted
    idx.apply(batch("e", BlockStored([999], None, [], 16, None, "TAPE", None)))
    stats = idx.streams()["e"]
    assert stats.unplaced_blocks == 1 and stats.tiers["TAPE"] == 1


def test_predictions_expire_or_are_confirmed(key_impl):
    clock = Clock()
    idx = PrefixIndex(predict_ttl=2.0, clock=clock)
    toks = list(range(64))
    assert idx.predict("e", toks) == 0  # block size not known yet
    assert idx.predict("e", toks, block_size=16) == 4
    m = idx.match(toks)["e"]
    assert m.predicted == 4 and m.credit == 4.0 and m.tiers["GPU"] == 0
    clock.t += 2.0
    assert idx.match(toks)["e"].predicted == 0
    idx.apply(batch("e", stored(toks, 16, 0, 1)))
    idx.predict("e", toks)
    idx.apply(batch("e", stored(toks, 16, 1, 1)))  # confirms block 1
    idx.apply(batch("e", BlockRemoved([stored(toks, 16, 1, 1).block_hashes[0]], None)))
    m = idx.match(toks)["e"]
    # block 1 confirmed then evicted: no longer predicted, so the prefix stops there
    assert (m.tiers["GPU"], m.predicted) == (1, 0)


def test_predictions_are_spread_over_shards_and_leave_none_behind():
    """A busy router holds rate x ttl x blocks predictions (384k at 1,000 requests/s of
    128-block prompts), and they churn. CPython rebuilds a churning dict in one go, under the
    router's lock: one dict of 384k held a route for 20-30 ms (bench/predictions.py). So no
    dict of the prediction state may hold more than a small share of them; and expired,
    confirmed and removed-stream predictions leave every shard empty."""
    from kvwire.index.state import PRED_SHARDS

    clock = Clock()
    idx = PrefixIndex(predict_ttl=2.0, clock=clock)
    prompts = [[p] + list(range(1, 16 * 64)) for p in range(100)]
    for i, toks in enumerate(prompts):
        assert idx.predict("ef"[i % 2], toks, block_size=16) == 64
    total = 100 * 64
    for shards in (idx._h.pred, idx._h.streams["e"].pred, idx._h.streams["f"].pred):
        sizes = [len(d) for d in shards]
        assert sum(sizes) in (total, total // 2)
        assert len(sizes) == PRED_SHARDS >= 32
        assert max(sizes) * 16 <= sum(sizes)  # random keys: about even (1/64 each)
    assert idx.streams()["e"].predicted_blocks == total // 2
    idx.apply(batch("e", stored(prompts[0], 16, 0, 64)))  # confirms prompt 0's blocks on e
    assert idx.streams()["e"].predicted_blocks == total // 2 - 64
    assert idx.match(prompts[0])["e"].predicted == 0
    idx.remove_stream("f")
    assert idx.match(prompts[1]) == {"e": idx.match(prompts[1])["e"]}
    assert sum(len(d) for d in idx._h.pred) == total // 2 - 64  # f's bits gone with it
    clock.t += 2.0
    assert idx.match(prompts[2])["e"].predicted == 0  # expired
    assert not any(idx._h.pred) and not any(idx._h.streams["e"].pred)


_FEW_KEYS = [0, 1, 2**58 - 1, 2**58, 2**63, 2**64 - 1, 12345 << 40]


@pytest.mark.skipif(not keys_mod.NATIVE, reason=f"C keys not built: {keys_mod.REASON}")
@settings(max_examples=150, deadline=None)
@given(shards=st.sampled_from([1, 2, 64]),
       ops=st.lists(st.tuples(
           st.booleans(),
           st.lists(st.sampled_from(_FEW_KEYS) | st.integers(0, 2**64 - 1), max_size=12),
           st.sampled_from([0, 1, 5, 63, 64, 130]),  # slots past 64: masks past 64 bits
           st.sampled_from([0.0, 1.0, 2.0, 2.5, 4.0])), max_size=25))
def test_the_c_prediction_maps_change_as_the_python_ones_do(shards, ops):
    """``pred_add`` / ``pred_expire`` (one C call per prompt) against their pure twins,
    step by step: the same expiry and mask dicts, shard by shard."""
    maps = {impl: (tuple({} for _ in range(shards)), tuple({} for _ in range(shards)))
            for impl in ("c", "py")}
    for add, keys, slot, t in ops:
        for impl, (expiry, masks) in maps.items():
            fn = ((keys_mod.pred_add if add else keys_mod.pred_expire) if impl == "c"
                  else (keys_mod.py_pred_add if add else keys_mod.py_pred_expire))
            fn(array("Q", keys), expiry, masks, t, 1 << slot)
        assert maps["c"] == maps["py"]
        for expiry, masks in maps.values():  # every key in its own shard
            for m in (expiry, masks):
                for i, d in enumerate(m):
                    assert all((k >> (64 - (shards.bit_length() - 1)) if shards > 1 else 0) == i
                               for k in d)


def test_prediction_maps_refuse_what_they_cannot_hold():
    if not keys_mod.NATIVE:
        pytest.skip(f"C keys not built: {keys_mod.REASON}")
    maps = tuple({} for _ in range(4))
    with pytest.raises(TypeError, match="array"):
        keys_mod.pred_add([1, 2], maps, maps, 1.0, 1)
    with pytest.raises(TypeError, match="array"):
        keys_mod.pred_add(array("q", [1]), maps, maps, 1.0, 1)
    with pytest.raises(ValueError, match="2\\*\\*b"):
        keys_mod.pred_add(array("Q", [1]), maps[:3], maps, 1.0, 1)
    with pytest.raises(TypeError, match="tuples of dicts"):
        keys_mod.pred_expire(array("Q", [1]), [{}], maps, 1.0, 1)
    # PrefixIndex.predict_keys takes any iterable of keys (an array('Q') as is)
    idx = PrefixIndex(predict_ttl=2.0, clock=Clock())
    idx.predict("e", [0] * 16, block_size=16)
    assert idx.predict_keys("e", [5, 2**64 - 1]) == 2
    assert idx.streams()["e"].predicted_blocks == 3


def test_predictions_and_matches_give_the_collector_nothing_to_walk():
    """A busy router predicts a prefix per request and holds it for the TTL: those keys must
    not sit in containers the cyclic GC walks (they made each full collection take tens of
    ms), and a match on the fast path must not allocate tracked objects at all."""
    import gc

    idx = PrefixIndex(predict_ttl=60.0)
    toks = list(range(20_000, 20_000 + 64 * 16))
    idx.apply(batch("e", stored(toks, 16, 0, 64)))
    for i in range(50):
        assert idx.predict("f", [i] + toks[1:], block_size=16) == 64
    # each held prediction gives the collector one object with no int referents to visit
    assert all(len(gc.get_referents(keys)) <= 1 for _, _, keys in idx._pred_queue)
    idx.match(toks)  # warm: answer templates, counts cache
    # Count only this thread's allocations: threads that earlier tests left running in this
    # process (a status feed sampling once a second) would otherwise allocate inside the
    # window. match() never releases the GIL, so a long switch interval keeps them out.
    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        gc.collect()
        before = len(gc.get_objects())
        for _ in range(200):
            idx.match(toks)
        grown = len(gc.get_objects()) - before
    finally:
        sys.setswitchinterval(old)
    assert grown < 20  # 200 matches: no tracked allocation kept


def test_suspect_stream_is_reported():
    idx = PrefixIndex()
    toks = list(range(160))
    # the engine's events use 16-token blocks salted differently from the requests
    idx.apply(batch("bad", stored(toks, 16, 0, 10, salt="engine-only")))
    idx.apply(batch("good", stored(toks, 16, 0, 10)))
    for _ in range(25):
        idx.match(toks)
    s = idx.streams()
    assert s["good"].suspect is None and s["good"].matched_requests == 25
    assert s["bad"].matched_requests == 0 and s["bad"].match_requests == 25
    assert "0 of 25 requests matched" in s["bad"].suspect
    idx.apply(batch("notok", BlockStored([1, 2], None, [], 16, None, "CPU", None)))
    assert "without token ids" in idx.streams()["notok"].suspect


def test_bad_input_is_counted_and_named():
    idx = PrefixIndex()
    idx.apply(batch("e", BlockStored([1, 2], None, [1, 2, 3], 16, None, None, None)))
    s = idx.streams()["e"]
    assert s.bad_events == 1 and "3 token ids for 2 blocks" in s.suspect
    with pytest.raises(TypeError, match="expected Batch"):
        idx.apply("not a delivery")
    assert idx.bad_items == 1
    with pytest.raises(ValueError, match="tier credit"):
        PrefixIndex(tier_credits={"GPU": -1})


def test_many_streams_grow_slots_and_remove_stream():
    idx = PrefixIndex()
    toks = list(range(48))
    for i in range(150):  # more than 64 slots: the masks are repacked twice
        idx.apply(batch(f"e{i}", stored(toks, 16, 0, 1 + i % 3)))
    m = idx.match(toks)
    assert all(m[f"e{i}"].tiers["GPU"] == 1 + i % 3 for i in range(150))
    idx.remove_stream("e7")
    assert "e7" not in idx.match(toks) and "e7" not in idx.streams()
    idx.apply(batch("new", stored(toks, 16, 0, 2)))  # reuses e7's slot, starts empty
    m = idx.match(toks)
    assert m["new"].tiers["GPU"] == 2 and m["e8"].tiers["GPU"] == 3


def churn(idx: PrefixIndex, nb: int, steps: int, per_batch: int = 100,
          every: int = 50_000) -> list[int]:
    """Fill ``nb`` blocks, then ``steps`` store+remove pairs keeping ``nb`` blocks indexed;
    returns ``sys.getallocatedblocks()`` after each ``every`` steps (after a gc)."""

    def ev(i: int) -> BlockStored:
        return BlockStored([i], None, [i, i + 1, i + 2, i + 3], 4, None, None, None)

    idx.apply(batch("e", *[ev(i) for i in range(nb)]))
    marks = []
    for start in range(nb, nb + steps, per_batch):
        evs = []
        for i in range(start, start + per_batch):
            evs.append(BlockRemoved([i - nb], None))
            evs.append(ev(i))
        idx.apply(batch("e", *evs))
        if (start + per_batch - nb) % every == 0:
            gc.collect()
            marks.append(sys.getallocatedblocks())
    return marks


def test_churn_memory_is_flat():
    """2x10^5 store/remove steps at a constant 20k blocks: the allocated-object count stays
    flat (10^6 steps: bench/index.py). Removed hashes are remembered between 1000 and 2000
    of them here, so the sawtooth of that memory is small against a leak of 1 per step."""
    idx = PrefixIndex(remember_removed=1000)
    marks = churn(idx, 20_000, 200_000, every=25_000)
    assert idx.streams()["e"].blocks == 20_000
    # (the first mark left out: the count is the whole process's, and what an earlier
    # test's threads still held when this one began can go during the first steps; seen
    # 17k above the rest after tests/test_load_share.py)
    marks = marks[1:]
    assert max(marks) - min(marks) < 5_000, marks


def test_bytes_per_block_is_bounded():
    """tracemalloc: the index's own memory per indexed block (documented in docs/prefix-index.md)."""
    idx = PrefixIndex()
    evs = [BlockStored([i * 7919 + 2**40], None, list(range(i, i + 16)), 16, None, None, None)
           for i in range(20_000)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        idx.apply(batch("e", *evs))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    per_block = used / len(evs)
    assert 50 < per_block < 400, per_block


# --------------------------------------------------------------------------- real feed


def _pub(dialect: str) -> tuple[ZmqEventPublisher, StreamSpec]:
    pub = ZmqEventPublisher(endpoint="tcp://*:0", replay_endpoint="tcp://*:0", dialect=dialect,
                            heartbeat_interval=0.2)
    port = pub.endpoint.rsplit(":", 1)[1]
    rport = pub.replay_endpoint.rsplit(":", 1)[1]
    return pub, StreamSpec(f"{dialect}/dp0", f"tcp://127.0.0.1:{port}", "",
                           f"tcp://127.0.0.1:{rport}")


@pytest.mark.parametrize("dialect,as_bytes", [
    ("vllm", False), ("vllm", True), ("sglang", False), ("vllm-legacy", False),
    ("vllm-legacy-v0", False),
])
def test_real_publisher_subscriber_feed(dialect, as_bytes):
    pub, spec = _pub(dialect)
    sub = Subscriber([spec])
    idx = PrefixIndex()
    a = list(range(1000, 1128))   # 8 blocks of 16
    b = a[:64] + list(range(5000, 5064))
    medium = None if dialect == "vllm-legacy-v0" else "GPU"
    try:
        ev_a = stored(a, 16, 0, 8, medium=medium, as_bytes=as_bytes)
        ev_b = stored(b, 16, 4, 4, medium=medium, as_bytes=as_bytes)
        pub.publish(EventBatch(time.time(), [ev_a]))
        pub.publish(EventBatch(time.time(), [ev_b]))
        pub.publish(EventBatch(time.time(), [BlockRemoved(ev_a.block_hashes[6:], medium)]))
        deadline = time.monotonic() + 20.0
        want = {"a": 6, "b": 8}
        got = {}
        while time.monotonic() < deadline:
            idx.apply_many(sub.poll_many(0.1))
            m = idx.match(a)
            if spec.name in m:
                got = {"a": m[spec.name].tiers["GPU"],
                       "b": idx.match(b)[spec.name].tiers["GPU"]}
                if got == want:
                    break
        assert got == want
        stats = idx.streams()[spec.name]
        assert stats.block_size == 16 and stats.blocks == 10 and stats.unknown_removes == 0
        assert stats.suspect is None
    finally:
        sub.close()
        pub.shutdown()


def test_set_bits_helper_agrees_with_pure_python():
    """_bits (C bits64 for 64-bit masks) lists the same slots as the pure generator."""
    import random

    from kvwire.index.state import _bits, _py_bits

    rng = random.Random(7)
    masks = [0, 1, 1 << 63, (1 << 64) - 1, 1 << 64, (1 << 200) | 5]
    masks += [rng.getrandbits(rng.choice([8, 64, 130])) for _ in range(300)]
    for m in masks:
        assert list(_bits(m)) == list(_py_bits(m)), m


def test_a_tier_seen_later_is_in_every_answer_after() -> None:
    """A medium no one configured (``NVME`` here) becomes a tier when a stream first stores
    there; answers given before were cached (templates, per-length counts): after, every
    answer counts blocks over the new set of tiers, the new one included."""
    idx = PrefixIndex()
    toks = list(range(160))
    idx.apply(batch("a", stored(toks, 16, 0, 10)))
    before = idx.match(toks)
    assert before["a"].tiers == {"GPU": 10, "CPU": 0, "DISK": 0}
    idx.apply(batch("b", stored(toks, 16, 0, 4, medium="NVME")))
    after = idx.match(toks)
    for name, want in (("a", {"GPU": 10, "CPU": 0, "DISK": 0, "NVME": 0}),
                       ("b", {"GPU": 0, "CPU": 0, "DISK": 0, "NVME": 4})):
        assert after[name].tiers == want and len(after[name].counts) == 4, after[name]
    assert idx.match(toks[:16 * 20] + [9] * 16)["a"].tiers["NVME"] == 0  # a fresh length too


def test_match_caches_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The no-match templates (one per prompt length) and the per-length counts are caches
    that start over when full, so a router that sees every prompt length keeps bounded
    memory (the limits lowered here: module tunables)."""
    from kvwire.index import walk

    monkeypatch.setattr(walk, "_TEMPLATES", 8)
    monkeypatch.setattr(walk, "_COUNTS_CACHE", 8)
    idx = PrefixIndex()
    toks = list(range(16 * 64))
    idx.apply(batch("a", stored(toks, 16, 0, 64)))
    for n in range(1, 64):
        got = idx.match(toks[: 16 * n])["a"]
        assert got.blocks == n and got.tiers["GPU"] == n
        assert len(idx.walk.tpl) <= 8 and len(idx.walk.counts) <= 8


def test_predicted_only_match_is_not_a_matched_request() -> None:
    """``matched_requests`` counts requests the stream's stored blocks matched; a match by
    a prediction alone (blocks routed there, not yet stored) is not one."""
    idx = PrefixIndex()
    toks = list(range(160))
    idx.predict("p", toks, block_size=16)
    assert idx.match(toks)["p"].predicted == 10
    assert idx.streams()["p"].matched_requests == 0
