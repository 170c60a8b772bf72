"""The engine's Prometheus metrics under vLLM's names (pure: counters in, exposition text out).

Names, types and histogram buckets are vLLM V1's, so dashboards and autoscalers written for
vLLM read a ``kvwire engine`` unchanged. Labels are vLLM's ``model_name`` and ``engine``
(the DP rank). Times are the model's seconds (equal to wall seconds at ``--speed 1``).

Small hand-made counters rather than prometheus_client: an observation is one ``bisect``
and two adds (the engine makes ~20 per request), and each engine owns its own set, so any
number of engines can live in one process (tests, DP ranks).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable

__all__ = ["EngineStats", "Histogram", "TransferStats", "render", "render_transfer"]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def _token_buckets(max_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_len`` (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    e = 1
    while True:
        for m in (1, 2, 5):
            v = m * e
            if v > max_len:
                return tuple(out)
            out.append(v)
        e *= 10


class Histogram:
    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: Iterable[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def observe_many(self, values: Iterable[float]) -> None:
        counts, b = self.counts, self.buckets
        n = 0
        s = 0.0
        for v in values:
            counts[bisect_left(b, v)] += 1
            s += v
            n += 1
        self.sum += s
        self.count += n


class EngineStats:
    """One engine's (one DP rank's) counters and histograms; the core updates them."""

    def __init__(self, max_model_len: int) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.request_success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        tok = _token_buckets(max_model_len)
        self.req_prompt = Histogram(tok)
        self.req_gen = Histogram(tok)
        self.iteration_tokens = Histogram((1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                           8192, 16384))


#: bytes of one pull: from one 16-token block of a small model to a long prompt's KV
BYTES_BUCKETS = (2.0**16, 2.0**18, 2.0**20, 2.0**22, 2.0**24, 2.0**26, 2.0**28, 2.0**30,
                 2.0**32, 2.0**34)


class TransferStats:
    """What the engine server adds to the model's transfer counters: failed pulls by
    reason, pulls recomputed locally, blocks served to decode engines and heartbeats
    answered."""

    def __init__(self) -> None:
        self.failed: dict[str, int] = {}
        self.recomputed = 0
        self.served_blocks = 0
        self.heartbeats = 0
        self.rooms = 0  # SGLang rooms known on the prefill side (set when rendered)
        self.rooms_dropped = 0  # rooms forgotten unclaimed to keep the table bounded
        #: decode side: telling a prefill engine to free its blocks failed
        self.failed_notifications = 0
        #: decode side: bytes of each pull that ended well (modelled: blocks x block size
        #: x bytes per token)
        self.bytes = Histogram(BYTES_BUCKETS)

    def fail(self, reason: str) -> None:
        self.failed[reason] = self.failed.get(reason, 0) + 1


def render_transfer(labels: dict[str, str], counts: dict[str, int], seconds: Histogram,
                    st: TransferStats) -> bytes:
    """The KV transfer's families (``kvwire_engine_kv_*``), appended to :func:`render`'s:
    ``counts`` is the core's ``transfer_counts``, ``seconds`` its pull-time histogram."""
    lab = _labels(labels)
    lines: list[str] = []

    def family(name: str, kind: str, help: str) -> None:
        lines.append(f"# HELP {name} {help}")
        lines.append(f"# TYPE {name} {kind}")

    def one(name: str, kind: str, help: str, value: float) -> None:
        family(name, kind, help)
        lines.append(f"{name}{{{lab}}} {value}")

    one("kvwire_engine_kv_held_blocks", "gauge",
        "Blocks held for remote decode engines under leases.", counts["held_blocks"])
    one("kvwire_engine_kv_leases", "gauge", "Leases held for remote decode engines.",
        counts["leases"])
    one("kvwire_engine_kv_leases_released_total", "counter",
        "Leases freed by the decode side (pulled, pushed, aborted or all cached).",
        counts["leases_released"])
    one("kvwire_engine_kv_leases_expired_total", "counter",
        "Leases freed because no decode engine took them in time.", counts["leases_expired"])
    one("kvwire_engine_kv_rooms", "gauge", "SGLang bootstrap rooms known here, waiting for "
        "their request or their decode engine.", st.rooms)
    one("kvwire_engine_kv_rooms_dropped_total", "counter", "SGLang bootstrap rooms "
        "forgotten unclaimed (the table keeps a bounded number).", st.rooms_dropped)
    one("kvwire_engine_kv_served_blocks_total", "counter",
        "Blocks read by or pushed to decode engines.", st.served_blocks)
    one("kvwire_engine_kv_heartbeats_total", "counter", "Lease heartbeats answered.",
        st.heartbeats)
    one("kvwire_engine_kv_transfers_started_total", "counter", "KV pulls started.",
        counts["started"])
    one("kvwire_engine_kv_transfers_in_progress", "gauge", "KV pulls started and not ended "
        "yet (waiting for the prefill engine, moving, or about to be applied).",
        counts["transferring"])
    family("kvwire_engine_kv_transfers_total", "counter", "KV pulls that ended, by result "
           "(aborted: the request's client went away first).")
    for result in ("ok", "failed", "aborted"):
        lines.append(f'kvwire_engine_kv_transfers_total{{{lab},result="{result}"}} '
                     f'{counts[result]}')
    family("kvwire_engine_kv_transfer_failures_total", "counter",
           "KV pulls that failed, by reason.")
    for reason, v in sorted(st.failed.items()):
        lines.append(f'kvwire_engine_kv_transfer_failures_total{{{lab},reason="{reason}"}} {v}')
    one("kvwire_engine_kv_transfer_recomputed_total", "counter",
        "Failed pulls recomputed locally (--kv-load-failure recompute).", st.recomputed)
    one("kvwire_engine_kv_local_prefills_total", "counter",
        "Remote-prefill requests prefilled here (all cached, or a pull under "
        "--kv-recompute-blocks).", counts["local_prefills"])
    one("kvwire_engine_kv_transfer_blocks_total", "counter", "Blocks pulled.",
        counts["blocks"])
    one("kvwire_engine_kv_transfer_bytes_total", "counter",
        "Bytes pulled (blocks x block size x bytes per token).", counts["bytes"])
    def hist(name: str, help: str, h: Histogram) -> None:
        family(name, "histogram", help)
        lines.extend(_histogram_lines(name, lab, h))

    hist("kvwire_engine_kv_transfer_seconds",
         "Seconds from a pull's start to its end (model time).", seconds)
    # the same under the names vLLM's NixlConnector gives them, for its dashboards
    hist("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache "
         "transfers.", seconds)
    hist("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache "
         "transfers.", st.bytes)
    for name, help, v in (
            ("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.",
             counts["failed"]),
            ("vllm:nixl_num_failed_notifications", "Number of failed NIXL KV Cache "
             "notifications.", st.failed_notifications),
            ("vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire.",
             counts["leases_expired"])):
        family(name, "counter", help)
        lines.append(f"{name}_total{{{lab}}} {v}")
    return ("\n".join(lines) + "\n").encode()


