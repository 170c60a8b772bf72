"""kvwire inside SGLang 0.5.23 (issue 11): the plugin, with SGLang's own code and real sockets.

SGLang has a general plugin group (``sglang.srt.plugins``), so this is the vLLM story with
SGLang's factory (a JSON config string, ``attn_dp_rank``, ``bind``, ``describe_local_source``).
SGLang is imported once here and once in a child that loads the plugins with SGLang's
``load_plugins()``: switches off (nothing changes), then on (the docs example).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import random
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from engine_helpers import (
    TIMEOUT,
    Child,
    collect,
    docs_blocks,
    engine_env,
    import_or_skip,
    replay_all,
    sub_socket,
    wait_for,
    warm_up,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.consume.items import Batch, Snapshot
from kvwire.consume.subscriber import StreamSpec, Subscriber
from kvwire.engines import sglang as plugin

WHEEL = "sglang (sglang==0.5.23)"

CHILD = r'''
import faulthandler, json, logging, os, sys, threading
faulthandler.dump_traceback_later(280, exit=True)  # a stuck child says where, then ends

def out(obj):
    print(json.dumps(obj), flush=True)

def fingerprint():
    import sglang.srt.disaggregation.kv_events as k
    return {
        "registry": {n: f"{v.__module__}.{v.__qualname__}"
                     for n, v in k.EventPublisherFactory._registry.items()},
        "kv_events": {n: id(v) for n, v in vars(k).items()},
        "factory": {n: id(v) for n, v in vars(k.EventPublisherFactory).items()},
        "zmq_publisher": {n: id(v) for n, v in vars(k.ZmqEventPublisher).items()},
        "env": sorted(os.environ),
        "threads": sorted(t.name for t in threading.enumerate()),
    }

logging.basicConfig(level=logging.INFO)  # as SGLang's server configures its log
import sglang.srt.plugins as plugins
from importlib.metadata import entry_points
before, mods = fingerprint(), set(sys.modules)
plugins.load_plugins()
after = fingerprint()
out({"phase": "off", "changed": sorted(k for k in before if before[k] != after[k]),
     "kvwire_modules": sorted(m for m in set(sys.modules) - mods if m.startswith("kvwire")),
     "entry_point": [e.value for e in entry_points(group="sglang.srt.plugins")
                     if e.name == "kvwire"]})

lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("sglang").addHandler(Keep())
plugins._plugins_loaded = False  # phase 1 changed nothing: as fresh as a new process
ns = {"__name__": "__main__"}
exec(sys.argv[1], ns)  # the docs example: sets KVWIRE_SGLANG_EVENTS, loads, creates `pub`
pub = ns["pub"]
import sglang.srt.disaggregation.kv_events as k
cls = k.EventPublisherFactory._registry["zmq"]
out({"phase": "on", "registry": f"{cls.__module__}.{cls.__qualname__}",
     "type": type(pub).__name__, "lines": lines, "source": pub.describe_local_source(16)})

sys.path.insert(0, sys.argv[2])
from test_engines_sglang import sglang_batches
n = 0
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "pub":
        for b in sglang_batches(k, cmd["n"], seed=n):
            pub.publish(b)
        n += cmd["n"]
        out({"published": n})
    elif cmd["op"] == "quit":
        out({"report": repr(pub.shutdown())})
        break
'''


def sglang_batches(k: Any, n: int, seed: int = 0) -> list[Any]:
    """``n`` batches of SGLang's own event classes, every field of 0.5.23's events used
    (signed 64-bit hashes as SGLang's namespacing makes them). Deterministic per seed."""
    rng = random.Random(seed)
    out, live = [], []
    for i in range(n):
        events: list[Any] = []
        if i % 40 == 39:
            events.append(k.AllBlocksCleared())
            live.clear()
        nb = rng.randint(1, 3)
        hashes = [rng.randrange(-(1 << 63), 1 << 63) for _ in range(nb)]
        events.append(k.BlockStored(
            block_hashes=hashes, parent_block_hash=live[-1] if live and rng.random() < 0.5
            else None, token_ids=[rng.randrange(1 << 17) for _ in range(2 * nb)], block_size=2,
            lora_id=rng.choice([None, 3]), medium=rng.choice(["GPU", "CPU_PINNED", None]),
            cache_salt=rng.choice([None, "salt"]), session_id=rng.choice([None, "s"]),
            lora_name=rng.choice([None, "adapter"])))
        live.extend(hashes)
        if len(live) > 4 and rng.random() < 0.4:
            gone = [live.pop(rng.randrange(len(live))) for _ in range(rng.randint(1, 2))]
            events.append(k.BlockRemoved(block_hashes=gone, medium=rng.choice(["GPU", None])))
        out.append(k.KVEventBatch(ts=2000.0 + i, events=events))
    return out


def summary(ev: Any) -> tuple[Any, ...]:
    kind = type(ev).__name__
    if kind == "BlockStored":
        return (kind, list(ev.block_hashes), ev.parent_block_hash, list(ev.token_ids),
                ev.block_size, ev.lora_id)
    if kind == "BlockRemoved":
        return (kind, list(ev.block_hashes))
    return (kind,)


def until_snapshot(sub: Subscriber) -> Snapshot:
    deadline = time.monotonic() + TIMEOUT
    while True:
        assert time.monotonic() < deadline, "no snapshot"
        item = sub.poll(TIMEOUT)
        assert item is not None, "no snapshot"
        if isinstance(item, Snapshot):
            return item


def nonempty(replayed: dict[int, bytes], strict: Any) -> list[int]:
    """Seqs of real batches (kvwire adds empty heartbeat batches when idle)."""
    return sorted(s for s, p in replayed.items() if strict.decode(p).events)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Child, str, str]]:
    """The child that loads the plugins as SGLang does; started before SGLang is imported here."""
    if importlib.util.find_spec("sglang") is None:  # (cheap: no import)
        import_or_skip("sglang", WHEEL)
    d = tmp_path_factory.mktemp("sglang-child")
    ep, rep = f"ipc://{d}/live", f"ipc://{d}/replay"
    [doc] = docs_blocks("test_engines_sglang")
    doc = doc.replace("tcp://*:5557", ep).replace("tcp://*:5558", rep)
    c = Child(CHILD, [doc, str(Path(__file__).parent)], engine_env(), d)
    yield c, ep, rep
    c.close()


