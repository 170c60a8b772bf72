"""What every ``kvwire`` subcommand shares: exit statuses, logging, and flags with one meaning
everywhere (``--log-level``, ``--connect-timeout``, ports, ``--engine``).

Exit statuses (docs/operations.md): 0 done; 1 a runtime failure (cannot connect, cannot
listen, fewer batches than ``--count``); 2 a bad command line or configuration, or a missing
extra; 3 a demo ran and missed its targets; 130/143 SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable

__all__ = [
    "EXIT_FAILURE", "EXIT_MISSED", "EXIT_OK", "EXIT_USAGE", "LOG_LEVELS", "add_connect_timeout",
    "add_log_level", "configure_logging", "count", "engine", "integer", "nonnegative", "number",
    "Parser", "port", "positive", "positive_int", "positive_seconds", "seconds",
]

EXIT_OK = 0
EXIT_FAILURE = 1  # the command was right, the world was not: refused, timed out, port in use
EXIT_USAGE = 2  # a bad flag, endpoint, engine or config (argparse exits 2 too), or no extra
EXIT_MISSED = 3  # kvwire demo: ran, but missed a target it printed

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
CONNECT_TIMEOUT = 10.0


class Parser(argparse.ArgumentParser):
    """Every ``kvwire`` parser (subcommands inherit the class): a bad flag is ONE line naming
    the flag and the reason, exit 2, instead of the whole usage before it; ``--help`` still
    prints the usage. Descriptions taken from a module's docstring lose their reST quotes."""

    def __init__(self, *args, **kwargs) -> None:
        if isinstance(kwargs.get("description"), str):
            kwargs["description"] = kwargs["description"].replace("``", "")
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see: {self.prog} --help)\n")


# The number converters of every command (argparse types). Their errors name the bound;
# argparse adds the flag: "argument --port: must be in 0..65535, got 70000".

def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An int in [lo, hi] (either bound may be None: unbounded)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            want = (f"in {lo}..{hi}" if lo is not None and hi is not None
                    else f">= {lo}" if lo is not None else f"<= {hi}")
            raise argparse.ArgumentTypeError(f"must be {want}, got {v}")
        return v

    parse.__name__ = "integer"
    return parse


def number(lo: float, *, strict: bool = False) -> Callable[[str], float]:
    """A finite float > lo (``strict``) or >= lo."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(v) or v < lo or (strict and v == lo):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>' if strict else '>='} {lo:g}, got {text}")
        return v

    parse.__name__ = "number"
    return parse


_port = integer(0, 65535)


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: any free one)."""
    try:
        int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    return _port(text)


#: A whole number >= 1 / >= 0.
positive_int = integer(1)
count = integer(0)
#: A finite number > 0 / >= 0 (seconds: 0 is none, at once).
positive = number(0, strict=True)
nonnegative = number(0)
positive_seconds = positive
seconds = nonnegative


def fraction(text: str) -> float:
    """A share, 0..1."""
    v = nonnegative(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in 0..1, got {text}")
    return v


def engine(text: str):
    """An argparse type: ``--engine NAME=ENDPOINT[,...]`` (:class:`EngineSpec`)."""
    from ..consume.engine_spec import EngineSpec

    try:
        return EngineSpec.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default=None,
                   help="kvwire's log level on stderr (default warning; kvwire -v: debug)")


def add_connect_timeout(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--connect-timeout", type=positive_seconds, default=CONNECT_TIMEOUT,
                   metavar="S",
                   help=f"give up (exit 1) if the first connection to {what} takes longer "
                        f"than S seconds, naming the last reason (default {CONNECT_TIMEOUT:g}; "
                        "a connection lost later is retried)")


