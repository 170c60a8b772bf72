"""A NATS consumer process for the end-to-end fault tests (tests/test_nats_e2e.py).

:func:`nats_consumer_main` runs ``Subscriber([NatsStreams(url)])`` and feeds every item to a
per-stream :class:`fault_helpers.Rebuild` (which asserts the contract: Reset, Snapshot(N),
Batch(N+1), ...); :class:`NatsConsumer` drives it over a Pipe and can SIGKILL it. Spawned
children import this module by name (tests/ is on ``sys.path`` under pytest)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
from fault_helpers import Child, Rebuild

from kvwire.consume.subscriber import Subscriber
from kvwire.nats.streams import NatsStreams


def nats_consumer_main(conn: Any, url: str, durable: str | None) -> None:
    sub = Subscriber([NatsStreams(url, durable=durable)])
    rbs: dict[str, Rebuild] = {}
    conn.send(("ready", os.getpid()))
    try:
        while True:
            for item in sub.poll_many(0.02):
                rbs.setdefault(item.stream, Rebuild()).feed(item)
            while conn.poll(0):
                cmd = conn.recv()
                if cmd == "state":
                    conn.send(("state", {k: rb.state() for k, rb in rbs.items()},
                               msgspec.to_builtins(sub.nats_stats()[0])))
                elif cmd == "cache":
                    conn.send(("cache", {k: rb.as_dict() for k, rb in rbs.items()}))
                elif cmd == "stop":
                    conn.send(("stopped",))
                    return
    except BaseException as e:  # a broken contract: tell the test, then die
        try:
            conn.send(("error", repr(e)))
        except OSError:
            pass
        raise
    finally:
        sub.close()


class NatsConsumer(Child):
    """Parent-side handle of one consumer process (``durable``: a named JetStream consumer)."""

    def __init__(self, url: str, durable: str | None = None) -> None:
        super().__init__(nats_consumer_main, (url, durable), "kvwire-nats-consumer")

    def state(self) -> tuple[dict, dict]:
        _, rbs, stats = self._ask("state", 10.0)
        return rbs, stats

    def wait(self, cond: Callable[[dict], bool], timeout: float, what: str) -> dict:
        """Ask for the state (every 50 ms) until ``cond(states by stream)`` holds."""
        deadline = time.monotonic() + timeout
        while True:
            rbs, stats = self.state()
            if cond(rbs):
                return rbs
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not met in {timeout}s; rebuilds {rbs}; "
                                     f"nats stats {stats}")
            self.conn.poll(0.05)  # nothing arrives unasked: a bounded 50 ms pause
