"""Which engines to follow: :class:`EngineSpec` and its parsers, for every command that names
engines (``serve --engine``, ``serve --nats-engine``, ``bridge --engine``).

It lives on the consumer side because the router (:mod:`kvwire.routing.core`) and the NATS
bridge (:mod:`kvwire.nats.bridge`) both follow engines: neither imports the other for it.

One name rule everywhere: 1-64 of letters, digits, ``_`` and ``-``. A name becomes a NATS
subject token (``<prefix>.<engine>.<rank>``, where ``.`` separates tokens and ``*``/``>`` are
wildcards) and a stream name ``NAME/dpR``, so ``.``, ``/``, ``:`` and spaces are refused by
``serve`` too: a fleet named for ``serve`` can always be bridged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..wire.endpoint import check_endpoint
from .subscriber import StreamSpec

__all__ = ["BOOTSTRAP_PORT", "ENGINE_NAME", "ENGINE_NAME_RULE", "ROLES", "EngineSpec",
           "check_engine_name"]

#: An engine name's pattern (also the NAME of its streams' NAME/dpR).
ENGINE_NAME = r"[A-Za-z0-9_-]{1,64}"
_NAME = re.compile(ENGINE_NAME)
#: What :func:`check_engine_name` accepts, as error messages say it.
ENGINE_NAME_RULE = ("1-64 of letters, digits, '_' and '-' (it becomes a NATS subject token, "
                    "where '.' separates tokens)")
_MAX_RANKS = 1024


def check_engine_name(name: str, where: str) -> str:
    """``name`` if it follows the one engine-name rule, else ValueError naming ``where``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}: engine name {name!r} must be {ENGINE_NAME_RULE}")
    return name


