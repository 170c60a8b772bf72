"""Benchmark kvwire.index.PrefixIndex: ingest rate, match latency, memory per block, churn.

Workload (deterministic for a seed): 64 engines (streams) x 16-token blocks. A pool of
prompt families (8k tokens = 512 blocks each, random token ids); each engine caches the
full 512-block chain of some of them, stored as vLLM-format ``BlockStored`` events of 32
blocks (a 512-token chunk, parent = the previous chunk's last hash), 4 events per batch,
until the index holds ``--blocks`` blocks (1M by default). Events are decoded values
(``Batch`` deliveries as the subscriber yields them); building them is not timed, applying
them is, own hashing included.

Match: an 8k-token prompt (512 blocks) against that index, p50/p99 over many prompts:
``typical`` = a cached family's prompt (held by the engines that cached it) with a fresh
tail; ``all-64`` = the worst case, a prompt every one of the 64 engines holds in full (the
walk never stops early); ``miss`` = a prompt nobody holds.

Baselines measured in the same run: a naive index (dict of sets of stream names keyed by
Python ``hash()`` of (parent key, token tuple), dict (stream, engine hash) -> key), and NVIDIA
Dynamo's radix tree (``ai-dynamo-runtime``, through its Python binding ``dynamo._core``) when
it is importable (a loud SKIPPED row when not): the same events as Dynamo's JSON ``stored``
events (its per-block ``tokens_hash`` from ``compute_block_hash_for_seq``, computed untimed:
the engine side's work), the same prompts hashed and matched by ``find_matches`` (timed).

Memory per indexed block: the RSS delta of ingesting the whole workload into each index
(each measured around its own ingest, the event garbage's high-water mark reached before).

    .venv/bin/python bench/index.py            # 1M blocks, about 1-2 minutes
    .venv/bin/python bench/index.py --quick    # 200k blocks
    .venv/bin/python bench/index.py --churn    # also 10^6 store/remove churn steps
    .venv/bin/python bench/index.py --key-scheme kvwire   # the earlier key scheme

Keys: the index's default scheme, the standard block hash (RFC #1527 sequence hashes, u32
tokens), or ``--key-scheme kvwire`` (int64 tokens, one xxh3 per block); docs/prefix-index.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
import tracemalloc
from collections.abc import Iterator

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from host import Steal  # noqa: E402

from kvwire.consume.stream import Batch  # noqa: E402
from kvwire.index import PrefixIndex  # noqa: E402
from kvwire.index.keys import NATIVE, REASON  # noqa: E402
from kvwire.wire.events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

#: The index's key scheme (--key-scheme).
KEY_SCHEME = "standard"

try:  # NVIDIA Dynamo's radix tree, the second baseline (pip install ai-dynamo-runtime==1.6.1)
    from dynamo._core import RadixTree as DynamoTree  # type: ignore[import-not-found]
    from dynamo._core import compute_block_hash_for_seq  # type: ignore[import-not-found]

    DYNAMO_MISSING = ""
except Exception as e:  # noqa: BLE001 - any import failure means: skip it, loudly
    DynamoTree = compute_block_hash_for_seq = None
    DYNAMO_MISSING = f"{type(e).__name__}: {e}"

BS = 16
FAMILY_BLOCKS = 512
CHUNK = 32
ENGINES = 64


class Workload:
    def __init__(self, blocks: int, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.vocab = list(range(32_000))  # shared int objects: token lists are pointer arrays
        pairs = blocks // FAMILY_BLOCKS
        per_engine = max(1, pairs // ENGINES)
        families = max(per_engine * 4, 64)
        self.families = [[self.vocab[rng.randrange(32_000)] for _ in range(FAMILY_BLOCKS * BS)]
                         for _ in range(families)]
        self.holders: dict[int, list[int]] = {}
        self.plan: list[tuple[int, int]] = []
        for e in range(ENGINES):
            for f in rng.sample(range(families), per_engine):
                self.plan.append((e, f))
                self.holders.setdefault(f, []).append(e)
        rng.shuffle(self.plan)
        self.blocks = len(self.plan) * FAMILY_BLOCKS
        self.rng = rng

    @staticmethod
    def ehash(f: int, i: int) -> int:
        return (0x9E37_79B9_7F4A_7C15 * (f * 4096 + i + 1)) & 0xFFFF_FFFF_FFFF_FFFF

    def batches(self, per: int = 4) -> Iterator[list[Batch]]:
        """Deliveries in chunks of about 64k blocks (so the events are never all in memory)."""
        out: list[Batch] = []
        evs: list[BlockStored] = []
        seq = 0
        for e, f in self.plan:
            toks = self.families[f]
            for c in range(0, FAMILY_BLOCKS, CHUNK):
                hs = [self.ehash(f, i) for i in range(c, c + CHUNK)]
                parent = None if c == 0 else self.ehash(f, c - 1)
                evs.append(BlockStored(hs, parent, toks[c * BS : (c + CHUNK) * BS], BS, None,
                                       "GPU", None))
                if len(evs) == per:
                    out.append(Batch(f"engine{e}/dp0", seq, KVEventBatch(0.0, evs)))
                    seq += 1
                    evs = []
            if len(out) * per * CHUNK >= 65_536:
                yield out
                out = []
        if evs:
            out.append(Batch("engine0/dp0", seq, KVEventBatch(0.0, evs)))
        if out:
            yield out

    def prompt(self, kind: str) -> list[int]:
        tail = [self.vocab[self.rng.randrange(32_000)] for _ in range(64 * BS)]
        if kind == "miss":
            return [self.vocab[self.rng.randrange(32_000)] for _ in range(FAMILY_BLOCKS * BS)]
        f = self.rng.choice(sorted(self.holders))
        return self.families[f][: (FAMILY_BLOCKS - 64) * BS] + tail


class NaiveIndex:
    """The baseline: dict of sets, Python hash() of (parent key, token tuple)."""

    def __init__(self) -> None:
        self.index: dict[int, set[str]] = {}
        self.h2k: dict[tuple[str, int], int] = {}

    def apply(self, item: Batch) -> None:
        s = item.stream
        for ev in item.batch.events:
            if type(ev) is BlockStored:
                bs = ev.block_size
                prev = 0 if ev.parent_block_hash is None else self.h2k[(s, ev.parent_block_hash)]
                toks = ev.token_ids
                for i, h in enumerate(ev.block_hashes):
                    prev = hash((prev, tuple(toks[i * bs : (i + 1) * bs])))
                    self.index.setdefault(prev, set()).add(s)
                    self.h2k[(s, h)] = prev
            elif type(ev) is BlockRemoved:
                for h in ev.block_hashes:
                    k = self.h2k.pop((s, h), None)
                    if k is not None:
                        self.index[k].discard(s)

    def match(self, toks: list[int], streams: list[str]) -> dict[str, int]:
        alive = set(streams)
        out = dict.fromkeys(streams, 0)
        prev = 0
        for i in range(len(toks) // BS):
            prev = hash((prev, tuple(toks[i * BS : (i + 1) * BS])))
            holders = self.index.get(prev)
            nxt = alive & holders if holders else set()
            for s in alive - nxt:
                out[s] = i
            alive = nxt
            if not alive:
                break
        else:
            for s in alive:
                out[s] = len(toks) // BS
        return out


class DynamoIndex:
    """NVIDIA Dynamo's RadixTree (its Python binding): one node per prefix block with the set
    of workers holding it, fed JSON ``stored`` events keyed by the engine's block hashes."""

    def __init__(self) -> None:
        self.tree = DynamoTree()
        self.workers: dict[str, int] = {}
        self.event_id = 0

    def prepare(self, item: Batch) -> list:
        """A delivery as Dynamo events (untimed: the engine computes ``tokens_hash``)."""
        wid = self.workers.setdefault(item.stream, len(self.workers))
        out = []
        for ev in item.batch.events:
            if type(ev) is not BlockStored:
                raise TypeError("the index workload only stores")
            local = compute_block_hash_for_seq(ev.token_ids, ev.block_size)
            self.event_id += 1
            out.append((wid, json.dumps({"event_id": self.event_id, "data": {"stored": {
                "parent_hash": ev.parent_block_hash,
                "blocks": [{"block_hash": h, "tokens_hash": t}
                           for h, t in zip(ev.block_hashes, local)]}}}).encode()))
        return out

    def apply(self, prepared: list) -> None:
        apply = self.tree.apply_event
        for wid, payload in prepared:
            apply(wid, payload)

    def match(self, toks: list[int]) -> dict:
        return self.tree.find_matches(compute_block_hash_for_seq(toks, BS)).scores


