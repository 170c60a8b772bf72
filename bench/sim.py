"""Simulator throughput: N requests x all five policies, wall time (target:
12,000 requests x 5 policies within 5 minutes on 2 cores), and the routing-quality targets
on the bundled trace (8 engines x 5,000 blocks).

    .venv/bin/python bench/sim.py                   # 12,000 requests (bundled trace x4, cut)
    .venv/bin/python bench/sim.py --requests 3993   # the bundled trace once (the quality run)
    .venv/bin/python bench/sim.py --engine-model fifo   # the one-request-at-a-time model
    .venv/bin/python bench/sim.py --compare         # kvwire vs SGLang's cache_aware, at 1x-4x
    .venv/bin/python bench/sim.py --ablate          # kvwire with and without its load rules
    .venv/bin/python bench/sim.py --compare --loads 3 --clairvoyant   # and clairvoyant (~9 min)
    .venv/bin/python bench/sim.py --replicas 4 --loads 3,4   # router replicas, load shared
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from kvwire.sim.fleet import POLICIES, SimConfig, run_sim
from kvwire.sim.floor import ttft_floor
from kvwire.sim.trace import bundled_trace_path, load_trace, repeat_trace


def compare(loads: list[float], engines: int, capacity: int,
            clairvoyant: bool = False) -> None:
    """The bundled trace at each load (its arrival times divided by it), under kvwire's
    default policy, its tail-first slack (32,768 tokens), the cost before the slack
    (load_weight 0.5, no slack), SGLang's cache_aware and round robin; the routing targets
    checked for each load (kvwire's default); with ``clairvoyant``, the policy that runs
    every engine ahead to give each request its earliest first token (perfect knowledge of
    the engines, greedy); last, the floor no router can go below (kvwire.sim.floor)."""
    base = load_trace(bundled_trace_path())
    print("| load | policy | hit ratio | work max/mean | TTFT p50 s | TTFT p99 s | e2e p99 s |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    verdicts = []
    for load in loads:
        reqs = [replace(r, t=r.t / load) for r in base]
        cfg = SimConfig(engines=engines, capacity=capacity)
        res = dict(run_sim(reqs, cfg, ["kvwire", "sglang", "round_robin"], workers=None).results)
        old = replace(cfg, load_weight=0.5, balance_slack_tokens=0)
        res["kvwire (old cost)"] = run_sim(reqs, old, ["kvwire"]).results["kvwire"]
        tail = replace(cfg, balance_slack_tokens=32_768)
        res["kvwire (slack 32,768)"] = run_sim(reqs, tail, ["kvwire"]).results["kvwire"]
        if clairvoyant:
            res["clairvoyant greedy"] = run_sim(reqs, cfg, ["clairvoyant"]).results[
                "clairvoyant"]
        for name in ("kvwire", "kvwire (slack 32,768)", "kvwire (old cost)", "sglang",
                     "round_robin", *(["clairvoyant greedy"] if clairvoyant else [])):
            s = res[name].summary()
            print(f"| {load:g}x | {name} | {s['hit_ratio']:.3f} | {s['work_max_over_mean']:.3f} "
                  f"| {s['ttft_p50_s']:.2f} | {s['ttft_p99_s']:.2f} | {s['e2e_p99_s']:.2f} |",
                  flush=True)
        kv, sg, rr = (res[n].summary() for n in ("kvwire", "sglang", "round_robin"))
        verdicts.append((load, [
            ("TTFT p99 <= 0.5x round robin's", kv["ttft_p99_s"] / rr["ttft_p99_s"], 0.5),
            ("TTFT p99 <= 0.8x SGLang's", kv["ttft_p99_s"] / sg["ttft_p99_s"], 0.8),
            ("hit ratio >= SGLang's (ratio)", kv["hit_ratio"] / sg["hit_ratio"], -1.0),
            ("work max/mean <= 1.05", kv["work_max_over_mean"], 1.05)]))
    fl = ttft_floor(base, SimConfig(engines=engines, capacity=capacity))
    f99 = fl.ttft_pct(0.99)
    print(f"| any | floor: each request alone, cache unbounded | {fl.hit_ratio:.3f} | - "
          f"| {fl.ttft_pct(0.5):.2f} | {f99:.2f} | - |")
    print()
    for load, checks in verdicts:
        for label, v, lim in checks:
            ok = v >= -lim if lim < 0 else v <= lim
            print(f"{load:g}x: {label}: {v:.3f} {'MET' if ok else 'MISSED'}")
    print(f"no router's TTFT p99 can go below the floor's, {f99:.2f} s; a target under it "
          "is out of reach at that load")


def ablate(loads: list[float], engines: int, capacity: int) -> None:
    """kvwire's policy with and without each of its two load rules: the drained load
    (LoadTracker.load: prefill worked off at the learned rate) and the balance slack
    (131,072 tokens, the default, against 32,768, which trades hits for a shorter tail)."""
    base = load_trace(bundled_trace_path())
    print("| load | drained load | slack (tokens) | hit ratio | work max/mean | TTFT p50 s "
          "| TTFT p99 s |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for load in loads:
        reqs = [replace(r, t=r.t / load) for r in base]
        for drain in (True, False):
            for slack in (32_768, 131_072):
                cfg = SimConfig(engines=engines, capacity=capacity, drain=drain,
                                balance_slack_tokens=slack)
                s = run_sim(reqs, cfg, ["kvwire"]).results["kvwire"].summary()
                print(f"| {load:g}x | {'yes' if drain else 'no'} | {slack:,} "
                      f"| {s['hit_ratio']:.3f} | {s['work_max_over_mean']:.3f} "
                      f"| {s['ttft_p50_s']:.2f} | {s['ttft_p99_s']:.2f} |", flush=True)


def replicas(loads: list[float], engines: int, capacity: int, n: int) -> None:
    """kvwire's policy as one router, as ``n`` replicas that each route on their own load
    (requests spread over them in turn), and as ``n`` replicas that share it (router/
    load_share.py's reports, arriving 0, 2 or 20 ms of model time after they were sent)."""
    base = load_trace(bundled_trace_path())
    print("| load | routers | hit ratio | work max/mean | TTFT p50 s | TTFT p99 s |")
    print("|---:|---|---:|---:|---:|---:|")
    for load in loads:
        reqs = [replace(r, t=r.t / load) for r in base]
        cfg = SimConfig(engines=engines, capacity=capacity)
        rows = [("one", cfg), (f"{n} apart", replace(cfg, replicas=n, share_load=False))]
        rows += [(f"{n} sharing, {d * 1e3:g} ms", replace(cfg, replicas=n, share_delay=d))
                 for d in (0.0, 0.002, 0.02)]
        for label, c in rows:
            s = run_sim(reqs, c, ["kvwire"], workers=1).results["kvwire"].summary()
            print(f"| {load:g}x | {label} | {s['hit_ratio']:.3f} "
                  f"| {s['work_max_over_mean']:.3f} | {s['ttft_p50_s']:.2f} "
                  f"| {s['ttft_p99_s']:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12_000)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=5000)
    ap.add_argument("--engine-model", choices=("batched", "fifo"), default="batched")
    ap.add_argument("--ablate", action="store_true",
                    help="kvwire with and without the drained load, at slacks of 32,768 "
                         "and 131,072 tokens, at --loads")
    ap.add_argument("--compare", action="store_true",
                    help="kvwire vs SGLang's cache_aware vs round robin at --loads")
    ap.add_argument("--clairvoyant", action="store_true",
                    help="--compare: also the clairvoyant policy, which runs every engine "
                         "ahead (slow: about 9 minutes a load on 2 cores)")
    ap.add_argument("--replicas", type=int, default=0, metavar="N",
                    help="kvwire as one router and as N replicas, apart and sharing their "
                         "load, at --loads")
    ap.add_argument("--loads", default="1,2,3,4",
                    help="--compare: arrival-rate multipliers of the bundled trace")
    args = ap.parse_args()
    if args.replicas:
        replicas([float(x) for x in args.loads.split(",")], args.engines, args.capacity,
                 args.replicas)
        return
    if args.ablate:
        ablate([float(x) for x in args.loads.split(",")], args.engines, args.capacity)
        return
    if args.compare:
        compare([float(x) for x in args.loads.split(",")], args.engines, args.capacity,
                args.clairvoyant)
        return
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
