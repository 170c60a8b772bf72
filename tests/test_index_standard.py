"""The standard block hash (RFC #1527, as Dynamo computes it) as the index's key scheme: the
spec's reference values, the LoRA / cache-namespace seed fold against Dynamo's own
``compute_block_hash_for_seq`` (peer tier: skipped loudly without ai-dynamo-runtime), the C
keys against the pure ones, and rfc1527 events announced by standard hashes only, matched
by a prompt that kvwire hashes itself."""

from __future__ import annotations

import json
import struct
import time
from array import array
from pathlib import Path

import pytest
from engine_helpers import import_or_skip
from hypothesis import given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest as xxh3

from kvwire.consume.stream import Batch
from kvwire.index import PrefixIndex, block_keys
from kvwire.index import keys as keys_mod
from kvwire.wire import rfc1527
from kvwire.wire.events import BlockRemoved, BlockStored, KVEventBatch, Rfc1527Fields

SPEC_LOCAL = [15310707395893867146, 15292316782987903195]
SPEC_SEQ = [15310707395893867146, 13769157705258532664]
U32 = st.integers(0, 2**32 - 1)
NAMES = st.one_of(st.none(), st.text(max_size=12))
native = pytest.mark.skipif(not keys_mod.NATIVE, reason=f"C keys not built: {keys_mod.REASON}")


def test_spec_reference_values() -> None:
    toks = list(range(32))
    assert rfc1527.standard_local_hashes(toks, 16) == SPEC_LOCAL
    assert rfc1527.standard_block_hashes(toks, 16) == SPEC_SEQ
    assert rfc1527.standard_seed() == rfc1527.STANDARD_SEED == 1337
    assert block_keys(toks, 16) == SPEC_SEQ  # the default scheme
    assert block_keys(toks + [5] * 15, 16) == SPEC_SEQ  # only full blocks
    assert keys_mod.py_chain_tokens(toks, 16, 2, None, 0, 1337) == SPEC_SEQ
    assert keys_mod.chain_tokens(toks, 16, 2, None, 0, 1337) == SPEC_SEQ
    assert keys_mod.chain_tokens(toks, 16, 2, SPEC_SEQ[0], 1, 1337) == SPEC_SEQ[1:]
    assert block_keys(toks, 16, scheme="kvwire") != SPEC_SEQ


def test_fold_rules_without_dynamo() -> None:
    """The fold as found against Dynamo (documented in docs/prefix-index.md), spelled out."""
    from xxhash import xxh3_64_intdigest as xxh3

    m = 2**64
    assert rfc1527.standard_seed("a") == (1337 + xxh3(b"a")) % m
    assert rfc1527.standard_seed(None, "ns") == (1337 + xxh3(b"ns", 1)) % m
    assert rfc1527.standard_seed("a", "ns") == (1337 + xxh3(b"a") + xxh3(b"ns", 1)) % m
    assert rfc1527.standard_seed("", "") == 1337  # empty names fold nothing
    # kvwire's notions: LoRA name -> lora_name, cache salt -> cache_namespace
    assert keys_mod.standard_fold("a", "ns") == rfc1527.standard_seed("a", "ns")
    toks = list(range(48))
    assert block_keys(toks, 16, "a", "ns") == rfc1527.standard_block_hashes(
        toks, 16, rfc1527.standard_seed("a", "ns"))


def dynamo_roll(local: list[int]) -> list[int]:
    """Sequence hashes as Dynamo rolls them over its local hashes (``compute_seq_hash_for_block``
    of its kv-router protocols): ``seq[0] = local[0]``, then ``xxh3_64(le_u64(seq[i-1]) ||
    le_u64(local[i]))`` with its fixed seed 1337, whatever seed the local hashes had."""
    seq: list[int] = []
    for h in local:
        seq.append(h if not seq else xxh3(struct.pack("<QQ", seq[-1], h), 1337))
    return seq


#: tokens 0..47, blocks of 16, LoRA "sql", namespace "ns": Dynamo 1.6.1's
#: compute_block_hash_for_seq (the local hashes), rolled by dynamo_roll
SQL_NS_LOCAL = [4740659346401312339, 13579242105682076948, 14012102813559346700]
SQL_NS_SEQ = [4740659346401312339, 17854500904795767951, 17711217977716770975]


