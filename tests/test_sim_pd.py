"""kvwire sim on a prefill/decode fleet: pairs routed by the router's own choose_pair,
prompts prefilled on prefill engines, their KV pulled by decode engines at the modelled cost
(or pushed, in SGLang's protocol); transfers failing at a seeded rate, under each
load-failure policy.

Real runs, as in test_sim.py: engines publish through ZmqEventPublishers on ipc:// loopback
and the kvwire policy routes from a Subscriber -> PrefixIndex.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace

import pytest

from kvwire.cli import sim as sim_cli
from kvwire.engine import TransferCost
from kvwire.sim.fleet import SimConfig, run_sim
from kvwire.sim.trace import Request, bundled_trace_path, load_trace

PD = SimConfig(engines=0, prefill=4, decode=2, capacity=400, seed=3)


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = sim_cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def reqs() -> list:
    return load_trace(bundled_trace_path(), limit=300)


@pytest.fixture(scope="module")
def pd_run(reqs: list) -> dict:
    return run_sim(reqs, PD, ["kvwire", "round_robin"], progress=False).to_json()


def test_every_request_is_prefilled_remotely_pulled_and_decoded(pd_run: dict,
                                                                reqs: list) -> None:
    assert pd_run["prefill"] == 4 and pd_run["decode"] == 2 and pd_run["engines"] == 0
    for name, p in pd_run["policies"].items():
        # every request finished (the run raises otherwise) and was disaggregated
        assert p["decider"]["disagg"] == len(reqs) and p["failed"] == 0, name
        # each either pulled its prompt or found it (nearly) all on its decode engine
        assert p["transfers"] + p["decode_local"] == len(reqs), name
        assert p["transfers"] > 0 and p["transfer_blocks"] >= p["transfers"]
        assert p["transfer_bytes"] == p["transfer_blocks"] * 512 * 131072
        assert 0 < p["transfer_p50_s"] <= p["transfer_p99_s"]
        assert p["prefill_prompt_tokens"] == sum(max(r.input_length, 1) for r in reqs)
        assert 0.0 < p["ttft_p50_s"] <= p["ttft_p99_s"] and p["itl_p50_s"] > 0
    kv = pd_run["policies"]["kvwire"]
    assert kv["events_applied"] == kv["events_published"] > 0


def test_kvwire_sends_prefills_where_their_prefix_is_cached(pd_run: dict) -> None:
    p = pd_run["policies"]
    assert p["kvwire"]["prefill_cached_ratio"] > 2 * p["round_robin"]["prefill_cached_ratio"]
    assert p["kvwire"]["transfer_blocks"] < p["round_robin"]["transfer_blocks"]


def test_the_pull_costs_what_the_link_says(reqs: list) -> None:
    """A slower link makes the same pulls take longer, and the first tokens with them."""
    few = reqs[:60]
    fast = run_sim(few, PD, ["round_robin"], progress=False).to_json()["policies"]["round_robin"]
    slow_cfg = replace(PD, transfer=TransferCost(bandwidth_Bps=5e8, latency_s=0.01))
    slow = run_sim(few, slow_cfg, ["round_robin"], progress=False).to_json()
    slow = slow["policies"]["round_robin"]
    assert slow["transfer_blocks"] == fast["transfer_blocks"]
    assert slow["transfer_p50_s"] > 10 * fast["transfer_p50_s"]
    assert slow["ttft_p50_s"] > fast["ttft_p50_s"]


def test_the_decider_keeps_cheap_or_busy_prefills_local(reqs: list) -> None:
    few = reqs[:80]
    always = replace(PD, disagg_min_tokens=10**9)  # every prompt misses fewer tokens
    p = run_sim(few, always, ["kvwire"], progress=False).to_json()["policies"]["kvwire"]
    assert p["decider"]["cached"] == len(few) and p["transfers"] == 0
    assert p["prefill_prompt_tokens"] == 0
    busy = replace(PD, pd_prefill_busy=0.0)  # any load at all on every prefill engine
    p = run_sim(few, busy, ["kvwire"], progress=False).to_json()["policies"]["kvwire"]
    assert p["decider"]["prefill_busy"] > 0 and p["decider"]["disagg"] > 0
    assert p["decider"]["prefill_busy"] + p["decider"]["disagg"] == len(few)
    assert p["transfers"] + p["decode_local"] == p["decider"]["disagg"]


def test_both_engines_serve_either_side(reqs: list) -> None:
    """Two both engines and one decode engine: pairs whose two sides land on one both
    engine prefill there (``local``)."""
    cfg = SimConfig(engines=2, prefill=0, decode=1, capacity=400, seed=1)
    p = run_sim(reqs[:60], cfg, ["round_robin"], progress=False).to_json()["policies"]
    d = p["round_robin"]["decider"]
    assert sum(d.values()) == 60 and d["disagg"] > 0 and d["local"] > 0


def test_cli_flags_table_and_json() -> None:
    rc, out, err = _cli(["bundled", "--limit", "40", "--prefill", "2", "--decode", "1",
                         "--capacity", "400", "--policies", "kvwire,round_robin",
                         "--kv-bandwidth-gbps", "8", "--kv-latency-ms", "5", "--json"])
    assert rc == 0, err
    d = json.loads(out)
    assert (d["prefill"], d["decode"], d["engines"]) == (2, 1, 0)
    p = d["policies"]["kvwire"]
    # 8 Gb/s: one 512-token block of 128 KiB a token takes 67 ms, plus 5 ms
    assert p["transfer_p50_s"] >= 512 * 131072 / 1e9 + 0.005
    rc, out, err = _cli(["bundled", "--limit", "40", "--prefill", "2", "--decode", "1",
                         "--capacity", "400", "--policies", "kvwire",
                         "--disagg-min-tokens", "100000"])
    assert rc == 0, err
    assert "prefill cached" in out and "cached=40" in out


@pytest.mark.parametrize("argv,needle", [
    (["--prefill", "2"], "decodes"),
    (["--prefill", "1", "--decode", "1", "--engine-model", "fifo"], "batched"),
    (["--prefill", "1", "--decode", "1", "--policies", "sglang"], "sglang"),
    (["--prefill", "1", "--decode", "1", "--replicas", "2"], "replicas"),
])
def test_bad_pd_arguments(argv: list[str], needle: str) -> None:
    rc, _, err = _cli(["bundled", "--limit", "5", *argv])
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ failures, the protocols


def _pd(reqs: list, cfg: SimConfig, policy: str = "round_robin") -> tuple[dict, object]:
    r = run_sim(reqs, cfg, [policy], progress=False)
    return r.to_json()["policies"][policy], r.results[policy]


def test_a_failure_rate_fails_that_share_of_transfers_deterministically(reqs: list) -> None:
    """kv_fail_rate: a seeded draw per transfer, so a run repeats exactly. Under "fail" the
    decode engine answers an error and the pair runs again with another prefill engine, as
    kvwire serve runs it; after pd_retries more, the prefill is done on the decode engine.
    Every request is answered."""
    few = reqs[:120]
    cfg = replace(PD, kv_fail_rate=0.3, load_failure="fail")
    p, res = _pd(few, cfg)
    assert _pd(few, cfg)[0] == p  # deterministic
    assert 0.15 * p["transfers"] < p["transfers_failed"] < 0.45 * p["transfers"], p
    assert p["reruns"] == p["transfers_failed"] and p["failed"] == 0
    assert len(res.ttft_s) == len(few) and p["decider"]["disagg"] == len(few)
    assert _pd(few, replace(cfg, seed=4))[0]["transfers_failed"] != p["transfers_failed"]
    # every transfer fails: each request's pair runs on three prefill engines, then local
    p = _pd(few, replace(cfg, kv_fail_rate=1.0))[0]
    assert p["decode_local"] == 0 and p["transfer_blocks"] == 0 and p["failed"] == 0
    assert p["transfers_failed"] == p["transfers"] == p["reruns"] == 3 * p["fallbacks"]
    assert p["fallbacks"] == len(few)
    p = _pd(few, replace(cfg, kv_fail_rate=1.0, pd_retries=0))[0]
    assert p["transfers_failed"] == p["fallbacks"] == len(few)


def test_fallback_fail_fails_what_every_prefill_engine_failed(reqs: list) -> None:
    """pd_fallback "fail" (``--pd-fallback fail``): a request whose transfer failed on every
    prefill engine tried is not prefilled on its decode engine but fails, as kvwire serve
    answers 502; no engine holds anything after, and the rest are answered as before."""
    few = reqs[:120]
    cfg = replace(PD, kv_fail_rate=1.0, load_failure="fail", pd_fallback="fail")
    p, res = _pd(few, cfg)
    assert p["failed"] == len(few) and p["fallbacks"] == 0 and res.ttft_s == []
    assert p["transfers_failed"] == p["transfers"] == p["reruns"] == 3 * len(few)
    cfg = replace(cfg, kv_fail_rate=0.5)
    p, res = _pd(few, cfg)
    local = _pd(few, replace(cfg, pd_fallback="local"))[0]
    assert p["failed"] == local["fallbacks"] > 0 and p["fallbacks"] == 0
    assert len(res.ttft_s) == len(few) - p["failed"]
    with pytest.raises(ValueError, match="pd_fallback"):
        replace(PD, pd_fallback="retry")
    rc, out, err = _cli(["bundled", "--limit", "30", "--prefill", "2", "--decode", "1",
                         "--capacity", "400", "--policies", "round_robin", "--kv-fail-rate",
                         "1", "--pd-fallback", "fail", "--retries", "0", "--json"])
    assert rc == 0, err
    assert json.loads(out)["policies"]["round_robin"]["failed"] == 30


def test_recompute_answers_every_request_a_failed_transfer_delays(reqs: list) -> None:
    """Under "recompute" the decode engine computes what the failed transfer should have
    brought, no pair runs again, and the first tokens come later than with no failure;
    under "fail" the same draws run pairs again (more transfers)."""
    few = reqs[:120]
    clean, clean_res = _pd(few, PD)
    p, res = _pd(few, replace(PD, kv_fail_rate=0.5, load_failure="recompute"))
    assert p["transfers_failed"] > 0 and p["reruns"] == p["fallbacks"] == p["failed"] == 0
    assert p["transfers"] == clean["transfers"] and len(res.ttft_s) == len(few)
    assert p["transfer_blocks"] < clean["transfer_blocks"]
    assert sum(res.ttft_s) > sum(clean_res.ttft_s)
    failing = _pd(few, replace(PD, kv_fail_rate=0.5, load_failure="fail"))[0]
    assert failing["reruns"] > 0 and failing["transfers"] > clean["transfers"]


def _two(decode_output: int = 400) -> list[Request]:
    """A request that keeps the decode engine stepping, then one with a long prompt."""
    return [Request(0.0, 1024, decode_output, (1, 2)),
            Request(0.5, 512 * 8, 2, tuple(range(10, 18)))]


def test_sglang_pushes_when_the_prefill_ends(reqs: list) -> None:
    """The decode engine is busy decoding when the second request's prefill ends: vLLM's
    decode engine admits it at its next step and pulls after that step; SGLang's had it
    allocated since its arrival and the prefill engine pushes at once, so its first token
    comes sooner. With the decode engine idle the two are the same."""
    cfg = SimConfig(engines=0, prefill=1, decode=1, capacity=400, seed=0)
    ttft = {proto: _pd(_two(), replace(cfg, pd_protocol=proto))[1].ttft_s
            for proto in ("vllm", "sglang")}
    assert ttft["sglang"][0] == ttft["vllm"][0]
    assert ttft["sglang"][1] < ttft["vllm"][1]
    idle = {proto: _pd(_two(1), replace(cfg, pd_protocol=proto))[1].ttft_s
            for proto in ("vllm", "sglang")}
    assert idle["sglang"] == idle["vllm"]


def test_sglang_waits_for_a_push_at_most_a_lease() -> None:
    """SGLang's decode engine allocates when the request comes and waits for the push; a
    prefill longer than the lease ends that wait, and the transfer has failed (vLLM's
    decode side starts only when the prefill is done)."""
    cfg = SimConfig(engines=0, prefill=1, decode=1, capacity=400, seed=0, lease_s=0.05,
                    load_failure="recompute")
    long = [Request(0.0, 512 * 8, 2, tuple(range(10, 18)))]  # a ~0.2 s prefill
    assert _pd(long, replace(cfg, pd_protocol="vllm"))[0]["transfers_failed"] == 0
    p = _pd(long, replace(cfg, pd_protocol="sglang"))[0]
    assert p["transfers_failed"] == 1 and p["failed"] == 0


def test_cli_failure_and_protocol_flags() -> None:
    base = ["bundled", "--limit", "40", "--prefill", "2", "--decode", "1", "--capacity", "400",
            "--policies", "round_robin", "--json"]
    rc, out, err = _cli([*base, "--kv-fail-rate", "1", "--kv-load-failure", "recompute",
                         "--pd-protocol", "sglang"])
    assert rc == 0, err
    p = json.loads(out)["policies"]["round_robin"]
    assert p["transfers_failed"] == p["transfers"] > 0 and p["failed"] == p["reruns"] == 0
    rc, out, err = _cli(base[:-1] + ["--kv-fail-rate", "1"])
    assert rc == 0, err
    assert "xfer failed" in out
    for bad, says in ((["--kv-fail-rate", "1.5"], "--kv-fail-rate: must be in 0..1"),
                      (["--pd-protocol", "nixl"], "--pd-protocol"),
                      (["--kv-load-failure", "retry"], "--kv-load-failure")):
        err_out = io.StringIO()
        with contextlib.redirect_stderr(err_out), pytest.raises(SystemExit) as e:
            sim_cli.main([*base, *bad])
        err = err_out.getvalue()
        assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err
