"""The ``rfc1527`` dialect (Mooncake's RFC #1527 KV events): Mooncake Store's own vectors,
aliases, milliseconds, the strict path's refusal, property round trips, a real socket."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cli_helpers import listen_while_publishing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mooncake_like import MooncakeLike

from kvwire.index.cache import BlockCache, chain_events
from kvwire.publish.config import KVEventsConfig
from kvwire.wire import rfc1527
from kvwire.wire.events import (
    FAST_DECODE_ERRORS,
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    EventError,
    KVEventBatch,
    Rfc1527Fields,
    decode_batch,
    decode_fast,
    encode_batch,
)

DATA = Path(__file__).parent / "data" / "rfc1527_mooncake.json"
U64_MAX = 2**64 - 1
enc = msgspec.msgpack.encode


def messages() -> list[dict[str, Any]]:
    return json.loads(DATA.read_text())["messages"]


def payloads() -> list[bytes]:
    return [bytes.fromhex(m["frames_hex"][2]) for m in messages()]


# --------------------------------------------------------------------------- Mooncake's vectors


def test_every_vector_decodes_with_nothing_dropped() -> None:
    dec = BatchDecoder(on_error=lambda e: pytest.fail(e.message))
    kinds = {"stored": 0, "removed": 0}
    for m, p in zip(messages(), payloads()):
        batch = dec.decode(p)
        assert len(batch.events) == len(m["msgpack"][1])
        for ev in batch.events:
            kinds["stored" if type(ev) is BlockStored else "removed"] += 1
    assert (dec.batches, dec.events, dec.bad_events, dec.bad_payloads) == (69, 77, 0, 0)
    assert kinds == {"stored": 47, "removed": 30}


def test_vectors_are_frames_seq_from_one() -> None:
    for i, m in enumerate(messages()):
        topic, seq, _ = (bytes.fromhex(f) for f in m["frames_hex"])
        assert topic == b"" and int.from_bytes(seq, "big") == m["seq"] == i + 1


def test_every_vector_reencodes_byte_exact() -> None:
    for p in payloads():
        assert encode_batch(decode_batch(p), "rfc1527") == p


def test_vectors_decode_to_their_listed_values() -> None:
    """Checked against the plain msgpack decode in the vector file, not the decoder itself:
    seconds, u64 sequence hashes (never the signed aliases), upper-case medium, envelope."""
    for m, p in zip(messages(), payloads()):
        ts_ms, evs, rank = m["msgpack"]
        batch = decode_batch(p)
        assert batch.ts == ts_ms / 1000 and 1.7e9 < batch.ts < 2.0e9  # seconds, in 2026
        assert batch.data_parallel_rank == rank == 0
        for got, want in zip(batch.events, evs):
            r = got.rfc1527
            assert r is not None
            assert r.event_id == want["event_id"]
            assert r.timestamp == want["timestamp"] / 1000
            assert (r.tenant_id, r.backend_id, r.object_key) == (
                want["tenant_id"], want["backend_id"], want["object_key"])
            assert r.base_block_idx == want["base_block_idx"]
            assert got.block_hashes == want["seq_hashes"]
            assert all(0 <= h <= U64_MAX for h in got.block_hashes)
            assert got.medium == want["medium"].upper() == "CPU"
            if want["event_type"] == "stored":
                assert type(got) is BlockStored
                assert got.parent_block_hash == want["parent_hash"]
                assert got.token_ids == [] and want["token_ids"] is None
                assert got.block_size == 0 and want["block_size"] is None
            else:
                assert type(got) is BlockRemoved


def test_vectors_reencode_in_other_dialects_without_rfc1527_fields() -> None:
    """Republished as vLLM (or another engine's) bytes, Mooncake's events carry what that
    dialect can (u64 hashes, upper-case tier) and nothing of the RFC envelope."""
    strip = msgspec.structs.replace
    for p in payloads():
        b = decode_batch(p)
        plain = strip(b, events=[strip(e, rfc1527=None) for e in b.events])
        for dialect in ("vllm", "sglang", "vllm-legacy"):
            out = encode_batch(b, dialect)
            assert out == encode_batch(plain, dialect) and b"rfc1527" not in out
            assert decode_batch(out) == decode_batch(encode_batch(plain, dialect))


def test_a_batch_of_rfc1527_events_decodes_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not event by event (twice slower): the per-event path is only for mixed or bad ones."""
    def per_event(raw: bytes) -> Any:
        raise AssertionError("decoded event by event")

    monkeypatch.setattr(rfc1527, "decode_event", per_event)
    for p in payloads():
        assert len(decode_batch(p, on_error=lambda e: pytest.fail(e.message)).events) >= 1


def test_non_numeric_object_keys_give_no_hashes_but_still_decode() -> None:
    evs = [ev for p in payloads() for ev in decode_batch(p).events]
    keyless = [ev for ev in evs if not ev.block_hashes]
    assert any(type(ev) is BlockStored for ev in keyless)
    assert {"not-a-seq-hash", "123abc"} <= {ev.rfc1527.object_key for ev in keyless}
    assert {ev.rfc1527.object_key: ev.block_hashes for ev in evs}["0x2a"] == [42]


def test_strict_map_path_refuses_every_vector() -> None:
    """Even the batches holding only ``removed`` events, whose aliases (``type``, signed
    ``block_hashes``, ``medium``) make a valid vLLM ``BlockRemoved``: read that way, 2^64-1
    would be removed as -1 and one block would become two (and the ts read as seconds)."""
    removed_only = 0
    for m, p in zip(messages(), payloads()):
        removed_only += all(e["event_type"] == "removed" for e in m["msgpack"][1])
        with pytest.raises(FAST_DECODE_ERRORS):
            decode_fast(p)
    assert removed_only == 27


def test_aliases_never_make_one_block_two() -> None:
    """Replaying Mooncake's stream into a cache: every block is known by its u64 sequence
    hash only, and each remove hits the block its store made (2^64-1, 2^63 included)."""
    cache = BlockCache()
    live: set[int] = set()
    for m, p in zip(messages(), payloads()):
        cache.apply(decode_batch(p))
        for e in m["msgpack"][1]:
            (live.update if e["event_type"] == "stored" else live.difference_update)(
                e["seq_hashes"])
        assert {h for _, h in cache.as_dict()} == live
        assert {tier for tier, _ in cache.as_dict()} <= {"CPU"}
    assert 2**63 in live or any(
        2**63 in e["seq_hashes"] for m in messages() for e in m["msgpack"][1])


def rfc_map(kind: str = "removed", **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"event_id": 1, "timestamp": 1_000, "event_type": kind,
                            "medium": "gpu"}
    base.update(fields)
    return base


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"seq_hashes": [U64_MAX], "block_hashes": [-1]}, [U64_MAX]),  # both: one hash
        ({"block_hashes": [-1, 5]}, [U64_MAX, 5]),  # alias only: cast back to u64
        ({"seq_hashes": [2**63]}, [2**63]),  # RFC field only
        ({"seq_hashes": [7], "block_hashes": [8]}, [7]),  # disagreeing alias: RFC wins
    ],
)
def test_alias_cases_decode_to_one_u64_hash(fields: dict[str, Any], want: list[int]) -> None:
    for kind in ("stored", "removed"):
        ev = decode_batch(enc([5, [rfc_map(kind, **fields)], 0])).events[0]
        assert ev.block_hashes == want
    stored = decode_batch(enc([5, [rfc_map("stored", seq_hashes=[1], parent_block_hash=-2)],
                                0])).events[0]
    assert stored.parent_block_hash == U64_MAX - 1
    stored = decode_batch(enc([5, [rfc_map("stored", seq_hashes=[1], parent_hash=9,
                                           parent_block_hash=-2)], 0])).events[0]
    assert stored.parent_block_hash == 9


