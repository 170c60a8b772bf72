"""SGLang's router (sglang-router 0.3.2, PD mode) in front of ``kvwire fleet --prefill 2
--decode 1``, all on loopback: the router probes the workers (health, ``/server_info``,
``/model_info``, an HTTP/2 preface), sends each request to a prefill and the decode engine
at once with ``bootstrap_host``/``bootstrap_port``/``bootstrap_room``, and the decode
engine takes the prompt's KV from the prefill engine through its bootstrap server. The
``openai`` client, unchanged, gets every answer, streamed or not."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from pd_helpers import TIMEOUT, FleetProcess, metric, start_retried, until


@pytest.fixture(scope="module")
def routed():
    try:
        import sglang_router  # noqa: F401
    except Exception as e:
        pytest.skip(f"sglang-router is missing or unimportable ({type(e).__name__}: {e}): "
                    "pip install sglang-router==0.3.2 to run SGLang's router in front of a "
                    "kvwire P/D fleet")
    fleet = FleetProcess("--prefill", "2", "--decode", "1")
    e = fleet.engines

    def start(port: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
               "--log-level", "warn", "--worker-startup-check-interval", "1"]
        for name in ("prefill0", "prefill1"):
            cmd += ["--prefill", e[name]["url"], e[name]["bootstrap_port"]]
        cmd += ["--decode", e["decode0"]["url"]]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL)

    def ready(router: subprocess.Popen, port: int) -> bool:
        try:  # the router adds its workers in the background
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=5.0,
                           json={"model": "kvwire-engine", "prompt": "warm up",
                                 "max_tokens": 1})
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    try:
        router, port, _ = start_retried(start, ready, "SGLang's router")
    except BaseException:
        fleet.close()
        raise
    try:
        yield f"http://127.0.0.1:{port}", fleet
    finally:
        router.terminate()
        try:
            router.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()
        fleet.close()


def _metric(url: str, name: str, **labels: str) -> float:
    got = metric(httpx.get(url + "/metrics", timeout=TIMEOUT).text, name, **labels)
    assert got is not None, f"{name} not in {url}/metrics"
    return got


def test_sglang_router_pd_in_front_of_kvwire_engines(routed):
    import openai

    url, fleet = routed
    e = fleet.engines
    dec = e["decode0"]["url"]
    ok0 = _metric(dec, "kvwire_engine_kv_transfers_total", result="ok")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=TIMEOUT,
                           max_retries=0)
    texts = [f"Request {i}: the decode engine pulls this prompt's blocks from a prefill "
             "engine found through its bootstrap server." for i in range(6)]
    got = []
    for i, text in enumerate(texts):
        if i % 3 == 0:
            r = client.completions.create(model="kvwire-engine", prompt=text, max_tokens=6)
            got.append(r.choices[0].text)
        elif i % 3 == 1:
            r = client.chat.completions.create(
                model="kvwire-engine", messages=[{"role": "user", "content": text}],
                max_tokens=6)
            got.append(r.choices[0].message.content)
        else:
            parts = []
            for chunk in client.chat.completions.create(
                    model="kvwire-engine", messages=[{"role": "user", "content": text}],
                    max_tokens=6, stream=True):
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
            got.append("".join(parts))
    assert all(got), got
    # the answer is the decode engine's, as it would answer the prompt alone
    alone = httpx.post(dec + "/v1/completions", timeout=TIMEOUT,
                       json={"prompt": texts[0], "max_tokens": 6}).json()
    assert got[0] == alone["choices"][0]["text"]
    # every request's KV came over the side channel; both prefill engines served
    assert _metric(dec, "kvwire_engine_kv_transfers_total", result="ok") == ok0 + len(texts)
    assert _metric(dec, "kvwire_engine_kv_transfers_total", result="failed") == 0
    for name in ("prefill0", "prefill1"):
        p = e[name]["url"]
        assert _metric(p, "kvwire_engine_kv_leases_released_total") >= len(texts) // 2 - 1
        until(lambda p=p: _metric(p, "kvwire_engine_kv_held_blocks") == 0,
              f"{name} to hold no block")
    for o in e.values():  # the router's probes (HTTP/2 preface included) are no bad request
        text = httpx.get(o["url"] + "/metrics", timeout=TIMEOUT).text
        assert "kvwire_engine_bad_requests_total 0" in text
