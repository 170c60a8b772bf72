"""The status page's live charts: the sampler's pure arithmetic (rates from counters, ratios,
TTFT p50 from histogram buckets, ring bounds, counter resets), ``GET /status.json`` over a
real ``kvwire serve`` in front of real ``kvwire engine`` processes and over the decision API
alone, and the page itself in a real headless chromium."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.serve.status.series import (
    SERIES,
    EngineReading,
    StatusSeries,
    bucket_quantile,
)

httpx = pytest.importorskip("httpx")
pytest.importorskip("httptools")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_proxy import ROOT, TIMEOUT, EngineProc, wait_for  # noqa: E402
from test_serve import _chromium, _stderr_line  # noqa: E402

COL = {k: i for i, k in enumerate(SERIES)}
INF = math.inf


def R(**kw: Any) -> EngineReading:
    return EngineReading(**kw)


# ---------------------------------------------------------------------------- pure sampler


def test_rates_and_ratios_come_from_counter_deltas() -> None:
    s = StatusSeries(capacity=10)
    ttft0 = ((0.01, 0.0), (0.1, 0.0), (1.0, 0.0), (INF, 0.0))
    ttft1 = ((0.01, 0.0), (0.1, 4.0), (1.0, 4.0), (INF, 4.0))  # 4 in (0.01, 0.1]
    s.add(10.0, {"a": R(routed=5, hit_credit=2, hit_blocks=4, requests=5, prompt_tokens=100,
                        cached_tokens=10, in_flight=1, load=3, ttft=ttft0)})
    assert s.window(10.0, 60)["a"]["t"] == []  # one reading: no interval yet
    s.add(12.0, {"a": R(routed=9, hit_credit=5, hit_blocks=8, requests=11,
                        prompt_tokens=300, cached_tokens=160, in_flight=2, load=7,
                        ttft=ttft1)})
    w = s.window(12.0, 60)["a"]
    assert w["t"] == [0.0]
    assert w["requests_per_s"] == [3.0]  # 6 answers in 2 s
    assert w["routed_per_s"] == [2.0]
    assert w["cached_ratio"] == [0.75]  # 150 of 200 new prompt tokens
    assert w["predicted_hit_ratio"] == [0.75]  # 3 of 4 blocks
    assert w["ttft_p50_s"] == [0.055]  # rank 2 of 4 in (0.01, 0.1]: halfway
    assert w["in_flight"] == [2.0] and w["load_blocks"] == [7.0]
    # nothing answered in the next interval: rates 0, ratios and TTFT unknown (None)
    s.add(13.0, {"a": R(routed=9, hit_credit=5, hit_blocks=8, requests=11,
                        prompt_tokens=300, cached_tokens=160, in_flight=0, ttft=ttft1)})
    w = s.window(13.0, 60)["a"]
    assert w["requests_per_s"][-1] == 0.0 and w["cached_ratio"][-1] is None
    assert w["ttft_p50_s"][-1] is None and w["predicted_hit_ratio"][-1] is None


def test_without_proxy_figures_are_none() -> None:
    s = StatusSeries()
    s.add(1.0, {"a": R(routed=1)})
    s.add(2.0, {"a": R(routed=4, hit_credit=1, hit_blocks=2)})
    w = s.window(2.0, 10)["a"]
    assert w["routed_per_s"] == [3.0] and w["predicted_hit_ratio"] == [0.5]
    for key in ("requests_per_s", "cached_ratio", "ttft_p50_s", "in_flight"):
        assert w[key] == [None], key


def test_a_counter_that_goes_back_counts_from_zero() -> None:
    """A restarted source: its counters start again; the new value is all new."""
    s = StatusSeries()
    b = ((0.1, 5.0), (INF, 5.0))
    s.add(1.0, {"a": R(routed=100, requests=100, prompt_tokens=1000, cached_tokens=900,
                       ttft=b)})
    s.add(2.0, {"a": R(routed=3, requests=2, prompt_tokens=10, cached_tokens=5,
                       ttft=((0.1, 0.0), (INF, 1.0)))})
    w = s.window(2.0, 10)["a"]
    assert w["routed_per_s"] == [3.0] and w["requests_per_s"] == [2.0]
    assert w["cached_ratio"] == [0.5]
    assert w["ttft_p50_s"] == [0.1]  # in +inf: the last finite bound


def test_time_that_does_not_advance_is_ignored() -> None:
    s = StatusSeries()
    s.add(5.0, {"a": R(routed=1)})
    s.add(5.0, {"a": R(routed=9)})
    s.add(4.0, {"a": R(routed=9)})
    s.add(6.0, {"a": R(routed=3)})
    assert s.window(6.0, 10)["a"]["routed_per_s"] == [2.0]


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 20), ticks=st.integers(0, 60),
       engines=st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6))
def test_rings_are_bounded(capacity: int, ticks: int, engines: list[str]) -> None:
    s = StatusSeries(capacity=capacity, max_engines=3)
    for t in range(ticks):
        s.add(float(t), {e: R(routed=t) for e in engines})
    assert len(s.rings) <= 3
    for name, ring in s.rings.items():
        assert len(ring) == min(capacity, max(ticks - 1, 0))
        w = s.window(float(ticks), 1e9)[name]
        assert all(len(w[k]) == len(w["t"]) for k in (*SERIES, "dt"))
        assert all(v == 1.0 for v in w["routed_per_s"])
    assert s.dropped_engines == (max(len(set(engines)) - 3, 0) * ticks)


def test_window_keeps_only_the_last_seconds() -> None:
    s = StatusSeries()
    for t in range(11):
        s.add(float(t), {"a": R(routed=t * t)})
    w = s.window(10.0, 3)["a"]
    assert w["t"] == [2.0, 1.0, 0.0] and w["routed_per_s"] == [15.0, 17.0, 19.0]


@pytest.mark.parametrize(("q", "buckets", "want"), [
    (0.5, [], None),
    (0.5, [(1.0, 0.0), (INF, 0.0)], None),
    (0.5, [(1.0, 2.0), (INF, 2.0)], 0.5),
    (0.5, [(1.0, 0.0), (3.0, 10.0), (INF, 10.0)], 2.0),
    (0.9, [(1.0, 5.0), (2.0, 5.0), (INF, 10.0)], 2.0),
    (1.0, [(1.0, 3.0), (2.0, 4.0), (INF, 4.0)], 2.0),
])
def test_bucket_quantile(q: float, buckets: list, want: float | None) -> None:
    assert bucket_quantile(q, buckets) == want


# ---------------------------------------------------------------------------- real processes


class Serve:
    """A real ``kvwire serve`` process; ``url`` once it said where it listens."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([str(ROOT / ".venv/bin/kvwire"), "serve", "--port", "0",
                                      *args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        while True:
            line = _stderr_line(self.proc, ".")
            m = re.search(r"(http://\S+)/", line)
            if m and "streams;" in line:
                self.url = m.group(1)
                return

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(TIMEOUT)
        if self.proc.stderr:
            self.proc.stderr.close()


