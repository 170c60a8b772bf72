"""``kvwire demo``, the fleet story over real HTTP: the real command end to end on a small
slice of the trace (two ``kvwire fleet``s, two ``kvwire serve`` proxies, the client), its
children gone after SIGTERM mid-run; and the replayer's pure parts (token ids equal to the
simulator's, the statistics, the targets)."""

from __future__ import annotations

import dataclasses
import re
import signal
import subprocess
import time

import psutil
import pytest
from cli_helpers import KVWIRE

from kvwire.cli.http_demo import OVERLOADED_LAG_S, TARGETS, PolicyRun, missed_targets
from kvwire.sim.batched import make_request
from kvwire.sim.http_replay import (
    TAIL_TOKEN_RANGE,
    ReplayRecord,
    SseTally,
    completion_body,
    percentile,
    request_token_ids,
    summarize,
)
from kvwire.sim.trace import MOONCAKE_BLOCK_TOKENS, Request, bundled_trace_path, load_trace

# Trace requests 3693.. share prefixes within a few dozen requests (the first ones barely do).
# 4 engines, not 2: with 2, round robin sends a conversation's next turn to the engine holding
# its prefix half the time, and once reached 0.166 against kvwire's 0.187 (a flake).
START, LIMIT = 3693, 60
SLICE = ["--start", str(START), "--limit", str(LIMIT), "--engines", "4", "--speed", "10"]


def _cache_limit(start: int, limit: int) -> float:
    """The cached-token ratio of trace requests ``start..start+limit`` with one unbounded
    cache: each prompt's leading blocks that an earlier prompt of the slice had."""
    seen: set[int] = set()
    hit = total = 0
    for r in load_trace(bundled_trace_path())[start:start + limit]:
        n = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            n += 1
        hit += min(n * MOONCAKE_BLOCK_TOKENS, r.input_length)
        total += r.input_length
        seen.update(r.hash_ids)
    return hit / total


def _row(out: str, policy: str) -> list[str]:
    m = re.search(rf"^{policy} +(\d.*)$", out, re.M)
    assert m, out
    return m.group(1).split()


