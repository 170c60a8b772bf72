"""The router's CPU per request over HTTP, for prompts mostly seen before and for prompts never
seen, against what the tokenizer library spends on their new tokens, measured in the same run.

``kvwire fleet 2`` (fast engines) behind ``kvwire serve --tokenizer builtin`` (or ``--tokenizer
qwen3``: the vendored Qwen3 tokenizer and chat template, chats built as bench/routing.py
builds them); first the bundled trace's first ``--warm`` requests (bench/routing.py's text
prompts or chats), 8 at a time; then, one request at a time:

* ``seen``: ``--n`` of those requests again, each with new words appended to its last part
  (a conversation's next turn, an agent's growing context): >= 90% of its tokens seen;
* ``new``: ``--n`` prompts of the trace's mean length that nobody sent before;
* ``short``: ``--n`` never-seen prompts of 20 words: what any request costs the router, its
  prompt aside (the HTTP in and out, the route, the engine's events), the fixed part of every
  row below;
* ``seen, as ids`` and ``new, as ids``: such prompts again (other new words, so that they are
  as new to the router and the engines), chats rendered, tokenized by the client and sent as
  token ids: what the router costs when it tokenizes nothing, its floor for them (the body
  parsed, blocks hashed and looked up, the body written, the engine's events, the answer).

Requests go over connections kept open, as HTTP clients keep them; ``--close`` opens one per
request instead (the router's accept and connection setup then count too). A request's CPU is
the router's (all its threads and any child process, read from the kernel's CPU clock of each
in ns, where /proc counts 10 ms ticks) from just before it is sent until just before the next
one, which leaves ``--settle`` after each answer for the work that lags it (its KV events reach
the ingest thread after the answer), and longer until the router is quiet (the rest of a
prompt routed on its start is tokenized after the answer), less the router's idle rate
(probes, timers: measured alone first, once the warm-up's work is done) over that time. Per group: its p50 and mean, beside the tokenizer library's CPU
on the same requests' new text (``tokenizers.Tokenizer.encode`` of a fresh object for Qwen3, a
fresh ``BuiltinTokenizer().encode`` for builtin; the chat's template render not included),
and the targets on the p50s: ``seen`` <= 1 ms; ``new`` <= 1.2x the library + 0.3 ms; and, under
the table, each group against its floor: <= the floor + 1.2x the library + 0.3 ms, and
against a short prompt's cost: ``seen`` <= ``short`` + 1.2x the library + 0.5 ms (a long body
itself, read, parsed, hashed, looked up and written to the engine, costs the router 0.4-0.7
ms more than a short one here even when it tokenizes nothing: ``seen, as ids``).

    .venv/bin/python bench/router_cpu.py
    .venv/bin/python bench/router_cpu.py --tokenizer qwen3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
from host import Steal  # noqa: E402
from proxy import PY, _kill, _start_router, free_port, tree_pids  # noqa: E402
from routing import (  # noqa: E402
    MODEL,
    ChatBuilder,
    prompt_text,
    start_fleet,
    stop_fleet,
    vendored_qwen3,
)

from kvwire.sim.trace import bundled_trace_path, load_trace  # noqa: E402
from kvwire.tokenize import BuiltinTokenizer, load_tokenizer  # noqa: E402

LETTERS = "abcdefghijklmnopqrstuvwxyz"


async def _post(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], body: bytes,
                close: bool) -> int:
    """One request on ``conn``; its status once the whole answer is read."""
    reader, writer = conn
    writer.write(b"POST /v1/%s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n%s\r\n"
                 % (b"chat/completions" if b'"messages"' in body[:200] else b"completions",
                    len(body), b"connection: close\r\n" if close else b"") + body)
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    await reader.readexactly(length)
    return int(head.split(b" ", 2)[1])


def send(port: int, bodies: list[bytes], at_once: int) -> list[int]:
    """``bodies`` over ``at_once`` connections kept open (the warm-up: its CPU not counted)."""
    async def main() -> list[int]:
        idle: asyncio.Queue = asyncio.Queue()
        for _ in range(at_once):
            idle.put_nowait(await asyncio.open_connection("127.0.0.1", port))

        async def one(b: bytes) -> int:
            conn = await idle.get()
            try:
                return await _post(conn, b, False)
            finally:
                idle.put_nowait(conn)
        out = list(await asyncio.gather(*(one(b) for b in bodies)))
        while not idle.empty():
            idle.get_nowait()[1].close()
        return out
    return asyncio.run(main())


def cpu_clock(pid: int) -> Callable[[], float]:
    """The CPU time (s, ns resolution) of ``pid`` and the child processes it has now: the
    kernel's per-process CPU clocks (the ids clock_getcpuclockid gives)."""
    ids = [((~p) << 3) | 2 for p in tree_pids(pid)]  # CPUCLOCK_SCHED of the whole process
    return lambda: sum(time.clock_gettime(i) for i in ids)