def _histogram_lines(name: str, labels: str, h: Histogram) -> list[str]:
    """One histogram's sample lines (cumulative buckets, +Inf, count, sum) under ``labels``
    (already rendered)."""
    out, acc = [], 0
    for b, c in zip(h.buckets, h.counts):
        acc += c
        out.append(f'{name}_bucket{{{labels},le="{float(b)}"}} {acc}')
    out.append(f'{name}_bucket{{{labels},le="+Inf"}} {h.count}')
    out.append(f"{name}_count{{{labels}}} {h.count}")
    out.append(f"{name}_sum{{{labels}}} {h.sum}")
    return out


def _labels(d: dict[str, str]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in d.items())


def render(engines: list[tuple[dict[str, str], EngineStats, Callable[[], tuple[int, int, float]]]],
           extra: dict[str, int] | None = None) -> bytes:
    """Prometheus text for every engine: (labels, stats, gauges() -> (running, waiting,
    kv usage fraction)). ``extra``: kvwire's own counters (``kvwire_engine_*``)."""
    lines: list[str] = []

    def family(name: str, kind: str, help: str) -> None:
        lines.append(f"# HELP {name} {help}")
        lines.append(f"# TYPE {name} {kind}")

    gauges = [(lab, g()) for lab, _, g in engines]
    for i, (name, help) in enumerate((
            ("vllm:num_requests_running", "Number of requests in model execution batches."),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."))):
        family(name, "gauge", help)
        for lab, vals in gauges:
            lines.append(f"{name}{{{_labels(lab)}}} {vals[i]}")
    counters = (
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
        ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
        ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
         "preemptions"),
        ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
         "tokens.", "prefix_cache_queries"),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
         "prefix_cache_hits"),
    )
    for name, help, attr in counters:
        family(name, "counter", help)
        for lab, st, _ in engines:
            lines.append(f"{name}_total{{{_labels(lab)}}} {getattr(st, attr)}")
    family("vllm:request_success", "counter", "Count of successfully processed requests.")
    for lab, st, _ in engines:
        for reason, v in st.request_success.items():
            lines.append(f'vllm:request_success_total{{{_labels(lab)},finished_reason="{reason}"}}'
                         f" {v}")
    hists = (
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
         "ttft"),
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
         "itl"),
        ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
         "e2e"),
        ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "req_prompt"),
        ("vllm:request_generation_tokens", "Number of generation tokens processed.", "req_gen"),
        ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
         "iteration_tokens"),
    )
    for name, help, attr in hists:
        family(name, "histogram", help)
        for lab, st, _ in engines:
            lines.extend(_histogram_lines(name, _labels(lab), getattr(st, attr)))
    for name, v in (extra or {}).items():
        full = f"kvwire_engine_{name}_total"
        family(full, "counter", f"kvwire engine: {name.replace('_', ' ')}.")
        lines.append(f"{full} {v}")
    return ("\n".join(lines) + "\n").encode()