def add_chat_template(p: argparse.ArgumentParser, who: str) -> None:
    """vLLM's ``--chat-template`` and ``--chat-template-content-format``, for ``who``."""
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help=f"{who} renders chats with this template instead of the model's: a "
                        "file, or the template itself (vLLM's --chat-template; give the "
                        "router what the engines were given)")
    p.add_argument("--chat-template-content-format", default="auto",
                   choices=("auto", "string", "openai"),
                   help="how message content reaches the template: auto (decided from the "
                        "template, vLLM's default), string (text parts joined) or openai "
                        "(a list of parts)")


def add_kv_transfer(p, what: str) -> None:
    """The KV transfer's flags, shared by ``kvwire engine`` (its engines pull) and ``kvwire
    sim`` (its model does): one meaning, one default. ``what``: "pull" or "transfer"."""
    p.add_argument("--kv-lease-s", type=positive, default=30.0, metavar="S",
                   help="seconds a prefill engine holds a prompt's KV for its decode engine "
                        "unless heartbeats extend it (vLLM's kv_lease_duration; default 30)")
    p.add_argument("--kv-bytes-per-token", type=positive_int, default=131072, metavar="B",
                   help="KV bytes a token (default 131072: Llama-3.1-8B in BF16)")
    p.add_argument("--kv-bandwidth-gbps", type=positive, default=400.0, metavar="G",
                   help="link bandwidth between engines in Gb/s (default 400)")
    p.add_argument("--kv-latency-ms", type=nonnegative, default=1.0, metavar="MS",
                   help=f"fixed time of one {what} (default 1 ms)")
    p.add_argument("--kv-recompute-blocks", type=count, default=0, metavar="N",
                   help="a decode engine recomputes a pull of at most N blocks instead "
                        "(vLLM's kv_recompute_threshold; default 0)")
    p.add_argument("--kv-load-failure", choices=("fail", "recompute"), default="fail",
                   help=f"a failed {what} fails the request (default, vLLM's) or the decode "
                        "engine recomputes the prompt (vLLM's kv_load_failure_policy)")


def transfer_cost(args: argparse.Namespace):
    """The :class:`~kvwire.engine.timing.TransferCost` :func:`add_kv_transfer`'s flags say."""
    from ..engine.timing import TransferCost

    return TransferCost(args.kv_bytes_per_token, args.kv_bandwidth_gbps * 1e9 / 8,
                        args.kv_latency_ms * 1e-3)


def add_pd_decider(p) -> None:
    """When a prefill/decode router prefills on the decode engine instead, by choice (a small
    uncached part, busy prefill engines) or after every prefill engine failed
    (``--pd-fallback``): ``kvwire serve`` and ``kvwire sim`` decide alike
    (:mod:`kvwire.routing.pairs`)."""
    from ..routing.pairs import FALLBACK

    p.add_argument("--disagg-min-tokens", type=count, default=0, metavar="N",
                   help="prefill/decode: a prompt missing fewer than N tokens on its decode "
                        "engine is prefilled there (default 0: always disaggregate)")
    p.add_argument("--pd-prefill-busy", type=nonnegative, default=float("inf"),
                   metavar="BLOCKS",
                   help="prefill/decode: when every prefill engine's load exceeds BLOCKS, "
                        "prefill on the decode engine (default: never)")
    p.add_argument("--pd-fallback", choices=FALLBACK, default="local",
                   help="prefill/decode: a prefill that failed on every prefill engine tried "
                        "(--retries more after the first) is done on the decode engine "
                        "(local, the default) or answered 502 (fail)")


def configure_logging(args: argparse.Namespace, *, stamped: bool = False) -> str:
    """Set up logging from ``--log-level`` (or ``-v``), replacing any earlier set-up; the
    level's name. ``stamped``: lines start with the time (long-running services)."""
    level = getattr(args, "log_level", None) or (
        "debug" if getattr(args, "verbose", False) else "warning")
    fmt = ("%(asctime)s %(name)s %(levelname)s %(message)s" if stamped
           else "%(name)s: %(levelname)s: %(message)s")
    logging.basicConfig(level=level.upper(), stream=sys.stderr, force=True, format=fmt)
    return level
