"""The NATS consumer's command lines in real processes: ``kvwire listen nats://`` shows the
items, ``kvwire serve --nats`` routes by a cache that arrived through JetStream."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("nats")

from nats_writer import Writer  # noqa: E402
from test_nats_consumer import _wait, _write, run  # noqa: E402


def test_kvwire_listen_nats_in_a_real_process(nats_server: Any) -> None:
    """``kvwire listen nats://... --json --count N`` shows the items (and the plain output
    names the streams); the summary on stderr has the NATS counters."""
    import json
    import subprocess
    import sys

    async def plan(w: Writer) -> None:
        await w.start("a", 0, epoch=4)
        await w.start("b", 2, epoch=1)
        await w.batches("a", 0, 7)
        await w.batches("b", 2, 5)

    run(_write(nats_server.url, plan))
    base = [sys.executable, "-m", "kvwire", "listen", nats_server.url, "--stream", "KVWIRE"]
    r = subprocess.run(base + ["--json", "--count", "12", "--duration", "60"],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in r.stdout.splitlines()]
    a = [(x["kind"], x.get("seq")) for x in recs if x["stream"] == "a/dp0"]
    assert a == [("reset", None), ("snapshot", 0)] + [("batch", s) for s in range(1, 8)]
    assert {x["stream"] for x in recs} == {"a/dp0", "b/dp2"}
    assert "nats: 16 messages, 12 batches, 0 gaps" in r.stderr, r.stderr
    # a subject filter narrows it to one engine; plain output
    r = subprocess.run(base + ["--subject", "kvwire.events.b.>", "--count", "5",
                               "--duration", "60", "--no-view"],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    assert "b/dp2" in r.stdout and "a/dp0" not in r.stdout
    assert "b/dp2: snapshot at seq 0" in r.stderr
    # a bad durable name: one clear line, exit 2
    r = subprocess.run(base + ["--durable", "no.dots", "--count", "1"],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 2 and "durable consumer name 'no.dots'" in r.stderr, r.stderr


def test_kvwire_serve_nats_routes_by_a_cache_that_came_through_jetstream(
        nats_server: Any) -> None:
    """``kvwire serve --nats URL`` (a real process): the engines are found on the stream, the
    index is fed from JetStream, and a prompt goes to the engine whose cache holds it."""
    import re
    import subprocess
    import sys

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from kvwire.wire.events import BlockStored

    bs = 16

    def toks(seed: int) -> list[int]:
        return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(8 * bs)]

    async def plan(w: Writer) -> None:
        for e in ("a", "b"):
            await w.start(e, 0, epoch=1)
        await w.batch("a", 0, [BlockStored(list(range(100, 108)), None, toks(1), bs, None)])
        await w.batch("b", 0, [BlockStored(list(range(200, 208)), None, toks(2), bs, None)])

    run(_write(nats_server.url, plan))
    p = subprocess.Popen([sys.executable, "-m", "kvwire", "serve", "--nats", nats_server.url,
                          "--port", "0", "--block-size", str(bs)],
                         stderr=subprocess.PIPE, text=True)
    try:
        port = None
        deadline = time.monotonic() + 60
        while port is None:
            assert time.monotonic() < deadline and p.poll() is None, "serve did not start"
            m = re.search(r"2 streams; http://127\.0\.0\.1:(\d+)/", p.stderr.readline())
            port = int(m.group(1)) if m else None
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            def indexed() -> bool:
                eng = http.get("/engines").json()
                return all(sum(eng[e]["ranks"][0]["blocks"].values()) == 8 for e in "ab")

            _wait(indexed, what="both engines indexed from JetStream")
            for seed, want in ((1, "a"), (2, "b")):
                r = http.post("/score", json={"token_ids": toks(seed)})
                assert r.status_code == 200 and r.json()["engine"] == want, r.text
                assert r.json()["overlap"][want] == 8
    finally:
        p.terminate()
        p.wait(10)
    r = subprocess.run([sys.executable, "-m", "kvwire", "serve", "--nats", nats_server.url,
                        "--stream", "NOPE", "--port", "0"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "cannot read stream NOPE" in r.stderr, r.stderr


def test_listen_nats_without_nats_py_says_how_to_get_it() -> None:
    """Without the nats extra: one line naming the extra, exit 2 (nats-py is installed here,
    so it is made unimportable in the child: the one way to cause this for real)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['nats'] = None\n"
            "from kvwire.cli.main import main\n"
            "sys.exit(main(['listen', 'nats://127.0.0.1:1', '--count', '1']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "pip install 'kvwire[nats]'" in r.stderr and "Traceback" not in r.stderr
