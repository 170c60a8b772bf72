"""kvwire inside real engines, without code changes: plugins for vLLM (``plugins.vllm``)
and SGLang (``plugins.sglang``), loaded through the engines' own entry point groups.

Each plugin is inert unless its environment switch is on (see docs/engines.md). This
package only holds what both plugins share: reading a switch, and the engines' socket
rules where they differ from kvwire's own publisher (the replay socket always binds; an
``ipc://`` endpoint cannot be offset per data-parallel rank).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

__all__ = ["OPTIONS_ENV", "EngineSockets", "FactorySwap", "PublisherOptions",
           "check_rank_endpoint", "publisher_options", "switch"]

#: JSON object of kvwire's own publisher settings, which the engines' configs cannot carry.
OPTIONS_ENV = "KVWIRE_PUBLISHER_OPTIONS"

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"", "0", "false", "no", "off"})


def switch(name: str, log: logging.Logger | None = None) -> bool:
    """Whether environment switch ``name`` is on. Unset or 0/false/no/off is off; an
    unrecognised value is off too, with a warning naming it (a typo must not half-enable)."""
    raw = os.environ.get(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value not in _OFF:
        (log or logging.getLogger("kvwire.plugins")).warning(
            "%s=%r is not one of 1/true/yes/on or 0/false/no/off: treated as off", name, raw)
    return False


class FactorySwap:
    """The ``"zmq"`` entry of an engine's ``EventPublisherFactory`` registry, swapped for
    kvwire's publisher and back; ``registry`` is called only when needed (it imports the
    engine). Idempotent both ways and thread-safe."""

    def __init__(self, registry: Callable[[], dict], name: str = "zmq") -> None:
        self._registry = registry
        self._name = name
        self._lock = threading.Lock()
        self._original: Any = None  # the engine's own constructor while kvwire's is in

    def install(self, cls: type) -> type:
        reg = self._registry()
        with self._lock:
            current = reg.get(self._name)
            if current is not cls:
                self._original = current
                reg[self._name] = cls
        return cls

    def uninstall(self) -> None:
        with self._lock:
            if self._original is None:
                return
            self._registry()[self._name] = self._original
            self._original = None


class PublisherOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``KVWIRE_PUBLISHER_OPTIONS``: kvwire's settings beyond the engine's config keys
    (defaults as kvwire's publisher; docs/operations.md explains each)."""

    heartbeat_interval: float | None = 1.0
    snapshot: bool = True
    curve_secret_key_file: str | None = None
    curve_authorized_keys_dir: str | None = None


def publisher_options() -> dict[str, Any]:
    """Keyword arguments for kvwire's publisher from ``KVWIRE_PUBLISHER_OPTIONS`` (unset:
    none). A bad value raises ValueError naming the variable and the key: the engine then
    stops at start with that message, rather than run without what the operator asked."""
    raw = os.environ.get(OPTIONS_ENV, "").strip()
    if not raw:
        return {}
    known = ", ".join(PublisherOptions.__struct_fields__)
    try:
        opts = msgspec.json.decode(raw, type=PublisherOptions)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"{OPTIONS_ENV}={raw!r}: {e} (a JSON object; keys: {known})") from None
    if opts.heartbeat_interval is not None and opts.heartbeat_interval <= 0:
        raise ValueError(f"{OPTIONS_ENV}: heartbeat_interval must be > 0 seconds or null, "
                         f"got {opts.heartbeat_interval!r}")
    kw: dict[str, Any] = {"heartbeat_interval": opts.heartbeat_interval,
                          "snapshot": opts.snapshot}
    if opts.curve_secret_key_file is not None:
        from ..wire.curve import CurveServer

        kw["curve"] = CurveServer(secret_key_file=opts.curve_secret_key_file,
                                  authorized_keys_dir=opts.curve_authorized_keys_dir)
    elif opts.curve_authorized_keys_dir is not None:
        raise ValueError(f"{OPTIONS_ENV}: curve_authorized_keys_dir needs "
                         "curve_secret_key_file (the publisher's own key)")
    return kw


def check_rank_endpoint(endpoint: str | None, rank: int, field: str) -> None:
    """Refuse what both engines refuse: a per-rank endpoint that is neither tcp nor inproc.
    (Two ranks cannot share one ``ipc://`` path; the engines raise, and so does kvwire.)"""
    if not endpoint or rank == 0:
        return
    if "inproc" in endpoint or "tcp" in endpoint:
        return
    raise ValueError(
        f"{field} {endpoint!r}: data-parallel rank {rank} needs a tcp:// or inproc:// "
        "endpoint (the port or name is offset per rank); an ipc:// path cannot be"
    )


class EngineSockets:
    """Mixin for kvwire's ``ZmqEventPublisher``: bind and connect as the engine would.

    kvwire's publisher binds or connects each socket by the endpoint's shape. Both engines
    always bind the replay ROUTER (a concrete host included), and SGLang decides the live
    socket with its own rule or an explicit ``bind``. Subclasses set ``_bind_live`` (None:
    kvwire's rule) before the publisher's constructor runs. Bound endpoints are recorded in
    ``_bound`` by field name (what the engine reports as its local source).
    """

    _bind_live: bool | None = None

    def _attach(self, sock: zmq.Socket, endpoint: str, field: str) -> str:
        from ..wire.endpoint import EndpointError, is_bind

        bound: dict[str, str] = self.__dict__.setdefault("_bound", {})
        want = True if field == "replay_endpoint" else self._bind_live
        if want is None or want == is_bind(endpoint):
            actual: str = super()._attach(sock, endpoint, field)  # type: ignore[misc]
            if is_bind(endpoint):
                bound[field] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            return actual
        if endpoint.startswith("tcp://") and ("[" in endpoint or "::" in endpoint):
            sock.setsockopt(zmq.IPV6, 1)
        try:
            if want:
                sock.bind(endpoint)
                bound[field] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
                return bound[field]
            sock.connect(endpoint)
            return endpoint
        except zmq.ZMQError as e:
            how = "bind" if want else "connect"
            raise EndpointError(f"{field} {endpoint!r}: cannot {how} it: {e.strerror}") from None


def warn_unknown_once(seen: set[str], unknown: dict[str, Any], engine: str,
                      log: logging.Logger) -> None:
    """Log once per key a config key this kvwire does not know (a newer engine's): ignored."""
    new = sorted(set(unknown) - seen)
    if new:
        seen.update(new)
        log.warning("kvwire: %s KV events config key(s) %s unknown to kvwire %s: ignored",
                    engine, ", ".join(f"{k}={unknown[k]!r}" for k in new), _version())


def _version() -> str:
    from .. import __version__

    return __version__
