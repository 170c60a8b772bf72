"""kvwire inside vLLM 0.33.0 (issue 11): the plugin, with vLLM's own code and real sockets.

vLLM is imported once in this process (about 10 s of CPU) and once in one child that loads
the plugins as vLLM does (``vllm.plugins.load_general_plugins()``): first with every switch
off, checking that nothing of vLLM changed, then with the switches on (the docs example),
publishing on command to this process's Subscriber, strict vLLM decoder and ``kvwire
listen``. The child starts first so the two imports overlap.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import random
import subprocess
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
from kvwire.engines import vllm as plugin

WHEEL = "vllm (vllm==0.33.0)"

CHILD = r'''
import faulthandler, json, logging, os, sys, threading
faulthandler.dump_traceback_later(280, exit=True)  # a stuck child says where, then ends

def out(obj):
    print(json.dumps(obj), flush=True)

def fingerprint():
    import vllm.config.kv_events as c
    import vllm.distributed.kv_events as k
    name = lambda v: f"{getattr(v, '__module__', '?')}.{getattr(v, '__qualname__', v)}"
    return {
        "registry": {n: name(v) for n, v in k.EventPublisherFactory._registry.items()},
        "kv_events": {n: id(v) for n, v in vars(k).items()},
        "config": {n: id(v) for n, v in vars(c).items()},
        "factory": {n: id(v) for n, v in vars(k.EventPublisherFactory).items()},
        "zmq_publisher": {n: id(v) for n, v in vars(k.ZmqEventPublisher).items()},
        "KVEventsConfig": {n: id(v) for n, v in vars(c.KVEventsConfig).items()},
        "env": sorted(os.environ),
        "threads": sorted(t.name for t in threading.enumerate()),
        "loggers": sorted(logging.Logger.manager.loggerDict),
    }

# Phase 1: every switch off. A run without kvwire is the state before the plugins load.
import vllm.plugins
from importlib.metadata import entry_points
before, mods = fingerprint(), set(sys.modules)
vllm.plugins.load_general_plugins()
after = fingerprint()
new_loggers = sorted(set(after.pop("loggers")) - set(before.pop("loggers")))
changed = sorted(k for k in before if before[k] != after[k])
changed += [f"logger {n}" for n in new_loggers if "kvwire" in n]
out({"phase": "off", "changed": changed,
     "kvwire_modules": sorted(m for m in set(sys.modules) - mods if m.startswith("kvwire")),
     "entry_point": [e.value for e in entry_points(group="vllm.general_plugins")
                     if e.name == "kvwire"]})

# Phase 2: the switches on, and the docs example, as a process of `vllm serve` would run
# it. (Phase 1 changed nothing, so this process is as fresh as a new one; vLLM loads its
# plugins once per process, hence the flag.)
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())  # what `vllm serve` does: vLLM's log handler
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("vllm").addHandler(Keep())
vllm.plugins.plugins_loaded = False
ns = {"__name__": "__main__"}
exec(sys.argv[1], ns)  # the docs example: sets KVWIRE_VLLM_EVENTS, loads, creates `pub`
pub = ns["pub"]
import vllm.distributed.kv_events as k
out({"phase": "on", "registry": f"{k.EventPublisherFactory._registry['zmq'].__module__}."
     f"{k.EventPublisherFactory._registry['zmq'].__qualname__}", "type": type(pub).__name__,
     "config": repr(pub.get_publisher_config()), "lines": lines})

sys.path.insert(0, sys.argv[2])
from test_engines_vllm import vllm_batches
n = 0
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "pub":
        for b in vllm_batches(k, cmd["n"], seed=n):
            pub.publish(b)
        n += cmd["n"]
        out({"published": n})
    elif cmd["op"] == "quit":
        out({"report": repr(pub.shutdown())})
        break
'''


def vllm_batches(k: Any, n: int, seed: int = 0) -> list[Any]:
    """``n`` batches of vLLM's own event classes using every field of 0.33.0's events:
    int and bytes hashes, chains, LoRA, extra keys, groups, spec kinds, lookahead tokens,
    removals of earlier blocks and an occasional full clear. Deterministic per seed."""
    rng = random.Random(seed)
    out, live = [], []
    for i in range(n):
        events: list[Any] = []
        if i % 40 == 39:
            events.append(k.AllBlocksCleared())
            live.clear()
        nb = rng.randint(1, 3)
        hashes = [rng.getrandbits(64) if rng.random() < 0.7 else rng.randbytes(32)
                  for _ in range(nb)]
        lora = rng.random() < 0.3
        events.append(k.BlockStored(
            block_hashes=hashes, parent_block_hash=live[-1] if live and rng.random() < 0.5
            else None, token_ids=[rng.randrange(1 << 17) for _ in range(4 * nb)],
            block_size=4, lora_id=7 if lora else None, medium=rng.choice(["GPU", None]),
            lora_name="adapter" if lora else None,
            extra_keys=[("adapter", ("mm", "img", 3)) if lora else None for _ in hashes]
            if rng.random() < 0.3 else None,
            group_idx=rng.choice([None, 0, 1]), kv_cache_spec_kind=rng.choice([None, "full"]),
            kv_cache_spec_sliding_window=rng.choice([None, 128]),
            locality=rng.choice([None, "LOCAL"]), ownership=None,
            session_id=rng.choice([None, "s1"]),
            lookahead_token_ids=[[1, 2]] * nb if rng.random() < 0.2 else None))
        live.extend(hashes)
        if len(live) > 4 and rng.random() < 0.4:
            gone = [live.pop(rng.randrange(len(live))) for _ in range(rng.randint(1, 2))]
            events.append(k.BlockRemoved(block_hashes=gone, medium=rng.choice(["GPU", None]),
                                         group_idx=rng.choice([None, 1])))
        out.append(k.KVEventBatch(ts=1000.0 + i, events=events))
    return out


def live_hashes(batches: list[Any]) -> set[Any]:
    """The blocks the batches leave cached (vLLM's hashes; media all GPU or unset)."""
    live: set[Any] = set()
    for b in batches:
        for ev in b.events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                live.clear()
            elif kind == "BlockStored":
                live.update(ev.block_hashes)
            else:
                live.difference_update(ev.block_hashes)
    return live


def summary(ev: Any) -> tuple[Any, ...]:
    """What kvwire's Subscriber decodes of an event (it keeps the fields it knows)."""
    kind = type(ev).__name__
    if kind == "BlockStored":
        return (kind, list(ev.block_hashes), ev.parent_block_hash, list(ev.token_ids),
                ev.block_size, ev.lora_id, ev.medium)
    if kind == "BlockRemoved":
        return (kind, list(ev.block_hashes), ev.medium)
    return (kind,)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Child, str, str]]:
    """The child that loads the plugins as vLLM does; started before vLLM is imported here."""
    if importlib.util.find_spec("vllm") is None:  # (cheap: no import)
        import_or_skip("vllm", WHEEL)
    d = tmp_path_factory.mktemp("vllm-child")
    ep, rep = f"ipc://{d}/live", f"ipc://{d}/replay"
    [doc] = docs_blocks("test_engines_vllm")
    doc = doc.replace("tcp://*:5557", ep).replace("tcp://*:5558", rep)
    c = Child(CHILD, [doc, str(Path(__file__).parent)], engine_env(), d)
    yield c, ep, rep
    c.close()


