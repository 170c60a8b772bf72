"""Benchmark the RFC #1403 indexer API: ``kvwire index``'s /query vs NVIDIA Dynamo's
standalone indexer (``python -m dynamo.indexer``, ai-dynamo-runtime 1.6.1) in the same run.

Like production, three kinds of process on this box:

* a publisher process: ``--engines`` kvwire ``ZmqEventPublisher`` s (ipc), each first storing
  ``--prefixes`` distinct prompts of ``--prompt-tokens`` tokens (16-token blocks); then, in the
  ingesting phase, churning at ``--ingest`` batches/s in total (each batch stores one new
  block and removes the one stored ``--window`` batches before, so the index size is constant);
* the servers, each with its publishers registered through its own ``POST /register``:
  Dynamo's indexer (``--threads 4``) and ``kvwire index --workers N``, one per N in
  ``--workers`` (default: 1 and the number of cores). Each server follows its own set of
  ``--engines`` streams with the same content (the same prompts, the same churn), and the
  churn goes only to the set of the server being measured, as on a box that runs one
  indexer: a measured server does not share the cores with the other servers' ingest of
  10,000 batches/s (0.15-0.32 cores each, which made the comparison depend on which other
  servers were in the run). ``--shared-streams``: one set that all servers follow at once;
* the load generator: wrk (C, Debian package ``wrk``), one thread, ``--conns`` keep-alive
  connections, closed loop, posting ``/query`` bodies from a table of 256 varied prompts (each
  a stored prompt's first k blocks, k uniform in 0..128, then fresh tokens up to 2,048): the
  same script, bodies and connections for both servers.

Both servers are first checked to give the same ``longest_matched`` per instance on sample
prompts. Then, per phase (static, ingesting), ``--reps`` rounds of one wrk run per server,
alternating which goes first (other load on the shared box hits both alike; the table shows
each run, so the spread is visible). ``cpu/req`` = the server's CPU time (utime+stime of all
its processes and threads, /proc) over the run / requests answered; ``cores`` = that CPU time
/ wall time. Before each phase's runs, 3 s without queries give each server's cores spent
on ingest alone (the heartbeats, or 10,000 batches/s).

    .venv/bin/python bench/indexer.py              # about 2 minutes
    .venv/bin/python bench/indexer.py --quick
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from host import Steal  # noqa: E402

CTX = mp.get_context("spawn")
BS = 16
PY = sys.executable
MODEL = "default"


def prompt_tokens(engine: int, j: int, n: int) -> list[int]:
    rnd = random.Random(engine * 100_003 + j)
    return [rnd.randrange(50_000) for _ in range(n)]


# ----------------------------------------------------------------------------- publisher


def endpoint(where: str, stream_set: int, e: int, kind: str) -> str:
    return f"ipc://{where}/s{stream_set}e{e}.{kind}"


def publisher_main(where: str, engines: int, sets: int, prefixes: int, ntok: int,
                   window: int, rate, target, published, ready, stop) -> None:
    """Store the prefixes on every set of ``engines`` streams, then publish ``rate.value``
    churn batches/s to set ``target.value`` until ``stop``. Each set's churn is its own
    consistent stream (its own counter: store block n, remove block n - ``window``), so a
    set that pauses while another server is measured resumes where it stopped."""
    from kvwire.publish.publisher import ZmqEventPublisher
    from kvwire.wire.events import BlockRemoved, BlockStored, KVEventBatch

    pubs = [[ZmqEventPublisher(endpoint=endpoint(where, s, i, "live"),
                               replay_endpoint=endpoint(where, s, i, "replay"),
                               heartbeat_interval=1.0, buffer_steps=200_000)
             for i in range(engines)] for s in range(sets)]
    for row in pubs:
        for i, pub in enumerate(row):
            for j in range(prefixes):
                base = (i << 40) | (j << 20)
                pub.publish(KVEventBatch(time.time(), [BlockStored(
                    list(range(base, base + ntok // BS)), None, prompt_tokens(i, j, ntok),
                    BS, None, "GPU")], 0))
    ready.set()
    k = 0
    ks = [0] * sets  # each set's own churn counter
    start, cur = time.perf_counter(), 0.0
    while not stop.is_set():
        r = rate.value
        if r != cur:  # a new phase: count from now
            start, cur, k0 = time.perf_counter(), r, k
        if r <= 0:
            time.sleep(0.01)
            continue
        due = k0 + int((time.perf_counter() - start) * r)
        s = target.value
        while k < due:  # what is due, then a 1 ms nap (no spinning on the shared cores)
            n = ks[s]
            e = n % engines
            h = (1 << 60) | n
            t0 = (n * BS) % (1 << 31)
            evs: list = [BlockStored([h], None, list(range(t0, t0 + BS)), BS, None, "GPU")]
            if n >= window:
                evs.append(BlockRemoved([(1 << 60) | (n - window)], "GPU"))
            pubs[s][e].publish(KVEventBatch(time.time(), evs, 0))
            ks[s] = n + 1
            k += 1
        published.value = k
        time.sleep(0.001)
    for row in pubs:
        for p in row:
            p.shutdown(timeout=1)


# ----------------------------------------------------------------------------- servers


def call(port: int, method: str, path: str, body: dict | None = None,
         timeout: float = 10.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One indexer under test: its process, port and CPU accounting."""

    def __init__(self, name: str, cmd: list[str], port: int, log: str) -> None:
        self.name = name
        self.port = port
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                call(port, "GET", "/dump", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start; log tail:\n"
                                       + open(log).read()[-2000:]) from None
                time.sleep(0.1)

    def pids(self) -> list[int]:
        """The server's process and all its descendants."""
        kids: dict[int, list[int]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                kids.setdefault(ppid, []).append(int(d))
        out, todo = [], [self.proc.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo += kids.get(p, [])
        return out

    def cpu(self) -> float:
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for p in self.pids():
            try:
                with open(f"/proc/{p}/stat") as f:
                    parts = f.read().rsplit(")", 1)[1].split()
                total += int(parts[11]) + int(parts[12])
            except (OSError, IndexError, ValueError):
                pass
        return total / tick

    def conns(self) -> str:
        """Established connections to the port per process holding them (e.g. ``9/7``:
        how the kernel or the acceptor spread wrk's connections over the workers)."""
        inodes: set[str] = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(table) as f:
                    next(f)
                    for line in f:
                        parts = line.split()
                        if parts[3] == "01" and int(parts[1].rsplit(":", 1)[1], 16) == self.port:
                            inodes.add(parts[9])
            except OSError:
                pass
        per = []
        for p in self.pids():
            try:
                fds = os.listdir(f"/proc/{p}/fd")
            except OSError:
                continue
            n = 0
            for fd in fds:
                try:
                    link = os.readlink(f"/proc/{p}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    n += 1
            if n:
                per.append(n)
        return "/".join(map(str, sorted(per, reverse=True))) or "-"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def register_body(where: str, stream_set: int, e: int) -> dict:
    """One body both peers take: Dynamo's field names and the RFC's, side by side."""
    return {"instance_id": 100 + e, "endpoint": endpoint(where, stream_set, e, "live"),
            "replay_endpoint": endpoint(where, stream_set, e, "replay"), "model_name": MODEL,
            "modelname": MODEL, "type": "vLLM", "tenant_id": "default", "block_size": BS,
            "dp_rank": 0}


def query_body(tokens: list[int]) -> dict:
    # token_ids first: kvwire's C parser reads the ids straight from the text then
    return {"token_ids": tokens, "model_name": MODEL, "model": MODEL, "block_size": BS}


def longest(answer: bytes) -> dict[str, int]:
    """``{instance: longest_matched}`` from either peer's /query answer (zeros left out)."""
    d = json.loads(answer)
    per = d["instances"] if "instances" in d else {
        i: v for tenant in d.values() for i, v in tenant.items()}
    return {str(i): v["longest_matched"] for i, v in per.items() if v["longest_matched"]}


# ----------------------------------------------------------------------------- load


def write_script(path: str, engines: int, prefixes: int, ntok: int) -> list[tuple]:
    rnd = random.Random(7)
    cases = []
    with open(path, "w") as f:
        f.write("bodies = {\n")
        for _ in range(256):
            e, j = rnd.randrange(engines), rnd.randrange(prefixes)
            k = rnd.randrange(0, ntok // BS + 1)
            toks = prompt_tokens(e, j, ntok)[:k * BS]
            toks += [rnd.randrange(50_000, 60_000) for _ in range(ntok - len(toks))]
            body = json.dumps(query_body(toks), separators=(",", ":"))
            cases.append((e, k, body))
            f.write("[[" + body + "]],\n")
        f.write("}\nwrk.method = 'POST'\nwrk.headers['Content-Type'] = 'application/json'\n"
                "n = 0\nrequest = function()\n  n = n + 1\n"
                "  return wrk.format(nil, '/query', nil, bodies[(n % #bodies) + 1])\nend\n")
    return cases


def wrk_run(port: int, script: str, seconds: float, conns: int,
            during: Callable[[], str] | None = None) -> dict:
    """One wrk run; ``during()`` is called once, 1 s in (its text is kept as ``during``)."""
    proc = subprocess.Popen(["wrk", "-t1", f"-c{conns}", f"-d{max(1, int(seconds))}s",
                             "--latency", "-s", script, f"http://127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = ""
    if during is not None:
        time.sleep(min(1.0, seconds / 3))
        seen = during()
    out = proc.communicate(timeout=seconds + 60)[0]

    def ms(label: str) -> float:
        m = re.search(rf"^\s*{label}\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)] if m else \
            float("nan")

    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    n = re.search(r"(\d+) requests in", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    err = re.search(r"Socket errors: (.*)", out)
    return {"rps": float(rps.group(1)) if rps else float("nan"),
            "requests": int(n.group(1)) if n else 0, "p50": ms("50%"), "p99": ms("99%"),
            "bad": int(bad.group(1)) if bad else 0, "socket_errors": err.group(1) if err else "",
            "during": seen}


def measure(srv: Server, script: str, seconds: float, conns: int) -> dict:
    c0, t0 = srv.cpu(), time.perf_counter()
    r = wrk_run(srv.port, script, seconds, conns, during=srv.conns)
    cpu, wall = srv.cpu() - c0, time.perf_counter() - t0
    r["cpu_us"] = cpu / max(1, r["requests"]) * 1e6
    r["cores"] = cpu / wall
    return r


# ----------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--prefixes", type=int, default=32, help="stored prompts per engine")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--ingest", type=float, default=10_000, help="batches/s, ingesting phase")
    p.add_argument("--window", type=int, default=20_000, help="churn blocks kept stored")
    p.add_argument("--workers", type=lambda t: [int(x) for x in t.split(",")],
                   default=[1, os.cpu_count() or 1],
                   help="kvwire index --workers, a comma list: one kvwire server each "
                        "(default: 1 and the number of cores)")
    p.add_argument("--conns", type=int, default=16, help="wrk connections")
    p.add_argument("--seconds", type=float, default=5.0, help="per wrk run")
    p.add_argument("--reps", type=int, default=2, help="A/B rounds per phase")
    p.add_argument("--quick", action="store_true", help="1 round of 3 s per phase")
    p.add_argument("--only", choices=("dynamo", "kvwire"), default=None,
                   help="measure one server only (no comparison)")
    p.add_argument("--kvwire-cmd", default=None,
                   help="command line of the kvwire server instead of `kvwire index` "
                        "({port} and {workers} are filled in)")
    p.add_argument("--shared-streams", action="store_true",
                   help="all servers follow the same publishers at once (each measured "
                        "server then shares the box with the others' ingest); default: "
                        "each server has its own set of streams, live only while it is "
                        "measured")
    a = p.parse_args()
    if a.quick:
        a.reps, a.seconds = 1, 3.0
    if shutil.which("wrk") is None:  # loud, and the rest of `make bench` still runs
        print("bench/indexer.py: SKIPPED: wrk is needed (apt-get install -y wrk)",
              file=sys.stderr)
        return 0
    try:
        import dynamo._core  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"bench/indexer.py: SKIPPED: ai-dynamo-runtime==1.6.1 is needed ({e}); "
              "`make bench` installs it", file=sys.stderr)
        return 0
    steal = Steal()
    t_start = time.time()
    where = tempfile.mkdtemp(prefix="kvwire-bench-indexer-")
    rate, published = CTX.Value("d", 0.0), CTX.Value("q", 0)
    target = CTX.Value("i", 0)
    ready, stop = CTX.Event(), CTX.Event()
    nservers = ((a.only != "kvwire") + (len(a.workers) if a.only != "dynamo" else 0))
    sets = 1 if a.shared_streams else nservers
    pub = CTX.Process(target=publisher_main, daemon=True, args=(
        where, a.engines, sets, a.prefixes, a.prompt_tokens, a.window, rate, target,
        published, ready, stop))
    pub.start()
    servers: list[Server] = []
    try:
        if not ready.wait(120):
            raise RuntimeError("publisher did not start")
        dport = free_port()
        if a.only != "kvwire":
            servers.append(Server("dynamo", [PY, "-m", "dynamo.indexer", "--port", str(dport),
                                             "--threads", "4"], dport, f"{where}/dynamo.log"))
        for w in a.workers if a.only != "dynamo" else ():
            kport = free_port()
            kcmd = (a.kvwire_cmd.format(port=kport, workers=w, where=where).split()
                    if a.kvwire_cmd else
                    [PY, "-m", "kvwire.cli.index", "--host", "127.0.0.1", "--port", str(kport),
                     "--workers", str(w)])
            servers.append(Server(f"kvwire-{w}w", kcmd, kport, f"{where}/kvwire{w}.log"))
        for i, s in enumerate(servers):
            for e in range(a.engines):
                st, out = call(s.port, "POST", "/register",
                               register_body(where, i % sets, e))
                if st >= 300:
                    raise RuntimeError(f"{s.name} /register: {st} {out[:300]!r}")
        # every stored prompt matched in full on its engine, by both
        deadline = time.monotonic() + 120
        for s in servers:
            for e in range(a.engines):
                for j in (0, a.prefixes - 1):
                    want = {str(100 + e): a.prompt_tokens // BS * BS}
                    body = query_body(prompt_tokens(e, j, a.prompt_tokens))
                    while longest(call(s.port, "POST", "/query", body)[1]) != want:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{s.name} never matched engine {e}'s prompt "
                                               f"{j}: {call(s.port, 'POST', '/query', body)}")
                        time.sleep(0.1)
        script = os.path.join(where, "query.lua")
        cases = write_script(script, a.engines, a.prefixes, a.prompt_tokens)
        agree = 0
        for e, k, body in cases[:64]:
            ans = [longest(call(s.port, "POST", "/query", json.loads(body))[1])
                   for s in servers]
            want = {str(100 + e): k * BS} if k else {}
            if any(x != want for x in ans):
                print(f"answers differ for engine {e} k={k}: want {want}, "
                      + ", ".join(f"{s.name} {x}" for s, x in zip(servers, ans)))
            else:
                agree += 1
        print(f"same answers on {agree}/64 sample prompts (longest_matched per instance)")
        rows = []
        idle: dict[str, dict[str, float]] = {}
        for phase, r in (("static", 0.0), ("ingesting", a.ingest)):
            rate.value = r
            n0, t0 = published.value, time.perf_counter()
            # no queries for a while: what each server spends on ingest alone (with its own
            # streams, one server after another: this also fills each one's churn window)
            idle[phase] = {}
            for group in ([servers] if sets == 1 or not r else [[s] for s in servers]):
                target.value = servers.index(group[0]) % sets
                c0, t1 = {s.name: s.cpu() for s in group}, time.perf_counter()
                time.sleep(3.0)
                idle[phase].update({s.name: (s.cpu() - c0[s.name]) / (time.perf_counter()
                                                                       - t1) for s in group})
            for rep in range(a.reps):
                order = servers[rep % len(servers):] + servers[:rep % len(servers)]
                for s in order:
                    if sets > 1 and r:  # its streams live, the others paused
                        target.value = servers.index(s)
                        time.sleep(0.5)
                    m = measure(s, script, a.seconds, a.conns)
                    rows.append((phase, rep, s.name, m))
            got = (published.value - n0) / (time.perf_counter() - t0)
            if r:
                print(f"ingesting phase: {got:,.0f} batches/s published (target {r:,.0f})")
        rate.value = 0.0
    finally:
        for s in servers:
            s.stop()
        stop.set()
        pub.join(10)
        if pub.is_alive():
            pub.kill()
    print()
    print(f"{'phase':<10} {'run':>3} {'server':<9} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'cpu/req us':>10} {'cores':>5} {'non-2xx':>7} {'conns':>7}")
    for phase, rep, name, m in rows:
        print(f"{phase:<10} {rep:>3} {name:<9} {m['rps']:>8,.0f} {m['p50']:>7.2f} "
              f"{m['p99']:>7.2f} {m['cpu_us']:>10.1f} {m['cores']:>5.2f} {m['bad']:>7} "
              f"{m['during']:>7}"
              + (f"  socket errors: {m['socket_errors']}" if m["socket_errors"] else ""))
    print()
    print("cores used with no queries (3 s): " + "; ".join(
        f"{ph}: " + ", ".join(f"{n} {c:.2f}" for n, c in d.items()) for ph, d in idle.items()))
    names = [s.name for s in servers]
    for phase in ("static", "ingesting") if "dynamo" in names else ():
        mean = {}
        for name in names:
            ms = [m for ph, _, n, m in rows if ph == phase and n == name]
            mean[name] = (sum(m["rps"] for m in ms) / len(ms),
                          sum(m["p99"] for m in ms) / len(ms))
        d = mean["dynamo"]
        for name in names[1:]:
            k = mean[name]
            ok = k[0] >= d[0] and k[1] <= d[1]
            print(f"{phase}: {name} / dynamo requests/s {k[0] / d[0]:.2f}x (target >= 1.0x), "
                  f"p99 {k[1]:.2f} vs {d[1]:.2f} ms (target <=), means of {a.reps} runs: "
                  f"{'MET' if ok else 'NOT met'}")
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t_start))}, "
          f"{time.time() - t_start:.0f} s, wrk -t1 -c{a.conns} -d{a.seconds:g}s, kvwire "
          f"--workers {','.join(map(str, a.workers))}, dynamo --threads 4, "
          + ("shared streams" if sets == 1 else "own streams per server") + f"; {steal}")
    shutil.rmtree(where, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
