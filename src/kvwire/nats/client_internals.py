"""Every use kvwire makes of nats-py's private API, in one place, behind a version gate.

nats-py's public API costs a lot per message at the rates the bridge and the consumers run:
``publish`` validates and encodes a header dict key by key, every message of a callback
subscription costs an event-loop wakeup, its header parser tests every character with a
generator. So, on a client of a tested nats-py version, kvwire

* sends the writer's ready-made HPUB commands (``_send_command``, ``_flush_queue``,
  ``_flush_pending``) and, when nothing of nats-py's is queued ahead, writes them to the
  socket itself (``_transport``, ``_pending_data_size``, ``stats``);
* drops the writer's publishes still queued (``_pending``) when the connection breaks, so
  that nothing sent before a recovery's decision goes out after it;
* handles the messages of chosen subscriptions in nats-py's read loop (``_process_msg``,
  ``_process_headers``, ``_build_message``, ``_subs``: :mod:`kvwire.nats.inbox`);
* parses headers with a cheaper function (``_parse_header_lines``, per connection).

:func:`internals` gives these for one client, or None; with None every caller takes nats-py's
public API instead (same behaviour, more CPU per message): for a nats-py outside
:data:`TESTED` (with a warning, once), a client lacking any of the attributes, or when the
environment variable :data:`FORCE_PUBLIC` is ``1`` (the test suite runs the writer and
consumer suites a second time so).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["FORCE_PUBLIC", "TESTED", "ClientInternals", "internals", "refusal",
           "version_tested"]

log = logging.getLogger("kvwire.nats")

#: nats-py versions the private uses were tested with: ``[low, high)`` (major, minor). Keep
#: in step with the pin in pyproject.toml.
TESTED = ((2, 16), (2, 17))
#: ``KVWIRE_NATS_PUBLIC_API=1``: never use the internals (the public-API path, forced).
FORCE_PUBLIC = "KVWIRE_NATS_PUBLIC_API"

_ATTRS = ("_send_command", "_flush_queue", "_flush_pending", "_transport",
          "_pending_data_size", "_pending", "stats", "_process_msg", "_process_headers",
          "_build_message", "_subs", "_parse_header_lines")
_warned: set[str] = set()


def version_tested(version: str) -> bool:
    """Whether nats-py ``version`` (e.g. ``"2.16.0"``) is in :data:`TESTED`."""
    try:
        mm = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return len(mm) == 2 and TESTED[0] <= mm < TESTED[1]


def _installed_version() -> str:
    try:
        from nats.aio.client import __version__
    except ImportError:
        return "?"
    return str(__version__)


def refusal(nc: Any) -> str | None:
    """Why :func:`internals` gives None for ``nc`` (None: it gives them)."""
    if os.environ.get(FORCE_PUBLIC) == "1":
        return f"{FORCE_PUBLIC}=1"
    version = _installed_version()
    if not version_tested(version):
        lo, hi = TESTED
        return (f"nats-py {version} is outside the versions kvwire was tested with "
                f"(>= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]})")
    missing = [a for a in _ATTRS if not hasattr(nc, a)]
    if missing:
        return f"the client has no {', '.join(missing)}"
    return None


class ClientInternals:
    """The private parts of one nats-py client that kvwire uses (see the module docstring).
    Made by :func:`internals` only."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc

    async def send(self, cmd: bytes) -> None:
        """Queue one protocol command (a whole ``HPUB``) as nats-py's ``publish`` would, and
        flush it unless nats-py's flusher is already due to."""
        nc = self.nc
        await nc._send_command(cmd)
        if nc._flush_queue is not None and nc._flush_queue.empty():
            await nc._flush_pending()

    def can_write_now(self) -> bool:
        """Connected, and nothing of nats-py's queued ahead (a write now cannot overtake)."""
        nc = self.nc
        return bool(nc.is_connected and not nc._pending_data_size
                    and nc._transport is not None)

    def write_now(self, cmd: bytes) -> None:
        """Hand ``cmd`` to the socket at once (only after :meth:`can_write_now`)."""
        nc = self.nc
        nc._transport.write(cmd)
        nc.stats["out_msgs"] += 1
        nc.stats["out_bytes"] += len(cmd)

    def drop_queued(self, drop: Callable[[bytes], bool]) -> int:
        """Remove the queued commands ``drop`` selects (nats-py would send them after a
        reconnect); how many."""
        nc = self.nc
        pending = nc._pending
        if not isinstance(pending, list):
            return 0
        keep = [c for c in pending if not drop(c)]
        if len(keep) != len(pending):
            nc._pending = keep
            nc._pending_data_size = sum(len(c) for c in keep)
        return len(pending) - len(keep)

    def tap(self) -> _Tap:
        """This client's message tap (made on first use: :mod:`kvwire.nats.inbox`)."""
        tap = getattr(self.nc, "_kvwire_tap", None)
        if tap is None:
            tap = self.nc._kvwire_tap = _Tap(self.nc)
        return tap

    def use_header_parser(self, fn: Callable[[bytes], dict[str, str]]) -> None:
        """Parse this connection's header blocks with ``fn`` (nats-py calls it as
        ``self._parse_header_lines``: set on the instance, this connection only)."""
        self.nc._parse_header_lines = fn


class _Tap:
    """Wraps one client's ``_process_msg``: messages for registered sids go to their
    callback directly, in the read loop; all others to nats-py as before."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.orig = nc._process_msg
        self.cbs: dict[int, tuple[Any, Callable[[Any], None]]] = {}
        nc._process_msg = self.process

    def add(self, sub: Any, cb: Callable[[Any], None]) -> None:
        self.cbs[sub._id] = (sub, cb)

    async def process(self, sid: int, subject: bytes, reply: bytes, data: bytes,
                      headers: bytes | None) -> None:
        got = self.cbs.get(sid)
        nc = self.nc
        if got is None or nc._subs.get(sid) is not got[0]:
            if got is not None:
                del self.cbs[sid]  # unsubscribed: nats-py's own rules apply
            await self.orig(sid, subject, reply, data, headers)
            return
        st = nc.stats
        st["in_msgs"] += 1
        st["in_bytes"] += len(data)
        hdr = await nc._process_headers(headers) if headers else None
        got[1](nc._build_message(sid, subject, reply, data, hdr))


def internals(nc: Any) -> ClientInternals | None:
    """The private parts of ``nc`` kvwire may use, or None: use the public API. A nats-py
    outside :data:`TESTED` is said once, as a warning; a client that is no nats-py client
    (a test's stand-in, None) quietly gets None."""
    why = refusal(nc)
    if why is None:
        return ClientInternals(nc)
    if why in _warned or why.startswith("the client has no") and not _is_nats_client(nc):
        return None
    _warned.add(why)
    if why.startswith(FORCE_PUBLIC):
        log.info("nats-py's public API only (%s)", why)
    else:
        msg = f"kvwire: {why}: using nats-py's public API only (slower per message)"
        log.warning("%s", msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return None


def _is_nats_client(nc: Any) -> bool:
    try:
        from nats.aio.client import Client
    except ImportError:
        return False
    return isinstance(nc, Client)