def test_lora_and_namespace_seed_the_local_hashes_only() -> None:
    """Without Dynamo: the LoRA / namespace seed ``S`` is the local hashes' seed, and every
    sequence hash chains with 1337 (a chain seeded by ``S`` matches nothing Dynamo or a
    Mooncake publisher computes past the first block); C and pure keys alike."""
    toks = list(range(48))
    fold = rfc1527.standard_seed("sql", "ns")
    assert rfc1527.standard_local_hashes(toks, 16, fold) == SQL_NS_LOCAL
    assert dynamo_roll(SQL_NS_LOCAL) == SQL_NS_SEQ
    assert rfc1527.standard_sequence_hashes(SQL_NS_LOCAL) == SQL_NS_SEQ
    assert rfc1527.standard_block_hashes(toks, 16, fold) == SQL_NS_SEQ
    assert block_keys(toks, 16, "sql", "ns") == SQL_NS_SEQ
    assert keys_mod.py_chain_tokens(toks, 16, 3, None, 0, fold) == SQL_NS_SEQ
    assert keys_mod.chain_tokens(toks, 16, 3, None, 0, fold) == SQL_NS_SEQ
    for chain in (keys_mod.chain_tokens, keys_mod.py_chain_tokens):  # continuing a chain
        assert chain(toks, 16, 3, SQL_NS_SEQ[0], 1, fold) == SQL_NS_SEQ[1:]
        assert chain(array("q", toks), 16, 3, SQL_NS_SEQ[1], 2, fold) == SQL_NS_SEQ[2:]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(0, 8), bs=st.integers(1, 24), lora=NAMES, ns=NAMES)
def test_equal_to_dynamo_compute_block_hash_for_seq(data, n, bs, lora, ns) -> None:
    """Whole chains (several blocks, a partial tail), with and without a LoRA name and a
    namespace: local hashes equal Dynamo's, sequence hashes equal Dynamo's roll of them, in
    the C keys and the pure-Python ones."""
    core = import_or_skip("dynamo._core", "ai-dynamo-runtime (ai-dynamo-runtime==1.6.1)")
    toks = data.draw(st.lists(U32, min_size=n * bs, max_size=n * bs + bs - 1))
    local = core.compute_block_hash_for_seq(toks, bs, lora_name=lora, cache_namespace=ns)
    assert len(local) == n
    want = dynamo_roll(local)
    fold = rfc1527.standard_seed(lora, ns)
    assert keys_mod.standard_fold(lora, ns) == fold
    assert rfc1527.standard_local_hashes(toks, bs, fold) == local
    assert rfc1527.standard_sequence_hashes(local) == want
    assert rfc1527.standard_block_hashes(toks, bs, fold) == want
    # the index's keys: the default scheme (C when built), and the pure-Python path
    assert block_keys(toks, bs, lora, ns) == want
    assert keys_mod.py_chain_tokens(toks, bs, n, None, 0, fold) == want
    assert keys_mod.chain_tokens(toks, bs, n, None, 0, fold) == want
    if n:
        mid = n // 2
        prev = want[mid - 1] if mid else None
        assert keys_mod.chain_tokens(toks, bs, n, prev, mid, fold) == want[mid:]
        assert keys_mod.py_chain_tokens(toks, bs, n, prev, mid, fold) == want[mid:]


