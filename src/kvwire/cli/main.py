"""The ``kvwire`` command: one subcommand per job (``kvwire --help`` lists them all).

Each subcommand lives in its own module here (``register`` adds it, ``run`` runs it), except
``listen``, ``keys`` and ``demo``, defined below. :func:`main` checks the pip extra the
command needs first (:mod:`kvwire.cli.extras`).
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Sequence

from .. import __version__
from . import extras
from .options import (
    EXIT_FAILURE,
    EXIT_MISSED,
    EXIT_OK,
    EXIT_USAGE,
    Parser,
    add_connect_timeout,
    configure_logging,
    integer,
    number,
    port,
)

__all__ = ["main"]

# Exit statuses a shell gives a process killed by the signal (128 + signo).
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM
RICH_HINT = "rich is not installed: plain output (pip install 'kvwire[cli]' for the live table)"


class _Terminated(BaseException):
    """Raised in the main thread by the SIGTERM handler, so ``finally`` blocks run."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated(signum)


def _install(signum: int, handler: object) -> dict[int, object]:
    """Set a handler where Python allows it (main thread); {signum: previous} or {}."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, handler)}


def _streams(args: argparse.Namespace) -> list:
    from ..consume.subscriber import StreamSpec
    from ..wire.curve import CurveClient

    if len(args.replay) > len(args.endpoint):
        raise ValueError(f"{len(args.replay)} --replay for {len(args.endpoint)} endpoints")
    if len(args.name) > len(args.endpoint):
        raise ValueError(f"{len(args.name)} --name for {len(args.endpoint)} endpoints")
    curve = None
    if args.curve_secret or args.curve_server_key:
        if not (args.curve_secret and args.curve_server_key):
            raise ValueError("CurveZMQ needs both --curve-secret and --curve-server-key")
        curve = CurveClient(secret_key_file=args.curve_secret,
                            server_public_key_file=args.curve_server_key)
    specs: list = []
    for i, ep in enumerate(args.endpoint):
        if ep.startswith("nats://"):  # every engine stream on a JetStream stream
            from ..nats.streams import NatsStreams

            specs.append(NatsStreams(ep, stream=args.stream, subject=args.subject,
                                     durable=args.durable))
            continue
        replay = args.replay[i] if i < len(args.replay) and args.replay[i] != "-" else None
        name = args.name[i] if i < len(args.name) else ep
        specs.append(StreamSpec(name, ep, args.topic, replay, curve))
    return specs


def _cmd_listen(args: argparse.Namespace) -> int:
    from ..consume.stream import Batch, Liveness, Reset, Snapshot, StreamConfig
    from ..consume.subscriber import Subscriber
    from .view import COLUMNS, StreamTally, counter_text, format_batch, record

    def notice(msg: str) -> None:
        print(f"kvwire listen: {msg}", file=sys.stderr, flush=True)

    try:
        specs = _streams(args)
        for s in specs:
            if hasattr(s, "open_link"):  # NATS: reach the server now, or say why not
                _reach_nats(s.url, min(args.connect_timeout, args.duration or math.inf))
        sub = Subscriber(specs, config=StreamConfig(request_timeout=args.replay_timeout))
    except (ValueError, ImportError) as e:
        notice(str(e))
        return EXIT_USAGE
    except OSError as e:  # kvwire.nats.connect.NatsConnectError
        notice(str(e))
        return EXIT_FAILURE
    tallies = {s.name: StreamTally(s.name) for s in specs if not hasattr(s, "open_link")}
    exporter = None
    if args.metrics is not None:
        from ..metrics import register, start_exporter, subscriber_collector

        register(subscriber_collector(sub))
        try:
            exporter = start_exporter(args.metrics, addr=args.metrics_addr)
        except (OSError, OverflowError, UnicodeError) as e:  # in use, unresolvable address
            sub.close()
            notice(f"cannot serve metrics on {args.metrics_addr}:{args.metrics} (--metrics, "
                   f"--metrics-addr): {e}")
            return EXIT_FAILURE
        notice(f"metrics on http://{args.metrics_addr}:{exporter.server_address[1]}/metrics")
    out = sys.stdout
    view = args.view if args.view is not None else (out.isatty() and not args.json)
    if view:
        try:  # an optional extra: without it, fall back to the plain view and say so once
            from rich.console import Console
            from rich.live import Live
            from rich.table import Table
        except ImportError:
            notice(RICH_HINT)
            view = False
    batches = 0
    deadline = None if args.duration is None else time.monotonic() + args.duration
    live = None
    if view:

        def table():
            t = Table(title="kvwire listen", expand=False)
            for c in COLUMNS:
                t.add_column(c, justify="left" if c in ("stream", "state") else "right")
            stats = sub.stats()
            now = time.monotonic()
            for name, tally in tallies.items():
                t.add_row(*tally.row(stats.get(name), now))
            return t

        live = Live(table(), console=Console(), refresh_per_second=4, transient=False)
        live.start()
    last_draw = 0.0
    status = 0
    handlers = _install(signal.SIGTERM, _raise_terminated)
    try:
        with sub:
            while args.count is None or batches < args.count:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                item = sub.poll(0.25 if left is None else min(0.25, left))
                now = time.monotonic()
                if live is not None and now - last_draw > 0.25:
                    live.update(table())
                    last_draw = now
                if item is None:
                    continue
                if item.stream not in tallies:  # NATS: streams appear as they are read
                    tallies[item.stream] = StreamTally(item.stream)
                tallies[item.stream].add(item, now)
                if isinstance(item, Batch):
                    batches += 1
                if args.json:
                    out.write(json.dumps(record(item), separators=(",", ":")) + "\n")
                    out.flush()
                elif live is not None:
                    continue
                elif isinstance(item, Batch):
                    out.write(format_batch(item.stream, item.seq, item.batch) + "\n")
                    out.flush()
                elif isinstance(item, Reset):
                    notice(f"{item.stream}: reset ({item.reason})")
                elif isinstance(item, Snapshot):
                    how = "exact" if item.exact else "contents before it unknown"
                    notice(f"{item.stream}: snapshot at seq {item.seq}: "
                           f"{item.block_count} blocks ({how})")
                elif isinstance(item, Liveness):
                    notice(f"{item.stream}: {'alive' if item.alive else 'DEAD'} ({item.reason})")
    except KeyboardInterrupt:  # Ctrl-C: still say what was seen, exit as a shell expects
        status = EXIT_SIGINT
    except _Terminated:
        status = EXIT_SIGTERM
    except BrokenPipeError:
        return 0
    finally:
        # A second signal while the summary prints would only lose the summary.
        handlers.update(_install(signal.SIGINT, signal.SIG_IGN))
        _install(signal.SIGTERM, signal.SIG_IGN)
        try:
            if live is not None:
                live.stop()
            if exporter is not None:
                exporter.shutdown()
            final = sub.stats()  # still readable after close: the counters outlive the sockets
            for name, st in final.items():
                s = st.stream
                notice(
                    f"{name}: {s.batches} batches, {s.gaps} gaps, {counter_text(s.replayed)} replayed, "
                    f"{counter_text(s.lost)} lost, {s.snapshots} snapshots, {s.resyncs} resyncs, "
                    f"{counter_text(s.restarts)} restarts, {s.bad_frames + s.bad_payloads} bad messages, "
                    f"mode {s.mode}, state {s.state}"
                )
            for n in sub.nats_stats():
                notice(f"nats: {n.messages} messages, {n.batches} batches, {n.gaps} gaps, "
                       f"{n.resyncs} resyncs, {n.inexact} inexact, {n.bad_messages} bad "
                       f"messages, {n.reconnects} reconnects"
                       + (f" (last error: {n.last_error})" if n.last_error else ""))
        finally:
            for signum, handler in handlers.items():
                _install(signum, handler)
    if status:
        return status
    if args.count is not None and batches < args.count:
        return EXIT_FAILURE
    return EXIT_OK


def _reach_nats(url: str, timeout: float) -> None:
    """Connect to the NATS server once (NatsConnectError, an OSError, if it does not answer
    within ``timeout``): without this a consumer would retry in the background for ever."""
    try:
        import nats  # noqa: F401
    except ImportError:
        raise ImportError("NATS streams need nats-py: pip install 'kvwire[nats]'") from None
    from ..nats.connect import reach

    reach(url, timeout, name="kvwire-listen")


def _cmd_demo(args: argparse.Namespace) -> int:
    if not args.late_join and not args.sim:  # the fleet story over real HTTP
        from .http_demo import HttpDemoConfig, run

        d = HttpDemoConfig()
        cfg = HttpDemoConfig(engines=args.engines or d.engines, start=args.start,
                             limit=args.limit or d.limit, speed=args.speed,
                             num_gpu_blocks=args.capacity or d.num_gpu_blocks)
        return run(args.report, cfg, lambda m: print(m, file=sys.stderr, flush=True))
    if not args.late_join:
        from ..sim.fleet_demo import missed_targets, run_fleet_demo

        result = run_fleet_demo(args.report, engines=args.engines or 8,
                                capacity=args.capacity if args.capacity is not None else 5000,
                                seed=args.seed, limit=args.limit)
        missed = missed_targets(result)
        for m in missed:
            print(f"kvwire demo: target missed: {m}", file=sys.stderr)
        return EXIT_MISSED if missed else EXIT_OK
    from ..sim.demo import run_demo

    s = run_demo(steps=args.steps, capacity=args.capacity if args.capacity is not None else 4096,
                 rate=args.rate, seed=args.seed)
    print("\nkvwire demo summary")
    print(f"  engine steps            {s.steps}")
    print(f"  batches published       {s.batches_published} (+ heartbeats)")
    print(f"  subscriber joined at    seq {s.joined_at_seq} "
          f"(snapshot of {s.snapshot_blocks} blocks)")
    print(f"  batches delivered after {s.batches_delivered}")
    print(f"  blocks stored / removed {s.blocks_stored} / {s.blocks_removed}")
    print(f"  prefix-cache hit rate   {s.prefix_hit_rate:.1%}")
    print(f"  gaps / replayed / lost  {s.gaps} / {s.replayed} / {s.lost}")
    print(f"  engine cache blocks     {s.engine_blocks}")
    print(f"  rebuilt by subscriber   {s.rebuilt_blocks} "
          f"({'exact match' if s.rebuilt_matches else 'MISMATCH'})")
    print(f"  wall time               {s.seconds:.1f} s")
    if not s.rebuilt_matches:
        print("kvwire demo: target missed: the subscriber's rebuilt cache differs from the "
              "engine's", file=sys.stderr)
        return EXIT_MISSED
    return EXIT_OK


def _cmd_keys(args: argparse.Namespace) -> int:
    from ..wire.curve import generate_keys

    public, secret = generate_keys(args.directory, args.name)
    print(f"public key: {public}  (give to peers)")
    print(f"secret key: {secret}  (mode 0600, keep private)")
    return 0


DESCRIPTION = """\
KV-cache event streams of LLM inference engines: follow them, publish them from an engine
model, route requests by them, simulate a fleet routed by them.

