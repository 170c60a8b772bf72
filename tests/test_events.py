"""Wire codec: golden vectors, dialects, hashes, error isolation, property tests."""

from __future__ import annotations

import logging
import math
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.wire.events import (
    DIALECTS,
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventError,
    KVEventBatch,
    Rfc1527Fields,
    decode_batch,
    encode_batch,
)

U64_MAX = 2**64 - 1
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1
DIGEST = bytes(range(32))

STORED_FIELDS = tuple(BlockStored.__struct_fields__)
REMOVED_FIELDS = tuple(BlockRemoved.__struct_fields__)
#: Only the rfc1527 dialect carries these (``event_type`` is always None: see KVCacheEvent).
RFC_ONLY = ("rfc1527", "event_type")
#: The engines' dialects; rfc1527 has its own tests (tests/test_rfc1527.py): it carries other
#: fields, u64 hashes only, and milliseconds.
ENGINE_DIALECTS = tuple(d for d in DIALECTS if d != "rfc1527")
CORE_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")

#: Fields each dialect carries (spec section 2); every other field comes back as None.
KEEP: dict[str, dict[type, tuple[str, ...]]] = {
    "vllm": {
        BlockStored: tuple(f for f in STORED_FIELDS if f != "cache_salt" and f not in RFC_ONLY),
        BlockRemoved: tuple(f for f in REMOVED_FIELDS if f not in RFC_ONLY),
    },
    "sglang": {
        BlockStored: (*CORE_STORED, "medium", "cache_salt", "session_id", "lora_name"),
        BlockRemoved: ("block_hashes", "medium"),
    },
    "vllm-legacy": {
        BlockStored: (*CORE_STORED, "medium"),
        BlockRemoved: ("block_hashes", "medium"),
    },
    "vllm-legacy-v0": {
        BlockStored: CORE_STORED,
        BlockRemoved: ("block_hashes",),
    },
}

_raw_batch = msgspec.msgpack.Decoder(tuple[float, list[msgspec.Raw], int | None])
enc = msgspec.msgpack.encode


def project(batch: KVEventBatch, dialect: str) -> KVEventBatch:
    """What ``batch`` decodes to after a trip through ``dialect``: dropped fields are None."""
    out: list[Any] = []
    for ev in batch.events:
        if type(ev) is AllBlocksCleared:
            out.append(AllBlocksCleared())
            continue
        keep = KEEP[dialect][type(ev)]
        fields = {f: (getattr(ev, f) if f in keep else None) for f in ev.__struct_fields__}
        out.append(type(ev)(**fields))
    return KVEventBatch(batch.ts, out, batch.data_parallel_rank)