@pytest.fixture(scope="module")
def k(child: Any) -> Any:
    """vLLM's kv_events module (imported while the child imports its own)."""
    return import_or_skip("vllm.distributed.kv_events", WHEEL)


@pytest.fixture(scope="module")
def vllm_config(k: Any) -> Any:
    return import_or_skip("vllm.config.kv_events", WHEEL).KVEventsConfig


@pytest.fixture
def plugin_on(k: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    monkeypatch.setenv("KVWIRE_VLLM_EVENTS", "1")
    monkeypatch.delenv("KVWIRE_VLLM_SHM", raising=False)
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


def ipc(tmp_path: Path, name: str) -> str:
    return f"ipc://{tmp_path}/{name}-{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------- plugin on


def test_factory_builds_kvwire_publisher_from_vllms_config(plugin_on, k, vllm_config, made,
                                                           tmp_path) -> None:
    cfg = vllm_config(enable_kv_cache_events=True, endpoint=ipc(tmp_path, "l"),
                      replay_endpoint=ipc(tmp_path, "r"), buffer_steps=500, hwm=1000,
                      max_queue_size=2000, topic="kv")
    pub = k.EventPublisherFactory.create(cfg, 0)
    made.append(pub)
    assert type(pub) is plugin_on and type(pub).__module__ == "kvwire.engines.vllm"
    assert isinstance(pub, k.EventPublisher)  # what vLLM's scheduler holds
    got = pub.get_publisher_config()
    assert type(got) is vllm_config and got == cfg  # resolved, as vLLM's own returns it
    st = pub.stats()  # kvwire's: the replay ring, queue bound and topic from vLLM's keys
    assert (pub._buffer_steps, pub._max_queue, pub._topic) == (500, 2000, "kv")
    assert st.sent == 0 and st.sender_alive
    # Events off or "null": vLLM's own null publisher, untouched by the plugin.
    assert type(k.EventPublisherFactory.create(vllm_config(), 0)) is k.NullEventPublisher


def test_same_bytes_as_vllms_own_publisher(plugin_on, k, vllm_config, made, ctx,
                                           tmp_path) -> None:
    """Both publishers get the same vLLM objects: every live and replayed payload is
    byte-identical, a strict decoder of vLLM's classes reads all of them, and kvwire's
    Subscriber receives every batch (and a snapshot of what they left cached)."""
    eps = {}
    for who in ("vllm", "kvwire"):
        cfg = vllm_config(enable_kv_cache_events=True, endpoint=ipc(tmp_path, who),
                          replay_endpoint=ipc(tmp_path, who + "-r"))
        pub = (k.ZmqEventPublisher(0, **{f: getattr(cfg, f) for f in plugin.KNOWN_KEYS})
               if who == "vllm" else k.EventPublisherFactory.create(cfg, 0))
        made.append(pub)
        eps[who] = (pub, cfg.endpoint, cfg.replay_endpoint)
    assert type(eps["kvwire"][0]) is plugin_on
    pubs = [eps["vllm"][0], eps["kvwire"][0]]
    subs = [sub_socket(ctx, eps[w][1]) for w in ("vllm", "kvwire")]
    sent: list[Any] = []

    def publish_same(batches: list[Any]) -> None:
        for b in batches:  # each publisher its own copy: vLLM's fills the rank in place
            for p in pubs:
                p.publish(copy.deepcopy(b))
        sent.extend(batches)

    warm = iter(vllm_batches(k, 400, seed=99))
    warm_up(subs, lambda: publish_same([next(warm)]))
    kw_sub = Subscriber([StreamSpec("vllm", eps["kvwire"][1], replay_endpoint=eps["kvwire"][2])],
                        ctx=ctx)
    strict = msgspec.msgpack.Decoder(k.KVEventBatch)
    try:
        snaps = [until_snapshot(kw_sub)]  # joined (INFO, SNAPSHOT) before the batches
        publish_same(vllm_batches(k, 150, seed=1))
        replays: list[dict[int, bytes]] = []

        def all_replayed() -> bool:
            replays[:] = [replay_all(ctx, eps[w][2]) for w in ("vllm", "kvwire")]
            return all(len(batches_of(r, strict)) == len(sent) for r in replays)

        wait_for(all_replayed, "both replay buffers to hold every batch")
        ours = batches_of(replays[1], strict)  # kvwire's seqs also count its heartbeats
        assert sorted(replays[0]) == list(range(len(sent)))
        assert [replays[1][s] for s in ours] == [replays[0][s] for s in range(len(sent))]
        for i, seq in enumerate(ours):  # vLLM's bytes and objects, with the publisher's rank
            want = copy.deepcopy(sent[i])
            want.data_parallel_rank = 0
            assert replays[1][seq] == msgspec.msgpack.encode(want), seq
            # (nested tuples in extra_keys come back as lists, from vLLM's bytes too)
            assert strict.decode(replays[1][seq]) == strict.decode(replays[0][i]), seq
        for s, r, last in zip(subs, replays, (len(sent) - 1, ours[-1])):
            live = collect(s, last)  # live bytes are the replayed bytes, without gaps
            assert all(live[q] == r[q] for q in live)
            assert sorted(live) == list(range(min(live), last + 1))
            assert min(live) <= (ours[-150] if r is replays[1] else len(sent) - 150)
        # kvwire's Subscriber: every batch once, in order, after its snapshot.
        got: dict[int, Any] = {}
        deadline = time.monotonic() + TIMEOUT
        while ours[-1] not in got:
            assert time.monotonic() < deadline, f"Subscriber stalled at {sorted(got)[-1:]}"
            item = kw_sub.poll(TIMEOUT)
            assert item is not None, f"Subscriber stalled at {sorted(got)[-1:]}"
            if isinstance(item, Snapshot):
                snaps.append(item)
            elif isinstance(item, Batch) and item.batch.events:
                assert item.seq not in got
                got[item.seq] = item.batch
        assert snaps and snaps[0].exact
        assert sorted(got) == [q for q in ours if q > snaps[0].seq]
        index = {q: i for i, q in enumerate(ours)}
        for seq, batch in got.items():
            want_events = sent[index[seq]].events
            assert [summary(e) for e in batch.events] == [summary(e) for e in want_events]
        assert kw_sub.stats()["vllm"].stream.mode == "kvwire"
    finally:
        kw_sub.close()
    # A late joiner's snapshot holds exactly what vLLM's events left cached.
    with Subscriber([StreamSpec("late", eps["kvwire"][1], replay_endpoint=eps["kvwire"][2])],
                    ctx=ctx) as late:
        item = until_snapshot(late)
        assert item.exact and item.seq >= ours[-1]
        cached = {h for ev in item.blocks for h in ev.block_hashes}
        assert cached == live_hashes(sent) and cached
    st = eps["kvwire"][0].stats()
    assert (st.encode_errors, st.model_unknown_events, st.snapshot_exact) == (0, 0, True)


def until_snapshot(sub: Subscriber) -> Snapshot:
    deadline = time.monotonic() + TIMEOUT
    while True:
        assert time.monotonic() < deadline, "no snapshot"
        item = sub.poll(TIMEOUT)
        assert item is not None, "no snapshot"
        if isinstance(item, Snapshot):
            return item


def batches_of(replayed: dict[int, bytes], strict: Any) -> list[int]:
    """Seqs of the non-empty batches (kvwire adds empty heartbeat batches when idle,
    which vLLM's strict decoder reads as empty ``KVEventBatch``es)."""
    return sorted(s for s, p in replayed.items() if strict.decode(p).events)


vllm_hash = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=32, max_size=32))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_vllm_event_encodes_as_vllm_encodes_it(plugin_on, k, vllm_config, made, tmp_path,
                                                   data) -> None:
    """Property: whatever vLLM 0.33 puts in its events, kvwire's sender produces vLLM's bytes."""
    if not made:
        made.append(k.EventPublisherFactory.create(
            # rank 3 (an ipc path cannot move per rank); connects, nobody listens
            vllm_config(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:9"), 3))
    pub = made[0]
    opt_s = st.one_of(st.none(), st.text(max_size=6))
    stored = st.builds(
        k.BlockStored, block_hashes=st.lists(vllm_hash, max_size=3),
        parent_block_hash=st.one_of(st.none(), vllm_hash),
        token_ids=st.lists(st.integers(0, 2**31), max_size=8), block_size=st.integers(1, 64),
        lora_id=st.one_of(st.none(), st.integers(0, 99)), medium=opt_s, lora_name=opt_s,
        extra_keys=st.one_of(st.none(), st.lists(st.one_of(st.none(), st.tuples(st.text(
            max_size=4), st.integers())), max_size=3)),
        group_idx=st.one_of(st.none(), st.integers(0, 9)), kv_cache_spec_kind=opt_s,
        kv_cache_spec_sliding_window=st.one_of(st.none(), st.integers(1, 4096)),
        locality=opt_s, ownership=opt_s, session_id=opt_s,
        lookahead_token_ids=st.one_of(st.none(), st.lists(st.lists(st.integers(0, 99),
                                                                    max_size=2), max_size=2)))
    removed = st.builds(k.BlockRemoved, block_hashes=st.lists(vllm_hash, max_size=3),
                        medium=opt_s, group_idx=st.one_of(st.none(), st.integers(0, 9)),
                        locality=opt_s, ownership=opt_s)
    events = data.draw(st.lists(st.one_of(stored, removed, st.just(k.AllBlocksCleared())),
                                max_size=4))
    rank = data.draw(st.one_of(st.none(), st.integers(0, 7)))
    batch = k.KVEventBatch(ts=data.draw(st.floats(allow_nan=False)), events=events,
                           data_parallel_rank=rank)
    want = copy.deepcopy(batch)
    if want.data_parallel_rank is None:
        want.data_parallel_rank = 3  # what vLLM's publish() fills in
    try:
        vllms = msgspec.msgpack.Encoder().encode(want)
    except OverflowError:  # vLLM's encoder refuses it; kvwire skips that seq, counted
        errors = pub.stats().encode_errors
        assert pub._encode(0, batch) is None and pub.stats().encode_errors == errors + 1
        return
    assert pub._encode(0, batch) == vllms


def test_rank_offsets_and_binding_as_vllm(plugin_on, k, vllm_config, made, ctx) -> None:
    """DP rank 2: the live endpoint (a concrete host: connect) and the replay endpoint
    (always bound) move by the rank, as vLLM's do; batches carry rank 2."""
    from socket import socket as pysock

    ports = []
    for _ in range(2):
        with pysock() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1] - 2)
    cfg = vllm_config(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{ports[0]}",
                      replay_endpoint=f"tcp://127.0.0.1:{ports[1]}")
    collector = sub_socket(ctx, f"tcp://127.0.0.1:{ports[0] + 2}", bind=True)
    pub = k.EventPublisherFactory.create(cfg, 2)
    made.append(pub)
    want = vllm_config(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{ports[0] + 2}",
                       replay_endpoint=f"tcp://127.0.0.1:{ports[1] + 2}")
    assert pub.get_publisher_config() == want
    assert k.ZmqEventPublisher.offset_endpoint_port(cfg.endpoint, 2) == want.endpoint
    batches = iter(vllm_batches(k, 200, seed=5))
    warm_up([collector], lambda: pub.publish(next(batches)))
    replayed = replay_all(ctx, want.replay_endpoint)
    assert replayed and all(msgspec.msgpack.decode(p)[2] == 2 for p in replayed.values())
    # ipc:// cannot move per rank: refused with the endpoint named, as vLLM refuses it.
    bad = vllm_config(enable_kv_cache_events=True, endpoint="ipc:///tmp/kvwire-x")
    with pytest.raises(ValueError, match=r"ipc:///tmp/kvwire-x.*rank 1"):
        k.EventPublisherFactory.create(bad, 1)
    with pytest.raises(ValueError):
        k.ZmqEventPublisher.offset_endpoint_port(bad.endpoint, 1)


def test_unknown_config_keys_warned_once_and_ignored(plugin_on, k, made, tmp_path) -> None:
    """A newer vLLM's KVEventsConfig may carry keys kvwire does not know: one warning."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("vllm.kvwire")
    h = Keep(logging.WARNING)
    log.addHandler(h)
    try:
        for _ in range(2):
            made.append(plugin_on(data_parallel_rank=0, endpoint=ipc(tmp_path, "u"),
                                  future_knob_xyz=3))
    finally:
        log.removeHandler(h)
    hits = [r for r in records if "future_knob_xyz=3" in r]
    assert len(hits) == 1 and "ignored" in hits[0], records
    assert made[-1].stats().sender_alive


def test_kvwire_options_from_the_environment(plugin_on, k, vllm_config, made, tmp_path,
                                             monkeypatch) -> None:
    """What vLLM's config cannot carry (heartbeats, snapshots, CurveZMQ) comes from
    KVWIRE_PUBLISHER_OPTIONS; a bad one stops the publisher with the key named."""
    cfg = vllm_config(enable_kv_cache_events=True, endpoint=ipc(tmp_path, "o"))
    monkeypatch.setenv("KVWIRE_PUBLISHER_OPTIONS", '{"heartbeat_interval": null, '
                       '"snapshot": false}')
    pub = k.EventPublisherFactory.create(cfg, 0)
    made.append(pub)
    info = pub._info()  # what an INFO request answers
    assert (info["heartbeat_interval"], info["snapshot"]) == (None, False)
    for bad, words in (('{"heartbeat": 2}', "heartbeat"),
                       ('{"heartbeat_interval": 0}', "heartbeat_interval"),
                       ('{"curve_authorized_keys_dir": "/x"}', "curve_secret_key_file"),
                       ("[1]", "JSON object")):
        monkeypatch.setenv("KVWIRE_PUBLISHER_OPTIONS", bad)
        with pytest.raises(ValueError, match=f"KVWIRE_PUBLISHER_OPTIONS.*{words}"):
            k.EventPublisherFactory.create(cfg, 0)


def test_after_shutdown_publish_raises_like_vllm(plugin_on, k, vllm_config, tmp_path) -> None:
    pub = k.EventPublisherFactory.create(
        vllm_config(enable_kv_cache_events=True, endpoint=ipc(tmp_path, "s")), 0)
    pub.publish(vllm_batches(k, 1)[0])
    assert pub.shutdown() is not None  # flushed: kvwire's report (vLLM ignores it)
    with pytest.raises(RuntimeError):
        pub.publish(vllm_batches(k, 1)[0])
    pub.shutdown()  # idempotent, as vLLM's scheduler may call it again


# --------------------------------------------------------------------------- plugin off


def test_off_register_changes_nothing_here(k, monkeypatch) -> None:
    for name in ("KVWIRE_VLLM_EVENTS", "KVWIRE_VLLM_SHM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVWIRE_VLLM_SHM", "0")
    registry = dict(k.EventPublisherFactory._registry)
    mods = set(sys.modules)
    plugin.register()
    assert k.EventPublisherFactory._registry == registry
    assert set(sys.modules) == mods


def test_off_in_a_fresh_vllm_process(child) -> None:
    """Loaded by vLLM's own loader with the switches unset: vLLM's factory registry, its
    modules' and classes' attributes, environment, threads and loggers are as before."""
    c, _, _ = child
    off = c.read()
    assert off["phase"] == "off"
    assert off["entry_point"] == ["kvwire.engines.vllm:register"]  # it was loaded
    assert off["changed"] == [], off
    assert off["kvwire_modules"] == ["kvwire", "kvwire.engines", "kvwire.engines.vllm"]


# --------------------------------------------------------------------------- loaded by vLLM


def test_loaded_by_vllm_publishes_to_subscriber_decoder_and_listen(child, k, ctx) -> None:
    """The docs example in a vLLM process: the log line, kvwire's class in vLLM's factory;
    then batches reach kvwire's Subscriber, a strict vLLM decoder (via vLLM's replay
    protocol) and ``kvwire listen``, which reports mode kvwire."""
    c, ep, rep = child
    on = c.read()
    while on.get("phase") != "on":  # the off phase's line when that test did not run
        on = c.read()
    assert on["registry"] == "kvwire.engines.vllm.KvwireVllmPublisher", on
    assert on["type"] == "KvwireVllmPublisher"
    active = [ln for ln in on["lines"] if "kvwire" in ln and "active in vLLM" in ln]
    assert len(active) == 1 and "KVWIRE_VLLM_EVENTS=1" in active[0], on["lines"]
    # (KVWIRE_VLLM_SHM through this plugin: tests/test_engines_vllm_shm.py, 4 processes)
    assert any("kvwire KV event publisher dp0" in ln for ln in on["lines"]), on["lines"]

    with Subscriber([StreamSpec("vllm", ep, replay_endpoint=rep)], ctx=ctx) as sub:
        listen = subprocess.Popen(
            [sys.executable, "-m", "kvwire", "listen", ep, "--replay", rep, "--count", "3",
             "--no-view"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            until_snapshot(sub)
            n = c.ask({"op": "pub", "n": 20})["published"]
            got: dict[int, Any] = {}
            while len(got) < n:
                item = sub.poll(TIMEOUT)
                assert item is not None, f"Subscriber got {len(got)} of {n}"
                if isinstance(item, Batch) and item.batch.events:
                    got[item.seq] = item.batch
            while listen.poll() is None:  # it counts batches from its own join on
                n = c.ask({"op": "pub", "n": 2})["published"]
                try:
                    listen.wait(0.5)
                except subprocess.TimeoutExpired:
                    pass
            out, err = listen.communicate(timeout=TIMEOUT)
        finally:
            if listen.poll() is None:
                listen.kill()
                listen.communicate()
        assert listen.returncode == 0, err
        assert "mode kvwire" in err, err
        assert sub.stats()["vllm"].stream.mode == "kvwire"
    sent = vllm_batches(k, 20, seed=0)
    firsts = sorted(got)[:20]  # kvwire's seqs also count its heartbeats (empty batches)
    assert [[summary(e) for e in got[q].events] for q in firsts] == \
        [[summary(e) for e in b.events] for b in sent]
    strict = msgspec.msgpack.Decoder(k.KVEventBatch)
    decoded = {s: strict.decode(p) for s, p in replay_all(ctx, rep).items()}
    ours = sorted(s for s, d in decoded.items() if d.events)
    assert len(ours) == n
    vllms = [strict.decode(msgspec.msgpack.encode(b)).events for b in sent]  # vLLM's bytes
    assert [decoded[q].events for q in ours[:20]] == vllms
    assert {d.data_parallel_rank for d in decoded.values()} == {0}
    report = c.ask({"op": "quit"})["report"]
    assert "unsent=0" in report, report


def test_child_stderr_has_no_traceback(child) -> None:
    """Runs last in this module: the child's errors would otherwise pass unseen."""
    c, _, _ = child
    err = c.stderr()
    assert "Traceback" not in err, err