def test_stored_with_tokens_and_cleared() -> None:
    b = decode_batch(enc([1_500, [
        rfc_map("stored", seq_hashes=[1, 2], token_ids=[1, 2, 3, 4], block_size=2,
                base_block_idx=3, parent_hash=0, lora_name="ad", additional_salt="s"),
        rfc_map("cleared", medium="disk", group_id=4),
    ], 2]))
    assert b.ts == 1.5 and b.data_parallel_rank == 2
    st_, cl = b.events
    assert (st_.token_ids, st_.block_size, st_.lora_name, st_.cache_salt) == (
        [1, 2, 3, 4], 2, "ad", "s")
    assert st_.rfc1527.base_block_idx == 3 and st_.medium == "GPU"
    assert type(cl) is AllBlocksCleared
    assert cl.rfc1527 == Rfc1527Fields(event_id=1, timestamp=1.0, group_id=4, medium="DISK")
    assert decode_batch(encode_batch(b, "rfc1527")) == b


def test_malformed_rfc_events_are_isolated_counted_and_explained() -> None:
    good = rfc_map("removed", seq_hashes=[3])
    bad = [
        rfc_map("stored"),  # no hashes at all
        rfc_map("updated", seq_hashes=[1]),  # unknown event type
        rfc_map("removed", seq_hashes=["x"]),  # wrong type
        rfc_map("stored", seq_hashes=[1], block_size=-1),
    ]
    vllm = {"type": "BlockRemoved", "block_hashes": [-1], "medium": "GPU"}
    seen: list[EventError] = []
    dec = BatchDecoder(on_error=seen.append)
    batch = dec.decode(enc([2_000, [good, *bad, vllm], 0]))
    assert batch.ts == 2.0  # a batch holding rfc1527 events is in milliseconds
    assert batch.events == [
        BlockRemoved([3], "GPU", rfc1527=Rfc1527Fields(event_id=1, timestamp=1.0)),
        BlockRemoved([-1], "GPU"),  # the vLLM event of a mixed batch keeps its own reading
    ]
    assert [e.index for e in seen] == [1, 2, 3, 4] and dec.bad_events == 4
    assert all("rfc1527" in e.message for e in seen)
    assert "seq_hashes" in seen[0].message and "updated" in seen[1].message


