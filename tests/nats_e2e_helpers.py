"""A NATS consumer process for the end-to-end fault tests (tests/test_nats_e2e.py).

:func:`nats_consumer_main` runs ``Subscriber([NatsStreams(url)])`` and feeds every item to a
per-stream :class:`fault_helpers.Rebuild` (which asserts the contract: Reset, Snapshot(N),
Batch(N+1), ...); :class:`NatsConsumer` drives it over a Pipe and can SIGKILL it. Spawned
children import this module by name (tests/ is on ``sys.path`` under pytest)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import msgspec
from fault_helpers import CTX, Rebuild

from kvwire.consume.subscriber import Subscriber
from kvwire.nats.consumer import NatsStreams


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


class NatsConsumer:
    """Parent-side handle of one consumer process (``durable``: a named JetStream consumer)."""

    def __init__(self, url: str, durable: str | None = None) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=nats_consumer_main, args=(child, url, durable),
                                daemon=True, name="kvwire-nats-consumer")
        self.proc.start()
        child.close()
        msg = self._ask(None, 60.0)
        assert msg[0] == "ready", msg

    def _ask(self, cmd: str | None, timeout: float) -> Any:
        if cmd is not None:
            try:
                self.conn.send(cmd)
            except OSError:  # it died; its last words (an "error") may still be in the pipe
                pass
        if not self.conn.poll(timeout):
            raise AssertionError(f"nats consumer process: no answer to {cmd!r} in {timeout}s")
        msg = self.conn.recv()
        assert msg[0] != "error", f"nats consumer process failed: {msg[1]}"
        return msg

    def state(self) -> tuple[dict, dict]:
        _, rbs, stats = self._ask("state", 10.0)
        return rbs, stats

    def cache(self) -> dict:
        return self._ask("cache", 30.0)[1]

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

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        self.conn.close()

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send("stop")
                if self.conn.poll(5):
                    self.conn.recv()
                self.proc.join(5)
        except (OSError, EOFError, BrokenPipeError):
            pass
        finally:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(10)
            self.conn.close()
