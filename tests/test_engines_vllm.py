"""kvwire inside vLLM 0.33.0: the plugin, with vLLM's own code and real sockets.

vLLM is imported once in this process (about 10 s of CPU) and once in one child
(tests/engine_child.py) that loads the plugins as vLLM does
(``vllm.plugins.load_general_plugins()``): first with every switch off, checking that
nothing of vLLM changed, then with the switches on (the docs example), publishing on
command to this process's Subscriber, strict vLLM decoder and ``kvwire listen``. The child
starts first so the two imports overlap.
"""

from __future__ import annotations

import copy
import logging
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from engine_helpers import (
    TIMEOUT,
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
from kvwire.plugins import vllm as plugin

WHEEL = "vllm (vllm==0.33.0)"


def vllm_batches(k: Any, n: int, seed: int = 0) -> list[Any]:
    """``n`` batches of vLLM's own event classes using every field of 0.33.0's events:
    int and bytes hashes, chains, LoRA, extra keys, groups, spec kinds, lookahead tokens,
    removals of earlier blocks and an occasional full clear. Deterministic per seed."""
    def stored(rng: random.Random, hashes: list[Any]) -> dict[str, Any]:
        lora = rng.random() < 0.3
        return dict(
            lora_id=7 if lora else None, medium=rng.choice(["GPU", None]),
            lora_name="adapter" if lora else None,
            extra_keys=[("adapter", ("mm", "img", 3)) if lora else None for _ in hashes]
            if rng.random() < 0.3 else None,
            group_idx=rng.choice([None, 0, 1]), kv_cache_spec_kind=rng.choice([None, "full"]),
            kv_cache_spec_sliding_window=rng.choice([None, 128]),
            locality=rng.choice([None, "LOCAL"]), ownership=None,
            session_id=rng.choice([None, "s1"]),
            lookahead_token_ids=[[1, 2]] * len(hashes) if rng.random() < 0.2 else None)

    return random_batches(
        k, n, seed, block_size=4, t0=1000.0, stored=stored,
        new_hash=lambda rng: rng.getrandbits(64) if rng.random() < 0.7 else rng.randbytes(32),
        removed=lambda rng: dict(medium=rng.choice(["GPU", None]),
                                 group_idx=rng.choice([None, 1])))


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
    yield from engine_child("vllm", WHEEL, tmp_path_factory)


@pytest.fixture(scope="module")
def k(child: Any) -> Any:
    """vLLM's kv_events module (imported while the child imports its own)."""
    return import_or_skip("vllm.distributed.kv_events", WHEEL)


@pytest.fixture(scope="module")
def vllm_config(k: Any) -> Any:
    return import_or_skip("vllm.config.kv_events", WHEEL).KVEventsConfig


@pytest.fixture
def plugin_on(k: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    yield from plugin_switched_on(plugin, k, "KVWIRE_VLLM_EVENTS", monkeypatch)


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
    assert type(pub) is plugin_on and type(pub).__module__ == "kvwire.plugins.vllm"
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
    Subscriber receives every batch (and a late joiner's snapshot holds exactly what
    vLLM's events left cached)."""
    eps = {}
    for who in ("vllm", "kvwire"):
        cfg = vllm_config(enable_kv_cache_events=True, endpoint=ipc(tmp_path, who),
                          replay_endpoint=ipc(tmp_path, who + "-r"))
        pub = (k.ZmqEventPublisher(0, **{f: getattr(cfg, f) for f in plugin.KNOWN_KEYS})
               if who == "vllm" else k.EventPublisherFactory.create(cfg, 0))
        made.append(pub)
        eps[who] = (pub, cfg.endpoint, cfg.replay_endpoint)
    assert type(eps["kvwire"][0]) is plugin_on
    sent, late = check_same_bytes(ctx, k, eps["vllm"], eps["kvwire"], batches=vllm_batches,
                                  summary=summary, rank_field="data_parallel_rank", n=150)
    cached = {h for ev in late.blocks for h in ev.block_hashes}
    assert cached == live_hashes(sent) and cached


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
    ports = free_ports(2, spare=2)
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
    with log_messages(logging.getLogger("vllm.kvwire")) as records:
        for _ in range(2):
            made.append(plugin_on(data_parallel_rank=0, endpoint=ipc(tmp_path, "u"),
                                  future_knob_xyz=3))
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
    assert_register_changes_nothing(plugin, k)


def test_off_in_a_fresh_vllm_process(child) -> None:
    """Loaded by vLLM's own loader with the switches unset: vLLM's factory registry, its
    modules' and classes' attributes, environment, threads and loggers are as before."""
    assert_off_phase(child[0], "vllm")


# --------------------------------------------------------------------------- loaded by vLLM


def test_loaded_by_vllm_publishes_to_subscriber_decoder_and_listen(child, k, ctx) -> None:
    """The docs example in a vLLM process: the log line, kvwire's class in vLLM's factory;
    then batches reach kvwire's Subscriber, a strict vLLM decoder (via vLLM's replay
    protocol) and ``kvwire listen``, which reports mode kvwire."""
    c, ep, rep = child
    on = read_phase(c, "on")
    assert on["registry"] == "kvwire.plugins.vllm.KvwireVllmPublisher", on
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
            got = receive(sub, n)
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