def test_other_dialects_float_ts_stays_seconds_in_a_mixed_batch() -> None:
    vllm = {"type": "AllBlocksCleared"}
    assert decode_batch(enc([2.5, [vllm], None])).ts == 2.5
    assert decode_batch(enc([2, [vllm], None])).ts == 2.0  # no rfc1527 event: seconds


def test_empty_batch_keeps_float_seconds() -> None:
    """kvwire's heartbeat in this dialect: an integer ts could not be told from another
    dialect's, so it stays float seconds (Mooncake never sends an empty batch)."""
    p = encode_batch(KVEventBatch(1795591289.014, [], 0), "rfc1527")
    assert p[1] == 0xCB
    assert decode_fast(p) == decode_batch(p) == KVEventBatch(1795591289.014, [], 0)


def test_kvwire_events_encode_in_mooncakes_layout() -> None:
    """An event with no rfc1527 fields (kvwire's own): every key, nil where unknown."""
    b = KVEventBatch(2.0, [BlockStored([2**63, 5], -1, [], 0, None, "CPU"),
                           BlockRemoved([bytes(24) + b"\x00" * 7 + b"\x09"], None),
                           AllBlocksCleared()], 0)
    ts, evs, rank = msgspec.msgpack.decode(encode_batch(b, "rfc1527"))
    assert (ts, rank) == (2000, 0)
    want_keys = list(messages()[0]["msgpack"][1][0])
    assert list(evs[0]) == want_keys
    assert evs[0]["seq_hashes"] == [2**63, 5] and evs[0]["block_hashes"] == [-(2**63), 5]
    assert (evs[0]["parent_hash"], evs[0]["parent_block_hash"]) == (U64_MAX, -1)
    assert evs[0]["medium"] == "cpu" and evs[0]["token_ids"] is None
    assert evs[0]["block_size"] is None and evs[0]["timestamp"] == 2000
    assert evs[1]["seq_hashes"] == [9]  # a byte hash: its last 8 bytes
    assert list(evs[1]) == want_keys[:17]
    assert evs[2]["event_type"] == "cleared" and evs[2]["type"] == "AllBlocksCleared"


def test_unencodable_hash_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="64-bit"):
        encode_batch(KVEventBatch(1.0, [BlockRemoved([2**64], None)], 0), "rfc1527")


# --------------------------------------------------------------------------- the standard hash


def test_standard_block_hash_matches_the_spec_example() -> None:
    tokens = list(range(32))
    assert rfc1527.standard_local_hashes(tokens, 16) == [
        15310707395893867146, 15292316782987903195]
    assert rfc1527.standard_block_hashes(tokens, 16) == [
        15310707395893867146, 13769157705258532664]
    assert rfc1527.standard_block_hashes(tokens + [1, 2, 3], 16) == (
        rfc1527.standard_block_hashes(tokens, 16))  # only full blocks
    assert rfc1527.standard_block_hashes(tokens, 16, seed=1) != (
        rfc1527.standard_block_hashes(tokens, 16))


# --------------------------------------------------------------------------- BlockCache


def test_block_cache_keeps_depths_of_token_less_chains() -> None:
    ev = BlockStored([10, 11, 12], 9, [], 0, None, "CPU",
                     rfc1527=Rfc1527Fields(event_id=1, base_block_idx=4))
    cache = BlockCache()
    cache.apply(KVEventBatch(1.0, [ev, BlockRemoved([11], "CPU")], 0))
    blocks = {b.hash: b.as_event() for b in cache.blocks()}
    assert blocks[12].rfc1527.base_block_idx == 6 and blocks[12].parent_block_hash == 11
    assert blocks[10].rfc1527.base_block_idx == 4 and blocks[12].token_ids == []
    subs = chain_events(cache.raw_copy())
    assert [(s.block_hashes, s.rfc1527.base_block_idx) for s in subs] == [([10], 4), ([12], 6)]


