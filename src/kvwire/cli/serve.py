"""``kvwire serve``: the cache-aware routing service (needs ``pip install kvwire[serve]``).

Wired into ``kvwire`` by :mod:`kvwire.cli.main` through :func:`register` / :func:`run`;
``python -m kvwire.cli.serve ...`` runs it directly.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .options import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    Parser,
    add_chat_template,
    add_connect_timeout,
    add_log_level,
    add_pd_decider,
    configure_logging,
    count,
    engine,
    nonnegative,
    port,
    positive,
    positive_int,
    seconds,
)

if TYPE_CHECKING:
    from ..proxy.proxy import ProxyConfig
    from ..serve.build import ServeConfig

#: Allocations between young-generation collections in a serve process (CPython: 700).
GC_THRESHOLD0 = int(os.environ.get("KVWIRE_GC_THRESHOLD0", "10000"))

__all__ = ["main", "register", "run", "serve_config"]

log = logging.getLogger("kvwire.serve")


def _nats_engine(text: str):
    from ..consume.engine_spec import EngineSpec

    try:
        return EngineSpec.parse_named(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _nats_url(text: str) -> str:
    from ..nats.connect import check_url

    try:
        return check_url(text, "--nats")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", action="append", type=engine, default=[],
                   metavar="NAME=ENDPOINT[,replay=ENDPOINT][,ranks=N][,topic=T][,url=URL]"
                           "[,first_seq=N][,role=prefill|decode|both][,bootstrap_port=P]",
                   help="an engine's KV event endpoint (repeat per engine); ranks=N follows "
                        "DP ranks at port + rank; url=http://HOST:PORT proxies /v1 requests "
                        "to it; first_seq=1 for a publisher numbering its run from 1 "
                        "(Mooncake Store); role= its side in prefill/decode serving "
                        "(default both); bootstrap_port= a prefill engine's SGLang bootstrap "
                        "port (default 8998)")
    p.add_argument("--pd-protocol", choices=("vllm", "sglang"), default=None,
                   help="prefill/decode pairs: the engines' protocol, vllm (kv_transfer_params, "
                        "sequential) or sglang (bootstrap_room, concurrent); default vllm, and "
                        "pairs only when an --engine has role=prefill or role=decode")
    add_pd_decider(p)
    p.add_argument("--policy", choices=("kvwire", "round_robin", "least_load", "random"),
                   default="kvwire", help="routing policy (default kvwire; the others are "
                                          "cache-blind baselines)")
    p.add_argument("--tokenizer", default=None, metavar="DIR|engine|builtin",
                   help="how the proxy tokenizes: a model directory with tokenizer.json, "
                        "'engine' (an engine's /tokenize) or 'builtin' (kvwire engine's "
                        "default); none: routed by load only")
    add_chat_template(p, "the proxy (with --tokenizer DIR|builtin)")
    p.add_argument("--retries", type=count, default=2,
                   help="proxy: other engines tried after a failure before the first byte")
    p.add_argument("--cooloff", type=positive, default=5.0,
                   help="proxy: seconds a failed engine stays down before probes may bring "
                        "it back")
    p.add_argument("--probe-interval", type=positive, default=1.0,
                   help="proxy: seconds between engine /health probes")
    p.add_argument("--probe-timeout", type=positive, default=5.0,
                   help="proxy: seconds an engine's /health may take before the probe fails "
                        "and the engine is marked down (default 5)")
    p.add_argument("--first-byte-timeout", type=positive, default=60.0,
                   help="proxy: seconds to wait for an engine's answer to begin")
    p.add_argument("--response-ids", type=count, default=100_000, metavar="N",
                   help="proxy: stored responses (/v1/responses) whose engine is remembered, "
                        "so that what names one goes there (default 100000; 0: none, each "
                        "is looked for on every engine)")
    p.add_argument("--stall-timeout", type=positive, default=300.0,
                   help="proxy: seconds a started stream may stay silent before it is ended "
                        "with an error event")
    p.add_argument("--max-in-flight", metavar="N", type=count, default=4096,
                   help="proxy: requests answered at once; more are refused with 429 and "
                        "Retry-After, counted (default 4096; 0: no limit)")
    p.add_argument("--tokenize-threads", metavar="N", type=count, default=2,
                   help="proxy: workers that encode a long prompt's new text off the event "
                        "loop, so it does not delay other requests (threads; processes for a "
                        "tokenizer that holds the GIL; default 2; 0: on the loop)")
    p.add_argument("--tokenize-queue", metavar="N", type=positive_int, default=16,
                   help="proxy: long prompts being encoded off the loop at once, waiting "
                        "included; more are refused with 429 and Retry-After, counted "
                        "(default 16)")
    p.add_argument("--shutdown-timeout", metavar="S", type=seconds, default=30.0,
                   help="on SIGTERM/SIGINT stop accepting and let the requests in flight "
                        "(streams too) finish for up to S seconds; a second signal stops at "
                        "once (default 30; 0: stop at once)")
    p.add_argument("--nats", metavar="URL", default=None, type=_nats_url,
                   help="feed the index from JetStream (kvwire bridge) instead: router "
                        "replicas share one ordered history")
    p.add_argument("--stream", default="KVWIRE", metavar="NAME",
                   help="--nats: the JetStream stream (default KVWIRE)")
    p.add_argument("--subject", default=None, metavar="FILTER",
                   help="--nats: subject filter (default kvwire.events.>)")
    p.add_argument("--nats-engine", action="append", type=_nats_engine, default=[],
                   metavar="NAME[:RANKS][,url=URL]",
                   help="--nats: an engine to route to, proxied to at url= (repeat; default: "
                        "every engine on the stream, those that appear later too, for the "
                        "decision API)")
    p.add_argument("--share-load", action=argparse.BooleanOptionalAction, default=None,
                   help="--nats: share each request's load with the other replicas on the "
                        "stream (core NATS subject kvwire.load.STREAM), so every replica "
                        "routes on the fleet's load (default: on with --nats)")
    add_connect_timeout(p, "--nats")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default loopback)")
    p.add_argument("--port", type=port, default=8000, help="HTTP port (0: any free one)")
    p.add_argument("--block-size", type=positive_int, default=16,
                   help="tokens per reference block, the policy's unit (default 16)")
    p.add_argument("--prefill-weight", type=nonnegative, default=1.0)
    p.add_argument("--load-weight", type=nonnegative, default=1.0,
                   help="weight of reserved load past the slack (default 1.0; the earlier "
                        "cost: 0.5 with --balance-slack 0; docs/router.md)")
    p.add_argument("--balance-slack", type=nonnegative, default=131_072.0, metavar="TOKENS",
                   help="load (in tokens of work) an engine may hold beyond the least-loaded "
                        "one's at no cost: cache first until then (default 131072; 32768: a "
                        "shorter tail, fewer hits; 0: every block of load counts, the old cost)")
    p.add_argument("--temperature", type=nonnegative, default=0.0,
                   help="> 0: sample engines by softmax(-cost/T) instead of the minimum")
    p.add_argument("--seed", type=int, default=None, help="seed of tie-breaks and sampling")
    p.add_argument("--max-tokens", type=positive_int, default=1 << 20,
                   help="longest prompt accepted (longer ones get 413)")
    p.add_argument("--expiry", type=positive, default=600.0,
                   help="seconds after which an unreleased request's load is dropped")
    p.add_argument("--predict-ttl", type=nonnegative, default=3.0,
                   help="seconds a routed prefix counts for its engine before events confirm")
    p.add_argument("--decode-load", type=nonnegative, default=1.0,
                   help="blocks of load a request reserves beyond its uncached prompt blocks "
                        "(its decode; default 1)")
    p.add_argument("--decode-share", type=nonnegative, default=0.6,
                   help="load per expected output block, in prefill blocks; the output "
                        "length is learned from /release's output_tokens (default 0.6: a "
                        "decoding sequence's share of a batched step over a prefilled "
                        "token's, 30 us / 50 us in kvwire engine's model; 50 for an engine "
                        "that decodes one request at a time)")
    p.add_argument("--registrations", metavar="FILE", default=None,
                   help="indexer API: keep /register'd streams in FILE (rewritten atomically "
                        "on each change, read at start: a restart follows the same streams); "
                        "with it, --engine is optional (docs/indexer-api.md)")
    p.add_argument("--engines-file", metavar="FILE", default=None,
                   help="keep the engines added and removed at run time (POST/DELETE "
                        "/engines) in FILE, rewritten atomically on each change and laid over "
                        "the command line's engines at start: a restart routes to the same "
                        "fleet (docs/router.md, \"Engines that come and go\")")
    p.add_argument("--admin-token", metavar="TOKEN", default=None,
                   help="allow POST /engines and DELETE /engines/NAME (engines added and "
                        "removed at run time) to callers sending 'Authorization: Bearer "
                        "TOKEN'; default: $KVWIRE_ADMIN_TOKEN; unset: off (403)")
    p.add_argument("--dead-after", type=positive, default=None,
                   help="silence (s) after which a stream is dead (default 3 heartbeats)")
    add_log_level(p)


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``kvwire``'s subparsers."""
    p = subparsers.add_parser("serve", help="route prompts to the engine holding their prefix",
                              description=__doc__.splitlines()[0], epilog=EPILOG)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def tune_process() -> None:
    """Process-wide settings of a dedicated ``kvwire serve`` process, once everything is built.

    * A 0.5 ms GIL switch interval (not 5 ms): the subscriber thread ingests while the event
      loop answers, and this bounds how long a request waits behind an ingest burst.
    * ``gc.freeze()``: the ~40,000 objects of the imports and the app (prometheus_client,
      httpx, msgspec's types, the index) move out of the cyclic collector's sight. Full
      collections had to walk them all (tens of ms each, 2026-12 on the 2-core box: still
      worth it after FastAPI, pydantic and uvicorn left): a few per minute under load, each
      one a p99 outlier.
    * A larger first-generation threshold: a routed request makes a few dozen short-lived
      containers, so the default 700 ran a young collection every ~20 requests.
    """
    sys.setswitchinterval(0.0005)
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD0, 10, 10)


