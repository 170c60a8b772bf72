"""kvwire as an SGLang general plugin (entry point group ``sglang.srt.plugins``).

SGLang calls :func:`register` through ``sglang.srt.plugins.load_plugins()`` in each of its
processes (engine, scheduler, detokenizer). It does nothing at all unless
``KVWIRE_SGLANG_EVENTS=1``; then SGLang's ``EventPublisherFactory`` builds kvwire's
publisher for the name ``"zmq"``, from SGLang's own ``--kv-events-config`` keys. SGLang's
event objects go out byte-exactly as SGLang's publisher sends them (its ``attn_dp_rank``
filled in the same way), plus kvwire's non-blocking ``publish()``, replay, INFO (epochs),
heartbeats and snapshots. Failures are logged and SGLang keeps its own publisher.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import weakref
from typing import Any

from . import (
    EngineSockets,
    FactorySwap,
    check_rank_endpoint,
    publisher_options,
    switch,
    warn_unknown_once,
)

__all__ = ["EVENTS_ENV", "install_events", "publisher_class", "register", "uninstall_events"]

EVENTS_ENV = "KVWIRE_SGLANG_EVENTS"
KNOWN_KEYS = ("endpoint", "bind", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size",
              "topic")

log = logging.getLogger("sglang.kvwire")  # a child of SGLang's logger: shows in its log
_class: type | None = None
_unknown_seen: set[str] = set()


def register() -> None:
    """SGLang's plugin hook: install kvwire's publisher when ``KVWIRE_SGLANG_EVENTS=1``."""
    if not switch(EVENTS_ENV, log):
        return  # inert: nothing of SGLang is imported or changed
    try:
        install_events()
    except Exception as e:
        log.error("kvwire: %s=1 but kvwire's KV event publisher could not be installed "
                  "(%s: %s); SGLang keeps its own publisher", EVENTS_ENV, type(e).__name__, e)
        return
    from .. import __version__

    log.info("kvwire %s active in SGLang (pid %d): %s=1 (KV event publisher 'zmq' is kvwire's)",
             __version__, os.getpid(), EVENTS_ENV)


def _registry() -> dict:
    from sglang.srt.disaggregation import kv_events

    return kv_events.EventPublisherFactory._registry


_swap = FactorySwap(_registry)


def install_events() -> type:
    """Make SGLang's factory build kvwire's publisher for ``"zmq"``; idempotent."""
    return _swap.install(publisher_class())


def uninstall_events() -> None:
    """Give SGLang's factory its own ``"zmq"`` publisher back (for tests)."""
    _swap.uninstall()


def _sglang_binds(endpoint: str) -> bool:
    """SGLang's rule for the live socket when ``bind`` is unset (it adds 0.0.0.0)."""
    return ("*" in endpoint or "::" in endpoint or "0.0.0.0" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


def _local_endpoint(endpoint: str | None) -> str | None:
    """How another process on this node reaches a bound endpoint (SGLang's convention):
    ipc paths made absolute, wildcard hosts as loopback; None if it cannot be advertised."""
    from ..wire.endpoint import split_host_port

    if endpoint is None:
        return None
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        return endpoint if path.startswith("@") else f"ipc://{os.path.abspath(path)}"
    if not endpoint.startswith("tcp://"):
        return None
    host, port = split_host_port(endpoint)
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return None
    host = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _shutdown_at_exit(ref: weakref.ref) -> None:
    pub = ref()
    if pub is not None:
        pub.shutdown(timeout=1.0)


def publisher_class() -> type:
    """kvwire's publisher as SGLang's factory calls it (built once, on first use)."""
    global _class
    if _class is not None:
        return _class
    import msgspec
    from sglang.srt.disaggregation import kv_events

    from ..publish.publisher import ZmqEventPublisher

    _plain = msgspec.msgpack.Encoder()

    class KvwireSglangPublisher(EngineSockets, ZmqEventPublisher, kv_events.EventPublisher):
        """kvwire's ``ZmqEventPublisher`` with SGLang's constructor and socket rules.

        SGLang tags batches with ``attn_dp_rank`` (not ``data_parallel_rank``): a batch
        without one gets this publisher's, in place, as SGLang's publisher does. The live
        socket binds per ``bind`` or SGLang's rule; the replay socket always binds;
        endpoints are offset per rank as kvwire does (a tcp port 0 stays 0, where SGLang
        would add the rank to it). Accepted batches are flushed at interpreter exit.
        """

        def __init__(
            self,
            attn_dp_rank: int = 0,
            endpoint: str = "tcp://*:5557",
            replay_endpoint: str | None = None,
            buffer_steps: int = 10_000,
            hwm: int = 100_000,
            max_queue_size: int = 100_000,
            topic: str = "",
            bind: bool | None = None,
            **unknown: Any,
        ) -> None:
            if unknown:
                warn_unknown_once(_unknown_seen, unknown, "SGLang", log)
            check_rank_endpoint(endpoint, attn_dp_rank, "endpoint")
            check_rank_endpoint(replay_endpoint, attn_dp_rank, "replay_endpoint")
            self._bind_live = _sglang_binds(endpoint) if bind is None else bool(bind)
            super().__init__(attn_dp_rank, endpoint, replay_endpoint, buffer_steps, hwm,
                             max_queue_size, topic, dialect="sglang", **publisher_options())
            self._exit_hook = functools.partial(_shutdown_at_exit, weakref.ref(self))
            atexit.register(self._exit_hook)
            log.info("kvwire KV event publisher attn_dp%d: %s %s, replay/INFO/SNAPSHOT %s, "
                     "epoch %d", attn_dp_rank, "bound" if self._bind_live else "connected to",
                     self.endpoint, self.replay_endpoint or "off", self.epoch)

        def publish(self, events: Any) -> None:
            if getattr(events, "attn_dp_rank", 0) is None and not self._closing:
                events.attn_dp_rank = self._data_parallel_rank
            super().publish(events)

        def _encode(self, seq: int, batch: Any) -> bytes | None:
            # SGLang's own batches (its rank filled in by publish()) are encoded as given,
            # as SGLang's encoder does: no attempt at kvwire's dialect first, which would
            # look for ``data_parallel_rank``. kvwire's heartbeats take the usual path.
            if not isinstance(batch, kv_events.EventBatch):
                return super()._encode(seq, batch)
            try:
                payload = _plain.encode(batch)
            except Exception as e:  # a bad object from the engine must not break the stream
                self._c["encode_errors"] += 1
                log.error("cannot encode SGLang KV event batch seq %d (%s); the seq is "
                          "skipped", seq, e)
                return None
            self._c["foreign_batches"] += 1
            return payload

        def shutdown(self, timeout: float = 5.0) -> Any:
            atexit.unregister(self._exit_hook)
            return super().shutdown(timeout)

        def describe_local_source(self, block_size: int) -> dict[str, Any] | None:
            """Where a process on this node subscribes (SGLang's ``/server_info``)."""
            bound = getattr(self, "_bound", {})
            endpoint = _local_endpoint(bound.get("endpoint"))
            if endpoint is None:
                return None
            source: dict[str, Any] = {"dp_rank": self._data_parallel_rank, "endpoint": endpoint,
                                      "topic": self._topic, "block_size": block_size}
            replay = _local_endpoint(bound.get("replay_endpoint"))
            if replay is not None:
                source["replay_endpoint"] = replay
            return source

    KvwireSglangPublisher.__module__ = __name__
    KvwireSglangPublisher.__qualname__ = "KvwireSglangPublisher"
    _class = KvwireSglangPublisher
    return _class
