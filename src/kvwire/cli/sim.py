"""``kvwire sim``: replay a Mooncake trace against a simulated fleet under each routing policy.

Exit status: 0 ok; 2 bad arguments or a bad trace (the message names the line); 1 the
simulation failed (e.g. the subscriber never caught up).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .options import (
    Parser,
    add_kv_transfer,
    add_pd_decider,
    count,
    fraction,
    nonnegative,
    positive,
    positive_int,
    transfer_cost,
)

__all__ = ["add_arguments", "main", "register", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``sim`` flags (shared by ``kvwire sim`` and :func:`main`)."""
    from ..sim.fleet import ALL_POLICIES, POLICIES
    from ..sim.types import PD_PROTOCOLS

    p.add_argument("trace", metavar="TRACE", nargs="?", default="bundled",
                   help="Mooncake JSONL trace (default: 'bundled', the packaged synthetic trace)")
    p.add_argument("--engines", type=positive_int, default=None,
                   help="engines that prefill and decode (role both; default 8, or 0 with "
                        "--prefill/--decode)")
    p.add_argument("--prefill", type=count, default=0, metavar="N",
                   help="prefill engines (a prefill/decode fleet, routed in pairs; batched "
                        "engine model)")
    p.add_argument("--decode", type=count, default=0, metavar="M", help="decode engines")
    add_pd_decider(p)
    add_kv_transfer(p, "transfer")
    p.add_argument("--kv-fail-rate", type=fraction, default=0.0, metavar="F",
                   help="prefill/decode: the share of transfers that fail at their end, "
                        "then follow --kv-load-failure (drawn per request from --seed: a "
                        "request's transfers fail alike under every policy; default 0)")
    p.add_argument("--retries", type=count, default=2, metavar="N",
                   help="prefill/decode: a pair whose transfer failed under "
                        "--kv-load-failure fail runs again with another prefill engine up "
                        "to N times, then follows --pd-fallback (as kvwire serve --retries; "
                        "default 2)")
    p.add_argument("--pd-protocol", choices=PD_PROTOCOLS, default="vllm",
                   help="prefill/decode: vllm (the decode engine admits the request when its "
                        "prefill ends, then pulls; default) or sglang (the decode engine "
                        "gets it at once and allocates; the prefill engine pushes when its "
                        "prefill ends)")
    p.add_argument("--capacity", type=positive_int, default=5000,
                   help="blocks each engine's prefix cache holds")
    p.add_argument("--block-tokens", type=positive_int, default=512, help="tokens per block")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated subset of {','.join(ALL_POLICIES)} (default: "
                        f"{','.join(POLICIES)}; sglang: SGLang router's cache_aware; "
                        "clairvoyant: runs each engine ahead for each request's earliest first "
                        "token, slow)")
    p.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    p.add_argument("--report", metavar="FILE.png", help="write a PNG report (matplotlib)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-rate", type=positive, default=20_000.0,
                   help="prefill tokens/s per engine")
    p.add_argument("--decode-rate", type=positive, default=400.0,
                   help="decode tokens/s per engine (per request, FIFO server)")
    p.add_argument("--repeat", type=positive_int, default=1,
                   help="replay the trace this many times back to back (fresh prefixes)")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="use only the first N requests of the trace")
    p.add_argument("--load-weight", type=float, default=None,
                   help="kvwire/oracle RoutingPolicy load_weight (default: the sim's tuned one)")
    p.add_argument("--balance-slack", type=float, default=None, metavar="TOKENS",
                   help="kvwire/oracle: load (tokens of work) past the least-loaded engine's "
                        "that costs nothing (default 131072; 0 with --load-weight 0.5: the "
                        "cost before the balance slack)")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="processes running policies in parallel (default: one per CPU)")
    p.add_argument("--predict-ttl", type=positive, default=None,
                   help="virtual seconds a routed prefix counts before events confirm it")
    p.add_argument("--replicas", type=positive_int, default=1,
                   help="kvwire: router replicas the requests are spread over in turn, each "
                        "with its own load (as kvwire serve --nats replicas; default 1)")
    p.add_argument("--share-load", action=argparse.BooleanOptionalAction, default=True,
                   help="--replicas: the replicas share their load, as kvwire serve --nats "
                        "does by default (--no-share-load: each routes on its own)")
    p.add_argument("--share-delay", type=nonnegative, default=0.002, metavar="S",
                   help="--replicas: virtual seconds a load report takes (default 0.002)")
    p.add_argument("--engine-model", choices=("batched", "fifo"), default="batched",
                   help="batched: continuous batching + paged cache (kvwire.engine); fifo: "
                        "one request at a time (docs/sim.md)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--cpu-blocks", type=count, default=0, help="CPU offload tier (blocks)")
    p.add_argument("--step-base-ms", type=positive, default=5.0)
    p.add_argument("--step-prefill-token-us", type=nonnegative, default=50.0)
    p.add_argument("--step-decode-seq-us", type=nonnegative, default=30.0)
    p.add_argument("--step-context-token-ns", type=nonnegative, default=0.0)


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``sim`` subcommand to ``kvwire``'s subparsers."""
    p = subparsers.add_parser("sim", help="simulate a fleet routing a real trace, per policy",
                              description=__doc__.splitlines()[0])
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Load the trace, simulate every requested policy, print the table or JSON."""
    from ..sim.fleet import ALL_POLICIES, SimConfig, SimError, run_sim
    from ..sim.trace import TraceError, bundled_trace_path, load_trace, repeat_trace

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in ALL_POLICIES]
    if bad or not policies:
        print(f"kvwire sim: unknown policy {', '.join(bad) or '(none given)'}; "
              f"choose from {', '.join(ALL_POLICIES)}", file=sys.stderr)
        return 2
    path = bundled_trace_path() if args.trace == "bundled" else args.trace
    try:
        reqs = load_trace(path, limit=args.limit)
    except TraceError as e:
        print(f"kvwire sim: bad trace: {e}", file=sys.stderr)
        return 2
    reqs = repeat_trace(reqs, args.repeat)
    kw = {}
    if args.load_weight is not None:
        kw["load_weight"] = args.load_weight
    if args.balance_slack is not None:
        if not args.balance_slack >= 0:
            print("kvwire sim: --balance-slack must be >= 0", file=sys.stderr)
            return 2
        kw["balance_slack_tokens"] = args.balance_slack
    if args.predict_ttl is not None:
        kw["predict_ttl"] = args.predict_ttl
    pd = args.prefill > 0 or args.decode > 0
    engines = args.engines if args.engines is not None else (0 if pd else 8)
    if pd:
        if args.engine_model != "batched":
            print("kvwire sim: --prefill/--decode need --engine-model batched",
                  file=sys.stderr)
            return 2
        if args.decode + engines < 1:
            print("kvwire sim: --prefill needs an engine that decodes (--decode M or "
                  "--engines K)", file=sys.stderr)
            return 2
        if args.replicas != 1:
            print("kvwire sim: --replicas is not simulated with --prefill/--decode",
                  file=sys.stderr)
            return 2
        unsupported = [p for p in policies if p in ("sglang", "clairvoyant")]
        if unsupported:
            print(f"kvwire sim: policy {', '.join(unsupported)} does not route "
                  "prefill/decode pairs", file=sys.stderr)
            return 2
        kw.update(prefill=args.prefill, decode=args.decode,
                  disagg_min_tokens=args.disagg_min_tokens,
                  pd_prefill_busy=args.pd_prefill_busy, lease_s=args.kv_lease_s,
                  recompute_blocks=args.kv_recompute_blocks,
                  load_failure=args.kv_load_failure, kv_fail_rate=args.kv_fail_rate,
                  pd_retries=args.retries, pd_fallback=args.pd_fallback,
                  pd_protocol=args.pd_protocol)
    try:
        from ..engine.timing import StepCost

        kw["step_cost"] = StepCost(args.step_base_ms * 1e-3, args.step_prefill_token_us * 1e-6,
                                   args.step_decode_seq_us * 1e-6,
                                   args.step_context_token_ns * 1e-9)
        if pd:
            kw["transfer"] = transfer_cost(args)
        cfg = SimConfig(engines=engines, capacity=args.capacity,
                        engine_model=args.engine_model,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, cpu_blocks=args.cpu_blocks,
                        block_tokens=args.block_tokens, prefill_rate=args.prefill_rate,
                        decode_rate=args.decode_rate, seed=args.seed,
                        replicas=args.replicas, share_load=args.share_load,
                        share_delay=args.share_delay, **kw)
        result = run_sim(reqs, cfg, policies, workers=args.workers)
    except (SimError, ValueError) as e:
        print(f"kvwire sim: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(result.table())
    if args.report:
        from ..sim.report import ReportUnavailable, write_report

        try:
            out = write_report(result, args.report)
        except ReportUnavailable as e:
            print(f"kvwire sim: {e}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"report written to {out.resolve()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``kvwire sim`` as a standalone entry point."""
    p = Parser(prog="kvwire sim", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