def from_json(value: Any) -> Any:
    """Vector values: ``{"hex": ...}`` is bytes, recursively."""
    if isinstance(value, dict):
        if set(value) == {"hex"}:
            return bytes.fromhex(value["hex"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def expected_rank(decoded: dict[str, Any]) -> int | None:
    return decoded["data_parallel_rank"] if "data_parallel_rank" in decoded else decoded[
        "attn_dp_rank"
    ]


def event_from_json(ev: dict[str, Any]) -> Any:
    cls = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
           "AllBlocksCleared": AllBlocksCleared}[ev["type"]]
    return cls(**{k: from_json(v) for k, v in ev.items() if k != "type"})


def full_stored(**over: Any) -> BlockStored:
    fields: dict[str, Any] = dict(
        block_hashes=[U64_MAX, 7],
        parent_block_hash=I64_MIN,
        token_ids=list(range(8)),
        block_size=4,
        lora_id=3,
        medium="CPU",
        lora_name="ad",
        extra_keys=[["x", [1, 2]], None],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=4096,
        locality="LOCAL",
        ownership="tier2",
        session_id="s1",
        lookahead_token_ids=[[8], [9, 10]],
        cache_salt="salt",
    )
    fields.update(over)
    return BlockStored(**fields)


def full_removed(**over: Any) -> BlockRemoved:
    fields: dict[str, Any] = dict(
        block_hashes=[DIGEST], medium="DISK", group_idx=2, locality="REMOTE", ownership="o"
    )
    fields.update(over)
    return BlockRemoved(**fields)


# --------------------------------------------------------------------------- golden vectors


def test_vector_decodes_to_listed_values(kv_vector: dict[str, Any]) -> None:
    payload = bytes.fromhex(kv_vector["payload_hex"])
    want = kv_vector["decoded"]
    batch = decode_batch(payload, on_error=lambda e: pytest.fail(f"unexpected {e}"))
    assert type(batch) is KVEventBatch
    assert batch.ts == want["ts"]
    assert batch.data_parallel_rank == expected_rank(want)
    assert len(batch.events) == len(want["events"])
    for i, (got, exp) in enumerate(zip(batch.events, want["events"])):
        assert type(got).__name__ == exp["type"], i
        listed = {k: from_json(v) for k, v in exp.items() if k != "type"}
        for field in got.__struct_fields__:
            value = getattr(got, field)
            if field in listed:
                assert value == listed[field], (i, field)
                # bytes hashes stay bytes, int hashes stay ints (no bool/str/float coercion)
                assert type(value) is type(listed[field]), (i, field)
            else:
                assert value is None, f"event {i}: unlisted field {field} = {value!r}"
        assert set(listed) <= set(got.__struct_fields__), set(listed) - set(
            got.__struct_fields__
        )


def test_vector_reencodes_to_identical_bytes(kv_vector: dict[str, Any]) -> None:
    payload = bytes.fromhex(kv_vector["payload_hex"])
    assert encode_batch(decode_batch(payload), kv_vector["dialect"]) == payload


def test_vector_encodes_from_listed_values(kv_vector: dict[str, Any]) -> None:
    """Encoding independently of the decoder: build the structs from the JSON values."""
    want = kv_vector["decoded"]
    batch = KVEventBatch(
        want["ts"], [event_from_json(e) for e in want["events"]], expected_rank(want)
    )
    assert encode_batch(batch, kv_vector["dialect"]) == bytes.fromhex(kv_vector["payload_hex"])


def test_vectors_cover_all_dialects(kv_vectors: list[dict[str, Any]]) -> None:
    assert {v["dialect"] for v in kv_vectors} == set(ENGINE_DIALECTS)
    assert set(DIALECTS) == {*ENGINE_DIALECTS, "rfc1527"}  # its vectors: tests/test_rfc1527.py


# --------------------------------------------------------------------------- hashes


@pytest.mark.parametrize("dialect", ENGINE_DIALECTS)
@pytest.mark.parametrize(
    "hashes",
    [[U64_MAX, 0, 2**63], [I64_MIN, -1, I64_MAX], [DIGEST, b"\xff" * 32]],
    ids=["u64", "i64", "bytes32"],
)
def test_hash_values_preserved_exactly(dialect: str, hashes: list[Any]) -> None:
    parent = hashes[-1]
    batch = KVEventBatch(
        1.5,
        [
            BlockStored(hashes[:2], parent, [1, 2, 3, 4], 2, None, "GPU"),
            BlockRemoved([hashes[0]], "GPU"),
        ],
        None,
    )
    out = decode_batch(encode_batch(batch, dialect))
    stored, removed = out.events
    assert stored.block_hashes == hashes[:2]
    assert stored.parent_block_hash == parent
    assert removed.block_hashes == [hashes[0]]
    for got, exp in zip([*stored.block_hashes, stored.parent_block_hash], [*hashes[:2], parent]):
        assert type(got) is type(exp)


def test_u64_and_i64_extremes_on_the_wire() -> None:
    """u64 max is msgpack uint64 (0xcf), i64 min is int64 (0xd3): what vLLM/SGLang emit."""
    b = encode_batch(KVEventBatch(0.0, [BlockRemoved([U64_MAX, I64_MIN], "GPU")], None), "vllm")
    assert bytes.fromhex("cf" + "ff" * 8) in b
    assert bytes.fromhex("d38000000000000000") in b


# --------------------------------------------------------------------------- decoder behaviour


def test_all_four_dialects_mixed_in_one_batch() -> None:
    payload = enc(
        [
            2.5,
            [
                # vllm map (with vLLM-only fields)
                {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
                 "lora_name": None, "group_idx": 3},
                # sglang map (signed hash, SGLang-only field)
                {"type": "BlockStored", "block_hashes": [-5], "parent_block_hash": 1,
                 "token_ids": [3, 4], "block_size": 2, "lora_id": 7, "medium": "CPU_PINNED",
                 "cache_salt": "s"},
                # vllm-legacy positional with medium
                ["BlockRemoved", [DIGEST], "CPU"],
                # vllm-legacy-v0 positional without medium
                ["BlockStored", [9], None, [5, 6], 2, None],
                ["AllBlocksCleared"],
                {"type": "AllBlocksCleared"},
            ],
            4,
        ]
    )
    errors: list[EventError] = []
    batch = decode_batch(payload, on_error=errors.append)
    assert errors == []
    assert batch == KVEventBatch(
        2.5,
        [
            BlockStored([1], None, [1, 2], 2, None, "GPU", group_idx=3),
            BlockStored([-5], 1, [3, 4], 2, 7, "CPU_PINNED", cache_salt="s"),
            BlockRemoved([DIGEST], "CPU"),
            BlockStored([9], None, [5, 6], 2, None),
            AllBlocksCleared(),
            AllBlocksCleared(),
        ],
        4,
    )


def test_unknown_map_keys_are_ignored_anywhere() -> None:
    payload = enc(
        [
            1.0,
            [
                {"future": {"nested": [1, {"x": b"y"}]}, "block_hashes": [5], "medium": None,
                 "type": "BlockRemoved", "zz_new": 1.5},
                {"type": "BlockStored", "block_hashes": [6], "parent_block_hash": 5,
                 "token_ids": [1], "block_size": 1, "lora_id": None, "brand_new": [None]},
            ],
            None,
        ]
    )
    errors: list[EventError] = []
    batch = decode_batch(payload, on_error=errors.append)
    assert errors == []
    assert batch.events == [BlockRemoved([5], None), BlockStored([6], 5, [1], 1, None)]


def test_batch_without_rank_or_with_trailing_elements() -> None:
    """``[ts, events]`` (no rank) and future trailing elements decode for every event shape."""
    for events in ([{"type": "AllBlocksCleared"}], [["AllBlocksCleared"]],
                   [["BlockRemoved", [1]], {"type": "AllBlocksCleared"}]):
        assert decode_batch(enc([1.0, events])).data_parallel_rank is None
        assert decode_batch(enc([1.0, events, 3, "future"])).data_parallel_rank == 3
        assert len(decode_batch(enc([1.0, events])).events) == len(events)


GOOD_A = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
GOOD_B = ["BlockStored", [2], 1, [7, 8], 2, None, "GPU"]
MALFORMED = [
    {"type": "BlockStored", "block_hashes": "notalist", "parent_block_hash": None,
     "token_ids": [1], "block_size": 1, "lora_id": None},  # wrong field type
    {"type": "BlockStored", "block_hashes": [1]},  # missing required fields
    {"type": "NoSuchEvent", "x": 1},  # unknown event type
    ["NoSuchEvent", 1, 2],  # unknown positional type
    ["BlockRemoved", [1.5]],  # float hash
    {"type": "BlockRemoved", "block_hashes": [True]},  # bool is not a hash
    42,
    "garbage",
    None,
    b"\x00\x01",
    {"no_type": 1},
]


def test_malformed_events_are_isolated_and_reported() -> None:
    events = [GOOD_A, *MALFORMED, GOOD_B]
    payload = enc([3.0, events, 1])
    seen: list[EventError] = []
    dec = BatchDecoder(on_error=seen.append)
    batch = dec.decode(payload)
    assert batch == KVEventBatch(
        3.0, [BlockRemoved([1], "GPU"), BlockStored([2], 1, [7, 8], 2, None, "GPU")], 1
    )
    assert [e.index for e in seen] == list(range(1, 1 + len(MALFORMED)))
    assert dec.last_errors == seen
    for err, bad in zip(seen, MALFORMED):
        assert err.raw == enc(bad)  # the offending event's own bytes
        assert err.message.startswith(f"event {err.index}")
    assert (dec.batches, dec.events, dec.bad_events, dec.bad_payloads) == (1, 2, len(MALFORMED), 0)
    # the next good batch clears last_errors and keeps counting
    dec.decode(enc([4.0, [GOOD_A], None]))
    assert dec.last_errors == []
    assert (dec.batches, dec.events, dec.bad_events) == (2, 3, len(MALFORMED))
    assert len(seen) == len(MALFORMED)


def test_invalid_utf8_and_deep_nesting_inside_an_event_are_isolated() -> None:
    bad_utf8 = msgspec.Raw(b"\x82\xa4type\xa1\xff\xa1x\x01")  # {"type": "\xff", ...}
    bad_str_field = msgspec.Raw(b"\x83\xa4type\xacBlockRemoved\xacblock_hashes\x91\x01"
                                b"\xa6medium\xa2\xc3\x28")  # medium: invalid UTF-8
    seen: list[EventError] = []
    batch = decode_batch(enc([1.0, [GOOD_A, bad_utf8, bad_str_field, GOOD_B], 0]), seen.append)
    assert len(batch.events) == 2
    assert [e.index for e in seen] == [1, 2]
    with pytest.raises(DecodeError):
        decode_batch(b"\xa2\xc3\x28")  # a lone invalid-UTF-8 str


def test_malformed_event_without_callback_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvwire.events"):
        batch = decode_batch(enc([1.0, [GOOD_A, {"type": "Nope"}], None]))
    assert batch.events == [BlockRemoved([1], "GPU")]
    assert any("event 1" in r.getMessage() for r in caplog.records)


NOT_A_BATCH = [
    (b"", "msgpack"),
    (b"\xc1", "msgpack"),  # never-used msgpack byte
    (bytes(range(200, 256)), None),
    (enc({"ts": 1.0, "events": []}), "array"),
    (enc("hello"), "array"),
    (enc([1.0]), "array of 1"),
    (enc(["soon", [], None]), "ts"),
    (enc([None, [], None]), "ts"),
    (enc([1.0, {"a": 1}, None]), "events"),
    (enc([1.0, "events", None]), "events"),
    (enc([1.0, [], "rank0"]), "rank"),
    (enc([1.0, [], 1.5]), "rank"),
    (enc([1.0, [], None])[:-1], None),  # truncated
    (enc([1.0, [], None]) + b"\x00", None),  # trailing bytes
    (b"\x91" * 50_000 + b"\xc0", None),  # absurd nesting
    (enc([1.0, [[[[[[]]]]]], None])[:4] + b"\x91" * 50_000 + b"\xc0", None),
]


@pytest.mark.parametrize("payload,words", NOT_A_BATCH, ids=range(len(NOT_A_BATCH)))
def test_not_a_batch_raises_decode_error(payload: bytes, words: str | None) -> None:
    dec = BatchDecoder(on_error=lambda e: None)
    with pytest.raises(DecodeError) as ei:
        dec.decode(payload)
    assert isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert msg and msg != "malformed batch" or words is None
    if words is not None:
        assert words in msg
    assert (dec.bad_payloads, dec.batches) == (1, 0)


def test_decode_accepts_memoryview() -> None:
    payload = encode_batch(KVEventBatch(1.0, [AllBlocksCleared()], 2))
    assert decode_batch(memoryview(payload)).events == [AllBlocksCleared()]
    legacy = encode_batch(KVEventBatch(1.0, [AllBlocksCleared()], 2), "vllm-legacy")
    assert decode_batch(memoryview(legacy)).events == [AllBlocksCleared()]


# --------------------------------------------------------------------------- constructors, dialects


def test_block_stored_keywords_and_defaults() -> None:
    ev = BlockStored(
        block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
        lora_id=None, medium="GPU",
    )
    assert (ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.lora_id,
            ev.medium) == ([1, 2], None, [1, 2, 3, 4], 2, None, "GPU")
    for f in STORED_FIELDS[6:]:
        assert getattr(ev, f) is None, f
    assert BlockRemoved(block_hashes=[1]).medium is None
    assert all(getattr(BlockRemoved([1]), f) is None for f in REMOVED_FIELDS[1:])


@pytest.mark.parametrize("dialect", ENGINE_DIALECTS)
def test_dialect_drops_documented_fields(dialect: str) -> None:
    """Also the rfc1527 fields of events that came from that dialect: no engine's bytes
    carry them (vllm's direct-encoding path must notice them too)."""
    rfc = Rfc1527Fields(event_id=5, timestamp=1.5, base_block_idx=2, object_key="k")
    batch = KVEventBatch(9.0, [full_stored(rfc1527=rfc), full_removed(rfc1527=rfc),
                               AllBlocksCleared(rfc1527=rfc)], 3)
    got = decode_batch(encode_batch(batch, dialect))
    assert got == project(batch, dialect)
    # and what is kept is really kept (project() is not vacuous)
    for f in KEEP[dialect][BlockStored]:
        assert getattr(got.events[0], f) is not None, f


def test_dialect_shapes_on_the_wire() -> None:
    batch = KVEventBatch(1.0, [BlockRemoved([1], None)], None)
    raws = {d: _raw_batch.decode(encode_batch(batch, d))[1][0] for d in ENGINE_DIALECTS}
    assert msgspec.msgpack.decode(raws["vllm"]) == {
        "type": "BlockRemoved", "block_hashes": [1], "medium": None}
    assert msgspec.msgpack.decode(raws["sglang"]) == {"type": "BlockRemoved", "block_hashes": [1]}
    assert msgspec.msgpack.decode(raws["vllm-legacy"]) == ["BlockRemoved", [1], None]
    assert msgspec.msgpack.decode(raws["vllm-legacy-v0"]) == ["BlockRemoved", [1]]
    # the "type" key comes first in map dialects
    assert bytes(raws["vllm"])[1:6] == b"\xa4type"


@pytest.mark.parametrize("dialect", ["", "VLLM", "vllm_legacy", "json", None])
def test_encode_unknown_dialect_raises_value_error(dialect: Any) -> None:
    with pytest.raises(ValueError, match="dialect"):
        encode_batch(KVEventBatch(1.0, [], None), dialect)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_encode_rejects_unencodable_events(dialect: str) -> None:
    with pytest.raises(TypeError):
        encode_batch(KVEventBatch(1.0, [object()], None), dialect)  # type: ignore[list-item]


# --------------------------------------------------------------------------- property tests

hashes = st.one_of(
    st.integers(0, U64_MAX),
    st.integers(I64_MIN, I64_MAX),
    st.binary(min_size=32, max_size=32),
)
opt_text = st.none() | st.text(max_size=12)
opt_int = st.none() | st.integers(0, 2**31)
mediums = st.none() | st.sampled_from(["GPU", "CPU", "STORAGE", "CPU_PINNED", "DISK", "EXTERNAL"])
json_like = st.recursive(
    st.none() | st.integers(-(2**40), 2**40) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=6,
)


@st.composite
def stored_events(draw: st.DrawFn) -> BlockStored:
    n = draw(st.integers(1, 4))
    bs = draw(st.integers(1, 8))
    per_block = st.none() | st.lists(json_like | st.none(), min_size=n, max_size=n)
    return BlockStored(
        block_hashes=draw(st.lists(hashes, min_size=n, max_size=n)),
        parent_block_hash=draw(st.none() | hashes),
        token_ids=draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * bs, max_size=n * bs)),
        block_size=bs,
        lora_id=draw(opt_int),
        medium=draw(mediums),
        lora_name=draw(opt_text),
        extra_keys=draw(per_block),
        group_idx=draw(opt_int),
        kv_cache_spec_kind=draw(opt_text),
        kv_cache_spec_sliding_window=draw(opt_int),
        locality=draw(opt_text),
        ownership=draw(opt_text),
        session_id=draw(opt_text),
        lookahead_token_ids=draw(per_block),
        cache_salt=draw(opt_text),
    )