def run(args: argparse.Namespace) -> int:
    """Build the service (:mod:`kvwire.serve.build`) and serve until interrupted. Exit
    statuses: 0 stopped, 1 cannot connect (--nats) or listen, 2 bad configuration or no
    extra."""
    try:
        from ..serve import build  # noqa: F401 (the serve extra's imports)
    except ImportError as e:
        print(f"kvwire serve: {e}; install with: pip install 'kvwire[serve]'", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(args, stamped=True)
    svc = built(args, "kvwire serve", _say)
    return svc if isinstance(svc, int) else serve_until_stopped(svc, "kvwire serve")


def built(args: argparse.Namespace, prog: str, say: Callable[[str], None]) -> Any:
    """The service the flags describe, or, when it cannot be built, the exit status after one
    line saying why (2: a bad configuration; 1: cannot connect or listen). Shared by every
    command that runs ``kvwire serve``'s service."""
    from ..serve.build import ConfigError, StartError, build

    try:
        return build(serve_config(args), say=say)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except StartError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_FAILURE


def serve_until_stopped(svc: Any, prog: str) -> int:
    """Tune the process, serve until interrupted, close; 1 (one line said) when serving
    failed at the socket level."""
    try:
        tune_process()
        log.info("process tuned: %d objects frozen, gc thresholds %s, switch interval %g s",
                 gc.get_freeze_count(), gc.get_threshold(), sys.getswitchinterval())
        svc.run()
    except OSError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        svc.close()
    return EXIT_OK


def _say(line: str) -> None:
    print(f"kvwire serve: {line}", file=sys.stderr, flush=True)


EPILOG = """exit status: 0 stopped (SIGINT/SIGTERM); 1 cannot connect to --nats within
--connect-timeout, or cannot listen on --host:--port; 2 a bad flag, --engine or stream, or
the serve extra missing (docs/operations.md)"""


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The flags as the service's config (the admin token: the flag, else the environment)."""
    from ..serve.build import ServeConfig

    return ServeConfig(
        engines=args.engine, host=args.host, port=args.port, policy=args.policy,
        prefill_weight=args.prefill_weight, load_weight=args.load_weight,
        balance_slack=args.balance_slack, temperature=args.temperature, seed=args.seed,
        block_size=args.block_size, max_tokens=args.max_tokens, expiry=args.expiry,
        predict_ttl=args.predict_ttl, decode_load=args.decode_load,
        decode_share=args.decode_share, dead_after=args.dead_after, tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        chat_template_content_format=args.chat_template_content_format,
        proxy=proxy_config(args), nats=args.nats, stream=args.stream, subject=args.subject,
        nats_engines=args.nats_engine, share_load=args.share_load,
        connect_timeout=args.connect_timeout, registrations=args.registrations,
        engines_file=args.engines_file, admin_token=_admin_token(args),
        shutdown_timeout=args.shutdown_timeout, disagg_min_tokens=args.disagg_min_tokens,
        pd_prefill_busy=args.pd_prefill_busy)


def proxy_config(args: argparse.Namespace) -> ProxyConfig:
    """The proxy's flags as its config."""
    from ..proxy.proxy import ProxyConfig

    return ProxyConfig(retries=args.retries, cooloff=args.cooloff,
                       probe_interval=args.probe_interval,
                       probe_timeout=args.probe_timeout,
                       first_byte_timeout=args.first_byte_timeout,
                       stall_timeout=args.stall_timeout, response_ids=args.response_ids,
                       max_in_flight=args.max_in_flight,
                       tokenize_threads=args.tokenize_threads,
                       tokenize_queue=args.tokenize_queue,
                       pd_protocol=args.pd_protocol, pd_fallback=args.pd_fallback)


def _admin_token(args: argparse.Namespace) -> str | None:
    """``--admin-token``, else ``$KVWIRE_ADMIN_TOKEN``; empty means unset."""
    from ..serve.admin import TOKEN_ENV

    return args.admin_token or os.environ.get(TOKEN_ENV) or None


def main(argv: Sequence[str] | None = None) -> int:
    """``kvwire serve`` as a standalone entry point."""
    p = Parser(prog="kvwire serve", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