def _chat(k: int, **kw: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 4,
            "messages": [{"role": "system", "content": f"status page {k} " + "words " * 80},
                         {"role": "user", "content": "q"}], **kw}


def _streamed(c: httpx.Client, body: dict[str, Any]) -> tuple[str, bytes]:
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        return r.headers["x-kvwire-engine"], b"".join(r.iter_raw())


def _usage(answer: bytes) -> tuple[int, int]:
    """(prompt, cached) tokens of an answer's usage object (the last SSE event with one)."""
    import json

    for part in reversed(answer.split(b"data: ")):
        part = part.strip()
        if part.startswith(b"{") and b'"usage"' in part:
            u = json.loads(part)["usage"]
            return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]
    raise AssertionError(f"no usage in {answer[-300:]!r}")


@pytest.fixture(scope="module")
def proxied() -> Iterator[tuple[str, list[str], dict[str, list[int]]]]:
    """Two `kvwire engine` processes behind a `kvwire serve` process that has answered
    streamed (with usage) and whole requests (round robin alternates: each prompt's
    streamed requests go to one engine and its whole ones to the other, four times each,
    so from the second on they find it cached); yields (url, engine names, the [prompt,
    cached] tokens the client read in each engine's answers) once the sampler has a point
    of every chart for every engine."""
    engines = [EngineProc("--speed", "5") for _ in range(2)]
    serve = None
    try:
        for e in engines:
            e.wait_ready()
        args = []
        for i, e in enumerate(engines):
            args += ["--engine", f"e{i}={e.events},url={e.url}"]
        serve = Serve(*args, "--tokenizer", "builtin", "--policy", "round_robin",
                      "--probe-interval", "0.2")
        names = ["e0", "e1"]
        usage = {n: [0, 0] for n in names}
        with httpx.Client(base_url=serve.url, timeout=TIMEOUT) as c:
            wait_for(lambda: all(e["ranks"][0]["alive"] and e["http"]["http_up"]
                                 for e in c.get("/engines").json().values()),
                     "both engines live on events and HTTP")
            for k in range(3):
                for _ in range(4):
                    name, answer = _streamed(c, _chat(k, stream=True,
                                                      stream_options={"include_usage": True}))
                    r = c.post("/v1/chat/completions", json=_chat(k))
                    assert r.status_code == 200
                    for n, a in ((name, answer), (r.headers["x-kvwire-engine"], r.content)):
                        got = _usage(a)
                        usage[n][0] += got[0]
                        usage[n][1] += got[1]
            # a stream open across a sampling tick on each engine: in-flight is seen as 1
            held = set()
            for _ in names:
                body = _chat(99, stream=True, max_tokens=5000, ignore_eos=True)
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    name = r.headers["x-kvwire-engine"]
                    held.add(name)
                    chunks = r.iter_raw()  # kept: a dropped iterator closes the stream
                    assert next(chunks).startswith(b"data: {")
                    wait_for(lambda n=name: 1.0 in _status(c)["engines"][n]["in_flight"],
                             "in-flight seen by the sampler")
            assert held == set(names)

            def charted() -> bool:
                st = _status(c)["engines"]
                return all(any(v for v in st[n][key] if v is not None)
                           for n in names for key in ("requests_per_s", "cached_ratio",
                                                      "ttft_p50_s", "in_flight"))
            wait_for(charted, "every chart of every engine has data")
            wait_for(lambda: all(_status(c)["engines"][n]["in_flight"][-1] == 0.0
                                 for n in names), "the held streams' end sampled")
        yield serve.url, names, usage
    finally:
        if serve is not None:
            serve.stop()
        for e in engines:
            e.stop()


