"""A toy engine for the restart-and-stall scenario (tests/test_tail_restart.py).

Spawned children import this module by name (as tests/fault_helpers.py). The engine is an
LRU prefix cache of 1,500 blocks of 128 tokens (``DemoEngine``) fed seeded prompts; its
batches are built before it binds, then published at a fixed rate through vLLM 0.33's own
``ZmqEventPublisher`` (a reference publisher: no INFO, no heartbeats) or kvwire's.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from fault_helpers import Prompts

from kvwire.index.cache import BlockCache
from kvwire.sim.demo import DemoEngine
from kvwire.wire.events import BlockStored


def _as_vllm(k: Any, batch: Any) -> Any:
    """The same batch as vLLM's own event objects (what its scheduler hands the publisher)."""
    events = [
        k.BlockStored(block_hashes=list(e.block_hashes), parent_block_hash=e.parent_block_hash,
                      token_ids=list(e.token_ids), block_size=e.block_size, lora_id=None,
                      medium=e.medium, lora_name=None)
        if type(e) is BlockStored else k.BlockRemoved(block_hashes=list(e.block_hashes),
                                                      medium=e.medium)
        for e in batch.events
    ]
    return k.KVEventBatch(ts=batch.ts, events=events)


def toy_engine_main(conn: Any, kind: str, port: int, rport: int, seed: int, n: int,
                    rate: float, linger: float) -> None:
    """Build ``n`` batches, say ``("built",)``; on ``"bind"`` bind (``("ready",)``); on
    ``"step"`` publish the next one (``("stepped",)``: the test warms its listener up with
    them); on ``"go"`` publish the rest at ``rate``/s, say ``("done", truth, last seq)``, stay
    ``linger`` seconds and shut the publisher down (``("stopped",)``)."""
    logging.disable(logging.WARNING)  # vLLM's "invalid replay request" for kvwire's INFO
    try:
        engine = DemoEngine(capacity=1500, block_size=128)
        prompts = Prompts(seed, "wide")
        truth = BlockCache()
        batches = []
        while len(batches) < n:
            b = engine.step(prompts.next())
            if b is not None:
                batches.append(b)
                truth.apply(b)
        if kind == "vllm":
            import vllm.distributed.kv_events as k

            batches = [_as_vllm(k, b) for b in batches]
            make = k.ZmqEventPublisher
        else:
            from kvwire.publish.publisher import ZmqEventPublisher as make
        conn.send(("built", os.getpid()))
        assert conn.recv() == "bind"
        deadline = time.monotonic() + 10.0
        while True:
            try:  # (vLLM's binds a wildcard endpoint, as its docs show; kvwire's too)
                pub = make(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}",
                           hwm=100, buffer_steps=20_000)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # the killed predecessor's ports are not free yet
        conn.send(("ready",))
        while (cmd := conn.recv()) == "step":
            pub.publish(batches.pop(0))
            conn.send(("stepped",))
        assert cmd == "go", cmd
        t0 = time.monotonic()
        for i, b in enumerate(batches):
            pub.publish(b)
            pause = t0 + (i + 1) / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)  # pacing the workload, not waiting on a result
        last = n - 1 if kind == "vllm" else pub.stats().last_seq  # (kvwire's: heartbeats too)
        conn.send(("done", truth.as_dict(), last))
        time.sleep(linger)  # the engine lingers, then shuts down (the fault's timing)
        pub.shutdown()
        conn.send(("stopped",))
    except BaseException as e:
        conn.send(("error", repr(e)))
        raise
