"""``kvwire fleet --prefill N --decode M --both K``: the engines it starts, the ``--engine``
specs it prints (roles, bootstrap ports, the port layout), a pair of its engines serving
both protocols (a ``both`` engine on either side), and its refusals."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import httpx
import pytest
from pd_helpers import TIMEOUT, FleetProcess, parse_spec, until
from pd_helpers import metric as sample
from test_engine_server_pd import PROMPT


@pytest.fixture(scope="module")
def fleet():
    f = FleetProcess("--prefill", "2", "--decode", "1", "--both", "1")
    try:
        yield f.base, f.specs
    finally:
        f.close()


def test_fleet_prints_roles_and_ports(fleet):
    base, specs = fleet
    got = [parse_spec(s) for s in specs]
    assert [n for n, _ in got] == ["prefill0", "prefill1", "decode0", "both0"]
    for i, (name, o) in enumerate(got):
        assert o["events"] == f"tcp://127.0.0.1:{base + 1000 + i}"
        assert o["replay"] == f"tcp://127.0.0.1:{base + 2000 + i}"
        assert o["url"] == f"http://127.0.0.1:{base + i}"
        assert o["role"] == re.sub(r"\d+$", "", name)
        if o["role"] == "decode":
            assert "bootstrap_port" not in o
        else:
            assert o["bootstrap_port"] == str(base + 4000 + i)
        info = httpx.get(o["url"] + "/server_info", timeout=TIMEOUT).json()
        assert info["kv_port"] == base + 3000 + i
        assert info["disaggregation_mode"] == ("null" if o["role"] == "both" else o["role"])
        assert info["disaggregation_bootstrap_port"] == (
            None if o["role"] == "decode" else base + 4000 + i)


def test_a_both_engine_serves_either_side(fleet):
    """vLLM: prefill0 -> both0 (decoding); SGLang: both0 (its own bootstrap port: the
    prefill side) -> decode0."""
    base, specs = fleet
    o = {n: opts for n, opts in map(parse_spec, specs)}
    body = {"prompt": PROMPT + " (fleet)", "max_tokens": 5}
    with httpx.Client(timeout=TIMEOUT) as c:
        r = c.post(o["prefill0"]["url"] + "/v1/completions", json=dict(
            body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        kv = r.json()["kv_transfer_params"]
        r = c.post(o["both0"]["url"] + "/v1/completions",
                   json=dict(body, kv_transfer_params=kv))
        assert r.status_code == 200, r.text
        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_room": 42,
                "bootstrap_port": int(o["both0"]["bootstrap_port"])}
        sb = dict(body, prompt=PROMPT + " (sglang fleet)", **boot)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault(
            "p", c.post(o["both0"]["url"] + "/v1/completions", json=sb)))
        t.start()
        r = c.post(o["decode0"]["url"] + "/v1/completions", json=sb)
        t.join(TIMEOUT)
        assert r.status_code == 200, r.text
        assert out["p"].status_code == 200 and out["p"].json()["usage"]["completion_tokens"] == 1

        def metric(url: str, name: str) -> float:
            got = sample(c.get(url + "/metrics").text, name)
            assert got is not None, name
            return got

        for name in ("both0", "decode0"):
            assert metric(o[name]["url"], "kvwire_engine_kv_transfers_started_total") == 1
        for name in ("prefill0", "both0"):
            until(lambda n=name: metric(o[n]["url"], "kvwire_engine_kv_held_blocks") == 0,
                  f"{name}'s lease released")


@pytest.mark.parametrize("flags, says", [
    (["--prefill", "2"], "needs an engine that decodes"),
    (["--decode", "1"], "needs an engine that prefills"),
    (["2", "--prefill", "1", "--decode", "1"], "give N or --prefill/--decode/--both"),
    (["--prefill", "1", "--decode", "1", "--dp-size", "2"], "need --dp-size 1"),
    (["--prefill", "1", "--decode", "1", "--role", "decode"], "--role is set per engine"),
    (["--prefill", "x", "--decode", "1"], "--prefill: "),
    (["--prefill", "1", "--decode", "1", "--kv-port", "9"], "--kv-port is set per engine"),
])
def test_fleet_refuses_bad_role_flags_in_one_line(flags, says):
    r = subprocess.run([sys.executable, "-m", "kvwire", "fleet", *flags], capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert r.returncode == 2, r
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
