"""``kvwire fleet N``: N ``kvwire engine`` processes on consecutive ports, and the ``--engine``
arguments a router needs to follow them; Ctrl-C or SIGTERM stops them all.

Engine ``i`` serves HTTP at ``--base-port + i``, publishes KV events at ``base + 1000 +
i * dp`` and answers replay at ``base + 2000 + i * dp`` (DP rank ``r`` adds ``r``), all on
``--host`` only (loopback by default): a test fleet's events carry prompts' token ids, so
they are not open to the network unless ``--all-interfaces`` asks (the publishers then warn).
Other
flags are passed to every engine unchanged, after the fleet has checked them (a bad one:
one line, exit 2, nothing started). On Ctrl-C or SIGTERM the fleet stops every engine
itself (SIGTERM, SIGKILL after ``STOP_TIMEOUT``), relays each one's ``stopped`` line and
exits only when all are gone; if it is killed outright, the children still die with it
(Linux: PR_SET_PDEATHSIG).

``kvwire fleet --prefill N --decode M [--both K]`` starts a disaggregated fleet instead:
engines ``prefill0..``, ``decode0..``, ``both0..`` in that order (``i`` counting across
them) with their ``--role``, their KV side channel at ``base + 3000 + i`` and, for prefill
and both engines, SGLang's bootstrap server at ``base + 4000 + i``; each printed
``--engine`` adds ``role=`` (and ``bootstrap_port=``).
"""

from __future__ import annotations

import argparse
import ipaddress
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from .options import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, Parser, count, port, positive_int

__all__ = ["engine_args", "main", "register", "run"]

READY_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0
_RESERVED = ("--port", "--events", "--replay", "--host", "--role", "--kv-port",
             "--bootstrap-port")


def _die_with_parent() -> None:  # runs in the child before exec
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def bind_host(host: str, all_interfaces: bool) -> str:
    """The host part of the engines' tcp bind endpoints for an HTTP ``host``.

    A publisher binds only an endpoint with ``*`` or ``::`` (vLLM's rule; a plain address
    means connect), so an IPv4 address is written IPv4-mapped, ``[::ffff:127.0.0.1]``: that
    binds this one address. ``*`` (every interface) when asked, for a wildcard ``host``, or
    where that form cannot bind (no IPv6 sockets): the fleet says so."""
    if all_interfaces or host in ("", "*", "0.0.0.0", "::"):
        return "*"
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:  # a name: its IPv4 address
        try:
            addr = ipaddress.ip_address(socket.gethostbyname(host))
        except OSError:
            return "*"
    if addr.version == 6:
        text = addr.compressed
        return f"[{text}]" if "::" in text else "*"
    mapped = f"::ffff:{addr}"
    try:  # the form binds where IPv6 sockets exist; check once, here, on a free port
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind((mapped, 0))
    except OSError as e:
        print(f"kvwire fleet: cannot bind {host} alone for the KV events here ({e}): they "
              "bind every interface", file=sys.stderr, flush=True)
        return "*"
    return f"[{mapped}]"


def engine_args(i: int, base: int, host: str, dp: int, bind: str = "*",
                role: str | None = None, name: str | None = None) -> tuple[list[str], str]:
    """Engine ``i``'s own flags and the router's ``--engine`` value for it; ``bind`` is
    :func:`bind_host`'s answer. With a ``role`` (a P/D fleet) the engine also gets its KV
    side channel at ``base + 3000 + i`` and, unless it decodes only, SGLang's bootstrap
    server at ``base + 4000 + i``; the spec names its role (and bootstrap port)."""
    http, events, replay = base + i, base + 1000 + i * dp, base + 2000 + i * dp
    flags = ["--host", host, "--port", str(http), "--events", f"tcp://{bind}:{events}",
             "--replay", f"tcp://{bind}:{replay}"]
    spec = (f"{name or f'engine{i}'}=tcp://{host}:{events},replay=tcp://{host}:{replay}"
            + (f",ranks={dp}" if dp > 1 else "") + f",url=http://{host}:{http}")
    if role is not None:
        flags += ["--role", role, "--kv-port", str(base + 3000 + i)]
        spec += f",role={role}"
        if role != "decode":
            flags += ["--bootstrap-port", str(base + 4000 + i)]
            spec += f",bootstrap_port={base + 4000 + i}"
    return flags, spec


