"""The simulator's ``clairvoyant`` policy (runs each engine ahead to the request's first
token) and :meth:`EngineModel.fork`, the copy it runs ahead on."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvwire.engine import EngineConfig, EngineModel, EngineRequest
from kvwire.sim.batched import BatchedSim, engine_config, make_request
from kvwire.sim.fleet import SimConfig, SimError, simulate_policy
from kvwire.sim.floor import ttft_floor
from kvwire.sim.routers import ROUTERS
from kvwire.sim.trace import Request, bundled_trace_path, load_trace


def _run(m: EngineModel) -> None:
    while not m.idle:
        m.step()


def test_a_fork_runs_ahead_alone_and_as_the_engine_would() -> None:
    """Running the fork changes nothing of the engine; the engine, run the same way
    afterwards, gives the first token the fork gave (same state, same clock)."""
    m = EngineModel(EngineConfig(num_gpu_blocks=64, block_size=16,
                                 max_num_batched_tokens=128))
    m.add(EngineRequest("long", list(range(600)), 4))
    m.step()
    m.step()
    before = (m.now, m.steps, len(m.waiting), len(m.running), m.cache.num_free, len(m.itl))
    f = m.fork()
    assert len(f.itl) == 0 and f.now == m.now
    probe = EngineRequest("short", list(range(1000, 1040)), 1)
    f.add(probe, f.now)
    _run(f)
    assert (m.now, m.steps, len(m.waiting), len(m.running), m.cache.num_free,
            len(m.itl)) == before
    same = EngineRequest("short", list(range(1000, 1040)), 1)
    m.add(same, m.now)
    _run(m)
    assert same.first_token_t == probe.first_token_t is not None


def _fleet(n: int) -> tuple[list[BatchedSim], SimConfig]:
    cfg = SimConfig(engines=n, capacity=400, block_tokens=512)
    return [BatchedSim(f"engine{i}", engine_config(cfg), None) for i in range(n)], cfg


def _route(router, i: int, req: Request, cfg: SimConfig) -> tuple[int, EngineRequest]:
    er, named = make_request(i, req, cfg.block_tokens)
    router.request = er
    return router.route(er.rid, req, er.hashes[:named], req.t), er


def test_clairvoyant_takes_the_earliest_first_token_and_then_the_cache() -> None:
    """Two engines: a prompt cached on a busy engine goes to the idle one when the idle one
    answers first; with both idle, to the engine holding it. Routing moves no engine on."""
    engines, cfg = _fleet(2)
    router = ROUTERS["clairvoyant"](engines, cfg)
    shared = tuple(range(8))  # 8 blocks of 512 tokens
    warm = Request(0.0, 8 * 512, 1, shared)
    e, er = _route(router, 0, warm, cfg)
    assert e == 0  # a tie: both idle, nothing cached: the first engine
    engines[0].model.add(er, 0.0)
    _run(engines[0].model)
    # both idle again: the engine holding the prompt answers first (and holds most)
    again = Request(1.0, 8 * 512 + 100, 1, shared)
    assert _route(router, 1, again, cfg)[0] == 0
    # engine 0 busy with a long uncached prompt: the same prompt goes to engine 1
    long = Request(2.0, 150 * 512, 1, tuple(range(100, 250)))
    busy, _ = make_request(2, long, cfg.block_tokens)
    engines[0].model.add(busy, 2.0)
    engines[0].model.step()
    state = [(m.now, m.steps, len(m.waiting), len(m.running), m.cache.num_free)
             for m in (x.model for x in engines)]
    assert _route(router, 3, replace(again, t=engines[0].model.now), cfg)[0] == 1
    assert [(m.now, m.steps, len(m.waiting), len(m.running), m.cache.num_free)
            for m in (x.model for x in engines)] == state


def test_clairvoyant_in_the_simulator_and_its_limits() -> None:
    """The whole loop on the head of the bundled trace: every request routed and answered,
    none faster than the floor; the FIFO engine model (nothing to run ahead) is refused."""
    reqs = load_trace(bundled_trace_path())[:60]
    cfg = SimConfig(engines=2, capacity=2000)
    res = simulate_policy(reqs, "clairvoyant", cfg, progress=False)
    assert len(res.ttft_s) == 60 and res.hit_ratio > 0
    floor = ttft_floor(reqs, cfg)  # perfect knowledge, still no better than the floor
    assert all(t >= f - 1e-9 for t, f in zip(res.ttft_s, floor.ttft_s, strict=True))
    with pytest.raises(SimError, match="batched"):
        simulate_policy(reqs, "clairvoyant", replace(cfg, engine_model="fifo"),
                        progress=False)