# --------------------------------------------------------------------------- property tests

u64 = st.integers(0, U64_MAX)
opt_text = st.none() | st.text(max_size=8)
opt_int = st.none() | st.integers(0, 2**40)
ms = st.integers(0, 2**45)
mediums = st.none() | st.sampled_from(["GPU", "CPU", "DISK"])


def rfc_fields(draw: st.DrawFn, kind: str) -> Rfc1527Fields:
    return Rfc1527Fields(
        event_id=draw(st.none() | u64),
        timestamp=draw(ms) / 1000,
        base_block_idx=draw(opt_int) if kind != "cleared" else None,
        model_name=draw(opt_text),
        tenant_id=draw(opt_text),
        backend_id=draw(opt_text),
        group_id=draw(st.none() | st.integers(0, 9) | st.text(max_size=4)),
        dp_rank=draw(st.none() | st.integers(0, 64)),
        object_key=draw(opt_text) if kind != "cleared" else None,
        block_size=draw(opt_int) if kind != "stored" else None,
        lora_name=draw(opt_text) if kind != "stored" else None,
        additional_salt=draw(opt_text) if kind != "stored" else None,
        medium=draw(mediums) if kind == "cleared" else None,
    )


@st.composite
def rfc_events(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    r = rfc_fields(draw, kind)
    if kind == "cleared":
        return AllBlocksCleared(rfc1527=r)
    hashes = draw(st.lists(u64, max_size=4))
    if kind == "removed":
        return BlockRemoved(hashes, draw(mediums), rfc1527=r)
    bs = draw(st.integers(0, 4))
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(hashes) * bs,
                           max_size=len(hashes) * bs)) if bs else []
    return BlockStored(hashes, draw(st.none() | u64), tokens, bs, None, draw(mediums),
                       draw(opt_text), cache_salt=draw(opt_text), rfc1527=r)


rfc_batches = st.builds(
    KVEventBatch,
    ts=ms.map(lambda v: v / 1000),
    events=st.lists(rfc_events(), min_size=1, max_size=5),
    data_parallel_rank=st.none() | st.integers(0, 2**31),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=rfc_batches)
def test_property_roundtrip(batch: KVEventBatch) -> None:
    payload = encode_batch(batch, "rfc1527")
    dec = BatchDecoder(on_error=lambda e: pytest.fail(e.message))
    assert dec.decode(payload) == batch
    assert encode_batch(dec.decode(payload), "rfc1527") == payload
    with pytest.raises(FAST_DECODE_ERRORS):
        decode_fast(payload)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=rfc_batches, vllm=st.lists(st.builds(
    BlockRemoved, st.lists(u64, min_size=1, max_size=3), st.none() | st.just("GPU")),
    max_size=3), data=st.data())
def test_property_mixed_with_vllm_events(batch: KVEventBatch, vllm: list[BlockRemoved],
                                         data: st.DataObject) -> None:
    """rfc1527 events beside vLLM ones in one batch: each read by its own rules."""
    raw = msgspec.msgpack.Decoder(tuple[int, list[msgspec.Raw], Any])
    _, rfc_raws, _ = raw.decode(encode_batch(batch, "rfc1527"))
    vllm_raws = [bytes(r) for r in msgspec.msgpack.Decoder(
        tuple[float, list[msgspec.Raw], Any]).decode(
        encode_batch(KVEventBatch(0.0, vllm, None)))[1]]
    order = data.draw(st.permutations([*zip(batch.events, rfc_raws),
                                       *zip(vllm, vllm_raws)]))
    ts_ms = round(batch.ts * 1000)
    got = decode_batch(enc([ts_ms, [msgspec.Raw(bytes(r)) for _, r in order],
                            batch.data_parallel_rank]),
                       on_error=lambda e: pytest.fail(e.message))
    assert got.ts == batch.ts
    assert got.events == [ev for ev, _ in order]


# --------------------------------------------------------------------------- selection, sockets


def test_dialect_selectable_in_config() -> None:
    assert KVEventsConfig.from_dict({"dialect": "rfc1527"}).dialect == "rfc1527"


def loopback(endpoint: str) -> str:
    """The publisher binds ``tcp://*:0`` and reports the node's address: connect locally."""
    return "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]


