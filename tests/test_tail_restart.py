"""An exact rebuild through an engine restart, against vLLM's own publisher and kvwire's.

The scenario, scaled down from the report that found it: a toy engine (an LRU cache of
1,500 blocks of 128 tokens, tests/tail_helpers.py) publishes through vLLM 0.33's
``ZmqEventPublisher`` (``hwm=100``, ``buffer_steps=20000``) 6,000 batches at 4,000/s while
``kvwire listen --json`` follows it from the start; it is SIGKILLed (kvwire's, and vLLM's
in one case, once its tail is replayed) and a new engine (another seed) binds the same
ports and publishes 6,000 batches, lingers 3 s and shuts down. The
listener is SIGSTOPped for 2 s during each engine's burst, so the PUB drops (its HWM) the
rest of each burst: the restarted engine's tail reaches the listener only if it asks for it
before that engine is gone. A reference publisher sends no heartbeats, so that tail used to
be asked for only by the periodic check (10 s): the listener said ``0 lost`` with a picture
that differed from the engine's in most of its blocks. Now the stream confirms its tail
right after the listener's stall, and the rebuild from its JSON output equals the engine's
cache, block for block; its summary says ``state exact``.

vLLM is imported only in the engine processes (about 10 s of CPU each; the two start
together so the imports overlap). Without vLLM the vLLM case skips, naming the wheel.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from typing import Any

import pytest
from engine_helpers import free_ports
from fault_helpers import CTX, SubProc
from tail_helpers import toy_engine_main

from kvwire.consume.subscriber import StreamSpec

pytestmark = pytest.mark.timeout(240)

WHEEL = "vllm (vllm==0.33.0)"
RATE = 4000.0
N1, N2 = 6000, 6000
STOP = 2.0  # how long the listener stays stopped (the fault itself)
LINGER = 3.0  # how long the restarted engine stays up after its burst


class ToyEngine:
    """Parent side of one toy engine process."""

    def __init__(self, kind: str, port: int, rport: int, seed: int, n: int,
                 linger: float) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=toy_engine_main,
                                args=(child, kind, port, rport, seed, n, RATE, linger),
                                daemon=True, name=f"kvwire-toy-engine-{seed}")
        self.proc.start()
        child.close()

    def expect(self, what: str, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise AssertionError(f"engine {self.proc.pid}: no {what!r} in {timeout}s")
        msg = self.conn.recv()
        assert msg[0] == what, f"engine {self.proc.pid}: {msg}"
        return msg

    def bind(self) -> None:
        self.conn.send("bind")
        self.expect("ready", 30)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.conn.close()


@pytest.mark.parametrize("case", ["vllm", "vllm-lingering", "kvwire"])
def test_exact_rebuild_through_a_restart_with_the_consumer_stalled(case):
    kind = case.split("-")[0]
    if kind == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip(f"{WHEEL} is missing; `make test` installs it (the ENGINES stamp)")
    port, rport = free_ports(2)
    # kvwire's publisher names its tail in heartbeats: its first engine lingers until the
    # listener has that tail (killed sooner, the tail is gone for good and counted lost).
    # vLLM's names nothing: its first engine shuts its publisher down at once, or (lingering)
    # answers the listener's tail check first and is then SIGKILLed, its socket's peer
    # state and the replays asked of it cut off mid-way.
    lingering = case != "vllm"
    e1 = ToyEngine(kind, port, rport, 1, N1, 60.0 if lingering else 0.0)
    e2 = ToyEngine(kind, port, rport, 2, N2, LINGER)  # built now: the imports overlap
    s = None
    try:
        e1.expect("built", 120)
        e2.expect("built", 120)
        e1.bind()
        # 64 KiB kernel buffers and a live queue of 50: a stall overflows every buffer on
        # the way, so the drops are real PUB drops (hwm=100), as on a busier host.
        s = SubProc(StreamSpec("e", f"tcp://127.0.0.1:{port}", "", f"tcp://127.0.0.1:{rport}"),
                    dict(rcvhwm=50, rcvbuf=65536))
        warm(e1, s, lambda rb, _: rb["last_seq"] >= 0)
        e1.conn.send("go")
        time.sleep(0.2)  # into the burst (1.5 s long), then the stall
        stall(s)
        _, _, last1 = e1.expect("done", 60)
        if lingering:
            s.wait(lambda rb, _: rb["last_seq"] >= last1, 20, "the first engine's tail")
        e1.kill()
        e2.bind()
        # Follow the new run before the stall: its restart seen, its first batches in.
        warm(e2, s, lambda rb, st: st["restarts"] >= 1 and rb["last_seq"] >= 0)
        e2.conn.send("go")
        time.sleep(0.2)  # the stall ends after the burst: its tail is dropped
        stall(s)
        _, truth, last = e2.expect("done", 60)
        rb = s.wait(lambda rb, st: rb["last_seq"] >= last and st["state"] == "exact",
                    LINGER + 20, "the restarted engine's tail delivered and confirmed")
        _, st = s.state()
        print(f"{kind}: gaps {st['gaps']} replayed {st['replayed']} lost {st['lost']} "
              f"restarts {st['restarts']} tail_checks {st['tail_checks']} state {st['state']}")
        assert any("restarted" in r for r in rb["resets"][1:]), rb["resets"]
        assert rb["exact"] and st["lost"] == 0, st
        cache = s.cache()
        assert cache == truth, f"{len(set(cache) ^ set(truth))} blocks differ"
        if kind == "vllm":  # the stalls dropped the tail: it came by replay, once asked
            assert st["mode"] == "reference" and st["tail_checks"] >= 1, st
    finally:
        if s is not None:
            s.close()
        e1.close()
        e2.close()


def warm(e: ToyEngine, s: SubProc, cond) -> None:
    """Publish one batch at a time until the subscriber's state meets ``cond`` (bounded)."""
    deadline = time.monotonic() + 60
    while True:
        e.conn.send("step")
        e.expect("stepped", 30)
        rb, st = s.state()
        if cond(rb, st):
            return
        assert time.monotonic() < deadline, f"the subscriber never followed: {rb} {st}"
        e.conn.poll(0.05)  # a bounded pause before the next batch


def stall(s: SubProc) -> None:
    os.kill(s.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(STOP)  # the consumer stays stopped (the fault itself)
    finally:
        os.kill(s.proc.pid, signal.SIGCONT)