removed_events = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, min_size=1, max_size=4),
    medium=mediums,
    group_idx=opt_int,
    locality=opt_text,
    ownership=opt_text,
)
events = st.one_of(stored_events(), removed_events, st.just(AllBlocksCleared()))
batches = st.builds(
    KVEventBatch,
    ts=st.floats(allow_nan=False),
    events=st.lists(events, max_size=6),
    data_parallel_rank=st.none() | st.integers(I64_MIN, U64_MAX),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches, dialect=st.sampled_from(ENGINE_DIALECTS))
def test_property_roundtrip_per_dialect(batch: KVEventBatch, dialect: str) -> None:
    payload = encode_batch(batch, dialect)
    got = decode_batch(payload, on_error=lambda e: pytest.fail(str(e)))
    assert got == project(batch, dialect)
    # encoding is a fixpoint: decoded values re-encode to the same bytes
    assert encode_batch(got, dialect) == payload


@settings(max_examples=150, deadline=None)
@given(
    ts=st.floats(allow_nan=False),
    items=st.lists(st.tuples(events, st.sampled_from(ENGINE_DIALECTS)), max_size=6),
)
def test_property_mixed_dialects_in_one_batch(ts: float, items: list[tuple[Any, str]]) -> None:
    raws = [_raw_batch.decode(encode_batch(KVEventBatch(0.0, [ev], None), d))[1][0]
            for ev, d in items]
    got = decode_batch(enc([ts, raws, 1]), on_error=lambda e: pytest.fail(str(e)))
    want = [project(KVEventBatch(0.0, [ev], None), d).events[0] for ev, d in items]
    assert got == KVEventBatch(ts, want, 1)


