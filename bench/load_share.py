"""Load sharing between router replicas (nats/load_channel.py, routing/sharing.py) over a real nats-server on
loopback: how long a reservation made at replica A takes to weigh on replica B's load, and
what the sharing costs in CPU per operation, at several request rates.

    .venv/bin/python bench/load_share.py            # 200, 1000 and 2000 requests/s, 5 s each
    .venv/bin/python bench/load_share.py --rates 500 --seconds 10

Each request is what the proxy shares: a reservation, its prediction (the prompt's blocks
as the index's own keys: ``--prediction-blocks``, 128 by default, a 2k-token prompt in
16-token blocks; 0 for none), its first token, its release. A and B are two RouterCores in
this process, routing to one engine whose stream they never follow (the load tracker and
the index's predictions are what they share), each with its own LoadShare thread and NATS
connection. Latency: from
A's ``route_proxy``-equivalent push to B's tracker holding the reservation, for every
request (B's side stamps each reservation as it applies it: a driver that polled B's
tracker measured its own stalls, 100-300 ms at times, not the sharing's). CPU: the two sharing threads' user +
system time (/proc/self/task) per request: A's sending and B's applying, heartbeats
included; the nats-server's own CPU is not counted. The GIL switch interval is kvwire
serve's, 0.5 ms. A, B and the driver share this process and its GIL (real replicas are
processes of their own): with 128-block predictions, which B applies to its index, it
saturates near 2,000 requests/s, and the bench says so when the driver falls behind.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent / "tests"))  # nats_helpers: the nats-server the tests use

from nats_helpers import NatsServer  # noqa: E402

from kvwire.consume.engine_spec import EngineSpec  # noqa: E402
from kvwire.nats.load_channel import LoadShare  # noqa: E402
from kvwire.routing.core import RouterCore  # noqa: E402
from kvwire.routing.sharing import Report  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def _thread_cpu(*shares: LoadShare) -> float:
    """CPU seconds (user + system) of the sharing threads, from /proc/self/task."""
    total = 0.0
    for s in shares:
        tid = s._thread.native_id if s._thread is not None else None
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def _stamp(share: LoadShare) -> dict[str, float]:
    """When each reservation of another replica was applied at ``share``'s replica (its
    ``receive``, wrapped)."""
    held: dict[str, float] = {}
    receive = share.peers.receive

    def stamped(report: Report, now: float) -> list:
        out = receive(report, now)
        t = time.perf_counter()
        for op in report.ops:
            if op[0] == "r":
                held[op[1]] = t
        return out

    share.peers.receive = stamped  # type: ignore[method-assign]
    return held


def run(url: str, rate: float, seconds: float,
        blocks: int) -> tuple[int, list[float], float]:
    engine = [EngineSpec("e0", "tcp://127.0.0.1:1")]  # (its stream is never followed)
    a, b = RouterCore(engine), RouterCore(engine)
    stream = a.targets[0].stream  # (e0/dp0: what the proxy predicts on, and B applies)
    for core in (a, b):  # the block size, as the stream's events would teach it
        core.index.prompt_keys(stream, [0] * 16, block_size=16)
    sa = LoadShare(a, url, "kvwire.load.BENCH", replica="A")
    sb = LoadShare(b, url, "kvwire.load.BENCH", replica="B")
    held = _stamp(sb)
    sa.start()
    sb.start()
    a.share = sa.push
    pushed: dict[str, float] = {}
    try:
        time.sleep(0.3)  # both subscribed
        c0, t0 = _thread_cpu(sa, sb), time.monotonic()
        n, period = 0, 1.0 / rate
        open_ids: list[str] = []
        while time.monotonic() - t0 < seconds:
            due = t0 + n * period
            if (d := due - time.monotonic()) > 0:
                time.sleep(d)
            rid = f"q{n}"
            toks = list(range(n * 16 * blocks, (n + 1) * 16 * blocks))
            with a.lock:
                a.loads.reserve(rid, "e0", 10.0, prefill=8.0)
                a.share(["r", rid, "e0", 10.0, 8.0])
                pushed[rid] = time.perf_counter()
                if blocks:
                    a._predict(stream, toks, None, None)
            open_ids.append(rid)
            if len(open_ids) > 20:  # each request lives ~20 requests: first token, release
                done = open_ids.pop(0)
                a.first_token(done, 8.0)
                a.finish(done, 16)
            n += 1
        cpu = _thread_cpu(sa, sb) - c0
        end = time.monotonic() + 2.0  # (the last ones on their way)
        while len(held) < n and time.monotonic() < end:
            time.sleep(0.01)
        if blocks and not b.index.streams()[stream].predicted_blocks:
            raise SystemExit("bench/load_share.py: B applied none of A's predictions")
    finally:
        a.close()
        b.close()
    lat = [held[r] - t for r, t in pushed.items() if r in held]
    if len(lat) < n:
        print(f"# {n - len(lat)} of {n} reservations never reached B", file=sys.stderr)
    return n, lat, cpu


def _q(sorted_s: list[float], p: float) -> float:
    """The ``p`` quantile of sorted seconds, in ms."""
    if not sorted_s:
        return float("nan")
    return sorted_s[min(len(sorted_s) - 1, int(p * len(sorted_s)))] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="200,1000,2000")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--prediction-blocks", type=int, default=128)
    args = ap.parse_args()
    sys.setswitchinterval(0.0005)  # (as kvwire serve runs: cli/serve.py)
    with tempfile.TemporaryDirectory() as tmp:
        srv = NatsServer(Path(tmp) / "nats").start()
        try:
            print("| requests/s | sent | latency p50 ms | p99 ms | max ms | CPU us/request |")
            print("|---:|---:|---:|---:|---:|---:|")
            for rate in [float(x) for x in args.rates.split(",")]:
                n, lat, cpu = run(srv.url, rate, args.seconds, args.prediction_blocks)
                lat.sort()

                per = cpu / max(n, 1) * 1e6
                print(f"| {rate:g} | {n} | {_q(lat, 0.5):.3f} | {_q(lat, 0.99):.3f} | "
                      f"{(lat[-1] * 1e3 if lat else float('nan')):.3f} | {per:.0f} |",
                      flush=True)
                if n < 0.95 * rate * args.seconds:
                    print(f"# at {rate:g}/s the driver sent {n / args.seconds:.0f}/s: this "
                          "process (A, B and the driver share one GIL) is saturated, and the "
                          "latency above is mostly queueing", file=sys.stderr)
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