@pytest.mark.parametrize("impl", ["native", "python"])
def test_index_keys_lora_salted_prompts_as_dynamo(impl, monkeypatch) -> None:
    """A LoRA + salted prompt stored with tokens (the salt on the first event only, as vLLM
    sends it) and another announced by rfc1527 sequence hashes only: the index's keys are
    Dynamo's sequence hashes, so a prompt hashed here, Dynamo's hashes and the C tier walk
    that hashes as it goes all find every block; with the C keys and the pure ones."""
    from kvwire.index import prefix as prefix_mod

    if impl == "python":
        monkeypatch.setattr(keys_mod, "NATIVE", False)  # read by index.walk at each match
        monkeypatch.setattr(keys_mod, "chain_tokens", keys_mod.py_chain_tokens)
        monkeypatch.setattr(prefix_mod, "chain_tokens", keys_mod.py_chain_tokens)
        monkeypatch.setattr(keys_mod, "KeyMap", dict)
    elif not keys_mod.NATIVE:
        pytest.skip(f"C keys not built: {keys_mod.REASON}")
    bs, n = 8, 6
    prompt = [(i * 7919) % 50_000 for i in range(n * bs)]
    fold = rfc1527.standard_seed("sql", "ns")
    want = dynamo_roll(rfc1527.standard_local_hashes(prompt, bs, fold))
    idx = PrefixIndex()
    first = BlockStored([1, 2], None, prompt[: 2 * bs], bs, None, None, "sql",
                        cache_salt="ns")
    rest = BlockStored([3, 4, 5, 6], 2, prompt[2 * bs :], bs, None, None, "sql")
    idx.apply(_batch("tokens", first, rest))
    ann = BlockStored(want[:4], None, [], bs, None, "CPU",
                      rfc1527=Rfc1527Fields(base_block_idx=0))
    idx.apply(_batch("hashes", *_wire(ann)))
    assert sorted(idx._h.keys) == sorted(want)
    got = idx.match(prompt, "sql", "ns")
    assert (got["tokens"].blocks, got["hashes"].blocks) == (n, 4)
    assert idx.match(prompt, "sql")["tokens"].blocks == 0
    walk = idx.walk
    by_hash = walk.tier_prefixes(want, ["tokens", "hashes"])
    assert (by_hash["tokens"][0], by_hash["hashes"][0]) == (n, 4)
    if walk.c_walk and impl == "native":  # the indexer's walk, hashing the prompt in C
        seed, chain_fold = keys_mod.chain_start("standard", "sql", "ns")
        names = ["tokens", "hashes"]
        flat = walk.walk_tokens(array("q", prompt), bs, n, seed, chain_fold,
                                [walk.streams[s].slot for s in names])
        assert walk.unflatten(flat, names, True) == walk.tier_prefixes(want, names,
                                                                      cumulative=True)


@native
@settings(max_examples=300, deadline=None)
@given(toks=st.lists(U32, max_size=200), bs=st.integers(1, 40), fold=st.integers(0, 2**64 - 1),
       start=st.integers(0, 8))
def test_native_standard_keys_equal_pure_python(toks, bs, fold, start) -> None:
    n = len(toks) // bs
    whole = keys_mod.chain_tokens(toks, bs, n, None, 0, fold)
    assert whole == keys_mod.py_chain_tokens(toks, bs, n, None, 0, fold)
    assert whole == rfc1527.standard_block_hashes(toks[: n * bs], bs, fold)
    s = min(start, n)
    mid = whole[s - 1] if s else None
    for src in (toks, array("q", toks)):
        assert keys_mod.chain_tokens(src, bs, n, mid, s, fold) == whole[s:]
        assert keys_mod.py_chain_tokens(src, bs, n, mid, s, fold) == whole[s:]
    if n:  # the match scan: stops where a key is missing, with that key
        masks = {k: 1 for k in whole}
        stop = min(start, n - 1)
        del masks[whole[stop]]
        lanes = keys_mod.Lanes()
        for k in masks:
            lanes.set(k, 1)
        for ln in (lanes, None):
            assert keys_mod.scan_tokens(toks, bs, n, 0, None, masks, 1, 1 << 64, ln,
                                        fold) == (stop, whole[stop])


def test_standard_tokens_must_be_u32() -> None:
    for bad in ([-1] * 4, [2**32] * 4):
        for chain in (keys_mod.chain_tokens, keys_mod.py_chain_tokens):
            with pytest.raises(ValueError, match="bit integer"):
                chain(bad, 4, 1, None, 0, 1337)
    assert len(block_keys([2**32] * 4, 4, scheme="kvwire")) == 1
    with pytest.raises(ValueError, match="key_scheme"):
        block_keys([1] * 4, 4, scheme="nope")
    with pytest.raises(ValueError, match="key_scheme"):
        PrefixIndex(key_scheme="nope")


# --------------------------------------------------------------------------- the index


def _batch(stream: str, *events, seq: int = 0) -> Batch:
    return Batch(stream, seq, KVEventBatch(time.time(), list(events)))


def _wire(*events) -> list:
    """Events through the rfc1527 codec and back (what a subscriber hands the index)."""
    payload = rfc1527.encode_batch(KVEventBatch(1.0, list(events)))
    return rfc1527.decode_batch(payload).events