def ingest(w: Workload, idx, prepare=None) -> tuple[float, float, int]:
    """CPU seconds (this process: Dynamo's binding applies on a thread of its own while the
    caller waits) and wall seconds spent in apply() for the whole workload, and blocks
    applied. CPU time is what "one core" means on a box shared with other work.
    ``prepare`` turns a delivery into what ``idx.apply`` takes, untimed."""
    cpu = wall = 0.0
    n = 0
    gc.disable()  # the subscriber's items are untracked; keep collector pauses out of the loop
    try:
        for chunk in w.batches():
            items = chunk if prepare is None else [prepare(item) for item in chunk]
            c, t = time.process_time(), time.perf_counter()
            for item in items:
                idx.apply(item)
            cpu += time.process_time() - c
            wall += time.perf_counter() - t
            n += sum(len(e.block_hashes) for b in chunk for e in b.batch.events)
            del items
    finally:
        gc.enable()
    return cpu, wall, n


def rss() -> int | None:
    """This process's resident set in bytes (None off Linux)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def measured_ingest(w: Workload, idx, prepare=None) -> tuple[float, float, int, float | None]:
    """``ingest`` plus the RSS it added per block (every index is kept alive, so each delta
    is that index's own memory; None off Linux)."""
    gc.collect()
    r0 = rss()
    cpu, wall, n = ingest(w, idx, prepare)
    gc.collect()
    r1 = rss()
    return cpu, wall, n, None if r0 is None or r1 is None else (r1 - r0) / n


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def time_match(fn, prompts: list[list[int]]) -> str:
    """p50/p99 in us of CPU time (this process, all its threads) and of wall time."""
    cs, ws = [], []
    for p in prompts:
        c, t = time.process_time_ns(), time.perf_counter_ns()
        fn(p)
        ws.append((time.perf_counter_ns() - t) / 1000)
        cs.append((time.process_time_ns() - c) / 1000)
    return (f"cpu p50 {pct(cs, 50):.0f} / p99 {pct(cs, 99):.0f} us; "
            f"wall p50 {pct(ws, 50):.0f} / p99 {pct(ws, 99):.0f} us")


def calibration() -> str:
    """How fast this core is right now: CPU ms of a fixed pure-Python loop (best of 5)."""
    best = min(_calib() for _ in range(5))
    return f"sum(range(10**6)) takes {best * 1e3:.1f} ms of CPU"


def jitter() -> str:
    """This host's own tail: a fixed ~50 us pure-Python loop timed like a match, 2000 times.
    Its p99/p50 is what the box adds to any p99 here (a VM's steal, interrupts), whatever
    the code does."""
    def work(_: object) -> None:
        s = 0
        for i in range(2000):
            s += i

    return time_match(work, [None] * 2000)


def _calib() -> float:
    c = time.thread_time()
    sum(range(10**6))
    return time.thread_time() - c


def churn_rows(steps: int) -> list[tuple[str, str, str]]:
    # removed hashes are remembered in two generations of `remember_removed`: sampled at a
    # period that is not a multiple of it, that sawtooth would look like slow growth, so it
    # is kept small here (the flatness being shown is the index's own)
    idx = PrefixIndex(remember_removed=1000, key_scheme=KEY_SCHEME)
    nb = 100_000

    def ev(i: int) -> BlockStored:
        return BlockStored([i], None, list(range(i, i + BS)), BS, None, None, None)

    idx.apply(Batch("e", 0, KVEventBatch(0.0, [ev(i) for i in range(nb)])))
    marks = []
    t = time.perf_counter()
    for start in range(nb, nb + steps, 100):
        evs: list = []
        for i in range(start, start + 100):
            evs.append(BlockRemoved([i - nb], None))
            evs.append(ev(i))
        idx.apply(Batch("e", 1, KVEventBatch(0.0, evs)))
        if (start + 100 - nb) % (steps // 5) == 0:
            gc.collect()
            marks.append(sys.getallocatedblocks())
    el = time.perf_counter() - t
    return [(f"churn {steps:,} store+remove at {nb:,} blocks", "kvwire",
             f"allocated objects per 1/5: {', '.join(f'{m:,}' for m in marks)} "
             f"({2 * steps / el / 1e6:.2f} M events/s)")]


def bytes_per_distinct_block() -> float:
    idx = PrefixIndex(key_scheme=KEY_SCHEME)
    evs = [BlockStored([(i * 7919 + 1) << 20], None, list(range(i, i + BS)), BS, None, None,
                       None) for i in range(50_000)]
    gc.collect()
    tracemalloc.start()
    b = tracemalloc.get_traced_memory()[0]
    idx.apply(Batch("e", 0, KVEventBatch(0.0, evs)))
    used = tracemalloc.get_traced_memory()[0] - b
    tracemalloc.stop()
    return used / len(evs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--quick", action="store_true", help="200k blocks, fewer prompts")
    ap.add_argument("--churn", action="store_true", help="also 10^6 churn steps")
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--churn-only", action="store_true", help="only the 10^6-step churn row")
    ap.add_argument("--key-scheme", choices=("standard", "kvwire"), default="standard",
                    help="the index's key scheme (default: standard)")
    a = ap.parse_args()
    global KEY_SCHEME
    KEY_SCHEME = a.key_scheme
    steal = Steal()
    blocks = 200_000 if a.quick else a.blocks
    nprompts = 300 if a.quick else a.prompts
    if a.churn_only:
        for r in churn_rows(1_000_000):
            print("  ".join(r))
        return
    w = Workload(blocks)
    rows: list[tuple[str, str, str]] = []

    rows.append(("calibration (this core, now)", "", calibration()))
    rows.append(("host jitter: a fixed ~50 us loop, timed alike", "", jitter()))
    for _ in w.batches():  # the event garbage's high-water mark, before any RSS is read
        break
    mem: list[tuple[str, str, str]] = []

    def ingested(name: str, cpu: float, wall: float, n: int, per: float | None) -> None:
        what = f"ingest {n:,} blocks (32-block events, {ENGINES} streams)"
        rows.append(("" if name != "kvwire" else what, name,
                     f"{n / cpu / 1e6:.2f} M blocks/s of CPU ({n / wall / 1e6:.2f} M/s wall)"
                     + (" (apply_event only)" if name == "dynamo" else "")))
        what = "memory per indexed block (RSS delta of the ingest)"
        mem.append(("" if mem else what, name, "?" if per is None else f"{per:.0f} B"))

    idx = PrefixIndex(key_scheme=KEY_SCHEME)
    cpu, wall, n, per = measured_ingest(w, idx)
    ingested("kvwire", cpu, wall, n, per)
    naive = dyn = None
    if not a.no_baseline:
        naive = NaiveIndex()
        ingested("naive", *measured_ingest(w, naive))
        if DynamoTree is None:
            print(f"bench/index.py: Dynamo baseline SKIPPED: ai-dynamo-runtime not importable "
                  f"({DYNAMO_MISSING}); pip install ai-dynamo-runtime==1.6.1", file=sys.stderr)
            rows.append(("", "dynamo", f"SKIPPED: not importable ({DYNAMO_MISSING})"))
        else:
            dyn = DynamoIndex()
            ingested("dynamo", *measured_ingest(w, dyn, dyn.prepare))
    streams = sorted(idx.streams())
    for kind in ("typical", "all-64", "miss"):
        if kind == "all-64":  # every engine caches one more family, in full
            extra = Workload(0, seed=99).families[0]
            ev = [BlockStored([Workload.ehash(10**6, i) for i in range(FAMILY_BLOCKS)], None,
                              extra, BS, None, None, None)]
            for s in streams:
                item = Batch(s, 0, KVEventBatch(0.0, ev))
                idx.apply(item)
                if naive is not None:
                    naive.apply(item)
                if dyn is not None:
                    dyn.apply(dyn.prepare(item))
            prompts = [extra[: (FAMILY_BLOCKS - 1) * BS] + w.prompt("miss")[:BS]
                       for _ in range(nprompts)]
        else:
            prompts = [w.prompt(kind) for _ in range(nprompts)]
        rows.append((f"match 8k-token prompt, {kind}", "kvwire", time_match(idx.match, prompts)))
        if naive is not None:
            rows.append(("", "naive", time_match(lambda p: naive.match(p, streams),
                                                 prompts[: nprompts // 4])))
        if dyn is not None:
            rows.append(("", "dynamo", time_match(dyn.match, prompts)))
    rows += mem
    rows.append(("memory per distinct block, 1 stream (tracemalloc)", "kvwire",
                 f"{bytes_per_distinct_block():.0f} B"))
    if a.churn:
        rows += churn_rows(1_000_000)

    w0 = max(len(r[0]) for r in rows)
    keys = "C keys" if NATIVE else f"pure-Python keys: {REASON}"
    print(f"kvwire index bench ({os.cpu_count()} cpus, {len(streams)} streams, "
          f"{idx_blocks(idx):,} blocks indexed, {keys}, key scheme {KEY_SCHEME}; {steal})")
    print(f"{'measurement':<{w0}}  {'index':<7}  result")
    for r in rows:
        print(f"{r[0]:<{w0}}  {r[1]:<7}  {r[2]}")


def idx_blocks(idx: PrefixIndex) -> int:
    return sum(s.blocks for s in idx.streams().values())


if __name__ == "__main__":
    main()