def _status(c: httpx.Client, seconds: int = 300) -> dict[str, Any]:
    r = c.get("/status.json", params={"seconds": seconds})
    assert r.status_code == 200, r.text
    return r.json()


def test_status_json_over_real_serve_and_engines(proxied: tuple) -> None:
    """The proxy counts the prompt and cached tokens the engines reported in their answers
    (streamed and whole), exactly; the sampler's points agree with the proxy's counters on
    /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    url, names, usage = proxied
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        st = _status(c)
        text = c.get("/metrics").text
        bad = c.get("/status.json", params={"seconds": "soon"})
        assert bad.status_code == 400 and "seconds" in bad.json()["error"]
        assert c.get("/status.json", params={"seconds": 0}).status_code == 400
        assert c.get("/status.json", params={"seconds": 10 ** 6}).status_code == 400
        recent = _status(c, 3)["engines"]["e0"]["t"]  # (the cut itself: a pure test)
        assert all(t < 3 for t in recent)
    got = {(s.name, s.labels.get("engine")): s.value
           for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert st["proxy"] is True and st["interval_s"] == 1.0 and set(st["series"]) == set(SERIES)
    for n in names:
        e = st["engines"][n]
        assert e["proxied"] and e["alive"]
        assert len(e["t"]) == len(e["requests_per_s"]) > 0
        # 12 answers and the held stream on each engine; rate x interval gives them back
        answered = sum(v * dt for v, dt in zip(e["requests_per_s"], e["dt"]))
        assert answered == pytest.approx(got["kvwire_proxy_requests_total", n], abs=0.01)
        assert got["kvwire_proxy_requests_total", n] == 13
        prompt = got["kvwire_proxy_prompt_tokens_total", n]
        cached = got["kvwire_proxy_cached_tokens_total", n]
        assert [prompt, cached] == usage[n]  # what the client read, the held streams aside
        assert 0 < cached < prompt  # the second sight of each prompt hit the cache
        ratios = [v for v in e["cached_ratio"] if v is not None]
        assert ratios and all(0 <= v <= 1 for v in ratios) and max(ratios) > 0
        assert all(v is None or 0 < v < 60 for v in e["ttft_p50_s"])
        assert e["in_flight"][-1] == 0.0 and max(e["in_flight"]) >= 1.0
        routed = sum(v * dt for v, dt in zip(e["routed_per_s"], e["dt"]))
        assert routed == pytest.approx(13, abs=0.01)


@pytest.fixture(scope="module")
def decision_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict]]:
    """A router over two publishers, no proxy (engines without url=): engine a holds 8
    blocks; 5 prompts of those 8 + 8 new blocks routed to it and not released. Yields
    (the fleet, /status.json once the sampler has counted the 5 routes)."""
    from test_serve import running_fleet, stored, tokens

    with running_fleet(tmp_path_factory.mktemp("decision")) as f:
        f.pubs["a"].publish(stored(tokens(1, 8), 1000))
        wait_for(lambda: f.blocks("a") >= 8, "a's blocks indexed")
        for _ in range(5):
            r = f.http.post("/route", json={"token_ids": tokens(1, 8) + tokens(9, 8)})
            assert r.status_code == 200 and r.json()["engine"] == "a", r.text

        def charted() -> dict | None:
            st = f.http.get("/status.json?seconds=60").json()
            e = st["engines"]["a"]
            routed = sum(v * dt for v, dt in zip(e["routed_per_s"], e["dt"]))
            return st if routed == pytest.approx(5, abs=0.01) else None
        yield f, wait_for(charted, "a's routes charted")


def test_status_json_without_proxy_shows_the_routers_figures(decision_only: tuple) -> None:
    """Decision API only: routed/s, the predicted hit ratio and the reserved load are
    charted; the proxy's figures are None (the page says n/a)."""
    _, st = decision_only
    assert st["proxy"] is False
    a = st["engines"]["a"]
    assert not a["proxied"] and a["alive"]
    # a holds 8 of the 16 blocks; after the first route, the prediction holds them all
    assert all(0.5 <= v <= 1 for v in a["predicted_hit_ratio"] if v is not None)
    assert any(v is not None for v in a["predicted_hit_ratio"])
    for key in ("requests_per_s", "cached_ratio", "ttft_p50_s", "in_flight"):
        assert set(a[key]) == {None}, key
    assert max(a["load_blocks"]) > 0  # 5 routes reserved, none released
    assert set(st["engines"]["b"]["routed_per_s"]) <= {0.0}