def check_url(val: str, where: str) -> str:
    """An engine's HTTP base ``http://HOST:PORT`` (no path, query or credentials), without
    a trailing slash; ValueError naming ``where`` otherwise."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(val)
        port = u.port
    except ValueError as e:
        raise ValueError(f"{where}: url {val!r}: {e}") from None
    if (u.scheme != "http" or not u.hostname or port is None or u.path not in ("", "/")
            or u.query or u.fragment or u.username or u.password):
        raise ValueError(f"{where}: url {val!r} must be http://HOST:PORT")
    return val.rstrip("/")


def _ranks(val: str, where: str) -> int:
    if not val.isdigit() or not 1 <= int(val) <= _MAX_RANKS:
        raise ValueError(f"{where}: ranks {val!r} must be 1..{_MAX_RANKS}")
    return int(val)


#: An engine's roles in prefill/decode serving: ``both`` (the default) serves either side.
ROLES = ("prefill", "decode", "both")
#: SGLang's default bootstrap port (a prefill engine's, where decode engines find it).
BOOTSTRAP_PORT = 8998


def _role(val: str, where: str) -> str:
    if val not in ROLES:
        raise ValueError(f"{where}: unknown role {val!r} (expected prefill, decode or both)")
    return val


def _port(val: str, where: str) -> int:
    if not val.isdigit() or not 1 <= int(val) <= 65535:
        raise ValueError(f"{where}: bootstrap_port {val!r} must be 1..65535")
    return int(val)


@dataclass(frozen=True)
class EngineSpec:
    """One engine: ``NAME=ENDPOINT[,replay=ENDPOINT][,ranks=N][,topic=T][,url=URL]
    [,first_seq=N][,role=prefill|decode|both][,bootstrap_port=P]``.

    ``endpoint`` is None for an engine whose streams come from JetStream (``serve --nats``):
    it has a name and ranks, and no ZeroMQ endpoint to follow. ``url`` is the engine's
    OpenAI-compatible HTTP base (``http://HOST:PORT``): only engines with one get proxied
    requests (``serve``'s ``/v1/*``); the others serve the decision API only.
    ``first_seq``: the seq its publisher numbers a run from (0; Mooncake Store's is 1).
    ``role``: what it does in prefill/decode serving (``prefill``, ``decode`` or ``both``,
    the default); ``bootstrap_port``: where SGLang's protocol finds a prefill engine's
    bootstrap server (8998 if not given; a ``decode`` engine has none)."""

    name: str
    endpoint: str | None
    replay: str | None = None
    ranks: int = 1
    topic: str = ""
    url: str | None = None
    first_seq: int = 0
    role: str = "both"
    bootstrap_port: int = BOOTSTRAP_PORT

    def __post_init__(self) -> None:
        _role(self.role, f"engine {self.name!r}")

    @property
    def prefills(self) -> bool:
        """Whether it may run a request's prefill for another engine (prefill, both)."""
        return self.role != "decode"

    @property
    def decodes(self) -> bool:
        """Whether it may decode (decode, both)."""
        return self.role != "prefill"

    @staticmethod
    def _role_opt(kw: dict[str, Any], key: str, val: str, where: str) -> bool:
        """Parse a ``role=`` or ``bootstrap_port=`` option into ``kw``; False for another."""
        if key == "role":
            kw["role"] = _role(val, where)
        elif key == "bootstrap_port":
            kw["bootstrap_port"] = _port(val, where)
        else:
            return False
        return True

    @staticmethod
    def _check_roles(kw: dict[str, Any], where: str) -> None:
        if "bootstrap_port" in kw and kw.get("role") == "decode":
            raise ValueError(f"{where}: bootstrap_port is a prefill engine's (this one has "
                             "role=decode)")

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        """Parse an ``--engine`` value; ValueError says which part is wrong."""
        where = f"--engine {text!r}"
        name, sep, rest = text.partition("=")
        if not sep:
            raise ValueError(f"{where}: expected NAME=ENDPOINT[,replay=...]")
        check_engine_name(name, where)
        parts = rest.split(",")
        endpoint, opts = parts[0], parts[1:]
        if not endpoint:
            raise ValueError(f"{where}: missing ENDPOINT after '{name}='")
        check_endpoint(endpoint, f"--engine {name} endpoint")
        kw: dict[str, Any] = {}
        for opt in opts:
            key, eq, val = opt.partition("=")
            if not eq or key not in ("replay", "ranks", "topic", "url", "first_seq", "role",
                                     "bootstrap_port"):
                raise ValueError(f"{where}: unknown option {opt!r} (expected replay=ENDPOINT, "
                                 "ranks=N, topic=T, url=URL, first_seq=N, "
                                 "role=prefill|decode|both or bootstrap_port=P)")
            if key in kw:
                raise ValueError(f"{where}: {key} given twice")
            if cls._role_opt(kw, key, val, where):
                continue
            if key == "replay":
                check_endpoint(val, f"--engine {name} replay")
                kw["replay"] = val
            elif key == "ranks":
                kw["ranks"] = _ranks(val, where)
            elif key == "url":
                kw["url"] = check_url(val, where)
            elif key == "first_seq":
                if val not in ("0", "1"):
                    raise ValueError(f"{where}: first_seq {val!r} must be 0 (vLLM, SGLang, "
                                     "kvwire) or 1 (Mooncake Store)")
                kw["first_seq"] = int(val)
            else:
                kw["topic"] = val
        cls._check_roles(kw, where)
        return cls(name, endpoint, **kw)

    @classmethod
    def parse_named(cls, text: str, flag: str = "--nats-engine") -> EngineSpec:
        """Parse ``NAME[:RANKS][,url=URL][,role=ROLE][,bootstrap_port=P]``: an engine
        whose streams come from JetStream, proxied to at ``URL`` if given (else it serves
        the decision API only)."""
        where = f"{flag} {text!r}"
        head, *opts = text.split(",")
        if "=" in head:
            raise ValueError(f"{where}: expected NAME[:RANKS][,url=URL] (the engines' streams "
                             "come from JetStream here, so no ZeroMQ endpoint is given)")
        name, sep, n = head.partition(":")
        check_engine_name(name, where)
        kw: dict[str, Any] = {}
        for opt in opts:
            key, eq, val = opt.partition("=")
            if key not in ("url", "role", "bootstrap_port") or not eq:
                raise ValueError(f"{where}: unknown option {opt!r} (expected url=URL, "
                                 "role=prefill|decode|both or bootstrap_port=P)")
            if key in kw:
                raise ValueError(f"{where}: {key} given twice")
            if not cls._role_opt(kw, key, val, where):
                kw["url"] = check_url(val, where)
        cls._check_roles(kw, where)
        return cls(name, None, ranks=_ranks(n, where) if sep else 1, **kw)

    def stream_names(self) -> list[str]:
        """The names of this engine's DP rank streams: ``NAME/dpR``."""
        return [f"{self.name}/dp{r}" for r in range(self.ranks)]

    def streams(self) -> list[StreamSpec]:
        """The subscriber specs of this engine's DP ranks, named ``NAME/dpR``."""
        if self.endpoint is None:
            raise ValueError(f"engine {self.name!r} has no ZeroMQ endpoint (its streams come "
                             "from JetStream)")
        return StreamSpec.for_ranks(self.name, self.endpoint, self.ranks, self.topic,
                                    self.replay, first_seq=self.first_seq)
