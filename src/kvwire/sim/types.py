"""What the simulator's parts share: its config, results, errors, progress bar and policy
names. Below the loops (fleet.py, batched.py) and the routers (routers.py), so each imports
them without importing the others."""

from __future__ import annotations

import math
import sys
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from ..engine.model import LOAD_FAILURE
from ..engine.timing import StepCost, TransferCost
from ..routing.pairs import FALLBACK
from ..routing.policy import POLICIES as ROUTER_POLICIES
from ..routing.policy import RoutingPolicy
from .baselines import CacheAwareParams
from .quantile import nearest_rank

__all__ = ["ALL_POLICIES", "ENGINE_MODELS", "POLICIES", "PolicyResult", "Progress", "SimConfig",
           "SimError", "SimResult"]


class SimError(RuntimeError):
    """The simulation could not proceed (e.g. the subscriber never caught up)."""


_JSON_KEYS = ("hit_ratio", "work_max_over_mean", "ttft_p50_s", "ttft_p99_s",
              "events_published", "events_applied", "prefix_reuse_ratio", "itl_p50_s",
              "itl_p99_s", "e2e_p50_s", "e2e_p99_s", "output_tok_s", "preemptions")
#: a prefill/decode fleet's keys (besides the above)
PD_KEYS = ("prefill_cached_ratio", "prefill_prompt_tokens", "transfers", "transfer_blocks",
           "transfer_bytes", "transfer_p50_s", "transfer_p99_s", "decider", "decode_local",
           "transfers_failed", "reruns", "fallbacks", "failed")
#: The policies a run compares unless told otherwise: every policy a router runs
#: (``kvwire serve --policy``, in its order) and, after kvwire's, the oracle (which reads
#: the engines' caches: only a simulator can).
POLICIES = (ROUTER_POLICIES[0], "oracle", *ROUTER_POLICIES[1:])
#: Every policy ``run_sim`` knows; the ones past POLICIES are run when asked for.
ALL_POLICIES = (*POLICIES, "sglang", "clairvoyant")
ENGINE_MODELS = ("batched", "fifo")
#: how a prefill/decode fleet moves KV (SimConfig.pd_protocol)
PD_PROTOCOLS = ("vllm", "sglang")


