"""Simulator throughput: N requests x all five policies, wall time (issue 10 §4 target:
12,000 requests x 5 policies within 5 minutes on 2 cores), and the routing-quality targets
of §6 on the bundled trace (8 engines x 5,000 blocks).

    .venv/bin/python bench/sim.py                   # 12,000 requests (bundled trace x4, cut)
    .venv/bin/python bench/sim.py --requests 3993   # the bundled trace once (the §6 run)
    .venv/bin/python bench/sim.py --engine-model fifo   # the one-request-at-a-time model
"""

from __future__ import annotations

import argparse
import time

from kvwire.sim.fleet import POLICIES, SimConfig, run_sim
from kvwire.sim.trace import bundled_trace_path, load_trace, repeat_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12_000)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=5000)
    ap.add_argument("--engine-model", choices=("batched", "fifo"), default="batched")
    args = ap.parse_args()
    base = load_trace(bundled_trace_path())
    reqs = repeat_trace(base, -(-args.requests // len(base)))[: args.requests]
    cfg = SimConfig(engines=args.engines, capacity=args.capacity, engine_model=args.engine_model)
    t0 = time.monotonic()
    res = run_sim(reqs, cfg, POLICIES, progress=None, workers=None)
    wall = time.monotonic() - t0
    print(res.table())
    print()
    print("| requests | policies | wall s | per policy s |")
    print("|---:|---:|---:|---|")
    per = ", ".join(f"{n} {r.wall_s:.1f}" for n, r in res.results.items())
    print(f"| {len(reqs)} | {len(POLICIES)} | {wall:.1f} | {per} |")
    verdict = "MET" if wall <= 300 else "MISSED"
    print(f"target: {len(reqs)} x {len(POLICIES)} policies <= 300 s: {verdict}")
    kv, orc, rnd = (res.results[p] for p in ("kvwire", "oracle", "random"))
    print()
    print("| quality (kvwire) | value | target |")
    print("|---|---:|---|")
    print(f"| hit ratio / oracle's | {kv.hit_ratio / orc.hit_ratio:.3f} | >= 0.98 |")
    print(f"| hit ratio / random's | {kv.hit_ratio / rnd.hit_ratio:.2f} | >= 2.5 |")
    print(f"| prefix reuse (tokens) | {kv.prefix_reuse_ratio:.3f} | |")
    print(f"| work max/mean | {kv.work_max_over_mean:.3f} | <= 1.10 |")


if __name__ == "__main__":
    main()