async def quiet(clock: Callable[[], float], window: float, limit: float) -> None:
    """Until the router spent at most 5% of a core over the last ``window`` s (at most
    ``limit`` s): work it does after an answer (the rest of a prompt routed on its start,
    tokenized in the background) counts with the request it is for."""
    end = time.perf_counter() + limit
    while time.perf_counter() < end:
        c0 = clock()
        await asyncio.sleep(window)
        if clock() - c0 <= 0.05 * window:
            return


def one_by_one(port: int, bodies: list[bytes], close: bool, clock: Callable[[], float],
               settle: float) -> tuple[list[int], list[tuple[float, float]]]:
    """``bodies`` one at a time; their statuses, and per request (router CPU, wall time)
    from just before it is sent until just before the next one (``settle`` after its
    answer, and longer until the router is quiet)."""
    async def main() -> tuple[list[int], list[tuple[float, float]]]:
        kept = None if close else await asyncio.open_connection("127.0.0.1", port)
        statuses, marks = [], [(clock(), time.perf_counter())]
        for b in bodies:
            conn = kept or await asyncio.open_connection("127.0.0.1", port)
            statuses.append(await _post(conn, b, close))
            if close:
                conn[1].close()
            await asyncio.sleep(settle)
            await quiet(clock, 0.005, 2.0)
            marks.append((clock(), time.perf_counter()))
        if kept is not None:
            kept[1].close()
        return statuses, [(c1 - c0, t1 - t0) for (c0, t0), (c1, t1) in zip(marks, marks[1:])]
    return asyncio.run(main())


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(LETTERS, k=rng.randint(3, 9))) for _ in range(n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="builtin", help="builtin or qwen3")
    ap.add_argument("--warm", type=int, default=300, help="trace requests sent first")
    ap.add_argument("--n", type=int, default=100, help="requests per measured group")
    ap.add_argument("--extend", type=float, default=0.05, help="new share of a seen prompt")
    ap.add_argument("--close", action="store_true",
                    help="a new connection per request (its setup counted), not kept open")
    ap.add_argument("--settle", type=float, default=0.02,
                    help="seconds after each answer before the next request (its events land)")
    a = ap.parse_args()
    tmp = vendored_qwen3() if a.tokenizer == "qwen3" else None
    spec = tmp or a.tokenizer
    tok = load_tokenizer(None if spec == "builtin" else spec)
    chat = spec != "builtin"
    reqs = load_trace(bundled_trace_path(), limit=a.warm)
    chats = ChatBuilder(tok) if chat else None
    rng = random.Random(5)
    mean_tokens = int(sum(r.input_length for r in reqs) / len(reqs))

    def body(content: object) -> bytes:
        b: dict = {"model": MODEL, "max_tokens": 1}
        b["messages" if chat else "prompt"] = content
        return json.dumps(b).encode()

    warm = [chats.messages(r, i) if chats else prompt_text(r, i) for i, r in enumerate(reqs)]
    fresh_lib = (lambda: BuiltinTokenizer()) if not chat else None
    if chat:
        from tokenizers import Tokenizer as Fast
        lib = Fast.from_file(os.path.join(spec, "tokenizer.json"))

    def as_ids(content: object) -> bytes:  # (tokenized here, by the client)
        text = tok.render_chat(content) if chat else content
        return json.dumps({"model": MODEL, "max_tokens": 1,
                           "prompt": tok.encode(text)}).encode()

    def extended(i: int, extra: str) -> object:
        """Warm-up request ``i`` with ``extra`` words at the end of its last part."""
        if not chat:
            return warm[i] + " " + extra
        msgs = [dict(m) for m in warm[i]]
        msgs[-1]["content"] += " " + extra
        return msgs

    seen, new, seen_new_text, new_text, seen_ids, new_ids = [], [], [], [], [], []
    per_word = len(tok.encode(words(random.Random(1), 1000))) / 1000
    for i in rng.sample(range(len(warm)), min(a.n, len(warm))):
        n_new = max(8, int(reqs[i].input_length * a.extend / per_word))
        extra = words(rng, n_new)
        seen_new_text.append(" " + extra)
        seen.append(body(extended(i, extra)))
        seen_ids.append(as_ids(extended(i, words(rng, n_new))))
    short = [body([{"role": "user", "content": words(rng, 20)}] if chat else words(rng, 20))
             for _ in range(a.n)]
    for _ in range(a.n):
        text = words(rng, int(mean_tokens / per_word))
        new_text.append(text)
        new.append(body([{"role": "user", "content": text}] if chat else text))
        other = words(rng, int(mean_tokens / per_word))
        new_ids.append(as_ids([{"role": "user", "content": other}] if chat else other))

    def lib_cpu(texts: list[str]) -> list[float]:
        out = []
        for t in texts:
            c0 = time.thread_time()
            if chat:
                lib.encode(t, add_special_tokens=False)
            else:
                fresh_lib().encode(t)
            out.append(time.thread_time() - c0)
        return out

    # the library's own cost on the new text (a fresh object each time for builtin)
    lib_seen, lib_new = lib_cpu(seen_new_text), lib_cpu(new_text)
    logdir = os.path.join("/tmp", f"kvwire-router-cpu-{os.getpid()}")
    os.makedirs(logdir, exist_ok=True)
    fleet, specs = start_fleet(2, free_port(), 200.0, os.path.join(logdir, "fleet.log"),
                               spec if chat else "builtin")
    router = None
    port = free_port()
    try:
        cmd = [PY, "-m", "kvwire", "serve", "--tokenizer", spec, "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "error"]
        for s in specs:
            cmd += ["--engine", s]
        router = _start_router(cmd, port, MODEL, os.path.join(logdir, "serve.log"),
                               "kvwire serve")
        clock = cpu_clock(router.pid)
        statuses = []
        for k in range(0, len(warm), 16):  # (at a pace the router keeps every prompt at:
            statuses += send(port, [body(w) for w in warm[k:k + 16]], 8)  # a rest it would
            asyncio.run(quiet(clock, 0.02, 30.0))  # skip in a burst keeps nothing)
        print(f"# warm: {len(warm)} trace requests, statuses {sorted(set(statuses))}; "
              f"tokenizer {a.tokenizer}; connections "
              f"{'closed after each request' if a.close else 'kept open'}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
              flush=True)
        asyncio.run(quiet(clock, 0.1, 120.0))  # (the warm-up's background work done)
        c0, t0 = clock(), time.perf_counter()
        time.sleep(5)
        idle = (clock() - c0) / (time.perf_counter() - t0)
        rows = {}
        steal = Steal()
        for name, bodies in (("short", short), ("seen", seen), ("new", new),
                             ("seen, as ids", seen_ids), ("new, as ids", new_ids)):
            st, per = one_by_one(port, bodies, a.close, clock, a.settle)
            rows[name] = (len(bodies), sorted(set(st)), [c - idle * w for c, w in per])
        print(f"# the router's idle CPU: {idle * 1e3:.1f} ms/s (subtracted); "
              f"{a.settle * 1e3:.0f} ms after each answer counted with it; {steal}")
        print("\n| group | requests | statuses | router CPU per request: p50 / mean | library "
              "CPU on the new text: p50 / mean | target on the p50 | |")
        print("|---|---:|---|---:|---:|---:|---|")
        libs = {"seen": lib_seen, "new": lib_new}
        p50 = {name: statistics.median(r[2]) for name, r in rows.items()}
        for name, (n, st, cpu) in rows.items():
            head = (f"| {name} | {n} | {st} | {p50[name] * 1e3:.2f} / "
                    f"{statistics.fmean(cpu) * 1e3:.2f} ms |")
            if name not in libs:
                what = "any request's part" if name == "short" else "the floor"
                print(head + f" - | {what} | |")
                continue
            lib50 = statistics.median(libs[name])
            target = 1e-3 if name == "seen" else 1.2 * lib50 + 0.3e-3
            print(f"{head} {lib50 * 1e3:.2f} / {statistics.fmean(libs[name]) * 1e3:.2f} ms | "
                  f"{target * 1e3:.2f} ms | {'MET' if p50[name] <= target else 'MISSED'} |")
        for name in libs:
            floor = p50[name + ", as ids"]
            target = floor + 1.2 * statistics.median(libs[name]) + 0.3e-3
            print(f"# {name} against its floor: {p50[name] * 1e3:.2f} ms <= {floor * 1e3:.2f} + "
                  f"1.2x the library + 0.3 = {target * 1e3:.2f} ms: "
                  f"{'MET' if p50[name] <= target else 'MISSED'}")
        target = p50["short"] + 1.2 * statistics.median(lib_seen) + 0.5e-3
        print(f"# seen against a short prompt: {p50['seen'] * 1e3:.2f} ms <= "
              f"{p50['short'] * 1e3:.2f} + 1.2x the library + 0.5 = {target * 1e3:.2f} ms: "
              f"{'MET' if p50['seen'] <= target else 'MISSED'}")
    finally:
        _kill(router)
        stop_fleet(fleet)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