@dataclass(frozen=True)
class SimConfig:
    """Fleet and model parameters (rates in tokens/s; times in virtual seconds)."""

    engines: int = 8
    capacity: int = 5000
    block_tokens: int = 512
    #: "batched" (kvwire.engine's model) or "fifo" (one request at a time, below)
    engine_model: str = "batched"
    #: batched only: the scheduler's limits, a CPU tier, the step-time constants
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    cpu_blocks: int = 0
    step_cost: StepCost = field(default_factory=StepCost)
    #: fifo only: service rates
    prefill_rate: float = 20_000.0
    decode_rate: float = 400.0
    seed: int = 0
    #: RoutingPolicy weights used by ``kvwire`` and ``oracle`` (same cost for both): a
    #: queue counts, block for block, once it exceeds the least-loaded engine's by
    #: ``balance_slack_tokens`` (docs/router.md has the comparison). The weights before
    #: the slack existed: ``load_weight=0.5, balance_slack_tokens=0``.
    prefill_weight: float = 1.0
    load_weight: float = 1.0
    balance_slack_tokens: int = 131_072
    #: Ties (a new prefix, engines idle) go to the engine busy least lately: the seconds
    #: it held requests, decayed over ``busy_window`` virtual seconds (LoadTracker.busy).
    busy_window: float = 600.0
    #: Load seen by the policy: reserved load less the prefill each engine has likely
    #: worked off at its learned rate (LoadTracker.load); False: reserved load only.
    drain: bool = True
    #: Load of a routed request = uncached blocks + decode_share x expected output blocks
    #: (expected = mean output of the requests completed so far). None: a decoded token's
    #: cost over a prefilled token's (fifo: prefill_rate / decode_rate; batched: the step
    #: cost's decode_seq_s / prefill_token_s), i.e. load is work in block-prefills.
    decode_share: float | None = None
    #: Predicted entries live this long (virtual s) unless events confirm them.
    predict_ttl: float = 30.0
    #: The ``sglang`` policy's parameters (SGLang router 0.3.2's defaults).
    cache_aware: CacheAwareParams = field(default_factory=CacheAwareParams)
    #: Wall seconds to wait for the subscriber to catch up before failing.
    sync_timeout: float = 30.0
    #: ``kvwire`` only: router replicas the requests are spread over in turn (each with
    #: its own load tracker, as ``kvwire serve --nats`` replicas behind a load balancer),
    #: and whether they share their load (router/load_share.py's PeerLoads, each report
    #: arriving ``share_delay`` virtual seconds after it was sent).
    replicas: int = 1
    share_load: bool = True
    share_delay: float = 0.002
    #: A prefill/decode fleet: ``prefill`` engines of role prefill and ``decode`` of role
    #: decode beside the ``engines`` of role both (both 0: every engine does both, as
    #: before). Batched engine model only; requests are routed in pairs (sim/pd.py).
    prefill: int = 0
    decode: int = 0
    #: what a pull costs, how long a prefill engine holds the blocks, and the largest pull
    #: a decode engine recomputes instead (the engine model's EngineConfig fields)
    transfer: TransferCost = field(default_factory=TransferCost)
    lease_s: float = 30.0
    recompute_blocks: int = 0
    #: a failed transfer fails its request ("fail") or the decode engine computes the rest
    #: of the prompt itself ("recompute"): the engine's ``--kv-load-failure``
    load_failure: str = "fail"
    #: the share of transfers that fail, at their end (drawn per request from ``seed``:
    #: the same requests' transfers fail under every policy that makes them)
    kv_fail_rate: float = 0.0
    #: a pair whose transfer failed under "fail" runs again with another prefill engine,
    #: as ``kvwire serve`` runs it, this many times; then its prefill is done on the decode
    #: engine (``kvwire serve --retries``) or fails, per ``pd_fallback`` ("local" or "fail":
    #: ``kvwire serve --pd-fallback``)
    pd_retries: int = 2
    pd_fallback: str = "local"
    #: how the KV moves: "vllm" (the decode engine admits the request when its prefill
    #: ends, then pulls) or "sglang" (the decode engine gets the request when the prefill
    #: engine does and allocates at once; the prefill engine pushes when its prefill ends)
    pd_protocol: str = "vllm"
    #: the decider: prefill on the decode engine when it misses fewer than this many
    #: prompt tokens, or when every prefill engine's load exceeds ``pd_prefill_busy`` blocks
    disagg_min_tokens: int = 0
    pd_prefill_busy: float = math.inf

    def __post_init__(self) -> None:
        if self.engine_model not in ENGINE_MODELS:
            raise ValueError(f"unknown engine model {self.engine_model!r}; choose from "
                             f"{', '.join(ENGINE_MODELS)}")
        if self.replicas < 1 or not self.share_delay >= 0:
            raise ValueError(f"need replicas >= 1 and share_delay >= 0, got "
                             f"{self.replicas} and {self.share_delay}")
        if self.prefill < 0 or self.decode < 0 or self.engines < 0:
            raise ValueError("engine counts must be >= 0")
        if self.load_failure not in LOAD_FAILURE:
            raise ValueError(f"load_failure must be one of {', '.join(LOAD_FAILURE)}, got "
                             f"{self.load_failure!r}")
        if self.pd_fallback not in FALLBACK:
            raise ValueError(f"pd_fallback must be one of {', '.join(FALLBACK)}, got "
                             f"{self.pd_fallback!r}")
        if self.pd_retries < 0:
            raise ValueError(f"pd_retries must be >= 0, got {self.pd_retries}")
        if not 0.0 <= self.kv_fail_rate <= 1.0:
            raise ValueError(f"kv_fail_rate must be within [0, 1], got {self.kv_fail_rate}")
        if self.pd_protocol not in PD_PROTOCOLS:
            raise ValueError(f"pd_protocol must be one of {', '.join(PD_PROTOCOLS)}, got "
                             f"{self.pd_protocol!r}")
        if not self.pd:
            if self.engines < 1:
                raise ValueError("need at least one engine")
            return
        if self.engine_model != "batched":
            raise ValueError("a prefill/decode fleet needs the batched engine model")
        if self.decode + self.engines < 1:
            raise ValueError("a prefill/decode fleet needs an engine that decodes "
                             "(--decode or --engines)")
        if self.replicas != 1:
            raise ValueError("router replicas are not simulated for a prefill/decode fleet")
        if self.disagg_min_tokens < 0 or not self.pd_prefill_busy >= 0:
            raise ValueError("disagg_min_tokens and pd_prefill_busy must be >= 0")

    @property
    def pd(self) -> bool:
        """Whether the fleet has prefill or decode engines (routed in pairs)."""
        return self.prefill > 0 or self.decode > 0

    @property
    def fleet_size(self) -> int:
        return self.engines + self.prefill + self.decode

    def routing_policy(self) -> RoutingPolicy:
        """The RoutingPolicy of the ``kvwire`` and ``oracle`` routers (slack in blocks)."""
        return RoutingPolicy(self.prefill_weight, self.load_weight, seed=self.seed,
                             balance_slack=self.balance_slack_tokens / self.block_tokens)

    def share(self) -> float:
        if self.decode_share is not None:
            return self.decode_share
        if self.engine_model == "batched":
            c = self.step_cost
            return c.decode_seq_s / c.prefill_token_s if c.prefill_token_s > 0 else 0.0
        return self.prefill_rate / self.decode_rate


