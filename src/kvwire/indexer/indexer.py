"""The RFC #1403 KV indexer API (Mooncake's Conductor, Dynamo's standalone indexer), with no
web framework: :class:`Indexer` owns the registrations and answers

    ``Indexer.handle(method: str, path: str, body: bytes) -> tuple[int, bytes]``

(HTTP status, JSON body), for ``POST /register``, ``/unregister``, ``/query``,
``/query_by_hash``, ``GET /dump``, ``/registrations``, ``/health``. ``path`` may carry a query
string (``?shape=mooncake|dynamo``). ``handle`` is thread-safe and never raises: bad input is
a 4xx naming what was wrong, counted in :attr:`Indexer.counts`. ``kvwire serve`` mounts it
beside ``/route`` (one index); ``kvwire index`` serves it alone.

Streams come from a :class:`~kvwire.routing.feed.Feed` (its ingest owns the sockets and is
the index's only writer; ``add_stream`` / ``remove_stream`` hand registrations to it): its
own, or a router's (``kvwire serve``: one index for both). Both peers' spellings are accepted; which shape answers is chosen per request (see
:func:`~kvwire.indexer.api.pick_shape`, docs/indexer-api.md).
"""

from __future__ import annotations

import logging
import os
import threading
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from ..consume.subscriber import StreamSpec
from ..index import block_keys
from ..index.keys import chain_start
from ..routing.core import RouterCore
from ..routing.feed import Feed
from ..routing.tokens import parse_route_body
from ..wire.endpoint import check_endpoint
from .api import (
    MEDIA,
    BadRequest,
    QueryBody,
    QueryByHashBody,
    RegisterBody,
    Registration,
    RegistrationFile,
    Scope,
    UnregisterBody,
    add_rank,
    decode,
    empty_answer,
    new_row,
    pick_shape,
    seq_from_local,
    shape_answer,
)

__all__ = ["INDEXER_PATHS", "Indexer"]

log = logging.getLogger("kvwire.indexer")
_enc = msgspec.json.Encoder()
#: a /query body's fields but its token ids (those are parsed in C into int64s)
_query_rest = msgspec.json.Decoder(QueryBody)
try:  # a /query answer's bytes from the walk's ints (_answer.c); else the rows in Python
    if os.environ.get("KVWIRE_NO_NATIVE"):
        raise ImportError("KVWIRE_NO_NATIVE set")
    from ._answer import answer as _c_answer
except ImportError:
    _c_answer = None
#: the other fields of a /query body kept decoded per text (longer ones are decoded each time)
_MAX_REST = 1024


def _json(status: int, obj: Any) -> tuple[int, bytes]:
    return status, _enc.encode(obj)