def test_demo_replays_over_http_and_kvwire_gets_more_cached_tokens(tmp_path) -> None:
    png = tmp_path / "report.png"
    r = subprocess.run([*KVWIRE, "demo", *SLICE, "--report", str(png)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode in (0, 3), (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    # exit 3 exactly when a printed target is missed, each named on stderr
    assert (r.returncode == 3) == ("kvwire demo: target missed:" in r.stderr), r.stderr
    assert "policy        ttft_p50  ttft_p99  trace p50  trace p99  cached  max/mean    ok" \
        in r.stdout, r.stdout
    kv, rr = _row(r.stdout, "kvwire"), _row(r.stdout, "round_robin")
    assert kv[-2:] == [str(LIMIT), "0"] and rr[-2:] == [str(LIMIT), "0"], r.stdout  # ok, failed
    # The engines' cached-token ratios against what an unbounded cache could give this
    # slice: kvwire reaches it (0.187), round robin's depends on arrival order (0.048-0.106
    # seen; 0.106 on a busy box), so it is held to "well below", not to a ratio of kvwire's.
    limit = _cache_limit(START, LIMIT)
    assert float(kv[4]) >= 0.95 * limit, (limit, r.stdout)
    assert float(rr[4]) <= 0.8 * limit, (limit, r.stdout)
    assert f"report written to {png.resolve()}" in r.stdout
    assert png.stat().st_size > 10_000


def test_demo_stops_every_child_on_sigterm() -> None:
    """SIGTERM to the demo alone (not its group, as a supervisor sends it): it stops both
    fleets (and so their engines) and both proxies before it exits."""
    p = subprocess.Popen([*KVWIRE, "demo", "--start", "3000", "--limit", "40", "--engines",
                          "2", "--speed", "0.5", "--report", "/dev/null"],  # a 22 s replay
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 90
        while "proxies up" not in line:
            line = p.stdout.readline()
            assert line and time.monotonic() < deadline, p.stderr.read()
        kids = psutil.Process(p.pid).children(recursive=True)
        # 2 fleets + their 2 engines each + 2 proxies
        assert len(kids) >= 8, [k.cmdline() for k in kids]
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 143
        assert "kvwire demo: interrupted; every engine and proxy it started is stopped" \
            in p.stderr.read()
        gone, alive = psutil.wait_procs(kids, timeout=30)
        assert not alive, [k.pid for k in alive]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_token_ids_are_the_simulators() -> None:
    reqs = load_trace(bundled_trace_path(), limit=50)
    for i, req in enumerate(reqs):
        ids = request_token_ids(req, i)
        assert len(ids) == max(req.input_length, 1)
        sim = make_request(i, req, 16)[0].prompt
        n = req.cacheable_tokens
        assert ids[:n] == list(sim[:n])


def test_tokens_past_the_hash_ids_are_unique_and_in_the_vocabulary() -> None:
    req = Request(0.0, 600, 4, (7,))  # 512 named tokens, 88 unique to the request
    a, b = request_token_ids(req, 1), request_token_ids(req, 2)
    assert a[:512] == b[:512] and a[512:] != b[512:]
    assert a == request_token_ids(req, 1)
    assert all(TAIL_TOKEN_RANGE[0] <= t < TAIL_TOKEN_RANGE[1] for t in a[512:])


def test_completion_body_streams_usage_and_caps_output() -> None:
    req = Request(0.0, 20, 300, (1,))
    body = completion_body(req, 0, model="m", max_output_tokens=16)
    assert body["max_tokens"] == 16 and body["ignore_eos"] and body["stream"]
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "m"
    assert completion_body(Request(0.0, 20, 0, (1,)), 0)["max_tokens"] == 1


def _rec(i: int, ttft: float | None, prompt: int, cached: int | None, engine: str | None,
         out: int = 10, status: int = 200, error: str | None = None) -> ReplayRecord:
    return ReplayRecord(i, 0.1 * i, 0.1 * i + 0.01, status, ttft,
                        None if error else 1.0, prompt, cached, out, engine, error)


def test_summary_statistics() -> None:
    recs = [_rec(0, 0.1, 1000, 500, "e0"), _rec(1, 0.2, 1000, 0, "e1"),
            _rec(2, 0.3, 2000, 1000, "e0"),
            _rec(3, None, 500, None, "e1", status=0, error="ConnectError: refused")]
    s = summarize(recs, ["e0", "e1", "e2"], prefill_token_cost=1.0, decode_token_cost=0.0)
    assert (s.requests, s.ok, s.failed) == (4, 3, 1)
    assert s.prompt_tokens == 4000 and s.cached_tokens == 1500  # the failed one not counted
    assert s.cached_ratio == pytest.approx(0.375)
    assert s.engine_work == {"e0": 1500.0, "e1": 1000.0, "e2": 0.0}  # idle engine counts
    assert s.work_max_over_mean == pytest.approx(1500 / (2500 / 3))
    assert s.ttft_p50_s == 0.2 and s.ttft_p99_s == 0.3
    assert s.max_send_lag_s == pytest.approx(0.01)
    assert percentile([], 0.5) == 0.0 and percentile([3.0, 1.0, 2.0], 0.5) == 2.0


def _run(policy: str, recs: list[ReplayRecord]) -> PolicyRun:
    return PolicyRun(policy, summarize(recs, ["e0", "e1"]), recs, 1.0)


def test_targets_name_what_was_missed() -> None:
    good = [_rec(i, 0.1, 1000, 600, f"e{i % 2}") for i in range(10)]
    slow = [_rec(i, 1.0, 1000, 100, f"e{i % 2}") for i in range(10)]
    assert missed_targets({"kvwire": _run("kvwire", good),
                           "round_robin": _run("round_robin", slow)}) == []
    missed = missed_targets({"kvwire": _run("kvwire", slow),
                             "round_robin": _run("round_robin", good)})
    assert any(f"target >= {TARGETS['cached_x']:g}x" in m for m in missed)
    assert any(f"target <= {TARGETS['ttft_p99_x']:g}x" in m for m in missed)
    # a client starved of CPU: TTFT is not judged, cached tokens still are
    starved = {p: dataclasses.replace(_run(p, r), client_lag_s=OVERLOADED_LAG_S)
               for p, r in (("kvwire", slow), ("round_robin", good))}
    missed = missed_targets(starved)
    assert len(missed) == 1 and f"target >= {TARGETS['cached_x']:g}x" in missed[0]
    lopsided = [_rec(i, 0.1, 1000, 600, "e0") for i in range(10)]
    failed = good[:9] + [_rec(9, None, 1000, None, "e1", status=0, error="ReadError: ")]
    missed = missed_targets({"kvwire": _run("kvwire", lopsided),
                             "round_robin": _run("round_robin", failed)})
    assert any("work max/mean is 2.00" in m for m in missed)
    assert any("1 of 10 requests failed with --policy round_robin (first: ReadError: )" in m
               for m in missed)


def test_sse_tally_decodes_only_what_it_needs_across_any_split() -> None:
    """The first token, the usage and [DONE] are found however the bytes are cut; a token
    chunk after the first is never decoded (a malformed one there is not noticed)."""
    stream = (b'data: {"choices":[{"index":0,"text":" A"}]}\n\n'
              b'data: {not json, never decoded}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":3,'
              b'"prompt_tokens_details":{"cached_tokens":16}}}\n\n'
              b'data: [DONE]\n\n')
    for cut in range(1, len(stream)):
        t = SseTally()
        firsts = [t.feed(stream[:cut]), t.feed(stream[cut:])]
        assert firsts.count(True) == 1 and t.first_token and t.done and t.error is None
        assert firsts[0] == (cut >= stream.index(b"\n\n") + 2)
        assert t.usage == {"prompt_tokens": 20, "completion_tokens": 3,
                           "prompt_tokens_details": {"cached_tokens": 16}}


def test_sse_tally_names_error_events_and_malformed_first_events() -> None:
    t = SseTally()
    assert not t.feed(b'data: {"error": {"message": "engine died", "code": 502}}\n\n')
    assert t.error == "error event: {'message': 'engine died', 'code': 502}"
    t = SseTally()
    assert not t.feed(b"data: {oops\n\n") and t.error.startswith("malformed SSE event")
    t = SseTally()  # a role-only first event (chat) is not the first token
    assert not t.feed(b'data: {"choices":[]}\n\n') and not t.first_token
