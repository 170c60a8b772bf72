"""kvwire inside SGLang 0.5.23: the plugin, with SGLang's own code and real sockets.

SGLang has a general plugin group (``sglang.srt.plugins``), so this is the vLLM story with
SGLang's factory (a JSON config string, ``attn_dp_rank``, ``bind``, ``describe_local_source``).
SGLang is imported once here and once in a child (tests/engine_child.py) that loads the
plugins with SGLang's ``load_plugins()``: switches off (nothing changes), then on (the docs
example).
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from engine_helpers import (
    Child,
    assert_off_phase,
    assert_register_changes_nothing,
    check_same_bytes,
    engine_child,
    free_ports,
    import_or_skip,
    log_messages,
    plugin_switched_on,
    random_batches,
    read_phase,
    receive,
    replay_all,
    sub_socket,
    until_snapshot,
    warm_up,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.consume.subscriber import StreamSpec, Subscriber
from kvwire.plugins import sglang as plugin

WHEEL = "sglang (sglang==0.5.23)"


def sglang_batches(k: Any, n: int, seed: int = 0) -> list[Any]:
    """``n`` batches of SGLang's own event classes, every field of 0.5.23's events used
    (signed 64-bit hashes as SGLang's namespacing makes them). Deterministic per seed."""
    return random_batches(
        k, n, seed, block_size=2, t0=2000.0,
        new_hash=lambda rng: rng.randrange(-(1 << 63), 1 << 63),
        stored=lambda rng, _: dict(
            lora_id=rng.choice([None, 3]), medium=rng.choice(["GPU", "CPU_PINNED", None]),
            cache_salt=rng.choice([None, "salt"]), session_id=rng.choice([None, "s"]),
            lora_name=rng.choice([None, "adapter"])),
        removed=lambda rng: dict(medium=rng.choice(["GPU", None])))


def summary(ev: Any) -> tuple[Any, ...]:
    kind = type(ev).__name__
    if kind == "BlockStored":
        return (kind, list(ev.block_hashes), ev.parent_block_hash, list(ev.token_ids),
                ev.block_size, ev.lora_id)
    if kind == "BlockRemoved":
        return (kind, list(ev.block_hashes))
    return (kind,)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Child, str, str]]:
    """The child that loads the plugins as SGLang does; started before SGLang is imported here."""
    yield from engine_child("sglang", WHEEL, tmp_path_factory)


@pytest.fixture(scope="module")
def k(child: Any) -> Any:
    return import_or_skip("sglang.srt.disaggregation.kv_events", WHEEL)


