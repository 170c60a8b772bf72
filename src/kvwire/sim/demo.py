"""``kvwire demo``: a toy engine with a real prefix cache, publishing real events.

The engine keeps an LRU cache of fixed-size blocks keyed by chained block hashes (each
block's key covers its parent's key and its own tokens, so equal keys mean equal
prefixes). A synthetic workload draws prompts from a few shared system prompts plus
random user turns, so the cache sees hits, misses and evictions. Events go out through
:class:`~kvwire.publisher.ZmqEventPublisher` and are consumed live by the ``listen`` logic,
which rebuilds the cache; the summary checks the rebuild against the engine.
"""

from __future__ import annotations

import collections
import hashlib
import math
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import msgspec

from ..consume.stream import Batch, Reset, Snapshot
from ..consume.subscriber import StreamSpec, Subscriber
from ..index.cache import BlockCache
from ..publish.publisher import ZmqEventPublisher
from ..wire.events import BlockRemoved, BlockStored, KVEventBatch

__all__ = ["DemoEngine", "DemoSummary", "chain_hashes", "run_demo", "synthetic_prompts"]


def chain_hashes(tokens: list[int], block_size: int, parent: int | None = None) -> list[int]:
    """Unsigned 64-bit keys of the full blocks of ``tokens``, each chained to its parent."""
    keys = []
    prev = (parent or 0).to_bytes(8, "little")
    for i in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[i : i + block_size]
        h = hashlib.blake2b(prev + b"".join(t.to_bytes(4, "little") for t in block), digest_size=8)
        prev = h.digest()
        keys.append(int.from_bytes(prev, "little"))
    return keys


class DemoEngine:
    """An LRU prefix cache of ``capacity`` blocks that reports what each step changed."""

    def __init__(self, capacity: int = 4096, block_size: int = 16, rank: int = 0) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.rank = rank
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.hit_blocks = 0
        self.total_blocks = 0
        self.stored = 0
        self.removed = 0

    def step(self, prompt: list[int]) -> KVEventBatch | None:
        """Schedule one prompt; the batch of cache changes, or None if nothing changed."""
        bs = self.block_size
        keys = chain_hashes(prompt, bs)
        hit = 0
        while hit < len(keys) and keys[hit] in self.lru:
            hit += 1
        self.hit_blocks += hit
        self.total_blocks += len(keys)
        for k in reversed(keys[:hit]):  # leaves stay older than their parents
            self.lru.move_to_end(k)
        new = keys[hit:]
        events: list = []
        evict = len(self.lru) + len(new) - self.capacity
        if evict > 0:
            victims = [k for k, _ in zip(self.lru, range(evict))]
            for k in victims:
                del self.lru[k]
            events.append(BlockRemoved(victims, "GPU"))
            self.removed += len(victims)
        if new:
            parent = keys[hit - 1] if hit else None
            if parent is not None and parent not in self.lru:
                parent = None  # evicted just now: the chain restarts at the root
            for k in reversed(new):
                self.lru[k] = None
                self.lru.move_to_end(k)
            events.append(
                BlockStored(new, parent, prompt[hit * bs : len(keys) * bs], bs, None, "GPU")
            )
            self.stored += len(new)
        if not events:
            return None
        return KVEventBatch(time.time(), events, self.rank)