def _announce(prompt: list[int], bs: int, start: int, count: int, seed: int = 1337,
              with_bs: bool = True) -> BlockStored:
    """An rfc1527 BlockStored of blocks start..start+count-1 by standard hashes only."""
    seq = rfc1527.standard_block_hashes(prompt, bs, seed)
    return BlockStored(seq[start : start + count], seq[start - 1] if start else None, [],
                       bs if with_bs else 0, None, "CPU",
                       rfc1527=Rfc1527Fields(base_block_idx=start))


def test_rfc1527_blocks_without_tokens_match_a_prompt() -> None:
    bs = 16
    prompt = list(range(1000, 1000 + 10 * bs))
    idx = PrefixIndex()
    events = _wire(_announce(prompt, bs, 0, 4), _announce(prompt, bs, 4, 3))
    assert all(e.rfc1527 is not None and not e.token_ids for e in events)
    idx.apply(_batch("mooncake", *events))
    m = idx.match(prompt)["mooncake"]
    assert (m.prompt_blocks, m.blocks) == (10, 7)
    assert m.counts[idx._h.tiers.index("CPU")] == 7
    assert idx.match(prompt, lora_name="a")["mooncake"].blocks == 0  # another seed
    other = prompt[:bs] + [7] * (9 * bs)
    assert idx.match(other)["mooncake"].blocks == 1
    # removals by the same hashes
    seq = rfc1527.standard_block_hashes(prompt, bs)
    rm = BlockRemoved(seq[5:7], "CPU", rfc1527=Rfc1527Fields(base_block_idx=5))
    idx.apply(_batch("mooncake", *_wire(rm), seq=1))
    assert idx.match(prompt)["mooncake"].blocks == 5
    # an event with no hashes indexes nothing
    empty = BlockStored([], None, [], bs, None, "CPU", rfc1527=Rfc1527Fields(base_block_idx=0))
    idx.apply(_batch("mooncake", *_wire(empty), seq=2))
    assert idx.streams()["mooncake"].blocks == 5


def test_rfc1527_and_token_events_share_keys() -> None:
    """A publisher that sends tokens and one that sends only standard hashes of the same
    prompt index the same keys: both streams match it, block for block."""
    bs = 8
    prompt = [(i * 7919) % 50_000 for i in range(6 * bs)]
    seq = rfc1527.standard_block_hashes(prompt, bs)
    idx = PrefixIndex()
    idx.apply(_batch("tokens", BlockStored([11, 12, 13, 14], None, prompt[: 4 * bs], bs, None)))
    idx.apply(_batch("hashes", *_wire(_announce(prompt, bs, 0, 4))))
    got = idx.match(prompt)
    assert got["tokens"].blocks == got["hashes"].blocks == 4
    assert set(seq[:4]) <= set(idx._h.keys)


def test_rfc1527_without_block_size_learns_it_from_prediction() -> None:
    """Mooncake writes nil block_size: the stream is matched once a block size is known."""
    bs = 4
    prompt = list(range(5 * bs))
    idx = PrefixIndex(predict_ttl=0.0)
    idx.apply(_batch("m", *_wire(_announce(prompt, bs, 0, 3, with_bs=False))))
    assert idx.match(prompt)["m"].blocks == 0
    assert "without a block size" in (idx.streams()["m"].suspect or "")
    idx.predict("m", prompt, block_size=bs)  # ttl 0: sets the block size only
    assert idx.streams()["m"].suspect is None
    assert idx.match(prompt)["m"].blocks == 3


def test_kvwire_scheme_stays_selectable() -> None:
    bs = 16
    prompt = list(range(4 * bs))
    old = PrefixIndex(key_scheme="kvwire")
    assert old.key_scheme == "kvwire" and PrefixIndex().key_scheme == "standard"
    old.apply(_batch("e", BlockStored([1, 2, 3, 4], None, prompt, bs, None, None, "a")))
    assert old.match(prompt, lora_name="a")["e"].blocks == 4
    assert old.match(prompt)["e"].blocks == 0
    assert set(old._h.keys) == set(block_keys(prompt, bs, "a", scheme="kvwire"))
    # standard hashes only mean nothing to the kvwire scheme: never matched
    old.apply(_batch("m", *_wire(_announce(prompt, bs, 0, 4))))
    assert old.match(prompt)["m"].blocks == 0


