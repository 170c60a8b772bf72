"""Endpoint rules (spec section 3), checked without sockets."""

from __future__ import annotations

import pytest

from kvwire.wire.endpoint import (
    EndpointError,
    binds_all_interfaces,
    check_endpoint,
    is_bind,
    offset_for_rank,
    resolve_check,
)


@pytest.mark.parametrize(
    "endpoint,bind",
    [
        ("tcp://*:5557", True),
        ("tcp://*:0", True),
        ("tcp://[::]:5557", True),
        ("tcp://[::1]:5557", True),  # the engines' literal rule: "::" anywhere binds
        ("ipc:///tmp/kv.sock", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://collector.example:5557", False),
        ("tcp://0.0.0.0:5557", False),  # no * and no :: -> connect, as in vLLM
        ("tcp://10.0.0.1:5557", False),
    ],
)
def test_bind_or_connect_rule(endpoint: str, bind: bool) -> None:
    assert is_bind(endpoint) is bind


@pytest.mark.parametrize(
    "endpoint,exposed",
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("tcp://[::1]:5557", False),
        ("tcp://127.0.0.1:5557", False),  # connect, not bind
        ("ipc:///tmp/x", False),
        ("inproc://x", False),
    ],
)
def test_binds_all_interfaces(endpoint: str, exposed: bool) -> None:
    assert binds_all_interfaces(endpoint) is exposed


@pytest.mark.parametrize(
    "endpoint,rank,want",
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 1, "tcp://*:5558"),
        ("tcp://*:5557", 7, "tcp://*:5564"),
        ("tcp://*:0", 3, "tcp://*:0"),  # port 0 stays 0
        ("tcp://10.1.2.3:6000", 2, "tcp://10.1.2.3:6002"),
        ("tcp://[::1]:6000", 2, "tcp://[::1]:6002"),
        ("inproc://kv", 0, "inproc://kv"),
        ("inproc://kv", 1, "inproc://kv_dp1"),
        ("inproc://kv", 12, "inproc://kv_dp12"),
    ],
)
def test_dp_rank_offset(endpoint: str, rank: int, want: str) -> None:
    assert offset_for_rank(endpoint, rank) == want


@pytest.mark.parametrize(
    "endpoint",
    [
        "",
        "localhost:5557",
        "udp://*:5557",
        "http://x:1",
        "tcp://",
        "tcp://*",
        "tcp://host",
        "tcp://*:",
        "tcp://*:abc",
        "tcp://*:-1",
        "tcp://*:65536",
        "tcp://:5557",
        "ipc://",
        "inproc://",
    ],
)
def test_malformed_endpoints(endpoint: str) -> None:
    with pytest.raises(EndpointError) as ei:
        check_endpoint(endpoint, "my_field")
    assert isinstance(ei.value, ValueError)
    assert "my_field" in str(ei.value)
    assert repr(endpoint) in str(ei.value)


@pytest.mark.parametrize("bad", [None, 5557, b"tcp://*:5557"])
def test_non_string_endpoint(bad: object) -> None:
    with pytest.raises(EndpointError, match="endpoint"):
        check_endpoint(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://*:5557", "tcp://*:0", "tcp://127.0.0.1:1", "tcp://[::1]:65535", "tcp://host.x:5557",
     "ipc:///tmp/kv.sock", "inproc://kv"],
)
def test_well_formed_endpoints(endpoint: str) -> None:
    assert check_endpoint(endpoint) == endpoint


def test_resolve_check() -> None:
    resolve_check("tcp://localhost:5557")
    resolve_check("tcp://127.0.0.1:5557")
    resolve_check("tcp://*:5557")
    resolve_check("ipc:///nonexistent/dir/sock")
    with pytest.raises(EndpointError) as ei:
        resolve_check("tcp://no-such-host.invalid:5557", "endpoint")
    assert "'tcp://no-such-host.invalid:5557'" in str(ei.value)
    assert "no-such-host.invalid" in str(ei.value)