def layout(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """The fleet's engines in order, (name, role): ``engine0..`` without roles, else
    ``prefill0.., decode0.., both0..``."""
    if args.n is not None:
        return [(f"engine{i}", None) for i in range(args.n)]
    return [(f"{role}{i}", role) for role, k in (("prefill", args.prefill),
                                                 ("decode", args.decode),
                                                 ("both", args.both)) for i in range(k)]


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``fleet`` subcommand to ``kvwire``'s subparsers."""
    p = subparsers.add_parser(
        "fleet", help="start N kvwire engines and print the --engine arguments for a router",
        description="Start N kvwire engines, print the --engine arguments a router needs, "
        "stop them all on Ctrl-C or SIGTERM.",
        epilog="Any other flag is a `kvwire engine` flag given to every engine. exit status: "
        "0 stopped by SIGINT/SIGTERM; 1 an engine failed to start or died; 2 a bad flag")
    _add(p)
    _role_form(p)
    p.set_defaults(func=run, _fleet_parser=p)
    return p


_ROLE_FORM = "roles"  # stands for N when the command line starts with a flag


def _role_form(p: argparse.ArgumentParser) -> None:
    """Let ``kvwire fleet --prefill N --decode M <engine flags>`` parse: argparse takes
    the engine flags only after the positional N, so a command line that starts with a
    flag is parsed as if N were :data:`_ROLE_FORM` (N then None), everything after it
    left to :func:`_check`."""
    base = type(p)

    class RoleForm(base):  # type: ignore[misc, valid-type]
        def parse_known_args(self, args=None, namespace=None):
            args = list(sys.argv[1:] if args is None else args)
            if args and args[0].startswith("-") and args[0] not in ("-h", "--help"):
                args = [_ROLE_FORM, *args]
            return super().parse_known_args(args, namespace)

    p.__class__ = RoleForm


def _n(text: str) -> int | None:
    return None if text == _ROLE_FORM else positive_int(text)


def _add(p: argparse.ArgumentParser) -> None:
    p.add_argument("n", type=_n, metavar="N", nargs="?", default=None,
                   help="number of engines (all of role both; or give --prefill/--decode)")
    p.add_argument("--prefill", type=count, default=0, metavar="N",
                   help="engines of role prefill (prefill0..)")
    p.add_argument("--decode", type=count, default=0, metavar="M",
                   help="engines of role decode (decode0..)")
    p.add_argument("--both", type=count, default=0, metavar="K",
                   help="with --prefill/--decode: engines of role both (both0..), with a KV "
                        "side channel and a bootstrap server")
    p.add_argument("--base-port", type=port, default=8000, metavar="P",
                   help="engine i serves HTTP at P + i (events P + 1000 + i, replay P + 2000 + i; "
                        "with roles its KV side channel P + 3000 + i, bootstrap P + 4000 + i)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address every engine binds, HTTP and KV events (default loopback)")
    p.add_argument("--all-interfaces", action="store_true",
                   help="bind the KV event and replay ports on every interface (tcp://*), "
                        "where anyone who reaches them reads the prompts' token ids (each "
                        "engine warns)")
    p.add_argument("engine_flags", nargs=argparse.REMAINDER,
                   help="flags for every engine (see kvwire engine --help)")


class _FlagError(Exception):
    pass


class _Parser(Parser):
    """Raises argparse's message instead of printing usage and exiting."""

    def error(self, message: str):
        raise _FlagError(message)


def _check(args: argparse.Namespace) -> str | None:
    extra: list[str] = []
    it = iter(a for a in args.engine_flags if a != "--")
    for a in it:  # fleet's own flags given after N land here too
        key, eq, val = a.partition("=")
        if args.n is None and not extra and a.isdigit():  # N after the fleet's own flags
            try:
                args.n = positive_int(a)
            except argparse.ArgumentTypeError as e:
                return f"N: {e}"
            continue
        if key == "--all-interfaces":
            args.all_interfaces = True
            continue
        if key in ("--prefill", "--decode", "--both"):
            val = val if eq else next(it, "")
            try:
                setattr(args, key[2:], count(val))
            except argparse.ArgumentTypeError as e:
                return f"{key}: {e}"
            continue
        if key in ("--base-port", "--host"):
            val = val if eq else next(it, "")
            if key == "--host":
                args.host = val
                continue
            try:
                args.base_port = port(val)
            except argparse.ArgumentTypeError as e:
                return f"--base-port: {e}"
            continue
        extra.append(a)
    roles = args.prefill + args.decode + args.both
    if args.n is not None and roles:
        return "give N or --prefill/--decode/--both, not both"
    if args.n is None and not roles:
        return "give N (engines of role both) or --prefill N --decode M"
    if args.n is None and args.prefill + args.both and not args.decode + args.both:
        return "a P/D fleet needs an engine that decodes (--decode M or --both K)"
    if args.n is None and args.decode and not args.prefill + args.both:
        return "a P/D fleet needs an engine that prefills (--prefill N or --both K)"
    args.engines = layout(args)
    args.n = len(args.engines)
    for a in extra:
        if a.split("=", 1)[0] in _RESERVED:
            key = a.split("=", 1)[0]
            hint = "--prefill/--decode/--both" if key == "--role" else "--base-port"
            return f"{key} is set per engine by kvwire fleet (use {hint})"
    if args.base_port + (4000 if roles else 2000) + args.n * 64 > 65535:
        return f"--base-port {args.base_port} leaves no room for {args.n} engines' ports"
    from .engine import add_arguments, options_from_args

    ep = _Parser(prog="kvwire engine", add_help=False)
    add_arguments(ep)
    try:
        ns, unknown = ep.parse_known_args(extra)
    except _FlagError as e:
        return f"bad engine flag: {e} (see kvwire engine --help)"
    if unknown:
        return f"unknown engine flag(s): {' '.join(unknown)} (see kvwire engine --help)"
    try:  # what every engine would refuse at its start, refused once here
        options_from_args(ns)
        from ..tokenize import load_tokenizer

        load_tokenizer(ns.tokenizer)
    except (ValueError, OSError) as e:  # TokenizerError is a ValueError
        return f"bad engine flags: {e}"
    if roles and ns.dp_size != 1:
        return f"a P/D fleet's engines need --dp-size 1, got {ns.dp_size}"
    args.engine_flags = extra
    args.dp = ns.dp_size
    return None


def run(args: argparse.Namespace) -> int:
    err = _check(args)
    if err:
        print(f"kvwire fleet: {err}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    procs: list[subprocess.Popen] = []
    relays: list[threading.Thread] = []
    stopping = threading.Event()

    def on_signal(signum, frame) -> None:
        stopping.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        specs = []
        bind = bind_host(args.host, args.all_interfaces)
        for i, (name, role) in enumerate(args.engines):
            flags, spec = engine_args(i, args.base_port, args.host, args.dp, bind, role, name)
            specs.append(spec)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "kvwire.cli.engine", *flags, *args.engine_flags],
                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
        if not _wait_ready(procs, stopping, relays):
            return EXIT_FAILURE if not stopping.is_set() else EXIT_OK
        for spec in specs:
            print(f"--engine {spec}", flush=True)
        print(f"kvwire fleet: {args.n} engines up (pids {' '.join(str(p.pid) for p in procs)})"
              "; Ctrl-C stops them", file=sys.stderr, flush=True)
        while not stopping.wait(0.2):
            dead = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]
            if dead:
                print(f"kvwire fleet: {args.engines[dead[0][0]][0]} exited with status "
                      f"{dead[0][1]}; "
                      "stopping the others", file=sys.stderr, flush=True)
                return EXIT_FAILURE
        return EXIT_OK
    finally:
        _stop_all(procs, relays)
        for s, h in old.items():
            signal.signal(s, h)