def test_salt_and_lora_fold_through_continuation_events() -> None:
    """vLLM puts the cache salt in the first block's extra keys only: a continuation event
    chains on with its parent's seed, so the whole salted prompt matches."""
    bs = 4
    prompt = list(range(100, 100 + 6 * bs))
    want = block_keys(prompt, bs, "lora", "tenant")
    idx = PrefixIndex()
    first = BlockStored([1, 2, 3], None, prompt[: 3 * bs], bs, None, None, "lora",
                        cache_salt="tenant")
    rest = BlockStored([4, 5, 6], 3, prompt[3 * bs :], bs, None, None, "lora")
    idx.apply(_batch("v", first, rest))
    assert sorted(idx._h.keys) == sorted(want)
    assert idx.match(prompt, "lora", "tenant")["v"].blocks == 6
    assert idx.match(prompt, "lora")["v"].blocks == 0
    assert idx.match(prompt, None, "tenant")["v"].blocks == 0
    # removing everything drops the remembered seeds with the keys
    idx.apply(_batch("v", BlockRemoved([1, 2, 3, 4, 5, 6], None), seq=1))
    assert idx._folds == {} and idx._h.keys == {}


def test_mooncake_vectors_store_and_remove_by_their_hashes() -> None:
    """Mooncake Store's own messages (tests/data/rfc1527_mooncake.json: puts, removes and
    lease evictions, no token ids): the index holds exactly the hashes stored and not yet
    removed, each under itself as the key."""
    data = Path(__file__).parent / "data" / "rfc1527_mooncake.json"
    held: set[int] = set()
    idx = PrefixIndex()
    for m in json.loads(data.read_text())["messages"]:
        b = rfc1527.decode_batch(bytes.fromhex(m["frames_hex"][2]))
        for ev in b.events:
            assert ev.rfc1527 is not None
            if isinstance(ev, BlockStored):
                assert not ev.token_ids
                held.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                held.difference_update(ev.block_hashes)
        idx.apply(Batch("mooncake", m["seq"], b))
    assert held and set(idx._h.keys) == held
    s = idx.streams()["mooncake"]
    assert s.blocks == len(held) and s.unplaced_blocks == 0 and s.unknown_removes == 0


def test_real_rfc1527_publisher_subscriber_feed() -> None:
    """Token-less rfc1527 batches over ZeroMQ (publisher -> subscriber -> index): prompts
    hashed by kvwire match the blocks announced by standard hashes only."""
    from kvwire.consume.subscriber import StreamSpec, Subscriber
    from kvwire.publish.publisher import ZmqEventPublisher
    from kvwire.wire.events import EventBatch

    pub = ZmqEventPublisher(endpoint="tcp://*:0", replay_endpoint="tcp://*:0",
                            dialect="rfc1527", heartbeat_interval=0.2)
    port = pub.endpoint.rsplit(":", 1)[1]
    rport = pub.replay_endpoint.rsplit(":", 1)[1]
    spec = StreamSpec("mooncake/dp0", f"tcp://127.0.0.1:{port}", "", f"tcp://127.0.0.1:{rport}")
    sub = Subscriber([spec])
    idx = PrefixIndex()
    bs = 16
    a = list(range(1000, 1000 + 8 * bs))
    b = a[: 4 * bs] + list(range(5000, 5000 + 4 * bs))
    seq_a = rfc1527.standard_block_hashes(a, bs)
    try:
        pub.publish(EventBatch(time.time(), [_announce(a, bs, 0, 8)]))
        pub.publish(EventBatch(time.time(), [_announce(b, bs, 4, 4)]))  # parent: a's 4th
        pub.publish(EventBatch(time.time(), [BlockRemoved(
            seq_a[6:], "CPU", rfc1527=Rfc1527Fields(base_block_idx=6))]))
        deadline = time.monotonic() + 20.0
        want, got = {"a": 6, "b": 8}, {}
        while time.monotonic() < deadline and got != want:
            idx.apply_many(sub.poll_many(0.1))
            m = idx.match(a)
            if spec.name in m:
                got = {"a": m[spec.name].blocks, "b": idx.match(b)[spec.name].blocks}
        assert got == want
        stats = idx.streams()[spec.name]
        assert stats.block_size == bs and stats.blocks == 10 and stats.unknown_removes == 0
        # (the batches, or the publisher's snapshot of its 10 blocks when joining late)
        assert stats.stores_without_tokens >= 10 and stats.unplaced_blocks == 0
        assert stats.tiers["CPU"] == 10 and stats.suspect is None
    finally:
        sub.close()
        pub.shutdown()
