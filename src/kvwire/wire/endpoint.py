"""ZeroMQ endpoint strings: validation, the bind-or-connect rule, and DP-rank offsets.

Kept apart from the sockets so the rules (spec section 3) are checked without any I/O.
"""

from __future__ import annotations

import socket

__all__ = [
    "EndpointError",
    "binds_all_interfaces",
    "check_endpoint",
    "is_bind",
    "offset_for_rank",
    "subscriber_binds",
    "resolve_check",
]

_SCHEMES = ("tcp", "ipc", "inproc")


class EndpointError(ValueError):
    """An endpoint string is malformed, unresolvable or unusable (e.g. its port is taken)."""


def check_endpoint(endpoint: str, field: str = "endpoint") -> str:
    """Return ``endpoint`` if it is well formed, else raise :class:`EndpointError` naming it."""
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise EndpointError(
            f"{field}: {endpoint!r} is not a ZeroMQ endpoint (expected tcp://host:port, "
            "ipc://path or inproc://name)"
        )
    scheme, rest = endpoint.split("://", 1)
    if scheme not in _SCHEMES:
        raise EndpointError(
            f"{field}: {endpoint!r} has unsupported transport {scheme!r} "
            f"(expected one of {', '.join(_SCHEMES)})"
        )
    if not rest:
        raise EndpointError(f"{field}: {endpoint!r} has no address after {scheme}://")
    if scheme == "tcp":
        host, port = split_host_port(endpoint, field)
        if not host:
            raise EndpointError(f"{field}: {endpoint!r} has no host (use * to bind all)")
        if port != "*" and (not port.isdigit() or int(port) > 65535):
            raise EndpointError(f"{field}: {endpoint!r} has an invalid port {port!r}")
    return endpoint


def split_host_port(endpoint: str, field: str = "endpoint") -> tuple[str, str]:
    """Split ``tcp://host:port`` (IPv6 hosts in brackets) into host and port strings."""
    rest = endpoint.split("://", 1)[1]
    host, sep, port = rest.rpartition(":")
    if not sep:
        raise EndpointError(f"{field}: {endpoint!r} has no port (expected tcp://host:port)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def is_bind(endpoint: str) -> bool:
    """The engines' rule: bind when the endpoint has ``*`` or ``::`` or is ipc/inproc."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def subscriber_binds(endpoint: str) -> bool:
    """A consumer binds only a wildcard tcp address (a central collector that publishers
    connect to); a concrete host, ``ipc://`` or ``inproc://`` is the publisher's, so connect."""
    return endpoint.startswith("tcp://") and "*" in endpoint or "://[::]" in endpoint


def binds_all_interfaces(endpoint: str) -> bool:
    """True for a tcp bind that anyone who can reach the host may connect to."""
    if not endpoint.startswith("tcp://") or not is_bind(endpoint):
        return False
    host, _ = split_host_port(endpoint)
    return host in ("*", "0.0.0.0", "::", "")


def offset_for_rank(endpoint: str, rank: int) -> str:
    """Endpoint of DP rank ``rank``: tcp port + rank (port 0 stays 0), inproc name + ``_dp{rank}``."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port.isdigit():
            p = int(port)
            return endpoint if p == 0 else f"{base}:{p + rank}"
    return endpoint


def resolve_check(endpoint: str, field: str = "endpoint") -> None:
    """Resolve a tcp endpoint's host now, so a typo fails at construction, not silently later."""
    if not endpoint.startswith("tcp://"):
        return
    host, _ = split_host_port(endpoint, field)
    if host in ("*", "0.0.0.0", "::", "") or host.startswith("["):
        return
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        raise EndpointError(f"{field}: cannot resolve host {host!r} of {endpoint!r}: {e}") from None