def _wait_ready(procs: list[subprocess.Popen], stopping: threading.Event,
                relays: list[threading.Thread]) -> bool:
    """Wait for every engine's ``serving`` line; False (and says why) if one fails."""
    sel = selectors.DefaultSelector()
    for i, p in enumerate(procs):
        sel.register(p.stdout, selectors.EVENT_READ, i)
    waiting = set(range(len(procs)))
    deadline = time.monotonic() + READY_TIMEOUT
    try:
        while waiting and not stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                print(f"kvwire fleet: engine(s) {sorted(waiting)} not ready within "
                      f"{READY_TIMEOUT:g} s", file=sys.stderr, flush=True)
                return False
            for key, _ in sel.select(min(left, 0.2)):
                i = key.data
                line = procs[i].stdout.readline()
                if not line:
                    print(f"kvwire fleet: engine{i} exited before serving (status "
                          f"{procs[i].wait()})", file=sys.stderr, flush=True)
                    return False
                if line.startswith(b"kvwire engine: serving"):
                    waiting.discard(i)
                    sel.unregister(procs[i].stdout)
                    t = threading.Thread(target=_drain, args=(procs[i].stdout,), daemon=True)
                    t.start()
                    relays.append(t)
        return not waiting
    finally:
        sel.close()


def _drain(stream) -> None:
    for line in stream:
        sys.stderr.buffer.write(line)
        sys.stderr.flush()


def _stop_all(procs: list[subprocess.Popen], relays: list[threading.Thread]) -> None:
    """SIGTERM every engine, wait, SIGKILL what is left: nothing keeps running when the
    fleet exits. Their last lines (``kvwire engine: stopped ...``) are relayed first."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + STOP_TIMEOUT
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for t in relays:  # the engines are gone: their pipes end
        t.join(1.0)


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog="kvwire fleet", description=__doc__.splitlines()[0])
    _add(p)
    _role_form(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