class Indexer:
    """Registrations + the RFC #1403 answers over ``feed``'s index (see module doc); given a
    router, its feed (the router's engines' streams are then ``owned``: not registrable).

    ``registrations``: a JSON file rewritten atomically on every change and read here, so a
    restarted indexer follows the same streams (their blocks come back from each engine's
    replay / snapshot). ``max_tokens`` bounds a query."""

    def __init__(self, feed: Feed | RouterCore, registrations: str | Path | None = None,
                 max_tokens: int = 1 << 20) -> None:
        self.feed: Feed = feed.feed if isinstance(feed, RouterCore) else feed
        self.max_tokens = max_tokens
        self.file = None if registrations is None else RegistrationFile(Path(registrations))
        self._lock = threading.Lock()  # registry changes (and the file) one at a time
        self.regs: dict[tuple[str, str, int], Registration] = {}
        #: request and error counters (``kvwire_indexer_*`` in /metrics)
        self.counts: dict[str, int] = {}
        #: streams whose events use another block size than registered (warned once each)
        self.size_mismatch: dict[str, tuple[int, int]] = {}
        self._owns_feed = False
        self._ingest: Any = None  # a LoopIngest when made standalone(on_loop=True)
        #: /query token ids parsed in C when ``_tokens.c`` is built (False: msgspec's list of
        #: ints, the reference the C path is checked against; same answers, slower)
        self.c_token_ids = parse_route_body is not None
        #: with C ids, /query answered by the C walk and answer (``_fast``); False: the rows
        #: in Python (same bytes)
        self.c_answers = _c_answer is not None
        #: (the rest of a /query body, query string) -> (scope, shape): a client sends the
        #: same few (model, tenant, ...) again and again
        self._asks: dict[tuple[bytes | None, str], tuple[Scope, str]] = {}
        #: bumped after every registry change: the query plans below are for one version
        self._version = 0
        self._plans: dict[tuple, _Plan] = {}
        self._plans_version = -1
        if self.file is not None:
            for reg in self.file.load():
                self._follow(reg)
                self.regs[reg.key] = reg

    @classmethod
    def standalone(cls, registrations: str | Path | None = None, *, on_loop: bool = False,
                   **feed_kw: Any) -> Indexer:
        """An indexer with its own started :class:`~kvwire.routing.feed.Feed` (``feed_kw``:
        its options); ``close()`` stops it. ``on_loop``: no subscriber thread; the ingest
        runs on the event loop given to :meth:`attach` (indexer/ingest.py says why)."""
        feed = Feed(**feed_kw)
        feed.start(thread=not on_loop)
        try:
            ix = cls(feed, registrations)
        except BaseException:
            feed.close()
            raise
        ix._owns_feed = True
        if on_loop:
            from .ingest import LoopIngest

            ix._ingest = LoopIngest(feed)
        return ix

    def attach(self, loop: Any) -> None:
        """Start the ingest on the event loop that serves this indexer, if it was made
        ``on_loop``; else nothing to do (a thread ingests)."""
        if self._ingest is not None:
            self._ingest.attach(loop)

    def close(self) -> None:
        """Stop the feed (and the loop's ingest) if this indexer made it (``standalone``)."""
        if self._ingest is not None:
            self._ingest.stop()
        if self._owns_feed:
            self.feed.close()

    # ------------------------------------------------------------------ HTTP face

    def handle(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        """Answer one request: ``(status, JSON bytes)``; never raises."""
        path, _, qs = path.partition("?")
        route = _ROUTES.get(path)
        if route is None:
            return self._bad(404, f"no such endpoint: {method} {path} (the indexer API has "
                             f"{', '.join(sorted(_ROUTES))})", "not_found")
        want, fn = route
        if method != want:
            return self._bad(405, f"{path} takes {want}, not {method}", "method")
        self._count(path.strip("/"))
        try:
            return fn(self, body, qs)
        except BadRequest as e:
            return self._bad(e.status, str(e), e.reason)
        except Exception as e:  # a bug must not take the service down: 500, logged
            log.exception("indexer %s failed", path)
            return self._bad(500, f"internal error answering {path}: {e}", "internal")

    def _bad(self, status: int, message: str, reason: str) -> tuple[int, bytes]:
        self._count("bad_" + reason)
        return _json(status, {"error": message, "reason": reason})

    def _count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    # ------------------------------------------------------------------ registry

    def _register(self, body: bytes, qs: str) -> tuple[int, bytes]:
        req = decode(body, RegisterBody)
        reg = req.registration()
        shape = pick_shape(req.dynamo_spelling(), qs)
        for field, ep in (("endpoint", reg.endpoint), ("replay_endpoint", reg.replay_endpoint)):
            if ep is not None:
                try:
                    check_endpoint(ep, field)
                except ValueError as e:
                    raise BadRequest(422, str(e), "bad_endpoint") from None
        with self._lock:
            old = self.regs.get(reg.key)
            if old != reg:
                # the file first: if it cannot be written, nothing has changed
                self._save({**self.regs, reg.key: reg})
                if old is not None:
                    self.feed.remove_stream(old.stream)
                self._follow(reg)
                self.regs[reg.key] = reg
                self._version += 1
        replaced = old is not None and old != reg
        if shape == "dynamo":
            return _json(201, {"status": "ok"})
        return _json(200, {"status": "registered successfully",
                           "instance_id": str(reg.instance_id), "replaced": replaced})

    def _follow(self, reg: Registration) -> None:
        # Mooncake Store's publisher numbers a run from 1 (RFC #1527), the engines from 0
        self.feed.add_stream(StreamSpec(reg.stream, reg.endpoint, reg.topic,
                                        reg.replay_endpoint,
                                        first_seq=1 if reg.type == "Mooncake" else 0))

    def _unregister(self, body: bytes, qs: str) -> tuple[int, bytes]:
        req = decode(body, UnregisterBody)
        shape = pick_shape(req.dynamo_spelling(), qs)
        tenant, inst = req.tenant(), str(req.instance_id)
        with self._lock:
            gone = [k for k in self.regs
                    if k[0] == tenant and k[1] == inst
                    and (req.dp_rank is None or k[2] == req.dp_rank)]
            if gone:
                self._save({k: r for k, r in self.regs.items() if k not in gone})
            for k in gone:
                self.feed.remove_stream(self.regs.pop(k).stream)
                self.size_mismatch.pop(Registration.stream_name(*k), None)
            self._version += 1
        if not gone:
            rank = "" if req.dp_rank is None else f" dp_rank {req.dp_rank}"
            raise BadRequest(404, f"instance {inst!r}{rank} of tenant {tenant!r} is not "
                             "registered", "unknown_instance")
        if shape == "dynamo":
            return _json(200, {"status": "ok"})
        return _json(200, {"status": "unregistered successfully",
                           "removed_instances": [f"{i}|{t}|{r}" for t, i, r in gone]})

    def _save(self, regs: dict[tuple[str, str, int], Registration]) -> None:
        if self.file is None:
            return
        try:
            self.file.save(list(regs.values()))
        except OSError as e:
            raise BadRequest(507, f"registrations file {self.file.path} could not be "
                             f"written ({e}): nothing changed", "file") from None

    def _registrations(self, body: bytes, qs: str) -> tuple[int, bytes]:
        """Every registration, with its stream's name and whether it is live now."""
        alive = self.feed.alive
        return _json(200, [{**msgspec.to_builtins(r), "stream": r.stream,
                            "alive": bool(alive.get(r.stream))}
                           for r in list(self.regs.values())])

    def _health(self, body: bytes, qs: str) -> tuple[int, bytes]:
        alive = self.feed.alive
        regs = list(self.regs.values())
        live = sum(1 for r in regs if alive.get(r.stream))
        failed, last = self.feed.stream_problems()
        return _json(200, {"ok": True, "registered": len(regs), "live": live,
                           "stream_errors": failed, "last_stream_error": last})

    # ------------------------------------------------------------------ queries

    def _query(self, body: bytes, qs: str) -> tuple[int, bytes]:
        fast = self._c_query(body, qs) if self.c_token_ids else None
        if fast is not None:
            packed, scope, shape = fast
            if self.c_answers:
                out = self._fast(packed, scope, shape)
                if out is not None:
                    return 200, out
            toks: Sequence[int] = array("q")
            toks.frombytes(packed)  # type: ignore[attr-defined]
        else:
            req = decode(body, QueryBody)
            if len(req.token_ids) > self.max_tokens:
                raise BadRequest(413, f"token_ids has {len(req.token_ids)} tokens, more than "
                                 f"the limit of {self.max_tokens}", "oversized_tokens")
            scope = req.scope()
            shape = pick_shape(req.dynamo_spelling(), qs)
            toks = req.token_ids

        def keys_for(bs: int, salt: str | None) -> Sequence[int]:
            return block_keys(toks, bs, scope.lora_name, salt, self.feed.index.key_scheme)

        return _json(200, shape_answer(shape, scope, self._answer(scope, keys_for, None)))

    def _c_query(self, body: bytes, qs: str) -> tuple[bytes, Scope, str] | None:
        """A /query body's token ids parsed straight into int64s by ``_tokens.c`` (a 2,048
        token body: ~6 us against ~40 us for msgspec's list of Python ints, and the keys
        are hashed without a Python int per token), its other fields by msgspec (once per
        distinct text). None for anything that path does not take as it is (ids not first,
        not plain ints below 2**32, given twice, over the limit, any other field wrong):
        the msgspec path then answers or names the error, so the answer is the same bytes
        either way."""
        got = parse_route_body(body)
        if got is None:
            return None
        packed, rest = got
        if not packed or len(packed) > 8 * self.max_tokens:
            return None
        ask = self._asks.get((rest, qs))
        if ask is None:
            try:
                req = _query_rest.decode(rest) if rest is not None else QueryBody()
                if req.token_ids:  # token_ids given twice: the strict path says what it keeps
                    return None
                ask = (req.scope(), pick_shape(req.dynamo_spelling(), qs))
            except (msgspec.DecodeError, BadRequest):
                return None
            if rest is None or len(rest) <= _MAX_REST:
                if len(self._asks) >= _MAX_PLANS:
                    self._asks.clear()
                self._asks[(rest, qs)] = ask
        return packed, ask[0], ask[1]

    def _fast(self, packed: bytes, scope: Scope, shape: str) -> bytes | None:
        """The /query answer's bytes in two C calls: the per-medium walk, hashing the
        prompt's blocks as it goes (``PrefixWalk.walk_tokens``), then the answer from its
        ints (``_answer.c``), both after a plan made once per registry version and index
        shape (:class:`_Fast`). None when this index or scope is not for it (no one in
        scope, more than 64 streams): then ``_answer``, which says the same."""
        plan = self._plan(scope)
        if not plan.regs:
            return None
        walk = getattr(self.feed.index, "walk", None)
        if walk is None:
            return None
        lock = self.feed.lock
        if not lock.acquire(timeout=self.feed.lock_timeout):
            raise BadRequest(503, "index busy (applying a large snapshot); retry", "busy")
        try:
            fast = plan.fast.get((walk.shape, shape, scope.lora_name))
            if fast is None:
                fast = plan.make_fast(self.feed.index, scope, shape)
            if not fast:
                return None
            for r, bs in fast.mismatched:
                self._mismatch(r, bs)
            ntok = len(packed) >> 3
            walk_tokens = walk.walk_tokens
            flats = tuple([walk_tokens(packed, bs, ntok // bs, seed, fold, slots) if slots
                           else None for bs, seed, fold, slots in fast.groups])
        finally:
            lock.release()
        return _c_answer(fast.dynamo, fast.tenant, fast.insts, fast.members, fast.media,
                         fast.nt, flats)

    def _query_by_hash(self, body: bytes, qs: str) -> tuple[int, bytes]:
        req = decode(body, QueryByHashBody)
        if getattr(self.feed.index, "key_scheme", "standard") != "standard":
            raise BadRequest(409, "this index keys blocks by the 'kvwire' scheme: sequence "
                             "hashes cannot be matched (run with the standard key scheme)",
                             "key_scheme")
        scope = req.scope()
        shape = pick_shape(req.dynamo_spelling(), qs)
        seq, local = req.hashes()
        if len(seq) + len(local) > self.max_tokens:
            raise BadRequest(413, "more hashes than the token limit", "oversized_tokens")

        # sequence hashes as given, or chained from the local ones (whose seed already holds
        # the LoRA / namespace): either way the same keys for every block size and salt
        keys = seq or seq_from_local(local)

        def keys_for(bs: int, salt: str | None) -> Sequence[int]:
            return keys

        return _json(200, shape_answer(shape, scope,
                                       self._answer(scope, keys_for, req.block_size)))

    def _answer(self, scope: Scope, keys_for: Any, hash_bs: int | None
                ) -> dict[str, dict[str, Any]]:
        """``{instance: {"longest_matched", "GPU", "CPU", "DISK", "DP": {rank: n}}}`` in
        tokens, for every registration in scope (unmatched ones with zeros)."""
        plan = self._plan(scope)
        if not plan.regs:
            self._count("empty_scope")
            return empty_answer(scope)
        index = self.feed.index
        out: dict[str, dict[str, Any]] = {}
        with self._index_lock():
            size_of = index.block_size_of
            groups = plan.groups_for(tuple([size_of(s) for s in plan.streams]), hash_bs)
            for r, bs in groups.mismatched:
                self._mismatch(r, bs)
            if groups.hash_mismatches:
                self._count("hash_block_size_mismatch", groups.hash_mismatches)
            for bs, salt, streams, members in groups.groups:
                held = {}
                if bs:
                    held = index.tier_prefixes(keys_for(bs, salt), streams, cumulative=True)
                for stream, inst, rank in members:
                    n, alone, cum = held.get(stream, _NOTHING)
                    add_rank(out.setdefault(inst, new_row()), rank, bs, n, alone, cum)
        return out

    def _plan(self, scope: Scope) -> _Plan:
        """The registrations ``scope`` covers, with what a query needs of them, made once
        per registry version (a query then only walks the index and fills in numbers)."""
        version = self._version  # read before the registrations: a change after it is seen
        if self._plans_version != version or len(self._plans) > _MAX_PLANS:
            self._plans = {}
            self._plans_version = version
        key = (scope.tenant, scope.model, scope.instance, scope.cache_salt)
        plan = self._plans.get(key)
        if plan is None:
            # (a copy: list() of a dict is one step under the GIL, so a /register on another
            # thread cannot change the dict under this loop)
            plan = _Plan([r for r in list(self.regs.values()) if scope.covers(r)],
                         scope.cache_salt)
            self._plans[key] = plan
        return plan

    @contextmanager
    def _index_lock(self) -> Iterator[None]:
        """The index, or 503 after the feed's ``lock_timeout`` (a large snapshot being
        applied): a caller is never kept waiting unbounded."""
        lock = self.feed.lock
        if not lock.acquire(timeout=self.feed.lock_timeout):
            raise BadRequest(503, "index busy (applying a large snapshot); retry", "busy")
        try:
            yield
        finally:
            lock.release()

    def _mismatch(self, r: Registration, bs: int) -> None:
        if self.size_mismatch.get(r.stream) != (r.block_size, bs):
            self.size_mismatch[r.stream] = (r.block_size, bs)  # type: ignore[assignment]
            self._count("block_size_mismatch")
            log.warning("instance %s registered with block_size %s publishes %s-token "
                        "blocks: answered in its events' block size", r.stream,
                        r.block_size, bs)

    # ------------------------------------------------------------------ dump

    def _dump(self, body: bytes, qs: str) -> tuple[int, bytes]:
        """Registrations and, per registered stream, the own keys (standard sequence
        hashes) it holds per medium: what a late replica needs to answer at once."""
        index = self.feed.index
        streams = {}
        with self._index_lock():
            regs = list(self.regs.values())
            for r in regs:
                streams[r.stream] = {
                    "tenant_id": r.tenant, "instance_id": r.instance_id,
                    "dp_rank": r.dp_rank, "model_name": r.model,
                    "block_size": index.block_size_of(r.stream) or r.block_size,
                    "blocks": index.held_keys(r.stream),
                }
        return _json(200, {"key_scheme": getattr(index, "key_scheme", "standard"),
                           "registrations": [msgspec.to_builtins(r)
                                             for r in regs],
                           "streams": streams})


_NOTHING: tuple[int, dict[str, int], dict[str, int]] = (0, {}, {})
#: query plans kept per registry version (one per scope asked; beyond this, started over)
_MAX_PLANS = 256


class _Groups:
    """A plan's registrations grouped for one set of their streams' block sizes: per
    ``(block size, salt)`` (0: nothing to walk) the streams to walk and ``(stream, instance,
    dp_rank)`` to fill in; the registrations publishing another block size than registered;
    how many are skipped for a /query_by_hash of another block size."""

    __slots__ = ("groups", "mismatched", "hash_mismatches")

    def __init__(self, regs: list[Registration], sizes: tuple[int | None, ...],
                 salt: str | None, hash_bs: int | None) -> None:
        groups: dict[tuple[int, str | None], tuple[list[str], list[tuple[str, str, int]]]] = {}
        self.mismatched: list[tuple[Registration, int]] = []
        self.hash_mismatches = 0
        for r, seen in zip(regs, sizes):
            bs = seen or r.block_size
            if bs and r.block_size and bs != r.block_size:
                self.mismatched.append((r, bs))
            if not bs or (hash_bs is not None and bs != hash_bs):
                if hash_bs is not None and bs:
                    self.hash_mismatches += 1
                key: tuple[int, str | None] = (0, None)
            else:
                # an instance registered with a salt holds its blocks unsalted: the query's
                # cache_salt chose the instance; one without is asked for salted blocks
                key = (bs, None if r.salt is not None else salt)
            streams, members = groups.setdefault(key, ([], []))
            streams.append(r.stream)
            members.append((r.stream, str(r.instance_id), r.dp_rank))
        self.groups = [(bs, s, streams, members)
                       for (bs, s), (streams, members) in groups.items()]


class _Plan:
    """The registrations one scope covers at one registry version, and their groupings per
    block sizes seen (these change with events, so they are looked up on every query)."""

    __slots__ = ("regs", "streams", "salt", "_groups", "fast")

    def __init__(self, regs: list[Registration], salt: str | None) -> None:
        self.regs = regs
        self.streams = [r.stream for r in regs]
        self.salt = salt
        self._groups: dict[tuple, _Groups] = {}
        #: (index shape, answer shape, LoRA) -> its _Fast (False: not for the C path)
        self.fast: dict[tuple[int, str, str | None], _Fast | bool] = {}

    def make_fast(self, index: Any, scope: Scope, shape: str) -> _Fast | bool:
        """This plan's :class:`_Fast` for the index as it is now (call under its lock)."""
        walk = index.walk
        if len(self.fast) > _MAX_PLANS:
            self.fast = {}
        fast: _Fast | bool = False
        if walk.can_walk_tokens():
            groups = self.groups_for(tuple([index.block_size_of(s) for s in self.streams]),
                                     None)
            fast = _Fast(walk, groups, scope, shape, index.key_scheme)
        self.fast[(walk.shape, shape, scope.lora_name)] = fast
        return fast

    def groups_for(self, sizes: tuple[int | None, ...], hash_bs: int | None) -> _Groups:
        key = (sizes, hash_bs)
        g = self._groups.get(key)
        if g is None:
            if len(self._groups) > _MAX_PLANS:
                self._groups = {}
            g = self._groups[key] = _Groups(self.regs, sizes, self.salt, hash_bs)
        return g


class _Fast:
    """What the C /query path needs of a plan at one index shape (its streams' slots and
    block sizes, its tiers): per group the walk's block size, chain start and slots; per
    registration its row (instance, rank, block size, group, place in the walk); the
    instances, tenant and ranks as JSON strings; where GPU, CPU and DISK are among the
    tiers."""

    __slots__ = ("groups", "members", "insts", "tenant", "dynamo", "media", "nt",
                 "mismatched")

    def __init__(self, walk: Any, groups: _Groups, scope: Scope, shape: str,
                 key_scheme: str) -> None:
        self.groups: list[tuple[int, int | None, int | None, list[int]]] = []
        members = []
        insts: dict[str, int] = {}
        for gi, (bs, salt, streams, mems) in enumerate(groups.groups):
            known = [s for s in streams if s in walk.streams] if bs else []
            if known:
                seed, fold = chain_start(key_scheme, scope.lora_name, salt)
                self.groups.append((bs, seed, fold, [walk.streams[s].slot for s in known]))
            else:
                self.groups.append((bs, None, None, []))
            place = {s: i for i, s in enumerate(known)}
            for stream, inst, rank in mems:
                members.append((insts.setdefault(inst, len(insts)), _enc.encode(str(rank)),
                                bs, gi, place.get(stream, -1)))
        self.members = tuple(members)
        self.insts = tuple(_enc.encode(i) for i in insts)
        self.tenant = _enc.encode(scope.tenant)
        self.dynamo = shape == "dynamo"
        self.media = tuple(walk.tier_idx.get(m, -1) for m in MEDIA)
        self.nt = len(walk.tiers)
        self.mismatched = groups.mismatched


_ROUTES: dict[str, tuple[str, Any]] = {
    "/register": ("POST", Indexer._register),
    "/unregister": ("POST", Indexer._unregister),
    "/query": ("POST", Indexer._query),
    "/query_by_hash": ("POST", Indexer._query_by_hash),
    "/dump": ("GET", Indexer._dump),
    "/registrations": ("GET", Indexer._registrations),
    "/indexer/health": ("GET", Indexer._health),
}
#: The paths ``handle`` answers (bytes, as ASGI servers give them).
INDEXER_PATHS = frozenset(p.encode() for p in _ROUTES)