@pytest.fixture
def plugin_on(k: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    yield from plugin_switched_on(plugin, k, "KVWIRE_SGLANG_EVENTS", monkeypatch)


def create(k: Any, rank: int = 0, **cfg: Any) -> Any:
    return k.EventPublisherFactory.create(json.dumps({"publisher": "zmq", **cfg}), rank)


# --------------------------------------------------------------------------- plugin on


def test_same_bytes_as_sglangs_own_publisher(plugin_on, k, made, ctx, tmp_path,
                                             monkeypatch) -> None:
    """Same SGLang objects to SGLang's publisher and to kvwire's (built by SGLang's factory
    from its JSON config): identical bytes live and replayed, a strict decoder of SGLang's
    classes reads them, kvwire's Subscriber gets every batch; both describe their local
    source alike (relative ipc paths made absolute)."""
    monkeypatch.chdir(tmp_path)
    tag = uuid.uuid4().hex[:6]
    cfgs = {w: {"endpoint": f"ipc://{w}-{tag}", "replay_endpoint": f"ipc://{w}-{tag}-r",
                "topic": "kv"} for w in ("sglang", "kvwire")}
    theirs = k.ZmqEventPublisher(0, **cfgs["sglang"])
    ours = create(k, **cfgs["kvwire"])
    made.extend([theirs, ours])
    assert type(ours) is plugin_on and isinstance(ours, k.EventPublisher)
    src = [p.describe_local_source(16) for p in (theirs, ours)]
    assert src[1] == json.loads(json.dumps(src[0]).replace("sglang-", "kvwire-"))
    assert src[1]["endpoint"] == f"ipc://{tmp_path}/kvwire-{tag}"
    eps = {w: (f"ipc://{tmp_path}/{w}-{tag}", f"ipc://{tmp_path}/{w}-{tag}-r")
           for w in cfgs}
    check_same_bytes(ctx, k, (theirs, *eps["sglang"]), (ours, *eps["kvwire"]),
                     batches=sglang_batches, summary=summary, rank_field="attn_dp_rank",
                     topic="kv", n=120)


def test_bind_loopback_and_rank_as_sglang(plugin_on, k, made, ctx) -> None:
    """``bind: true`` on a concrete loopback host binds (kvwire's own rule would connect);
    attn_dp_rank 1 moves both ports and tags the batches; describe_local_source agrees."""
    live_p, rep_p = free_ports(2, spare=1)
    pub = create(k, 1, endpoint=f"tcp://127.0.0.1:{live_p}", bind=True,
                 replay_endpoint=f"tcp://127.0.0.1:{rep_p}")
    made.append(pub)
    want_live, want_rep = f"tcp://127.0.0.1:{live_p + 1}", f"tcp://127.0.0.1:{rep_p + 1}"
    assert pub.describe_local_source(32) == {
        "dp_rank": 1, "endpoint": want_live, "topic": "", "block_size": 32,
        "replay_endpoint": want_rep}
    s = sub_socket(ctx, want_live)
    batches = iter(sglang_batches(k, 200, seed=3))
    warm_up([s], lambda: pub.publish(next(batches)))
    strict = msgspec.msgpack.Decoder(k.KVEventBatch)
    got = replay_all(ctx, want_rep)
    assert got and {strict.decode(p).attn_dp_rank for p in got.values()} == {1}
    # Connect-style (bind false, no wildcard): nothing local to advertise, as SGLang says.
    conn = create(k, endpoint=f"tcp://127.0.0.1:{live_p}", bind=False)
    made.append(conn)
    assert conn.describe_local_source(16) is None
    with pytest.raises(ValueError, match=r"ipc:///tmp/kvwire-sg.*rank 2"):
        create(k, 2, endpoint="ipc:///tmp/kvwire-sg")


sg_hash = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_sglang_event_encodes_as_sglang_encodes_it(plugin_on, k, made, data) -> None:
    if not made:
        made.append(create(k, 2, endpoint="tcp://127.0.0.1:9"))  # connects; nobody listens
    opt_s = st.one_of(st.none(), st.text(max_size=5))
    stored = st.builds(
        k.BlockStored, block_hashes=st.lists(sg_hash, max_size=3),
        parent_block_hash=st.one_of(st.none(), sg_hash),
        token_ids=st.lists(st.integers(0, 2**31), max_size=6), block_size=st.integers(1, 64),
        lora_id=st.one_of(st.none(), st.integers(0, 9)), medium=opt_s, cache_salt=opt_s,
        session_id=opt_s, lora_name=opt_s)
    removed = st.builds(k.BlockRemoved, block_hashes=st.lists(sg_hash, max_size=3),
                        medium=opt_s)
    events = data.draw(st.lists(st.one_of(stored, removed, st.just(k.AllBlocksCleared())),
                                max_size=4))
    rank = data.draw(st.one_of(st.none(), st.integers(0, 7)))
    batch = k.KVEventBatch(ts=data.draw(st.floats(allow_nan=False)), events=events,
                           attn_dp_rank=rank)
    want = copy.deepcopy(batch)
    if want.attn_dp_rank is None:
        want.attn_dp_rank = 2
    pub = made[0]
    if batch.attn_dp_rank is None:  # publish() fills it in place, as SGLang's does
        batch.attn_dp_rank = 2
    assert pub._encode(0, batch) == msgspec.msgpack.Encoder().encode(want)


def test_unknown_keys_warned_once(plugin_on, made, tmp_path) -> None:
    with log_messages(plugin.log) as records:
        for i in range(2):
            made.append(plugin_on(attn_dp_rank=0, endpoint=f"ipc://{tmp_path}/u{i}",
                                  future_sg_knob="x"))
    hits = [r for r in records if "future_sg_knob='x'" in r]
    assert len(hits) == 1 and "ignored" in hits[0], records


def test_off_register_changes_nothing_here(k, monkeypatch) -> None:
    monkeypatch.setenv("KVWIRE_SGLANG_EVENTS", "0")
    assert_register_changes_nothing(plugin, k)


def test_off_in_a_fresh_sglang_process(child) -> None:
    assert_off_phase(child[0], "sglang")


def test_loaded_by_sglang_publishes_to_subscriber_and_decoder(child, k, ctx) -> None:
    c, ep, rep = child
    on = read_phase(c, "on")
    assert on["registry"] == "kvwire.plugins.sglang.KvwireSglangPublisher", on
    active = [ln for ln in on["lines"] if "active in SGLang" in ln]
    assert len(active) == 1 and "KVWIRE_SGLANG_EVENTS=1" in active[0], on["lines"]
    assert on["source"]["endpoint"] == ep and on["source"]["replay_endpoint"] == rep
    with Subscriber([StreamSpec("sglang", ep, replay_endpoint=rep)], ctx=ctx) as sub:
        until_snapshot(sub)
        got = receive(sub, c.ask({"op": "pub", "n": 20})["published"])
        assert sub.stats()["sglang"].stream.mode == "kvwire"
    sent = sglang_batches(k, 20, seed=0)
    assert [[summary(e) for e in got[q].events] for q in sorted(got)] == \
        [[summary(e) for e in b.events] for b in sent]
    strict = msgspec.msgpack.Decoder(k.KVEventBatch)
    decoded = {s: strict.decode(p) for s, p in replay_all(ctx, rep).items()}
    assert [decoded[q].events for q in sorted(decoded) if decoded[q].events] == \
        [b.events for b in sent]
    assert "unsent=0" in c.ask({"op": "quit"})["report"]
    assert "Traceback" not in c.stderr(), c.stderr()