def _check_decode(payload: bytes) -> None:
    try:
        out = decode_batch(payload, on_error=lambda e: None)
    except DecodeError:
        return
    assert type(out) is KVEventBatch
    assert isinstance(out.ts, float) or math.isnan(out.ts)
    assert all(type(e) in (BlockStored, BlockRemoved, AllBlocksCleared) for e in out.events)


msgpack_objs = st.recursive(
    st.none() | st.booleans() | st.integers(I64_MIN, U64_MAX) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=40) | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared",
                                                "type", "block_hashes", "medium"]),
    lambda inner: st.lists(inner, max_size=6)
    | st.dictionaries(st.text(max_size=8) | st.sampled_from(STORED_FIELDS + ("type",)), inner,
                      max_size=6),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300))
def test_property_random_bytes_only_decode_error(data: bytes) -> None:
    _check_decode(data)


@settings(max_examples=300, deadline=None)
@given(obj=msgpack_objs)
def test_property_random_msgpack_only_decode_error(obj: Any) -> None:
    _check_decode(enc(obj))


@settings(max_examples=300, deadline=None)
@given(ts=msgpack_objs, evs=st.lists(msgpack_objs | events, max_size=5), rank=msgpack_objs)
def test_property_batch_shaped_garbage(ts: Any, evs: list[Any], rank: Any) -> None:
    """Batch-shaped values with random events/fields: decodes (isolating) or DecodeError."""
    _check_decode(enc([ts, evs, rank]))
    _check_decode(enc([1.0, evs, None]))


