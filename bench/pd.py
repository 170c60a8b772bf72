"""Prefill/decode serving side by side: the bundled trace replayed over HTTP at the trace's
times against the same ``kvwire fleet --prefill 4 --decode 2`` (SGLang's P/D protocol),
behind SGLang's router in its P/D mode (``round_robin``, ``power_of_two``, ``cache_aware``)
and behind ``kvwire serve --pd-protocol sglang`` (``--policy round_robin`` and ``kvwire``),
and, as the aggregated baseline, 6 engines of role ``both`` behind ``kvwire serve``.
Each condition gets a fresh fleet (cold caches) and the same requests at the same times.

    .venv/bin/python bench/pd.py                      # first 800 requests, --speed 8
    .venv/bin/python bench/pd.py --requests 1500 --load 2

Prompts are bench/routing.py's text prompts (one builtin token per trace token, so every
router, SGLang's included, sees the trace's prefixes). Measured by the client: TTFT p50/p99
and ITL p99 in model seconds (wall x ``--speed``), failed requests; from the engines'
/metrics: the prefill engines' cached-token ratio (prefix-cache hits / prompt tokens: the
compute a prefill placed where its prefix is cached saves), the decode engines' transfers
(count, blocks), and after the run every engine's held (leased) blocks; from kvwire serve's
GET /engines, the load left in flight (must be 0). SGLang's router 0.3.2's P/D
``cache_aware`` never builds its tree and picks at random (its row says so). Then the
simulator's view of the same fleets (``kvwire sim --prefill 4 --decode 2``) on the same
requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from proxy import PY, _kill, free_port, tree_cpu  # noqa: E402
from proxy import _start_router as start_router  # noqa: E402
from routing import fleet_up, pct, prompt_text, replay, stop_fleet  # noqa: E402

from kvwire.sim.floor import ttft_floor  # noqa: E402
from kvwire.sim.trace import bundled_trace_path, load_trace  # noqa: E402

MODEL = "kvwire-engine"
CONDITIONS = ("sglang-round_robin", "sglang-power_of_two", "sglang-cache_aware",
              "kvwire-round_robin", "kvwire", "aggregated")
NOTES = {"sglang-cache_aware": "0.3.2's P/D cache_aware never builds its tree: random picks"}


def start_fleet(args: list[str], want: int, base: int, a: argparse.Namespace,
                log: str) -> tuple[subprocess.Popen, list[str]]:
    cmd = [PY, "-m", "kvwire", "fleet", *args, "--base-port", str(base), "--speed",
           str(a.speed), "--block-size", "512", "--num-gpu-blocks", str(a.blocks),
           "--max-model-len", "262144", "--log-level", "error"]
    return fleet_up(cmd, want, log)


def spec_field(spec: str, key: str) -> str | None:
    for part in spec.split(","):
        k, eq, v = part.partition("=")
        if eq and k == key:
            return v
    return None


def metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def metric(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (any labels)."""
    return sum(float(v) for v in re.findall(
        rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def _wait_idle(urls: list[str], timeout: float = 60.0) -> dict[str, float]:
    """Each engine's held blocks once none is left held or ``timeout`` passes (a lease
    ends at the latest after the engines' lease time)."""
    deadline = time.monotonic() + timeout
    while True:
        held = {u: metric(metrics(u), "kvwire_engine_kv_held_blocks") for u in urls}
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def run_condition(name: str, a: argparse.Namespace, plan: list[tuple[float, bytes]]) -> dict:
    log = os.path.join(a.logdir, f"pd-{name}.log")
    agg = name == "aggregated"
    fleet_args = ["6"] if agg else ["--prefill", str(a.prefill), "--decode", str(a.decode)]
    want = 6 if agg else a.prefill + a.decode
    fleet, specs = start_fleet(fleet_args, want, a.base_port, a, log)
    urls = [spec_field(s, "url") for s in specs]
    roles = [spec_field(s, "role") or "both" for s in specs]
    prefill_urls = [u for u, r in zip(urls, roles) if r in ("prefill", "both")]
    decode_urls = [u for u, r in zip(urls, roles) if r in ("decode", "both")]
    router = None
    port = free_port()
    try:
        if name.startswith("sglang-"):
            policy = name.split("-", 1)[1]
            cmd = [PY, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                   str(port), "--pd-disaggregation", "--prefill-policy", policy,
                   "--decode-policy", policy, "--prometheus-host", "127.0.0.1",
                   "--prometheus-port", str(free_port()), "--log-level", "warn",
                   "--worker-startup-check-interval", "1"]
            for s, u, r in zip(specs, urls, roles):
                if r == "prefill":
                    cmd += ["--prefill", u, spec_field(s, "bootstrap_port") or "8998"]
                else:
                    cmd += ["--decode", u]
            router = start_router(cmd, port, MODEL, log, f"sglang-router ({policy})")
        else:
            policy = "round_robin" if name == "kvwire-round_robin" else "kvwire"
            cmd = [PY, "-m", "kvwire", "serve", "--tokenizer", "builtin", "--host",
                   "127.0.0.1", "--port", str(port), "--log-level", "error", "--block-size",
                   "512", "--policy", policy, "--decode-share", str(a.decode_share)]
            if not agg:
                cmd += ["--pd-protocol", "sglang"]
            for s in specs:
                cmd += ["--engine", s]
            router = start_router(cmd, port, MODEL, log, f"kvwire serve ({name})")
        before = {u: metrics(u) for u in urls}
        rcpu0 = tree_cpu(router.pid)
        t0 = time.monotonic()
        recs = asyncio.run(replay([f"http://127.0.0.1:{port}/v1/completions"], plan))
        wall = time.monotonic() - t0
        rcpu = tree_cpu(router.pid) - rcpu0
        held = _wait_idle(urls)
        after = {u: metrics(u) for u in urls}
        in_flight = None
        if name.startswith("kvwire") or agg:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/engines", timeout=10) as r:
                st = json.loads(r.read())
            # what the router still holds: reserved load per rank, requests in flight
            in_flight = sum(row.get("load", 0.0) for e in st.values() if isinstance(e, dict)
                            for row in e.get("ranks", ())) + sum(
                e.get("http", {}).get("in_flight", 0) for e in st.values()
                if isinstance(e, dict))
    finally:
        _kill(router)
        stop_fleet(fleet)

    def delta(us: list[str], m: str) -> float:
        return sum(metric(after[u], m) - metric(before[u], m) for u in us)

    prompt = delta(prefill_urls, "vllm:prompt_tokens_total")
    hits = delta(prefill_urls, "vllm:prefix_cache_hits_total")
    good = [r for r in recs if r["error"] is None and r["ttft"] is not None]
    ttft = [r["ttft"] * a.speed for r in good]
    itl = [x * a.speed for r in good for x in r["itl"]]
    return {"name": name, "ok": len(good), "failed": len(recs) - len(good),
            "errors": sorted({r["error"] for r in recs if r["error"]})[:3],
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "itl_p99": pct(itl, 0.99),
            "cached": hits / prompt if prompt else float("nan"),
            "transfers": delta(decode_urls, "kvwire_engine_kv_transfers_started_total"),
            "pulled_blocks": delta(decode_urls, "kvwire_engine_kv_transfer_blocks_total"),
            "transfer_failures": delta(decode_urls, "kvwire_engine_kv_transfer_failures_total"),
            "held_after": sum(held.values()), "in_flight_after": in_flight, "wall": wall,
            "router_cpu_per_request": rcpu / max(1, len(recs))}


def sim_view(a: argparse.Namespace) -> str:
    """The simulator's table for the same fleets and requests."""
    cmd = [PY, "-m", "kvwire", "sim", "--limit", str(a.requests), "--prefill", str(a.prefill),
           "--decode", str(a.decode), "--capacity", str(a.blocks), "--policies",
           "round_robin,kvwire", "--pd-protocol", "sglang"]  # (the fleet speaks SGLang's)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    return p.stdout if p.returncode == 0 else f"(kvwire sim failed: {p.stderr.strip()[-500:]})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=5000, help="KV blocks (of 512) per engine")
    ap.add_argument("--speed", type=float, default=8.0, help="engines' clock x wall time")
    ap.add_argument("--load", type=float, default=1.0,
                    help="trace compressed this much more than the engines' clock")
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--decode-share", type=float, default=0.6)
    ap.add_argument("--base-port", type=int, default=18800)
    ap.add_argument("--conditions", default=",".join(CONDITIONS),
                    help=f"comma-separated, of: {', '.join(CONDITIONS)}")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulator's view")
    ap.add_argument("--logdir", default="/tmp")
    a = ap.parse_args()
    bad = set(a.conditions.split(",")) - set(CONDITIONS)
    if bad:
        ap.error(f"unknown condition(s) {sorted(bad)}: expected {', '.join(CONDITIONS)}")
    reqs = load_trace(bundled_trace_path(), limit=a.requests)
    scale = 1.0 / (a.speed * a.load)
    t0 = reqs[0].t
    plan = []
    for i, r in enumerate(reqs):
        body = {"model": MODEL, "stream": True, "prompt": prompt_text(r, i),
                "max_tokens": max(1, min(r.output_length, a.max_output)), "ignore_eos": True}
        plan.append(((r.t - t0) * scale, json.dumps(body).encode()))
    print(f"# {len(plan)} requests over {(reqs[-1].t - t0) * scale:.0f} s wall, fleet "
          f"--prefill {a.prefill} --decode {a.decode} (aggregated: 6 x both), --speed "
          f"{a.speed:g}, load x{a.load:g}, outputs <= {a.max_output} tokens; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    res: dict[str, dict] = {}
    for name in a.conditions.split(","):
        r = res[name] = run_condition(name, a, plan)
        print(f"# {name}: ok {r['ok']} failed {r['failed']} {r['errors']} wall "
              f"{r['wall']:.0f} s", flush=True)
    print()
    print("| router | TTFT p50 (model s) | TTFT p99 | ITL p99 | prefill cached ratio | "
          "transfers | blocks pulled | failed | held after | load after | router CPU "
          "ms/req |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res.values():
        note = f" ({NOTES[r['name']]})" if r["name"] in NOTES else ""
        print(f"| {r['name']}{note} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | "
              f"{r['itl_p99']:.3f} | {r['cached']:.3f} | {r['transfers']:.0f} | "
              f"{r['pulled_blocks']:.0f} | {r['failed'] + r['transfer_failures']:.0f} | "
              f"{r['held_after']:.0f} | "
              f"{'-' if r['in_flight_after'] is None else r['in_flight_after']} | "
              f"{r['router_cpu_per_request'] * 1e3:.2f} |")
    sg = [r for n, r in res.items() if n.startswith("sglang-")]
    kv = res.get("kvwire")
    if kv and sg:
        best_cached = max(r["cached"] for r in sg)
        best_p99 = min(r["ttft_p99"] for r in sg)
        print()
        for label, v, lim, op in (
                ("prefill cached ratio >= 2x the best SGLang row", kv["cached"],
                 2 * best_cached, ">="),
                ("TTFT p99 <= 0.7x the best SGLang row", kv["ttft_p99"], 0.7 * best_p99, "<="),
                ("no failed request", kv["failed"] + kv["transfer_failures"], 0, "<="),
                ("no held block after the run", kv["held_after"], 0, "<="),
                ("no load left after the run", kv["in_flight_after"] or 0, 0, "<=")):
            ok = v <= lim if op == "<=" else v >= lim
            print(f"target {label}: {v:.3f} vs {lim:.3f} {'MET' if ok else 'MISSED'}")
    # The same engines, each request alone with every earlier prompt cached, prefilled where
    # it decodes (no transfer): no router's TTFT p99 goes below this one's.
    print(f"floor (each request alone on one engine, cache unbounded, no transfer): TTFT p99 "
          f"{ttft_floor(reqs).ttft_pct(0.99):.2f} s")
    if not a.no_sim:
        print()
        print("# the simulator's view (kvwire sim, same requests and fleets):")
        print(sim_view(a))


if __name__ == "__main__":
    main()