@dataclass
class PolicyResult:
    """Everything measured for one policy."""

    name: str
    hit_blocks: int = 0
    prompt_blocks: int = 0
    engine_work_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    itl_s: array = field(default_factory=lambda: array("d"))
    route_us: list[float] = field(default_factory=list)
    events_published: int = 0
    events_applied: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    span_s: float = 0.0  # first arrival to last completion
    preemptions: int = 0
    wall_s: float = 0.0
    #: a prefill/decode fleet's counts (sim/pd.py's PdCounts.summary), else None
    pd: dict[str, Any] | None = None

    @property
    def prefix_reuse_ratio(self) -> float:
        """Prompt tokens found cached on admission / prompt tokens (the mocker's ratio)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def work_max_over_mean(self) -> float:
        w = self.engine_work_s
        mean = sum(w) / len(w) if w else 0.0
        return max(w) / mean if mean > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The six §4 keys (deterministic for a seed), then wall-clock extras."""
        ttft = sorted(self.ttft_s)
        lat = sorted(self.route_us)
        itl = sorted(self.itl_s)
        e2e = sorted(self.e2e_s)
        return {
            "hit_ratio": round(self.hit_ratio, 6),
            "work_max_over_mean": round(self.work_max_over_mean, 6),
            "ttft_p50_s": round(nearest_rank(ttft, 0.50), 6),
            "ttft_p99_s": round(nearest_rank(ttft, 0.99), 6),
            "events_published": self.events_published,
            "events_applied": self.events_applied,
            "prefix_reuse_ratio": round(self.prefix_reuse_ratio, 6),
            "itl_p50_s": round(nearest_rank(itl, 0.50), 6),
            "itl_p99_s": round(nearest_rank(itl, 0.99), 6),
            "e2e_p50_s": round(nearest_rank(e2e, 0.50), 6),
            "e2e_p99_s": round(nearest_rank(e2e, 0.99), 6),
            "output_tok_s": round(self.output_tokens / self.span_s, 3) if self.span_s else 0.0,
            "preemptions": self.preemptions,
            **(self.pd or {}),
            "route_p50_us": round(nearest_rank(lat, 0.50), 1),
            "route_p99_us": round(nearest_rank(lat, 0.99), 1),
            "engine_work_s": [round(w, 3) for w in self.engine_work_s],
        }