def test_page_without_proxy_in_headless_chromium(decision_only: tuple, tmp_path: Path
                                                 ) -> None:
    """The page charts routed/s and the predicted hit ratio, and says TTFT and in-flight
    are n/a."""
    f, _ = decision_only
    card = _card(_browse(f.port, tmp_path), "a")
    assert _points(card, "routed_per_s") > 0 and _points(card, "predicted_hit_ratio") > 0
    assert card.count("n/a (no proxy)") == 2
    assert 'data-na="ttft_p50_s"' in card and 'data-na="in_flight"' in card


# ---------------------------------------------------------------------------- the page


def _browse(port: int | str, tmp: Path) -> str:
    """The page's DOM after its script ran a few refreshes in headless chromium."""
    browser = _chromium()
    if browser is None:
        msg = ("CHROMIUM NOT INSTALLED: the status page's charts were NOT checked in a "
               "browser (apt-get install -y chromium)")
        print(msg, file=sys.stderr)
        pytest.skip(msg)
    profile = tempfile.mkdtemp(dir=tmp)
    r = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--user-data-dir={profile}", "--virtual-time-budget=4000", "--dump-dom",
         f"http://127.0.0.1:{port}/"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": profile})
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _card(dom: str, engine: str) -> str:
    """The chart card of ``engine`` in the DOM (up to the next card or the table)."""
    start = dom.find(f'<div class="engine" data-engine="{engine}">')
    assert start >= 0, dom[:3000]
    ends = [i for i in (dom.find('<div class="engine"', start + 1),
                        dom.find("<table", start)) if i >= 0]
    return dom[start:min(ends)]


def _points(card: str, series: str) -> int:
    """How many points the chart of ``series`` drew (0 if it is not there)."""
    m = re.search(rf'<svg [^>]*data-series="{series}" data-points="(\d+)"[^>]*>.*?'
                  rf'<path d="([^"]*)"', card, re.S)
    if m is None:
        return 0
    assert int(m.group(1)) == 0 or m.group(2).startswith("M"), m.group(0)
    return int(m.group(1))


def test_charts_in_headless_chromium(proxied: tuple, tmp_path: Path) -> None:
    """The page, loaded in a real chromium after real requests, draws the four charts of
    every engine with data, and still the stream table."""
    url, names, _ = proxied
    dom = _browse(url.rsplit(":", 1)[1], tmp_path)
    for n in names:
        card = _card(dom, n)
        for series in ("requests_per_s", "cached_ratio", "ttft_p50_s", "in_flight"):
            assert _points(card, series) > 0, (n, series, card[:2000])
        assert "n/a" not in card
        assert f'data-stream="{n}/dp0"' in dom  # the table is still there
    assert '<b id="health" class="ok">ok</b>' in dom
    assert "proxy figures" in dom