def synthetic_prompts(
    n: int, seed: int = 0, n_system: int = 8, vocab: int = 32000
) -> list[list[int]]:
    """Prompts sharing a few system prompts (Zipf-like popularity) plus random user turns."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(rng.choice((64, 128, 256, 512)))]
               for _ in range(n_system)]
    weights = [1.0 / (i + 1) for i in range(n_system)]
    prompts = []
    for _ in range(n):
        system = rng.choices(systems, weights)[0]
        user = [rng.randrange(vocab) for _ in range(rng.randrange(16, 160))]
        prompts.append(system + user)
    return prompts


class DemoSummary(msgspec.Struct):
    steps: int
    batches_published: int
    joined_at_seq: int
    snapshot_blocks: int
    batches_delivered: int
    blocks_stored: int
    blocks_removed: int
    prefix_hit_rate: float
    gaps: int
    replayed: int
    lost: int
    engine_blocks: int
    rebuilt_blocks: int
    rebuilt_matches: bool
    seconds: float


def run_demo(
    steps: int = 3000,
    capacity: int = 4096,
    rate: float = 1000.0,
    seed: int = 0,
    join_after: float = 0.3,
    out: Callable[[str], None] = print,
) -> DemoSummary:
    """Run engine and a late-joining subscriber in one process over real sockets.

    The subscriber starts after ``join_after`` of the steps, bootstraps from the
    publisher's snapshot and then follows the live stream; the summary checks that its
    rebuilt cache equals the engine's. Bad arguments raise ValueError naming the argument
    (a negative step count used to run zero steps and report success).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate >= 0):
        raise ValueError(f"rate must be a finite number >= 0 (0: unpaced), got {rate!r}")
    if not (isinstance(join_after, (int, float)) and 0 <= join_after <= 1):
        raise ValueError(f"join_after must be in [0, 1], got {join_after!r}")
    t0 = time.monotonic()
    engine = DemoEngine(capacity=capacity)
    prompts = synthetic_prompts(steps, seed)
    tmp = tempfile.mkdtemp(prefix="kvwire-demo-")
    pub = ZmqEventPublisher(
        endpoint=f"ipc://{tmp}/events",
        replay_endpoint=f"ipc://{tmp}/replay",
        topic="kv-events",
        heartbeat_interval=0.2,
    )
    rebuilt = BlockCache()
    truth = BlockCache()
    got = {"batches": 0, "snapshot_blocks": 0, "joined": -1}
    stop = threading.Event()
    caught_up = threading.Event()
    target = [1 << 62]
    spec = StreamSpec("engine0", pub.endpoint, "kv-events", pub.replay_endpoint)

    def consume() -> None:
        with Subscriber([spec]) as sub:
            while not stop.is_set():
                item = sub.poll(0.05)
                if isinstance(item, Reset):
                    rebuilt.clear()
                elif isinstance(item, Snapshot):
                    rebuilt.clear()
                    rebuilt.apply_events(item.blocks)
                    got["snapshot_blocks"] = item.block_count
                    got["joined"] = item.seq
                    out(f"  subscriber joined late: snapshot of {item.block_count} blocks "
                        f"as of seq {item.seq}")
                elif isinstance(item, Batch):
                    rebuilt.apply(item.batch)
                    got["batches"] += 1
                    if item.seq >= target[0]:
                        caught_up.set()
            got["stats"] = sub.stats()["engine0"].stream

    th = threading.Thread(target=consume, name="kvwire-demo-subscriber", daemon=True)
    out(f"demo engine publishing on {pub.endpoint} (replay/snapshot {pub.replay_endpoint})")
    published = 0
    interval = 1.0 / rate if rate > 0 else 0.0
    next_t = time.monotonic()
    join_step = int(steps * join_after)
    for i, prompt in enumerate(prompts):
        if i == join_step:
            th.start()
        batch = engine.step(prompt)
        if batch is not None:
            pub.publish(batch)
            truth.apply(batch)
            published += 1
        if (i + 1) % max(1, steps // 5) == 0:
            out(f"  step {i + 1}/{steps}: cache {len(engine.lru)} blocks, "
                f"hit rate {engine.hit_blocks / max(1, engine.total_blocks):.1%}")
        if interval:
            next_t += interval
            pause = next_t - time.monotonic()
            if pause > 0:
                time.sleep(pause)
    if not th.is_alive():
        th.start()
    # Everything published must arrive: wait on the condition, bounded.
    target[0] = pub.stats().last_seq
    caught_up.wait(15.0)
    stop.set()
    th.join(5.0)
    pub.shutdown(timeout=2.0)
    shutil.rmtree(tmp, ignore_errors=True)
    st = got.get("stats")
    return DemoSummary(
        steps=steps,
        batches_published=published,
        joined_at_seq=got["joined"],
        snapshot_blocks=got["snapshot_blocks"],
        batches_delivered=got["batches"],
        blocks_stored=engine.stored,
        blocks_removed=engine.removed,
        prefix_hit_rate=engine.hit_blocks / max(1, engine.total_blocks),
        gaps=st.gaps if st else 0,
        replayed=st.replayed if st else 0,
        lost=st.lost if st else 0,
        engine_blocks=len(engine.lru),
        rebuilt_blocks=len(rebuilt),
        rebuilt_matches=rebuilt.as_dict() == truth.as_dict()
        and {h for _, h in truth.as_dict()} == set(engine.lru),
        seconds=time.monotonic() - t0,
    )
