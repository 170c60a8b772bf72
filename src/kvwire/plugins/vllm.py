"""kvwire as a vLLM general plugin (entry point group ``vllm.general_plugins``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers).
It does nothing at all unless a switch is on:

* ``KVWIRE_VLLM_EVENTS=1``: vLLM's ``EventPublisherFactory`` builds kvwire's publisher for
  the name ``"zmq"`` (the only non-null publisher vLLM's ``KVEventsConfig`` accepts), from
  vLLM's own config keys. vLLM's event objects go out byte-exactly as vLLM's publisher
  sends them, plus kvwire's non-blocking ``publish()``, replay, INFO (epochs), heartbeats
  and snapshots.
* ``KVWIRE_VLLM_SHM=1``: vLLM's shared-memory ``MessageQueue`` becomes kvwire's
  (:mod:`kvwire.plugins.vllm_shm`).

A switch that cannot take effect (vLLM's modules missing, a bug) is logged as an error and
vLLM keeps its own implementation: a plugin must never stop the engine from starting.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from . import (
    EngineSockets,
    FactorySwap,
    check_rank_endpoint,
    publisher_options,
    switch,
    warn_unknown_once,
)

__all__ = ["EVENTS_ENV", "SHM_ENV", "install_events", "publisher_class", "register",
           "uninstall_events"]

EVENTS_ENV = "KVWIRE_VLLM_EVENTS"
SHM_ENV = "KVWIRE_VLLM_SHM"
KV_EVENTS_MODULE = "vllm.distributed.kv_events"
#: The config keys of vLLM 0.33's KVEventsConfig that the publisher takes (besides
#: ``enable_kv_cache_events`` and ``publisher``, which vLLM's factory consumes).
KNOWN_KEYS = ("endpoint", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size", "topic")

_class: type | None = None
_unknown_seen: set[str] = set()


def _logger() -> logging.Logger:
    """A child of vLLM's logger, so kvwire's lines show in vLLM's log with its format."""
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.kvwire")
    except Exception:  # vLLM absent or broken: still say what happens
        return logging.getLogger("kvwire.plugins.vllm")


def register() -> None:
    """vLLM's plugin hook: apply the switches that are on (see the module docstring)."""
    events, shm = switch(EVENTS_ENV), switch(SHM_ENV)
    if not (events or shm):
        return  # inert: nothing of vLLM is imported or changed
    log = _logger()
    active = []
    if events:
        try:
            install_events()
            active.append(f"{EVENTS_ENV}=1 (KV event publisher 'zmq' is kvwire's)")
        except Exception as e:
            log.error("kvwire: %s=1 but kvwire's KV event publisher could not be installed "
                      "(%s: %s); vLLM keeps its own publisher", EVENTS_ENV, type(e).__name__, e)
    if shm:
        try:
            from . import vllm_shm

            vllm_shm.install()
            active.append(f"{SHM_ENV}=1 (shm MessageQueue is kvwire's)")
        except ImportError as e:
            log.error("kvwire: %s=1 but the shm queue swap is not available (%s); vLLM keeps "
                      "its own MessageQueue", SHM_ENV, e)
        except Exception as e:
            log.error("kvwire: %s=1 but the shm queue swap failed (%s: %s); vLLM keeps its "
                      "own MessageQueue", SHM_ENV, type(e).__name__, e)
    from .. import __version__

    if active:
        log.info("kvwire %s active in vLLM (pid %d): %s", __version__, os.getpid(),
                 "; ".join(active))


def _registry() -> dict:
    from vllm.distributed import kv_events

    return kv_events.EventPublisherFactory._registry


_swap = FactorySwap(_registry)


def install_events() -> type:
    """Make vLLM's factory build kvwire's publisher for ``"zmq"``; idempotent. Returns the
    class. Raises ImportError if vLLM's kv_events module cannot be imported."""
    return _swap.install(publisher_class())


def uninstall_events() -> None:
    """Give vLLM's factory its own ``"zmq"`` publisher back (for tests)."""
    _swap.uninstall()


def publisher_class() -> type:
    """kvwire's publisher as vLLM's factory calls it (built once, on first use: it
    subclasses vLLM's ``EventPublisher``, so vLLM must be importable)."""
    global _class
    if _class is not None:
        return _class
    from vllm.config.kv_events import KVEventsConfig as VllmConfig
    from vllm.distributed import kv_events

    from ..publish.publisher import ZmqEventPublisher
    from ..wire.endpoint import is_bind

    log = _logger()

    class KvwireVllmPublisher(EngineSockets, ZmqEventPublisher, kv_events.EventPublisher):
        """kvwire's ``ZmqEventPublisher`` with vLLM's constructor, rank rules and config.

        Takes the keys of vLLM's ``KVEventsConfig`` (a newer vLLM's extra keys are
        logged once and ignored). The live and replay endpoints are offset per DP rank as
        vLLM does (tcp port + rank, port 0 left to the OS; inproc name + ``_dp{rank}``;
        anything else refused for rank > 0); the replay socket always binds.
        ``get_publisher_config()`` returns vLLM's own config class with this rank's
        endpoints, which vLLM hands to its front end (``get_kv_event_sources``).
        """

        def __init__(
            self,
            data_parallel_rank: int = 0,
            endpoint: str = "tcp://*:5557",
            replay_endpoint: str | None = None,
            buffer_steps: int = 10_000,
            hwm: int = 100_000,
            max_queue_size: int = 100_000,
            topic: str = "",
            **unknown: Any,
        ) -> None:
            if unknown:
                warn_unknown_once(_unknown_seen, unknown, "vLLM", log)
            check_rank_endpoint(endpoint, data_parallel_rank, "endpoint")
            check_rank_endpoint(replay_endpoint, data_parallel_rank, "replay_endpoint")
            super().__init__(data_parallel_rank, endpoint, replay_endpoint, buffer_steps, hwm,
                             max_queue_size, topic, dialect="vllm", **publisher_options())
            cfg = self._config
            assert cfg is not None

            def reported(configured: str | None, actual: str | None) -> str | None:
                # vLLM reports the endpoint as configured (rank-offset), or the bound one
                # when the OS chose the port.
                if configured and configured.startswith("tcp://") and configured.endswith(":0"):
                    return actual
                return configured

            self._vllm_config = VllmConfig(
                enable_kv_cache_events=True, publisher="zmq",
                endpoint=reported(cfg.endpoint, self.endpoint),
                replay_endpoint=reported(cfg.replay_endpoint, self.replay_endpoint),
                buffer_steps=buffer_steps, hwm=hwm, max_queue_size=max_queue_size, topic=topic,
            )
            log.info("kvwire KV event publisher dp%d: %s %s, replay/INFO/SNAPSHOT %s, epoch %d",
                     data_parallel_rank, "bound" if is_bind(cfg.endpoint) else "connected to",
                     self.endpoint, self.replay_endpoint or "off", self.epoch)

        def get_publisher_config(self) -> Any:
            """vLLM's ``KVEventsConfig`` with this rank's endpoints (as vLLM's publisher)."""
            return self._vllm_config

    KvwireVllmPublisher.__module__ = __name__
    KvwireVllmPublisher.__qualname__ = "KvwireVllmPublisher"
    _class = KvwireVllmPublisher
    return _class