@settings(max_examples=200, deadline=None)
@given(batch=batches, dialect=st.sampled_from(ENGINE_DIALECTS), data=st.data())
def test_property_mutated_payloads(batch: KVEventBatch, dialect: str, data: st.DataObject) -> None:
    payload = bytearray(encode_batch(batch, dialect))
    i = data.draw(st.integers(0, len(payload) - 1))
    payload[i] = data.draw(st.integers(0, 255))
    _check_decode(bytes(payload))
    _check_decode(bytes(payload[: data.draw(st.integers(0, len(payload)))]))


def test_decoded_batches_and_events_are_not_gc_tracked() -> None:
    """Consumers decode hundreds of thousands of batches a second: the structs stay out of
    the garbage collector's generations (only their lists are tracked)."""
    import gc

    from kvwire.consume.stream import Batch

    b = decode_batch(encode_batch(KVEventBatch(1.0, [
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                    block_size=2, lora_id=None, medium="GPU"),
        BlockRemoved(block_hashes=[1], medium="GPU"),
        AllBlocksCleared(),
    ], 0)))
    assert not gc.is_tracked(b)
    assert not any(gc.is_tracked(e) for e in b.events)
    assert not gc.is_tracked(Batch("s", 0, b))


# A long prompt's batch: its token ids go through the C list maker (wire/_ids.c) when built.
_strict = msgspec.msgpack.Decoder(KVEventBatch)
token_values = st.one_of(st.integers(0, 2**18 + 5), st.integers(I64_MIN, U64_MAX),
                         st.sampled_from([0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32,
                                          I64_MAX, U64_MAX, -1, -32, -33, -128, -129, I64_MIN]))


