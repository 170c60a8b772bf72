"""``kvwire bridge``: follow engines and write their KV event streams to NATS JetStream
(needs ``pip install kvwire[nats]``; see docs/scale-out.md).

Wired into ``kvwire`` by :mod:`kvwire.cli.main` through :func:`register`; ``python -m
kvwire.cli.bridge ...`` runs it directly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import gc
import json
import signal
import sys
from collections.abc import Sequence

from .options import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    Parser,
    add_connect_timeout,
    add_log_level,
    configure_logging,
    engine,
    nonnegative,
    positive,
    positive_int,
)

__all__ = ["add_arguments", "main", "register", "run"]


def _nats_url(text: str) -> str:
    from ..nats.connect import check_url

    try:
        return check_url(text, "--nats")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..nats.subjects import DEFAULT_PREFIX, DEFAULT_STREAM

    p.add_argument("--nats", required=True, action="append", metavar="URL", type=_nats_url,
                   help="NATS server URL, e.g. nats://10.0.0.9:4222 (repeat for a cluster)")
    p.add_argument("--engine", action="append", type=engine, required=True,
                   metavar="NAME=ENDPOINT[,replay=ENDPOINT][,ranks=N][,topic=T][,first_seq=N]",
                   help="an engine's KV event endpoint (repeat per engine), as for serve")
    p.add_argument("--stream", default=DEFAULT_STREAM, help="JetStream stream name")
    p.add_argument("--prefix", default=DEFAULT_PREFIX,
                   help="subject prefix: subjects are PREFIX.ENGINE.RANK")
    p.add_argument("--max-age", type=positive, metavar="S",
                   help="discard messages older than S seconds (default: keep)")
    p.add_argument("--max-bytes", type=positive_int, metavar="B",
                   help="stream size limit in bytes, oldest discarded (default: none)")
    p.add_argument("--max-msgs-per-subject", type=positive_int, metavar="N",
                   help="history kept per engine rank (default: all)")
    p.add_argument("--duplicate-window", type=positive, default=120.0, metavar="S",
                   help="Nats-Msg-Id dedupe window (default 120 s; <= --max-age)")
    p.add_argument("--snapshot-interval", type=nonnegative, default=30.0,
                   metavar="S", help="object-store snapshot period (default 30 s; 0: none)")
    p.add_argument("--share", action="store_true",
                   help="split engines among bridges by leases (default: every bridge "
                        "follows every engine, deduplicated)")
    p.add_argument("--lease-ttl", type=positive, default=10.0, metavar="S",
                   help="lease lifetime (--share): a dead bridge's engines move after S s")
    p.add_argument("--max-inflight", type=positive_int, default=4096, metavar="N",
                   help="unacknowledged publishes at most (default 4096)")
    p.add_argument("--ack-timeout", type=positive, default=5.0, metavar="S")
    p.add_argument("--pack", type=positive_int, default=256, metavar="N",
                   help="one message in flight per engine rank, guarded by "
                        "Nats-Expected-Last-Subject-Sequence; what arrives meanwhile goes "
                        "as one run of up to N batches (default 256; never waits to fill "
                        "one). 1: one message per batch, pipelined, deduplicated by "
                        "Nats-Msg-Id alone")
    add_connect_timeout(p, "NATS")
    p.add_argument("--log-interval", type=nonnegative, default=10.0,
                   metavar="S", help="one-line stats every S seconds (0: none)")
    add_log_level(p)


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``bridge`` subcommand to ``kvwire``'s subparsers."""
    p = subparsers.add_parser("bridge", help="write engines' KV events to NATS JetStream",
                              description=__doc__.splitlines()[0], epilog=EPILOG)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


EPILOG = """exit status: 0 stopped cleanly (SIGINT/SIGTERM); 1 no NATS connection within
--connect-timeout, or the server failed setting up the stream; 2 a bad flag, --engine or
config (a stream that exists with other settings included), or the nats extra missing
(docs/operations.md)"""


def run(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM; exit 0 after a clean close, 1 if NATS cannot be reached,
    2 on bad config (the stream's included)."""
    try:
        from ..nats.bridge import Bridge, BridgeConfig, BridgeError
    except ImportError as e:
        print(f"kvwire bridge: {e}; install with: pip install 'kvwire[nats]'", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(args, stamped=True)
    cfg = BridgeConfig(
        nats=args.nats, stream=args.stream, prefix=args.prefix, max_age=args.max_age,
        max_bytes=args.max_bytes, max_msgs_per_subject=args.max_msgs_per_subject,
        duplicate_window=args.duplicate_window, snapshot_interval=args.snapshot_interval,
        share=args.share, lease_ttl=args.lease_ttl, max_inflight=args.max_inflight,
        ack_timeout=args.ack_timeout, pack=args.pack, log_interval=args.log_interval,
        connect_timeout=args.connect_timeout)
    try:
        bridge = Bridge(args.engine, cfg)
    except BridgeError as e:
        print(f"kvwire bridge: {e}", file=sys.stderr)
        return EXIT_USAGE

    # SIGUSR1 prints every thread's stack to stderr: what a bridge that will not stop is doing
    # (only where stderr is a real file: not when called in-process with stderr captured)
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, OSError, ValueError, RuntimeError):  # io.UnsupportedOperation too
        pass

    async def main_async() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        def report() -> None:  # SIGUSR2: the stats now, and the lag since the last report
            print(f"kvwire bridge: stats {json.dumps(bridge.report())}", file=sys.stderr,
                  flush=True)

        loop.add_signal_handler(signal.SIGUSR2, report)
        # A signal while starting (e.g. still trying to connect) stops it there.
        starting = asyncio.ensure_future(bridge.start())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(BaseException):
                await starting
            await bridge.close(drain=0)
            print("kvwire bridge: stopped while starting", file=sys.stderr, flush=True)
            return EXIT_OK
        try:
            starting.result()
        except BridgeError as e:  # no connection (exit 1), or the stream's config (exit 2)
            print(f"kvwire bridge: {e}", file=sys.stderr)
            await bridge.close(drain=0)
            return EXIT_FAILURE if isinstance(e.__cause__, OSError) else EXIT_USAGE
        except Exception as e:  # noqa: BLE001 - e.g. no JetStream on the server: one line
            print(f"kvwire bridge: cannot set up the stream on {', '.join(cfg.nats)}: "
                  f"{type(e).__name__}: {e}", file=sys.stderr)
            await bridge.close(drain=0)
            return EXIT_FAILURE
        # Startup's objects (modules, the nats and zmq machinery) go to the permanent
        # generation: a full collection then scans only what the run keeps (its pauses
        # were 25-40 ms after a busy minute, stalling every stream; ~1-13 ms frozen).
        gc.collect()
        gc.freeze()
        print(f"kvwire bridge: {len(args.engine)} engines -> {cfg.stream} ({cfg.prefix}.>) "
              f"on {', '.join(cfg.nats)}{' (share)' if cfg.share else ''}",
              file=sys.stderr, flush=True)
        try:
            await stop.wait()
        finally:
            await bridge.close()
        print(f"kvwire bridge: stopped {json.dumps(bridge.summary())}", file=sys.stderr,
              flush=True)
        return EXIT_OK

    try:  # uvloop when installed (kvwire[serve] brings it): ~20% less CPU per batch
        import uvloop
    except ImportError:
        return asyncio.run(main_async())
    return uvloop.run(main_async())


def main(argv: Sequence[str] | None = None) -> int:
    """``kvwire bridge`` as a standalone entry point."""
    p = Parser(prog="kvwire bridge", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
