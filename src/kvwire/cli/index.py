"""``kvwire index``: only the RFC #1403 indexer API (``/register``, ``/unregister``,
``/query``, ``/query_by_hash``, ``/dump``), on the lean HTTP server, on one core or several
(``--workers``; docs/indexer-api.md says how the workers keep one index).

Wired into ``kvwire`` by :mod:`kvwire.cli.main` through :func:`register` / :func:`run`;
``python -m kvwire.cli.index ...`` runs it directly.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from typing import Any

from .options import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    Parser,
    add_log_level,
    configure_logging,
    integer,
    port,
)

__all__ = ["add_arguments", "main", "make_handle", "register", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8090,
                   help="HTTP port (default 8090, as Dynamo's indexer; 0: any free one)")
    p.add_argument("--workers", type=integer(1, 64), default=1,
                   help="processes serving the port, each with a full replica of the index "
                        "that follows every registered stream itself (default 1; "
                        "docs/indexer-api.md)")
    p.add_argument("--registrations", metavar="FILE", default=None,
                   help="keep the registrations in FILE, so a restart follows the same streams")
    add_log_level(p)


def make_handle(options: dict[str, Any], worker: int = 0) -> Any:
    """One replica: a fresh :class:`kvwire.indexer.indexer.Indexer` and its ``handle``
    (module level so that a spawned worker can build its own from ``options``)."""
    from ..indexer.indexer import Indexer

    # the ingest runs on the worker's HTTP loop (serve_forever attaches it): no thread
    ix = Indexer.standalone(options.get("registrations"), on_loop=True)
    if worker:  # every worker reads the file; worker 0 alone writes it (one writer, and
        ix.file = None  # every worker applies the same registrations in the same order)
    return ix.handle


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``index`` subcommand to ``kvwire``'s subparsers."""
    p = subparsers.add_parser(
        "index", help="the RFC #1403 KV indexer API alone (Dynamo's indexer, Mooncake's "
        "Conductor)", description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog="exit status: 0 stopped by SIGINT/SIGTERM; 1 cannot listen, or a worker died; "
        "2 a bad flag")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    configure_logging(args, stamped=True)
    from ..indexer import server as ih

    options = {"registrations": args.registrations}
    say = functools.partial(print, file=sys.stderr, flush=True)
    try:
        if args.workers == 1:  # no sequencer, no second process: the leanest path
            handle = make_handle(options)
            sock = ih.listen_socket(args.host, args.port)
            say(f"kvwire index: http://{args.host}:{sock.getsockname()[1]} "
                f"(1 worker, {ih.describe_loop()}, pid {os.getpid()})")
            try:
                ih.serve_forever(handle, sock)
            finally:
                handle.__self__.close()  # the subscriber's sockets
            return EXIT_OK
        status = ih.run_workers(
            functools.partial(make_handle, options), args.host, args.port, args.workers,
            on_ready=lambda p: say(f"kvwire index: http://{args.host}:{p} ({args.workers} "
                                   f"workers, {ih.describe_loop()}, pid {os.getpid()})"))
        return EXIT_OK if status == 0 else EXIT_FAILURE
    except OSError as e:
        say(f"kvwire index: cannot listen on {args.host}:{args.port}: {e}")
        return EXIT_FAILURE
    except ValueError as e:
        say(f"kvwire index: {e}")
        return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog="kvwire index", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
