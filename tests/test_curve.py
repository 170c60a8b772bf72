"""CurveZMQ on live, replay and snapshot sockets: only authorised keys receive anything."""

from __future__ import annotations

import time

import pytest
import zmq

from kvwire.consume.stream import Batch, Snapshot, StreamConfig
from kvwire.consume.subscriber import StreamSpec, Subscriber
from kvwire.publish.publisher import ZmqEventPublisher
from kvwire.wire.curve import CurveClient, CurveServer, generate_keys
from kvwire.wire.events import BlockStored, KVEventBatch


@pytest.fixture
def keys(tmp_path):
    generate_keys(tmp_path / "server", "engine")
    generate_keys(tmp_path / "clients", "router")
    generate_keys(tmp_path / "strangers", "mallory")
    return tmp_path


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(time.time(), [BlockStored([i], None, [i] * 4, 4, None, "GPU")], 0)


def collect(sub: Subscriber, seconds: float) -> list:
    items, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        item = sub.poll(0.05)
        if item is not None:
            items.append(item)
    return items


def test_only_authorised_clients_receive(keys) -> None:
    server = CurveServer(secret_key_file=str(keys / "server/engine.key_secret"),
                         authorized_keys_dir=str(keys / "clients"))
    pub = ZmqEventPublisher(endpoint="tcp://*:0", replay_endpoint="tcp://*:0",
                            heartbeat_interval=0.1, curve=server)
    for i in range(5):
        pub.publish(batch(i))

    def client(secret: str) -> CurveClient:
        return CurveClient(secret_key_file=str(keys / secret),
                           server_public_key_file=str(keys / "server/engine.key"))

    cfg = StreamConfig(info_timeout=0.5)
    subs = {
        "router": Subscriber([StreamSpec("e", pub.endpoint, "", pub.replay_endpoint,
                                         client("clients/router.key_secret"))], config=cfg),
        "mallory": Subscriber([StreamSpec("e", pub.endpoint, "", pub.replay_endpoint,
                                          client("strangers/mallory.key_secret"))], config=cfg),
        "plain": Subscriber([StreamSpec("e", pub.endpoint, "", pub.replay_endpoint)], config=cfg),
    }
    try:
        got = {name: collect(sub, 2.0) for name, sub in subs.items()}
    finally:
        for sub in subs.values():
            sub.close()
        pub.shutdown(timeout=1)
    snaps = [i for i in got["router"] if isinstance(i, Snapshot)]
    assert snaps and snaps[0].exact and snaps[0].block_count == 5  # snapshot socket works
    assert any(isinstance(i, Batch) for i in got["router"])  # live works
    for stranger in ("mallory", "plain"):
        assert not [i for i in got[stranger] if isinstance(i, Batch)]
        assert not [i for i in got[stranger] if isinstance(i, Snapshot) and i.blocks]


def test_bad_key_files_are_clear_errors(keys, tmp_path) -> None:
    with pytest.raises(ValueError, match="no secret key"):
        ZmqEventPublisher(endpoint="tcp://*:0", curve=CurveServer(
            secret_key_file=str(keys / "server/engine.key")))  # the public half
    with pytest.raises(ValueError, match="cannot read CURVE key file"):
        CurveClient(secret_key_file=str(tmp_path / "missing"),
                    server_public_key_file=str(keys / "server/engine.key")).apply(
            zmq.Context.instance().socket(zmq.SUB))
    with pytest.raises(ValueError, match="not a directory"):
        ZmqEventPublisher(endpoint="tcp://*:0", curve=CurveServer(
            secret_key_file=str(keys / "server/engine.key_secret"),
            authorized_keys_dir=str(tmp_path / "nope")))


def test_curve_suppresses_the_exposure_warning(keys, caplog) -> None:
    server = CurveServer(secret_key_file=str(keys / "server/engine.key_secret"))
    with caplog.at_level("WARNING", logger="kvwire.publisher"):
        pub = ZmqEventPublisher(endpoint="tcp://*:0", heartbeat_interval=None, curve=server)
    pub.shutdown(timeout=1)
    assert not [r for r in caplog.records if "all interfaces" in r.getMessage()]
