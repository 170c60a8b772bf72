"""``kvwire epp``: kvwire as the endpoint picker behind Envoy (needs ``pip install
kvwire[epp]``).

Envoy's ``ext_proc`` filter asks it, per request, which engine to send to (gRPC on
``--grpc-port``); Envoy connects. The engines, the routing flags and the HTTP port (``/metrics``,
``/health``, ``/engines``, the status page) are ``kvwire serve``'s, on one routing core: the
engines it picks among are those with ``url=`` (``--engine``, or ``POST /engines`` at run
time); the indexer API's ``/register`` only adds an event stream to the index (for
``/query``), never an engine to pick. ``kvwire epp --envoy-config`` prints an Envoy bootstrap
for it (docs/epp.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .options import EXIT_OK, EXIT_USAGE, Parser, configure_logging, port, positive

__all__ = ["main", "register", "run"]


GRPC_PORT = 9002  # the Gateway API Inference Extension's
HTTP_PORT = 9090  # (its metrics port)
EPILOG = """exit status: 0 stopped (SIGINT/SIGTERM) or the Envoy config printed; 1 cannot
listen (HTTP or gRPC) or connect (--nats); 2 a bad flag or engine, no engine with url=, or
the epp extra missing (docs/epp.md)"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from . import serve

    serve.add_arguments(p)
    p.set_defaults(port=HTTP_PORT)
    g = p.add_argument_group("endpoint picker")
    g.add_argument("--grpc-port", type=port, default=GRPC_PORT,
                   help=f"the ext_proc (and gRPC health) port Envoy calls (default "
                        f"{GRPC_PORT}; 0: any free one); --host is its address too; the HTTP "
                        f"--port (default {HTTP_PORT}) serves /metrics, /health and the "
                        "status page")
    g.add_argument("--max-body", type=positive, default=32 << 20, metavar="BYTES",
                   help="a longer request body is refused with 413 (default 32 MiB)")
    g.add_argument("--grpc-tls-cert", metavar="FILE", default=None,
                   help="serve gRPC over TLS with this PEM certificate chain (with "
                        "--grpc-tls-key; default: plaintext); with --envoy-config, Envoy "
                        "connects over TLS and trusts it")
    g.add_argument("--grpc-tls-key", metavar="FILE", default=None,
                   help="the PEM private key of --grpc-tls-cert")
    g.add_argument("--envoy-config", action="store_true",
                   help="print an Envoy bootstrap that calls this picker and exit (no "
                        "--engine needed)")
    g.add_argument("--envoy-port", type=port, default=8081,
                   help="--envoy-config: the port Envoy serves clients on (default 8081)")
    g.add_argument("--envoy-admin-port", type=port, default=19000,
                   help="--envoy-config: Envoy's admin port, on loopback (default 19000)")
    g.add_argument("--more-pickers", metavar="HOST:PORT", action="append", default=[],
                   type=_address,
                   help="--envoy-config: another kvwire epp's gRPC address (repeat): Envoy "
                        "spreads the requests over all of them (several processes, more "
                        "cores; --nats shares their load)")
    g.add_argument("--request-body-mode", choices=("FULL_DUPLEX_STREAMED", "BUFFERED"),
                   default="FULL_DUPLEX_STREAMED",
                   help="--envoy-config: how Envoy sends a request body (default "
                        "FULL_DUPLEX_STREAMED, the Inference Extension chart's)")
    g.add_argument("--response-body-mode", choices=("FULL_DUPLEX_STREAMED", "STREAMED", "NONE"),
                   default="FULL_DUPLEX_STREAMED",
                   help="--envoy-config: how Envoy sends an answer's body (default "
                        "FULL_DUPLEX_STREAMED; STREAMED: chunk by chunk, each answered; NONE: "
                        "the picker sees the headers and the stream's end only, the lightest)")


def _address(text: str) -> tuple[str, int]:
    host, sep, p = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r}")
    return host.strip("[]"), port(p)


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("epp", help="pick engines for Envoy (ext_proc endpoint picker)",
                              description=__doc__.splitlines()[0], epilog=EPILOG)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def _say(line: str) -> None:
    print(f"kvwire epp: {line}", file=sys.stderr, flush=True)


def envoy_config(args: argparse.Namespace) -> str:
    from ..epp.bootstrap import EnvoyConfig, bootstrap

    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    return bootstrap(EnvoyConfig(
        listen_port=args.envoy_port, admin_port=args.envoy_admin_port, epp_host=host,
        epp_port=args.grpc_port, more_pickers=tuple(args.more_pickers),
        buffer_limit=int(args.max_body),
        tls_ca=None if args.grpc_tls_cert is None else os.path.abspath(args.grpc_tls_cert),
        request_body_mode=args.request_body_mode,
        response_body_mode=args.response_body_mode))


def run(args: argparse.Namespace) -> int:
    """Build ``kvwire serve``'s service, start the picker's gRPC server on its loop, serve
    until interrupted."""
    if args.envoy_config:
        sys.stdout.write(envoy_config(args))
        return EXIT_OK
    if (args.grpc_tls_cert is None) != (args.grpc_tls_key is None):
        print("kvwire epp: --grpc-tls-cert and --grpc-tls-key go together", file=sys.stderr)
        return EXIT_USAGE
    try:
        from ..epp.picker import Picker
        from ..epp.service import Service
        from ..h2.grpc import context
        from ..serve import build  # noqa: F401 (the extra's imports)
    except ImportError as e:
        print(f"kvwire epp: {e}; install with: pip install 'kvwire[epp]'", file=sys.stderr)
        return EXIT_USAGE
    from .serve import built, serve_until_stopped

    configure_logging(args, stamped=True)
    creds = None
    if args.grpc_tls_cert is not None:
        try:
            creds = context(args.grpc_tls_cert, args.grpc_tls_key)
        except OSError as e:  # (ssl.SSLError is one: a key that does not fit)
            print(f"kvwire epp: cannot read the TLS files: {e}", file=sys.stderr)
            return EXIT_USAGE
    svc = built(args, "kvwire epp", _say)
    if isinstance(svc, int):
        return svc
    proxy = svc.proxy
    if proxy is None:  # (no engine has url=: nothing to pick among)
        svc.close()
        print("kvwire epp: give --engine NAME=ENDPOINT,url=http://IP:PORT (repeat): the picker "
              "picks among the engines with url=", file=sys.stderr)
        return EXIT_USAGE
    picker = Picker(svc.core, proxy.fleet, proxy.tokens, args.max_in_flight)
    grpc_svc = Service(picker, proxy.prober.probed.is_set, int(args.max_body))
    svc.routes.metrics.registry.register(grpc_svc.metrics)  # (on /metrics beside serve's)

    async def start() -> None:
        bound = await grpc_svc.start(args.host, args.grpc_port, creds)
        _say(f"ext_proc on {args.host}:{bound} (gRPC{', TLS' if creds else ''}); "
             f"/metrics and the status page on {svc.url}/")

    async def stop() -> None:  # (after HTTP drained): answers streaming through Envoy
        await grpc_svc.stop(args.shutdown_timeout)  # get the same time to end

    svc.beside(start, stop)
    return serve_until_stopped(svc, "kvwire epp")


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog="kvwire epp", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