def _step(i: int) -> KVEventBatch:
    return KVEventBatch(time.time(), [
        BlockStored([U64_MAX - i, 2**63 + i], None, [], 0, None, "CPU"),
        BlockRemoved([U64_MAX - i + 1], "CPU"),
    ], None)


def test_publisher_and_subscriber_over_a_real_socket() -> None:
    from kvwire.consume.stream import Batch, StreamConfig
    from kvwire.consume.subscriber import StreamSpec, Subscriber
    from kvwire.publish.publisher import ZmqEventPublisher

    pub = ZmqEventPublisher(endpoint="tcp://*:0", dialect="rfc1527",
                            heartbeat_interval=0.1)
    sub = Subscriber([StreamSpec("moon", loopback(pub.endpoint))],
                     config=StreamConfig(request_timeout=0.2))
    got: list[Batch] = []
    try:
        deadline = time.monotonic() + 20
        i = 0
        while time.monotonic() < deadline and not (
                sum(bool(b.batch.events) for b in got) >= 3
                and any(not b.batch.events for b in got)):
            if sum(bool(b.batch.events) for b in got) < 3:
                pub.publish(_step(i))
                i += 1
            item = sub.poll(0.05)
            if isinstance(item, Batch):
                got.append(item)
        stats = sub.stats()["moon"].stream
    finally:
        sub.close()
        pub.shutdown(timeout=1)
    full = [b for b in got if b.batch.events]
    assert len(full) >= 3 and any(not b.batch.events for b in got)  # heartbeats too
    now = time.time()
    for b in got:
        assert now - 30 < b.batch.ts <= now + 1  # seconds, also for the empty heartbeats
    for b in full:
        stored, removed = b.batch.events
        assert stored.block_hashes[0] > 2**63 and stored.medium == "CPU"
        assert stored.rfc1527 is not None and removed.rfc1527 is not None
    assert stats.bad_payloads == 0


def test_kvwire_listen_shows_an_rfc1527_stream() -> None:
    from kvwire.publish.publisher import ZmqEventPublisher

    pub = ZmqEventPublisher(endpoint="tcp://*:0", dialect="rfc1527",
                            heartbeat_interval=None)
    proc, out, err = listen_while_publishing(
        pub, _step, loopback(pub.endpoint), "--count", "2", "--json", "--replay-timeout", "0.2")
    assert proc.returncode == 0, err
    recs = [json.loads(line) for line in out.splitlines()]
    batches = [r for r in recs if r["kind"] == "batch"]
    assert len(batches) == 2
    for r in batches:
        assert abs(r["ts"] - time.time()) < 60
        assert r["events"][0]["medium"] == "CPU" and r["events"][0]["block_hashes"][0] > 2**63
        assert "rfc1527" in r["events"][0]


# --------------------------------------------------------------------------- a run from seq 1


@pytest.mark.parametrize("first_seq", [1, 0])
def test_a_mooncake_run_followed_from_its_start_is_exact(first_seq: int) -> None:
    """Joined after all 69 batches were published: the replay from 0 answers seqs 1..69,
    Mooncake's whole run. Told ``first_seq=1`` (as an RFC #1403 ``/register`` of type
    Mooncake tells it), the subscriber holds it exactly; with the engines' 0 it must call
    it a late start, since for them seq 0 would be missing."""
    import threading

    from kvwire.consume.stream import Batch, Snapshot, StreamConfig
    from kvwire.consume.subscriber import StreamSpec, Subscriber

    moon = MooncakeLike(messages())
    moon.publish_all()  # nobody listens yet: these reach the subscriber only by replay
    stop = threading.Event()
    server = threading.Thread(target=moon.serve, args=(stop,), daemon=True)
    server.start()
    sub = Subscriber([StreamSpec("moon", moon.endpoint, replay_endpoint=moon.replay_endpoint,
                                 first_seq=first_seq)],
                     config=StreamConfig(request_timeout=0.5, info_timeout=0.3))
    snaps: list[Snapshot] = []
    seqs: list[int] = []
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (not seqs or seqs[-1] < 69):
            item = sub.poll(0.05)
            if isinstance(item, Snapshot):
                snaps.append(item)
            elif isinstance(item, Batch):
                seqs.append(item.seq)
        stats = sub.stats()["moon"].stream
    finally:
        sub.close()
        stop.set()
        server.join()
        moon.close()
    assert seqs == list(range(1, 70)), seqs
    assert len(snaps) == 1 and snaps[0].seq == 0
    assert snaps[0].exact is (first_seq == 1) and stats.exact is (first_seq == 1), stats
    assert stats.lost == 0 and stats.bad_payloads == 0
