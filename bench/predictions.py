"""Benchmark what a busy router's predictions cost the index (kvwire.index.PrefixIndex).

A router predicts every prompt it routes (the prompt counts as held by its engine until that
engine's events store it) and holds the prediction for ``predict_ttl`` seconds at most. At
``--rate`` requests/s of ``--blocks``-block prompts that is rate x ttl x blocks keys live
(1,000/s x 3 s x 128 = 384k; more in a bench with no engine events to confirm them).

Three measurements, each against a baseline in the same run:

* ``predict``: the wall time of each ``predict_keys`` call (one prompt) at steady state, on
  a simulated clock (``1 / rate`` per call), p50 / p99 / p99.9 / max and the calls over
  5 ms. kvwire keeps predictions in ``PRED_SHARDS`` dicts; the baseline is the same index
  with one dict (the layout before 2026-11-30, made by setting the shard constants to one
  shard: every call does the same operations). A dict that churns is rebuilt by CPython in
  one go now and then; a route waits for that under the router's lock.
* ``match``: a cached 8k-token prompt (512 blocks, 8 engines hold it) with no prediction
  live, and with the churn's predictions live (none on the prompt). Before 2026-11-30 any
  live prediction took the C scan off its fast path (a dict probe per block); the baseline
  here is the same index with none live.
* ``ingest``: 32-block stores with predictions live on every engine, and with none. Before
  2026-11-30 a stream with any live prediction stored on the Python path.

    .venv/bin/python bench/predictions.py
    .venv/bin/python bench/predictions.py --rate 1000 --blocks 128 --ttl 3 --calls 20000
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from array import array

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from host import Steal  # noqa: E402

from kvwire.consume.stream import Batch  # noqa: E402
from kvwire.index import PrefixIndex  # noqa: E402
from kvwire.index import prefix as _prefix  # noqa: E402
from kvwire.index import state as _state  # noqa: E402
from kvwire.index import walk as _walk  # noqa: E402
from kvwire.index.keys import NATIVE, REASON  # noqa: E402
from kvwire.wire.events import BlockStored, KVEventBatch  # noqa: E402

BS = 16
ENGINES = 8


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


class Layout:
    """The prediction layout while in the ``with``: ``shards`` dicts (64: kvwire's; 1: the
    layout before 2026-11-30)."""

    def __init__(self, shards: int) -> None:
        self.shards = shards
        self.shift = 64 - (shards.bit_length() - 1)

    def __enter__(self) -> Layout:
        self.saved = (_state.PRED_SHARDS, _prefix.PRED_SHIFT, _walk.PRED_SHIFT)
        _state.PRED_SHARDS = self.shards
        _prefix.PRED_SHIFT = _walk.PRED_SHIFT = self.shift
        return self

    def __exit__(self, *exc: object) -> None:
        _state.PRED_SHARDS, _prefix.PRED_SHIFT, _walk.PRED_SHIFT = self.saved


def churn(idx: PrefixIndex, clock: list[float], a: argparse.Namespace) -> list[float]:
    """``a.calls`` predictions of ``a.blocks`` random keys, round robin over the engines,
    ``1 / a.rate`` apart; the wall time of each call after the first ttl (steady state)."""
    rng = random.Random(7)
    warm = int(a.rate * a.ttl)
    lat = []
    for i in range(warm + a.calls):
        clock[0] += 1.0 / a.rate
        keys = array("Q", (rng.getrandbits(64) for _ in range(a.blocks)))
        t = time.perf_counter()
        idx.predict_keys(f"engine{i % ENGINES}", keys)
        if i >= warm:
            lat.append(time.perf_counter() - t)
    return lat


def cached(idx: PrefixIndex) -> list[int]:
    """Store one 512-block prompt on every engine; return it."""
    rng = random.Random(3)
    toks = [rng.randrange(32_000) for _ in range(512 * BS)]
    for e in range(ENGINES):
        evs = [BlockStored([(e << 40) + c * 32 + i + 1 for i in range(32)],
                           None if c == 0 else (e << 40) + c * 32, toks[c * 32 * BS:(c + 1) * 32 * BS],
                           BS, None, "GPU", None) for c in range(16)]
        idx.apply(Batch(f"engine{e}", 0, KVEventBatch(0.0, evs)))
    return toks


def ingest_rate(live: bool, n_batches: int = 4000) -> float:
    """M blocks/s of CPU applying 32-block stores (4 a batch, 8 engines), with predictions
    live on every engine (none of them on the stored blocks) or none."""
    rng = random.Random(1)
    idx = PrefixIndex(predict_ttl=1e9, clock=lambda: 0.0)
    if live:
        for e in range(ENGINES):
            idx.predict_keys(f"engine{e}", array("Q", (rng.getrandbits(64) for _ in range(128))))
    batches = []
    for b in range(n_batches):
        evs = [BlockStored([(b * 4 + c) * 32 + i + 1 for i in range(32)], None,
                           [rng.randrange(32_000) for _ in range(32 * BS)], BS, None, "GPU", None)
               for c in range(4)]
        batches.append(Batch(f"engine{b % ENGINES}", b // ENGINES, KVEventBatch(0.0, evs)))
    t = time.process_time()
    for bt in batches:
        idx.apply(bt)
    return n_batches * 4 * 32 / (time.process_time() - t) / 1e6


def time_match(idx: PrefixIndex, prompt: list[int], n: int = 2000) -> tuple[float, float]:
    ws = []
    for _ in range(n):
        t = time.perf_counter_ns()
        idx.match(prompt)
        ws.append((time.perf_counter_ns() - t) / 1000)
    return pct(ws, 50), pct(ws, 99)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rate", type=float, default=1000.0, help="predictions (requests) per second")
    ap.add_argument("--blocks", type=int, default=128, help="blocks per prediction")
    ap.add_argument("--ttl", type=float, default=3.0, help="predict_ttl, seconds")
    ap.add_argument("--calls", type=int, default=20_000, help="calls timed at steady state")
    a = ap.parse_args()
    if a.rate <= 0 or a.blocks < 1 or a.ttl <= 0 or a.calls < 100:
        ap.error("--rate and --ttl must be > 0, --blocks >= 1, --calls >= 100")
    steal = Steal()
    rows: list[tuple[str, str, str]] = []
    for name, shards in (("kvwire", _state.PRED_SHARDS), ("one dict", 1)):
        with Layout(shards):
            clock = [0.0]
            idx = PrefixIndex(predict_ttl=a.ttl, clock=lambda c=clock: c[0])
            prompt = cached(idx)
            quiet = time_match(idx, prompt)
            gc.collect()
            lat = [x * 1e3 for x in churn(idx, clock, a)]
            live = sum(len(d) for d in idx._h.pred)
            busy = time_match(idx, prompt)
        what = (f"predict {a.blocks} blocks ({live:,} live)" if name == "kvwire" else "")
        rows.append((what, f"{name} ({shards})",
                     f"p50 {pct(lat, 50):.3f} / p99 {pct(lat, 99):.3f} / p99.9 "
                     f"{pct(lat, 99.9):.2f} / max {max(lat):.1f} ms; "
                     f"{sum(x > 5 for x in lat)} of {len(lat):,} calls over 5 ms"))
        if name == "kvwire":
            rows.append(("match 512 cached blocks, none predicted", "kvwire",
                         f"p50 {quiet[0]:.0f} / p99 {quiet[1]:.0f} us"))
            rows.append(("", "+ predictions live",
                         f"p50 {busy[0]:.0f} / p99 {busy[1]:.0f} us"))
            rates = {live: max(ingest_rate(live) for _ in range(3)) for live in (False, True)}
            rows.append(("ingest 512k blocks (32-block stores), best of 3", "kvwire",
                         f"{rates[False]:.2f} M blocks/s of CPU"))
            rows.append(("", "+ predictions live", f"{rates[True]:.2f} M blocks/s of CPU"))
    w0 = max(len(r[0]) for r in rows)
    keys = "C keys" if NATIVE else f"pure-Python keys: {REASON}"
    print(f"kvwire prediction bench ({os.cpu_count()} cpus, {ENGINES} engines, {a.rate:g} "
          f"predictions/s x {a.blocks} blocks x {a.ttl:g} s ttl, {keys}; {steal})")
    print(f"{'measurement':<{w0}}  {'layout':<18}  result")
    for r in rows:
        print(f"{r[0]:<{w0}}  {r[1]:<18}  {r[2]}")


if __name__ == "__main__":
    main()