def _same_as_msgspec(payload: bytes) -> None:
    """decode_fast gives what msgspec's strict decoder gives: the same batch, or an error
    of the same kind."""
    from kvwire.wire.events import FAST_DECODE_ERRORS, decode_fast

    try:
        want: Any = _strict.decode(payload)
    except FAST_DECODE_ERRORS as e:
        want = type(e)
    try:
        got: Any = decode_fast(payload)
    except FAST_DECODE_ERRORS as e:
        got = type(e)
    assert got == want
    if isinstance(got, KVEventBatch):
        for ev in got.events:
            if type(ev) is BlockStored:
                assert type(ev.token_ids) is list
                assert all(type(t) is int for t in ev.token_ids)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches, vals=st.lists(token_values, min_size=1, max_size=60),
       n=st.integers(8200, 9000), dialect=st.sampled_from(("vllm", "sglang")), data=st.data())
def test_property_long_batches_decode_fast_as_msgspec(batch: KVEventBatch, vals: list[int],
                                                       n: int, dialect: str,
                                                       data: st.DataObject) -> None:
    from kvwire.wire.events import RAW_IDS_BYTES

    ids = (vals * (n // len(vals) + 1))[:n]
    long = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=ids,
                       block_size=len(ids) // 2, lora_id=None, medium=None)
    evs = list(batch.events)
    evs.insert(data.draw(st.integers(0, len(evs))), long)
    payload = encode_batch(KVEventBatch(batch.ts, evs, batch.data_parallel_rank), dialect)
    assert len(payload) >= RAW_IDS_BYTES
    _same_as_msgspec(payload)
    mutated = bytearray(payload)
    i = data.draw(st.integers(0, len(payload) - 1))
    mutated[i] = data.draw(st.integers(0, 255))
    _same_as_msgspec(bytes(mutated))
    _same_as_msgspec(payload[: data.draw(st.integers(0, len(payload)))])


def test_long_batch_token_ids_that_are_not_integers_fail_as_msgspec_says() -> None:
    base = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "block_size": 9000, "lora_id": None, "medium": None, "lora_name": None}
    for ids in ([1] * 8999 + [1.0], [1] * 8999 + [True], [1] * 8999 + [None], "x" * 9000,
                [1] * 8999 + [[1]], [1] * 8999 + [2**64 - 1]):
        _same_as_msgspec(enc([1.0, [dict(base, token_ids=ids)], None]))


def test_long_batch_token_ids_use_shared_ints_when_built() -> None:
    from kvwire.wire import events as ev_mod

    if ev_mod._int_list is None:
        pytest.skip("kvwire.wire._ids not built")
    ids = [70_000 + i % 50 for i in range(4000)]
    b = ev_mod.decode_fast(encode_batch(KVEventBatch(1.0, [BlockStored(
        block_hashes=[1], parent_block_hash=None, token_ids=ids, block_size=4000, lora_id=None,
        medium=None)])))
    got = b.events[0].token_ids
    assert got == ids
    assert got[0] is got[50]  # one object per value, not one per id
