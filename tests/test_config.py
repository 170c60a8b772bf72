"""``--kv-events-config``: defaults (spec section 4) and strict, helpful validation."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvwire.publish.config import KVEventsConfig


def test_defaults_per_spec() -> None:
    c = KVEventsConfig()
    assert c.enable_kv_cache_events is False
    assert c.publisher == "null"  # disabled -> null
    assert c.endpoint == "tcp://*:5557"
    assert c.replay_endpoint is None
    assert c.buffer_steps == 10_000
    assert c.hwm == 100_000
    assert c.max_queue_size == 100_000
    assert c.topic == ""
    # kvwire additions
    assert c.dialect == "vllm"
    assert c.heartbeat_interval == 1.0


def test_publisher_defaults_to_zmq_when_enabled() -> None:
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert KVEventsConfig.from_cli('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert KVEventsConfig.from_cli("{}") == KVEventsConfig()
    # an explicit choice is kept
    assert KVEventsConfig(enable_kv_cache_events=True, publisher="null").publisher == "null"


def test_from_cli_accepts_the_engines_json() -> None:
    text = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'
    )
    c = KVEventsConfig.from_cli(text)
    assert (c.enable_kv_cache_events, c.publisher, c.endpoint, c.replay_endpoint, c.topic) == (
        True, "zmq", "tcp://*:5557", "tcp://*:5558", "kv-events")
    assert (c.buffer_steps, c.hwm, c.max_queue_size) == (10_000, 100_000, 100_000)


def test_from_cli_all_fields() -> None:
    raw = {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///tmp/kv.sock",
        "replay_endpoint": "inproc://replay", "buffer_steps": 5, "hwm": 0, "max_queue_size": 7,
        "topic": "t", "dialect": "sglang", "heartbeat_interval": None,
    }
    c = KVEventsConfig.from_cli(json.dumps(raw))
    for k, v in raw.items():
        assert getattr(c, k) == v, k
    assert KVEventsConfig.from_dict(raw) == c
    # heartbeat given as a JSON int is accepted as seconds
    assert KVEventsConfig.from_cli('{"heartbeat_interval": 2}').heartbeat_interval == 2.0


@pytest.mark.parametrize(
    "raw,words",
    [
        ({"enable_kv_cache_event": True}, ["enable_kv_cache_event", "True"]),  # typo
        ({"port": 5557}, ["port", "5557"]),
        ({"buffer_steps": "10"}, ["buffer_steps", "'10'"]),
        ({"buffer_steps": 1.5}, ["buffer_steps", "1.5"]),
        ({"buffer_steps": True}, ["buffer_steps", "True"]),
        ({"enable_kv_cache_events": "yes"}, ["enable_kv_cache_events", "'yes'"]),
        ({"enable_kv_cache_events": 1}, ["enable_kv_cache_events", "1"]),
        ({"endpoint": 5557}, ["endpoint", "5557"]),
        ({"endpoint": None}, ["endpoint", "None"]),
        ({"topic": ["a"]}, ["topic", "['a']"]),
        ({"hwm": "big"}, ["hwm", "'big'"]),
        ({"heartbeat_interval": "1s"}, ["heartbeat_interval", "'1s'"]),
        ({"buffer_steps": 0}, ["buffer_steps", "0"]),
        ({"max_queue_size": -3}, ["max_queue_size", "-3"]),
        ({"hwm": -1}, ["hwm", "-1"]),
        ({"heartbeat_interval": 0}, ["heartbeat_interval", "0"]),
        ({"heartbeat_interval": -1.5}, ["heartbeat_interval", "-1.5"]),
        ({"dialect": "vllm2"}, ["dialect", "'vllm2'"]),
        ({"endpoint": "localhost:5557"}, ["endpoint", "'localhost:5557'"]),
        ({"endpoint": "udp://*:5557"}, ["endpoint", "'udp://*:5557'"]),
        ({"endpoint": "tcp://*"}, ["endpoint", "'tcp://*'"]),
        ({"endpoint": "tcp://*:http"}, ["endpoint", "'tcp://*:http'"]),
        ({"endpoint": "tcp://*:70000"}, ["endpoint", "'tcp://*:70000'"]),
        ({"endpoint": "tcp://:5557"}, ["endpoint", "'tcp://:5557'"]),
        ({"endpoint": "inproc://"}, ["endpoint", "'inproc://'"]),
        ({"replay_endpoint": "tcp://*:"}, ["replay_endpoint", "'tcp://*:'"]),
        ({"replay_endpoint": "nowhere"}, ["replay_endpoint", "'nowhere'"]),
    ],
)
def test_invalid_values_name_field_and_value(raw: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as ei:
        KVEventsConfig.from_cli(json.dumps(raw))
    msg = str(ei.value)
    for w in words:
        assert w in msg, (w, msg)
    # same through from_dict
    with pytest.raises(ValueError):
        KVEventsConfig.from_dict(raw)


@pytest.mark.parametrize("text", ["", "nope", "{'single': 'quotes'}", '{"a": 1', "[]", "null",
                                  '"zmq"', "5"])
def test_from_cli_rejects_non_objects(text: str) -> None:
    with pytest.raises(ValueError) as ei:
        KVEventsConfig.from_cli(text)
    assert "JSON" in str(ei.value) or "object" in str(ei.value)


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ValueError, match="buffer_steps"):
        KVEventsConfig(buffer_steps=0)
    with pytest.raises(ValueError, match="'tcp://host-without-port'"):
        KVEventsConfig(endpoint="tcp://host-without-port")
    with pytest.raises(ValueError, match="dialect"):
        KVEventsConfig(dialect="nope")