commands:
{commands}

'kvwire COMMAND --help' gives a command's flags, its exit statuses and the pip extra it
needs, if any ('pip install kvwire' runs the rest)."""


def _add_listen(sub) -> None:
    ls = sub.add_parser(
        "listen", help="follow the KV events of one or more publishers",
        description="Follow publishers reliably: bootstrap from snapshots (kvwire publishers), "
        "fill gaps by replay, detect restarts. On a terminal: a live per-stream table; "
        "piped: one readable block per batch; --json: one JSON object per item.",
        epilog="exit status: 0 done (--count reached, --duration over, stdout closed); 1 "
        "fewer than --count batches, or no NATS connection within --connect-timeout (or "
        "--duration), or --metrics cannot listen; 2 a bad flag or endpoint, or an extra "
        "missing; 130/143 SIGINT/SIGTERM (docs/operations.md)",
    )
    ls.add_argument("endpoint", nargs="+",
                    help="live endpoint(s), e.g. tcp://10.0.0.5:5557 (binds only tcp://*:PORT), "
                    "or nats://HOST:PORT: every engine on a JetStream stream (kvwire bridge)")
    ls.add_argument("--stream", default="KVWIRE", metavar="NAME",
                    help="nats://: the JetStream stream (default KVWIRE)")
    ls.add_argument("--subject", default=None, metavar="FILTER",
                    help="nats://: subject filter (default kvwire.events.>)")
    ls.add_argument("--durable", default=None, metavar="NAME",
                    help="nats://: a durable consumer (resumes where it acked)")
    ls.add_argument("--replay", metavar="ENDPOINT", action="append", default=[],
                    help="replay/snapshot endpoint of the i-th live endpoint (repeat; - for none)")
    ls.add_argument("--name", action="append", default=[],
                    help="name of the i-th stream (repeat; default: its endpoint)")
    ls.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    ls.add_argument("--json", action="store_true",
                    help="one JSON object per line: batches, resets, snapshots (field kind)")
    ls.add_argument("--count", type=integer(1), metavar="N", help="exit 0 after N batches")
    ls.add_argument("--duration", type=number(0, strict=True), metavar="S",
                    help="stop after S seconds")
    ls.add_argument("--view", action=argparse.BooleanOptionalAction, default=None,
                    help="live per-stream table (default: when stdout is a terminal)")
    ls.add_argument("--replay-timeout", type=number(0, strict=True), default=2.0, metavar="S",
                    help="give up on a replay/snapshot answer after S seconds of silence")
    ls.add_argument("--metrics", type=port, metavar="PORT",
                    help="serve Prometheus metrics on PORT (0: any free port)")
    ls.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR")
    ls.add_argument("--curve-secret", metavar="FILE", help="this client's CurveZMQ secret key")
    ls.add_argument("--curve-server-key", metavar="FILE", help="the publishers' public key")
    add_connect_timeout(ls, "a nats:// endpoint")
    ls.set_defaults(func=_cmd_listen)


def _add_keys(sub) -> None:
    ks = sub.add_parser("keys", help="generate a CurveZMQ key pair (NAME.key, NAME.key_secret)")
    ks.add_argument("directory")
    ks.add_argument("name")
    ks.set_defaults(func=_cmd_keys)


def _add_demo(sub) -> None:
    dm = sub.add_parser(
        "demo", help="the fleet story: a trace routed by cache over real HTTP, vs round robin",
        description="Default: start two `kvwire fleet`s of engines, each behind a `kvwire serve` "
        "proxy (--policy kvwire and round_robin), replay a slice of Mooncake's bundled trace to "
        "both over HTTP at its arrival times, print client-measured TTFT and the engines' "
        "cached tokens, write a PNG report (docs/sim.md). --sim: the simulated fleet story "
        "(every policy, virtual time). --late-join: one engine and a subscriber that joins "
        "late, bootstraps from a snapshot and must rebuild the engine's cache exactly.",
        epilog="exit status: 0 every target it prints was met; 3 a target missed (each named "
        "on stderr: default, kvwire's cached tokens and TTFT p99 vs round robin's, its work "
        "max/mean, no failed request; --sim: kvwire's hit ratio vs the oracle's and random's, "
        "its work max/mean; --late-join: the rebuilt cache differs); 1 a process of the demo "
        "failed to start; 2 a bad flag")
    dm.add_argument("--engines", type=integer(1), default=None,
                    help="engines per fleet (default 4; --sim: 8)")
    dm.add_argument("--capacity", type=integer(1), default=None,
                    help="engine cache size in blocks (default 28000 of 16 tokens; --sim: 5000 "
                    "of 512; --late-join: 4096)")
    dm.add_argument("--report", default="report.png", metavar="FILE.png",
                    help="where the fleet story's PNG goes")
    dm.add_argument("--start", type=integer(0), default=3000, metavar="N",
                    help="the trace request the HTTP replay starts at (default 3000: the "
                    "trace's first requests share almost no prefixes)")
    dm.add_argument("--limit", type=integer(1), default=None, metavar="N",
                    help="replay N requests (default 300; --sim: the whole trace)")
    dm.add_argument("--speed", type=number(0, strict=True), default=4.0, metavar="X",
                    help="engines and trace run X times faster than real time (default 4)")
    dm.add_argument("--sim", action="store_true",
                    help="the simulated fleet story (every policy, virtual time) instead")
    dm.add_argument("--late-join", action="store_true",
                    help="the single-engine late-joiner check instead of the fleet story")
    dm.add_argument("--steps", type=integer(1), default=3000,
                    help="engine steps to run (--late-join)")
    dm.add_argument("--rate", type=number(0, strict=False), default=1000.0,
                    help="engine steps per second, 0: as fast as possible (--late-join)")
    dm.add_argument("--seed", type=int, default=0)
    dm.set_defaults(func=_cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand, each listed with its one-line purpose in ``kvwire --help``."""
    from . import bridge, engine, epp, fleet, index, serve, sim  # own modules (light imports)

    p = Parser(prog="kvwire", usage="kvwire [-h] [-v] [--version] COMMAND ...",
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    p.add_argument("--version", action="version", version=f"kvwire {__version__}",
                   help="print kvwire's version and exit")
    # The commands are listed in the description (one line each); argparse's own listing of
    # a subparsers group would repeat them in a {a,b,...} line.
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", prog="kvwire",
                           help=argparse.SUPPRESS)
    for add in (_add_listen, engine.register, fleet.register, serve.register, epp.register,
                index.register, bridge.register, _add_keys, sim.register, _add_demo):
        add(sub)
    width = max(len(a.dest) for a in sub._choices_actions)
    p.description = DESCRIPTION.format(commands="\n".join(
        f"  {a.dest:<{width}}  {a.help}" for a in sub._choices_actions))
    for name, cp in sub.choices.items():
        install = extras.needs_text(name)
        if install:
            cp.epilog = f"{cp.epilog}; {install}" if cp.epilog else install
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, set up logging (``serve`` and ``bridge`` redo it from their ``--log-level``),
    run the subcommand; its exit status (docs/operations.md)."""
    args = build_parser().parse_args(argv)
    line = extras.missing(args.command, args)
    if line is not None:  # before anything starts: one line naming the extra, exit 2
        print(line, file=sys.stderr, flush=True)
        return EXIT_USAGE
    configure_logging(args)
    try:
        return args.func(args)
    except ModuleNotFoundError as e:  # an optional module the table above missed
        line = extras.module_line(args.command, (e.name or "").partition(".")[0])
        if line is None:  # no extra brings it: a broken install, the traceback says where
            raise
        print(line, file=sys.stderr, flush=True)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