@dataclass
class SimResult:
    """One run: the fleet's shape and each policy's result."""

    requests: int
    config: SimConfig
    results: dict[str, PolicyResult]

    def to_json(self) -> dict[str, Any]:
        """The object ``kvwire sim --json`` prints: exactly the issue's shape, every value
        deterministic for a seed (route latencies, which measure this machine, are left to
        the table and the report)."""
        cfg = self.config
        keys = (*_JSON_KEYS, *PD_KEYS) if cfg.pd else _JSON_KEYS
        out: dict[str, Any] = {
            "requests": self.requests,
            "engines": cfg.engines,
            "capacity": cfg.capacity,
            "engine_model": cfg.engine_model,
        }
        if cfg.pd:
            out.update(prefill=cfg.prefill, decode=cfg.decode)
        out["policies"] = {n: {k: v for k, v in r.summary().items() if k in keys}
                           for n, r in self.results.items()}
        return out

    def table(self) -> str:
        """A plain-text table, one row per policy."""
        if self.config.pd:
            return self._pd_table()
        head = (f"{'policy':<12}{'hit_ratio':>10}{'max/mean':>10}{'ttft_p50':>10}"
                f"{'ttft_p99':>10}{'itl_p50':>9}{'e2e_p99':>9}{'out tok/s':>10}"
                f"{'events pub':>12}{'applied':>10}{'route p99':>11}")
        rows = [head]
        for n, r in self.results.items():
            s = r.summary()
            rows.append(
                f"{n:<12}{s['hit_ratio']:>10.3f}{s['work_max_over_mean']:>10.3f}"
                f"{s['ttft_p50_s']:>9.2f}s{s['ttft_p99_s']:>9.2f}s"
                f"{s['itl_p50_s'] * 1e3:>7.1f}ms{s['e2e_p99_s']:>8.2f}s{s['output_tok_s']:>10.0f}"
                f"{s['events_published']:>12}{s['events_applied']:>10}{s['route_p99_us']:>9.0f}us"
            )
        return "\n".join(rows)

    def _pd_table(self) -> str:
        head = (f"{'policy':<12}{'ttft_p50':>10}{'ttft_p99':>10}{'prefill cached':>15}"
                f"{'transfers':>10}{'blocks':>9}{'xfer p99':>10}{'xfer failed':>12}"
                f"{'local (decider)':>24}{'failed':>7}")
        rows = [head]
        for n, r in self.results.items():
            s = r.summary()
            local = ",".join(f"{k}={v}" for k, v in s["decider"].items() if k != "disagg" and v)
            rows.append(
                f"{n:<12}{s['ttft_p50_s']:>9.3f}s{s['ttft_p99_s']:>9.3f}s"
                f"{s['prefill_cached_ratio']:>15.3f}{s['transfers']:>10}"
                f"{s['transfer_blocks']:>9}{s['transfer_p99_s'] * 1e3:>8.1f}ms"
                f"{s['transfers_failed']:>12}{local or '-':>24}{s['failed']:>7}")
        return "\n".join(rows)


class Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, label: str, total: int, enabled: bool | None = None) -> None:
        self.on = sys.stderr.isatty() if enabled is None else enabled
        self.label, self.total, self.last = label, total, 0.0

    def update(self, n: int, force: bool = False) -> None:
        if not self.on:
            return
        now = time.monotonic()
        if not force and now - self.last < 0.1:
            return
        self.last = now
        frac = n / self.total if self.total else 1.0
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{self.label:<11} [{bar:<30}] {n}/{self.total}")
        sys.stderr.flush()

    def done(self) -> None:
        if self.on:
            self.update(self.total, force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()