@pytest.fixture(scope="module")
def k(child: Any) -> Any:
    return import_or_skip("sglang.srt.disaggregation.kv_events", WHEEL)


@pytest.fixture
def plugin_on(k: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    monkeypatch.setenv("KVWIRE_SGLANG_EVENTS", "1")
    plugin.register()
    yield k.EventPublisherFactory._registry["zmq"]
    plugin.uninstall_events()
    assert k.EventPublisherFactory._registry["zmq"] is k.ZmqEventPublisher


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def made() -> Iterator[list[Any]]:
    pubs: list[Any] = []
    yield pubs
    for p in pubs:
        p.shutdown()


def free_ports(n: int, spare: int = 0) -> list[int]:
    from socket import socket as pysock

    out = []
    for _ in range(n):
        with pysock() as s:
            s.bind(("127.0.0.1", 0))
            out.append(s.getsockname()[1] - spare)
    return out


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
    subs = [sub_socket(ctx, eps[w][0]) for w in ("sglang", "kvwire")]
    sent: list[Any] = []

    def publish_same(batches: list[Any]) -> None:
        for b in batches:  # each its own copy: both fill attn_dp_rank in place
            theirs.publish(copy.deepcopy(b))
            ours.publish(copy.deepcopy(b))
        sent.extend(batches)

    warm = iter(sglang_batches(k, 400, seed=99))
    warm_up(subs, lambda: publish_same([next(warm)]))
    strict = msgspec.msgpack.Decoder(k.KVEventBatch)
    with Subscriber([StreamSpec("sglang", eps["kvwire"][0], "kv", eps["kvwire"][1])],
                    ctx=ctx) as sub:
        until_snapshot(sub)
        publish_same(sglang_batches(k, 120, seed=1))
        replays: list[dict[int, bytes]] = []

        def all_replayed() -> bool:
            replays[:] = [replay_all(ctx, eps[w][1]) for w in ("sglang", "kvwire")]
            return all(len(nonempty(r, strict)) == len(sent) for r in replays)

        wait_for(all_replayed, "both replay buffers to hold every batch")
        seqs = nonempty(replays[1], strict)
        assert sorted(replays[0]) == list(range(len(sent)))
        assert [replays[1][s] for s in seqs] == [replays[0][s] for s in range(len(sent))]
        for i, seq in enumerate(seqs):
            want = copy.deepcopy(sent[i])
            want.attn_dp_rank = 0
            assert replays[1][seq] == msgspec.msgpack.encode(want), seq
            assert strict.decode(replays[1][seq]) == want, seq
        for s, r, last in zip(subs, replays, (len(sent) - 1, seqs[-1])):
            live = collect(s, last)
            assert all(live[q] == r[q] for q in live)
            assert sorted(live) == list(range(min(live), last + 1))
        got: dict[int, Any] = {}
        deadline = time.monotonic() + TIMEOUT
        while seqs[-1] not in got:
            assert time.monotonic() < deadline, f"Subscriber stalled at {sorted(got)[-1:]}"
            item = sub.poll(TIMEOUT)
            assert item is not None, f"Subscriber stalled at {sorted(got)[-1:]}"
            if isinstance(item, Batch) and item.batch.events:
                got[item.seq] = item.batch
        first = seqs.index(min(got))
        assert sorted(got) == seqs[first:] and len(got) >= 120
        for i, q in enumerate(seqs[first:], first):
            assert [summary(e) for e in got[q].events] == [summary(e) for e in sent[i].events]
            assert got[q].data_parallel_rank == 0  # attn_dp_rank, at the same place
        assert sub.stats()["sglang"].stream.mode == "kvwire"
    with Subscriber([StreamSpec("late", eps["kvwire"][0], "kv", eps["kvwire"][1])],
                    ctx=ctx) as late:
        snap = until_snapshot(late)
        assert snap.exact and snap.seq >= seqs[-1]
    st = ours.stats()
    assert (st.encode_errors, st.model_unknown_events, st.snapshot_exact) == (0, 0, True)


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
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    h = Keep(logging.WARNING)
    plugin.log.addHandler(h)
    try:
        for i in range(2):
            made.append(plugin_on(attn_dp_rank=0, endpoint=f"ipc://{tmp_path}/u{i}",
                                  future_sg_knob="x"))
    finally:
        plugin.log.removeHandler(h)
    hits = [r for r in records if "future_sg_knob='x'" in r]
    assert len(hits) == 1 and "ignored" in hits[0], records


def test_off_register_changes_nothing_here(k, monkeypatch) -> None:
    monkeypatch.setenv("KVWIRE_SGLANG_EVENTS", "0")
    registry, mods = dict(k.EventPublisherFactory._registry), set(sys.modules)
    plugin.register()
    assert k.EventPublisherFactory._registry == registry and set(sys.modules) == mods


def test_off_in_a_fresh_sglang_process(child) -> None:
    c, _, _ = child
    off = c.read()
    assert off["phase"] == "off"
    assert off["entry_point"] == ["kvwire.engines.sglang:register"]
    assert off["changed"] == [], off
    assert off["kvwire_modules"] == ["kvwire", "kvwire.engines", "kvwire.engines.sglang"]


def test_loaded_by_sglang_publishes_to_subscriber_and_decoder(child, k, ctx) -> None:
    c, ep, rep = child
    on = c.read()
    while on.get("phase") != "on":
        on = c.read()
    assert on["registry"] == "kvwire.engines.sglang.KvwireSglangPublisher", on
    active = [ln for ln in on["lines"] if "active in SGLang" in ln]
    assert len(active) == 1 and "KVWIRE_SGLANG_EVENTS=1" in active[0], on["lines"]
    assert on["source"]["endpoint"] == ep and on["source"]["replay_endpoint"] == rep
    with Subscriber([StreamSpec("sglang", ep, replay_endpoint=rep)], ctx=ctx) as sub:
        until_snapshot(sub)
        n = c.ask({"op": "pub", "n": 20})["published"]
        got: dict[int, Any] = {}
        while len(got) < n:
            item = sub.poll(TIMEOUT)
            assert item is not None, f"Subscriber got {len(got)} of {n}"
            if isinstance(item, Batch) and item.batch.events:
                got[item.seq] = item.batch
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
