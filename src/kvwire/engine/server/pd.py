"""Disaggregated serving in ``kvwire engine``: the KV side channel between engines and both
P/D protocols over it (vLLM's ``kv_transfer_params``, SGLang's ``bootstrap_*``).

The side channel is HTTP/1.1 on the package's one stack (``--kv-port``). What moves is
what names a block in the model, its hash: the decode engine checks each against the hash
it computed for the same prompt (a mismatch fails the transfer), and the modelled transfer
time (:class:`~kvwire.engine.timing.TransferCost`) stands for moving the bytes. Routes:

* ``GET /kvwire/kv/info``: ``{"engine_id", "role", "block_size", "bytes_per_token",
  "host", "kv_port", "bootstrap_port"}``.
* ``POST /kvwire/kv/read`` ``{"request_id", "block_ids", "engine_id"}`` (vLLM: the decode
  engine pulls from ``remote_host:remote_port``): ``{"request_id", "hashes"}`` (``null``
  for a partial block), 404 when the lease is gone, 409 when ``engine_id`` (vLLM's
  ``remote_engine_id``) is another engine's (restarted on the same port), 400 for a block
  the lease does not hold.
* ``POST /kvwire/kv/release`` ``{"request_id"}`` or ``{"bootstrap_room"}``, with a
  ``"reason"`` (``pulled``, ``cached``, ``aborted``, ``failed``): ``{"released": bool}``.
* ``POST /kvwire/kv/heartbeat`` ``{"request_ids": [...], "bootstrap_rooms": [...]}``:
  each lease is held ``--kv-lease-s`` more; ``{"extended": n, "missing": [...]}``.
* ``POST /kvwire/kv/room`` ``{"bootstrap_room", "dst_host", "dst_port", "from_block",
  "num_blocks"}`` (SGLang: the decode engine tells the prefill engine where the room's KV
  goes, and which blocks it lacks; 0 blocks: nothing, free them): ``{"accepted": true}``,
  or 410 when the room's lease expired before.
* ``POST /kvwire/kv/push`` ``{"bootstrap_room", "from_block", "hashes"}`` or ``{...,
  "error"}`` (SGLang: the prefill engine pushes a room's blocks to the decode engine):
  200, or 404 for a room the decode engine no longer waits for.

SGLang's bootstrap server (``--bootstrap-port``, prefill engines) answers as SGLang's does:
``GET /health``, ``PUT /route`` (a rank registers), ``GET /route?prefill_dp_rank=&
prefill_cp_rank=&target_tp_rank=&target_pp_rank=`` (all -1: the prefill server's shape;
else the rank's ``{"rank_ip", "rank_port"}``, here the side channel),
``POST /register_dp_rank`` and ``POST /query_dp_ranks``.

The engine's loop is never blocked: every exchange is a task with a bounded wait, the
model is told the end of a pull at the model time it ends (the later of the real
exchange's end and the modelled transfer time) and steps up to it itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from ...http1 import HttpError
from ...http1.client import Pool, UpstreamError
from ...http1.server import Request, Routes, Server
from ..core import EngineCore, Handle
from ..metrics import TransferStats
from .openai import Bootstrap, KVTransferParams

if TYPE_CHECKING:
    from .runner import Runner

__all__ = ["PD", "Remote"]

log = logging.getLogger("kvwire.engine.pd")
_enc = msgspec.json.Encoder().encode
_dec = msgspec.json.Decoder()

#: wall seconds any one side-channel exchange may take
EXCHANGE_TIMEOUT = 5.0
#: rooms a prefill engine remembers before their request arrives (SGLang sends both at once)
MAX_ROOMS = 65536


def _json_error(e: HttpError) -> bytes:
    return _enc({"error": e.message})


@dataclass(eq=False)
class Remote:
    """A decode-side request whose prompt's KV is on a prefill engine."""

    handle: Handle
    proto: str  # "vllm" | "sglang"
    host: str | None = None  # the prefill engine's side channel (SGLang: once resolved)
    port: int | None = None
    remote_id: str | None = None  # vLLM's remote_request_id
    block_ids: list[int] | None = None
    engine_id: str | None = None  # vLLM's remote_engine_id
    boot: Bootstrap | None = None
    #: waiting (heartbeats go), pulling, done (the prefill side was told)
    state: str = "waiting"
    push: asyncio.Future | None = None
    task: asyncio.Task | None = field(default=None, repr=False)
    #: wall seconds the request waited for its KV once the prefill engine had it (vLLM:
    #: the pull; SGLang: from the push's arrival to the pull's end), 0.0 when nothing was
    #: pulled (all cached here, or a small pull recomputed); None until known
    kv_seconds: float | None = None


@dataclass(eq=False)
class Room:
    """A prefill-side SGLang room: its request (once it arrived) and where its KV goes
    (once the decode engine said)."""

    rid: str | None = None
    dst: tuple[str, int] | None = None
    frm: int = 0
    n: int = 0
    born: float = 0.0
    #: its lease expired before a decode engine asked: a late ask is told so at once
    expired: bool = False


class PD:
    """One engine's P/D side: the side channel, the bootstrap server, the leases it gave
    out (prefill) and the pulls it runs (decode). ``dp_size`` is 1 (one core, one runner).
    ``runners`` is the engine's list, filled when it starts (after this is made)."""

    def __init__(self, cores: list[EngineCore], runners: list[Runner], kv_port: int = 0,
                 bootstrap_port: int | None = None, host: str = "127.0.0.1") -> None:
        self.cores, self.runners = cores, runners
        self.cfg = cores[0].model.cfg
        self.role = self.cfg.role
        self.host = host
        self.kv_port = kv_port
        self.bootstrap_port = bootstrap_port
        self.engine_id = os.urandom(8).hex()
        self.stats = TransferStats()
        self.remotes: dict[str, Remote] = {}  # decode side, by local request id
        self.waiting_push: dict[int, Remote] = {}  # decode side, SGLang rooms
        self.rooms: dict[int, Room] = {}  # prefill side, SGLang
        self.room_of: dict[str, int] = {}  # prefill side: request id -> room
        self.ranks: dict[tuple[int, int, int, int], dict[str, Any]] = {}
        self.dp_rooms: dict[int, int] = {}
        self._pools: dict[tuple[str, int], Pool] = {}
        self._boots: dict[tuple[str, int], tuple[str, int]] = {}
        self._tasks: set[asyncio.Task] = set()
        self.kv_server: Server | None = None
        self.boot_server: Server | None = None
        r = self.routes = Routes(render=_json_error)
        r.add("GET", "/kvwire/kv/info", self._info)
        r.add("POST", "/kvwire/kv/read", self._read)
        r.add("POST", "/kvwire/kv/release", self._release)
        r.add("POST", "/kvwire/kv/heartbeat", self._heartbeat)
        r.add("POST", "/kvwire/kv/room", self._room)
        r.add("POST", "/kvwire/kv/push", self._push_in)
        b = self.boot_routes = Routes(render=_json_error)
        b.add("GET", "/health", lambda c: c.respond(200, b"OK", ctype=b"text/plain"))
        b.add("PUT", "/route", self._route_put)
        b.add("GET", "/route", self._route_get)
        b.add("POST", "/register_dp_rank", self._register_dp_rank)
        b.add("POST", "/query_dp_ranks", self._query_dp_ranks)

    # ------------------------------------------------------------------ lifecycle

    @property
    def core(self) -> EngineCore:
        return self.cores[0]

    @property
    def runner(self) -> Runner:
        return self.runners[0]

    async def start(self) -> None:
        self.kv_server = Server(self.routes)
        await self.kv_server.start(host=self.host, port=self.kv_port)
        self.kv_port = self.kv_server.port
        if self.bootstrap_port is not None:
            self.boot_server = Server(self.boot_routes)
            await self.boot_server.start(host=self.host, port=self.bootstrap_port)
            self.bootstrap_port = self.boot_server.port
            # this engine's one rank: its KV is at the side channel
            self.ranks[(0, 0, 0, 0)] = {"rank_ip": self.host, "rank_port": self.kv_port}
        self._spawn(self._heartbeats())

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for s in (self.kv_server, self.boot_server):
            if s is not None:
                s.close(connections=True)
        for p in self._pools.values():
            p.close()

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def _pool(self, host: str, port: int) -> Pool:
        p = self._pools.get((host, port))
        if p is None:
            p = self._pools[(host, port)] = Pool(host, port, connect_timeout=2.0, max_idle=64)
        return p

    async def _post(self, host: str, port: int, path: bytes, body: dict[str, Any],
                    method: bytes = b"POST") -> tuple[int, Any]:
        status, raw = await self._pool(host, port).fetch(
            method, path, EXCHANGE_TIMEOUT, [(b"content-type", b"application/json")],
            _enc(body))
        try:
            return status, _dec.decode(raw) if raw else None
        except msgspec.DecodeError:
            return status, None

    def _wall(self, model_s: float) -> float:
        return model_s / self.runner.speed

    # ------------------------------------------------------------------ prefill side

    def expiry_unix(self, rid: str) -> float | None:
        lease = self.core.model.leases.get(rid)
        if lease is None:
            return None
        return time.time() + self._wall(lease.expires - self.runner.now())

    def kv_params(self, rid: str) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` a vLLM prefill answer carries for ``rid``'s lease."""
        lease = self.core.model.leases.get(rid)
        if lease is None:
            return None
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": list(lease.blocks), "remote_engine_id": self.engine_id,
                "remote_request_id": rid, "remote_host": self.host,
                "remote_port": self.kv_port, "tp_size": 1, "remote_num_tokens": lease.tokens,
                "remote_blocks_expiry_time": self.expiry_unix(rid), "transfer_mode": "READ",
                "dcp_size": 1, "pp_size": 1}

    def open_room(self, room: int, rid: str) -> None:
        """A SGLang prefill request for ``room`` arrived as ``rid``."""
        r = self.rooms.get(room)
        if r is None:
            self._trim_rooms()
            r = self.rooms[room] = Room(born=time.monotonic())
        r.rid = rid
        self.room_of[rid] = room

    def _trim_rooms(self) -> None:
        if len(self.rooms) < MAX_ROOMS:
            return
        old = time.monotonic() - self._wall(self.cfg.lease_s)
        for k in [k for k, r in self.rooms.items() if r.rid is None and r.born < old]:
            del self.rooms[k]
            self.stats.rooms_dropped += 1
        while len(self.rooms) >= MAX_ROOMS:  # still full: the oldest go
            k = next(iter(self.rooms))
            r = self.rooms.pop(k)
            self.stats.rooms_dropped += 1
            if r.rid is not None:
                self.room_of.pop(r.rid, None)

    def _drop_room(self, rid: str) -> None:
        room = self.room_of.pop(rid, None)
        if room is not None:
            self.rooms.pop(room, None)

    def _lease_ready(self, rid: str) -> None:
        """A SGLang prefill finished: push if the decode engine has said where."""
        room = self.room_of.get(rid)
        if room is None:
            return
        r = self.rooms.get(room)
        if r is not None and r.dst is not None:
            self._spawn(self._push_out(room, r))

    async def _push_out(self, room: int, r: Room) -> None:
        rid = r.rid
        assert rid is not None and r.dst is not None
        self._drop_room(rid)
        lease = self.core.read(rid, self.runner.now())
        if r.n == 0:
            body: dict[str, Any] = {}
        elif lease is None:
            body = {"bootstrap_room": room, "error": "lease expired"}
        else:
            body = {"bootstrap_room": room, "from_block": r.frm,
                    "hashes": self._hashes(lease, r.frm, r.n)}
        try:
            if body:
                await self._post(r.dst[0], r.dst[1], b"/kvwire/kv/push", body)
                if lease is not None:
                    self.stats.served_blocks += r.n
        except (UpstreamError, asyncio.TimeoutError) as e:
            log.info("push of room %d to %s:%d failed: %s", room, *r.dst, e)
        finally:
            self._free(rid)

    @staticmethod
    def _hashes(lease, frm: int, n: int) -> list[int | None]:
        h = lease.hashes
        return [h[j] if j < len(h) else None for j in range(frm, frm + n)]

    def _free(self, rid: str) -> bool:
        ok = self.core.release(rid)
        if ok:
            self.runner.wake()
        return ok

    def on_expired(self, rids: list[str]) -> None:
        for rid in rids:
            room = self.room_of.pop(rid, None)
            r = self.rooms.get(room) if room is not None else None
            if r is not None:  # kept as a tombstone (trimmed like an unclaimed room)
                r.rid, r.expired, r.born = None, True, time.monotonic()

    # side-channel routes (prefill side)

    def _info(self, conn: Request) -> None:
        t = self.cfg.transfer
        conn.respond(200, _enc({"engine_id": self.engine_id, "role": self.role,
                                "block_size": self.cfg.block_size,
                                "bytes_per_token": t.bytes_per_token, "host": self.host,
                                "kv_port": self.kv_port,
                                "bootstrap_port": self.bootstrap_port}))

    @staticmethod
    def _body(conn: Request) -> dict[str, Any]:
        try:
            d = _dec.decode(conn.body)
        except msgspec.DecodeError as e:
            raise HttpError(400, f"body: not JSON ({e})") from None
        if not isinstance(d, dict):
            raise HttpError(400, "body: expected an object")
        return d

    @staticmethod
    def _field(d: dict[str, Any], name: str, kind: type) -> Any:
        v = d.get(name)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise HttpError(400, f"{name}: expected {kind.__name__}, got {v!r}")
        return v

    def _read(self, conn: Request) -> None:
        d = self._body(conn)
        rid = self._field(d, "request_id", str)
        ids = self._field(d, "block_ids", list)
        eid = d.get("engine_id")
        if eid is not None and eid != self.engine_id:  # another engine's block ids
            raise HttpError(409, f"engine_id {eid!r} is not this engine's "
                            f"({self.engine_id!r}): it was restarted")
        lease = self.core.read(rid, self.runner.now())
        if lease is None:
            raise HttpError(404, f"no lease for request {rid!r} (released or expired)")
        pos = {b: i for i, b in enumerate(lease.blocks)}
        out: list[int | None] = []
        for b in ids:
            i = pos.get(b)
            if i is None:
                raise HttpError(400, f"block_ids: block {b!r} is not held for {rid!r}")
            out.append(lease.hashes[i] if i < len(lease.hashes) else None)
        self.stats.served_blocks += len(out)
        conn.respond(200, _enc({"request_id": rid, "hashes": out}))

    def _rid_of(self, d: dict[str, Any]) -> str | None:
        if "request_id" in d:
            return self._field(d, "request_id", str)
        room = self._field(d, "bootstrap_room", int)
        r = self.rooms.get(room)
        return None if r is None else r.rid

    def _release(self, conn: Request) -> None:
        rid = self._rid_of(self._body(conn))
        ok = rid is not None and self._free(rid)
        if rid is not None:
            self._drop_room(rid)
        conn.respond(200, _enc({"released": ok}))

    def _heartbeat(self, conn: Request) -> None:
        d = self._body(conn)
        rids = list(d.get("request_ids") or [])
        for room in d.get("bootstrap_rooms") or []:
            r = self.rooms.get(room) if isinstance(room, int) else None
            if r is not None and r.rid is not None:
                rids.append(r.rid)
            elif r is not None:  # the prefill request has not arrived yet: keep its room
                r.born = time.monotonic()
        until = self.runner.now() + self.cfg.lease_s
        missing = [rid for rid in rids if not (isinstance(rid, str)
                                               and self.core.extend(rid, until))]
        self.stats.heartbeats += 1
        conn.respond(200, _enc({"extended": len(rids) - len(missing), "missing": missing}))

    def _room(self, conn: Request) -> None:
        d = self._body(conn)
        room = self._field(d, "bootstrap_room", int)
        host = self._field(d, "dst_host", str)
        port = self._field(d, "dst_port", int)
        frm = self._field(d, "from_block", int)
        n = self._field(d, "num_blocks", int)
        r = self.rooms.get(room)
        if r is not None and r.expired:
            del self.rooms[room]
            raise HttpError(410, f"room {room}: its lease expired before it was asked for")
        if r is None:
            self._trim_rooms()
            r = self.rooms[room] = Room(born=time.monotonic())
        r.dst, r.frm, r.n = (host, port), frm, n
        conn.respond(200, _enc({"accepted": True}))
        if r.rid is not None and r.rid in self.core.model.leases:
            self._spawn(self._push_out(room, r))

    # bootstrap server routes (SGLang's)

    def _route_put(self, conn: Request) -> None:
        d = self._body(conn)
        try:
            key = (int(d.get("attn_dp_rank", d.get("system_dp_rank", 0))),
                   int(d.get("attn_cp_rank", 0)), int(d.get("attn_tp_rank",
                                                             d.get("engine_rank", 0))),
                   int(d.get("pp_rank", 0)))
            self.ranks[key] = {"rank_ip": str(d["rank_ip"]), "rank_port": int(d["rank_port"])}
        except (KeyError, TypeError, ValueError) as e:
            raise HttpError(400, f"bad rank registration: {e}") from None
        conn.respond(200, b"OK", ctype=b"text/plain")

    def _route_get(self, conn: Request) -> None:
        q = conn.args()
        names = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        if not all(q.get(k) for k in names):
            conn.respond(400, b"Missing inputs for bootstrap server.", ctype=b"text/plain")
            return
        try:
            key = tuple(int(q[k]) for k in names)
        except ValueError:
            raise HttpError(400, "bootstrap ranks must be integers") from None
        if key == (-1, -1, -1, -1):
            conn.respond(200, _enc({"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1,
                                    "pp_size": 1, "page_size": self.cfg.block_size,
                                    "kv_cache_dtype": "auto",
                                    "follow_bootstrap_room": True}))
            return
        info = self.ranks.get(key)  # type: ignore[arg-type]
        if info is None:
            conn.respond(404, f"Bootstrap info not found for {key}".encode(),
                         ctype=b"text/plain")
            return
        conn.respond(200, _enc(info))

    def _register_dp_rank(self, conn: Request) -> None:
        d = self._body(conn)
        if len(self.dp_rooms) >= MAX_ROOMS:
            self.stats.rooms_dropped += len(self.dp_rooms)
            self.dp_rooms.clear()
        self.dp_rooms[int(self._field(d, "bootstrap_room", int))] = int(
            self._field(d, "dp_rank", int))
        conn.respond(200, b"OK", ctype=b"text/plain")

    def _query_dp_ranks(self, conn: Request) -> None:
        d = self._body(conn)
        rooms = d.get("bootstrap_rooms") or []
        conn.respond(200, _enc({str(r): self.dp_rooms[r] for r in rooms
                                if isinstance(r, int) and r in self.dp_rooms}))

    # ------------------------------------------------------------------ decode side

    def track(self, h: Handle, kv: KVTransferParams | None, boot: Bootstrap | None) -> None:
        """A remote-prefill request arrived: remember where its KV is."""
        if kv is not None:
            r = Remote(h, "vllm", kv.remote_host, kv.remote_port, kv.remote_request_id,
                       list(kv.remote_block_ids or ()), kv.remote_engine_id)
        else:
            assert boot is not None
            r = Remote(h, "sglang", boot=boot)
            self._spawn(self._resolve(r))
        self.remotes[h.req.rid] = r

    async def _resolve(self, r: Remote) -> bool:
        """SGLang: where the prefill engine's side channel is, from its bootstrap server
        (asked once per server)."""
        if r.host is not None:
            return True
        b = r.boot
        assert b is not None
        key = (b.host, b.port)
        got = self._boots.get(key)
        if got is None:
            try:
                status, info = await self._post(
                    b.host, b.port, b"/route?prefill_dp_rank=0&prefill_cp_rank=0"
                    b"&target_tp_rank=0&target_pp_rank=0", {}, method=b"GET")
            except (UpstreamError, asyncio.TimeoutError) as e:
                log.info("bootstrap server %s:%d: %s", b.host, b.port, e)
                return False
            try:
                got = (str(info["rank_ip"]), int(info["rank_port"]))  # type: ignore[index]
            except (KeyError, TypeError, ValueError):
                log.info("bootstrap server %s:%d answered %d %r", b.host, b.port, status, info)
                return False
            if status != 200:
                return False
            self._boots[key] = got
        r.host, r.port = got
        return True

    def after_step(self, step) -> None:
        """A step was handed out: start its pulls, tell prefill engines what is no longer
        needed, answer failed requests, forget expired leases."""
        if step.expired:
            self.on_expired(step.expired)
        for h in step.pulls:
            r = self.remotes.get(h.req.rid)
            if r is not None:
                r.state = "pulling"
                r.task = self._spawn(self._pull(r))
            elif not h.aborted:  # (cannot happen: every remote-prefill request is tracked)
                self.stats.fail("untracked")  # never hang
                self.core.transfer_done(h.req.rid, False, self.runner.now())
                self.runner.wake()
            # (aborted since its step was computed: the core counted the pull as aborted,
            # the abort told the prefill engine)
        for h in step.local_prefills:  # everything cached here (or a small pull): freed there
            r = self.remotes.get(h.req.rid)
            if r is not None:
                r.kv_seconds = 0.0
            self._let_go(h.req.rid, "cached")
        for h in step.failed:
            self.ended(h)
            h.sink(h, 0, True)
        for h in step.finished:
            if h.req.remote_decode:
                self._lease_ready(h.req.rid)
            else:
                self.ended(h)

    def after_idle(self, expired: list[str], failed: list[Handle]) -> None:
        if expired:
            self.on_expired(expired)
        for h in failed:
            self.ended(h)
            h.sink(h, 0, True)

    def kv_seconds(self, rid: str) -> float | None:
        """How long decode-side request ``rid`` waited for its KV once the prefill engine
        had it (wall seconds; 0.0: nothing pulled), or None (not a remote-prefill request,
        or its pull has not ended)."""
        r = self.remotes.get(rid)
        return None if r is None else r.kv_seconds

    def ended(self, h: Handle, reason: str = "finished") -> None:
        """A decode-side request is over (finished, failed or aborted); or a prefill-side
        one aborted before its prefill ended (its room is forgotten)."""
        if h.req.remote_decode:
            if h.req.rid not in self.core.model.leases:
                self._drop_room(h.req.rid)
            return
        r = self.remotes.pop(h.req.rid, None)
        if r is None:
            return
        if r.state != "done":
            if r.task is not None and not r.task.done():
                r.task.cancel()
            self._tell(r, "aborted" if h.aborted else reason)
        if r.boot is not None:
            self.waiting_push.pop(r.boot.room, None)

    def _let_go(self, rid: str, reason: str) -> None:
        r = self.remotes.get(rid)
        if r is not None and r.state != "done":
            self._tell(r, reason)

    def _tell(self, r: Remote, reason: str) -> None:
        """Tell the prefill engine that ``r``'s blocks are not needed any more."""
        r.state = "done"
        self._spawn(self._tell_async(r, reason))

    async def _tell_async(self, r: Remote, reason: str) -> None:
        try:
            if r.proto == "vllm":
                await self._post(r.host, r.port, b"/kvwire/kv/release",  # type: ignore[arg-type]
                                 {"request_id": r.remote_id, "reason": reason})
            elif await self._resolve(r):
                assert r.boot is not None
                await self._post(r.host, r.port, b"/kvwire/kv/room",  # type: ignore[arg-type]
                                 {"bootstrap_room": r.boot.room, "dst_host": self.host,
                                  "dst_port": self.kv_port, "from_block": 0, "num_blocks": 0})
        except (UpstreamError, asyncio.TimeoutError) as e:
            self.stats.failed_notifications += 1
            log.info("could not tell %s:%s to free (%s): %s", r.host, r.port, reason, e)

    async def _pull(self, r: Remote) -> None:
        h = r.handle
        req = h.req
        rid = req.rid
        start = self.runner.now()
        frm, n = req.pull_from, req.pull_blocks
        bs = self.cfg.block_size
        why = None
        hashes: Any = None
        ready = start  # when the KV could start moving (SGLang: once it was pushed)
        try:
            if r.proto == "vllm":
                ids = (r.block_ids or [])[frm:frm + n]
                if len(ids) < n:
                    why = "blocks"
                else:
                    status, body = await self._post(
                        r.host, r.port, b"/kvwire/kv/read",  # type: ignore[arg-type]
                        {"request_id": r.remote_id, "block_ids": ids,
                         "engine_id": r.engine_id})
                    if status == 200 and isinstance(body, dict):
                        hashes = body.get("hashes")
                    else:
                        why = {404: "lease", 409: "engine"}.get(status, "refused")
            else:
                why = await self._room_pull(r, frm, n)
                if why is None:
                    hashes = r.push.result() if r.push is not None else None
                    ready = self.runner.now()
        except (UpstreamError, asyncio.TimeoutError, OSError):
            why = "unreachable"
        except Exception:  # a bug of ours must not leave the request transferring forever
            log.exception("KV pull for %s failed", rid)
            why = "error"
        if why is None:
            if not isinstance(hashes, list) or len(hashes) != n:
                why = "bad answer"
            else:
                mine = req.hashes
                for i, hv in enumerate(hashes):
                    j = frm + i
                    if hv is not None and j < len(mine) and hv != mine[j]:
                        why = "hash mismatch"
                        break
        ok = why is None
        end = max(self.runner.now(), start + self.cfg.transfer.time(n, bs))
        if rid not in self.core.model.transferring:
            return  # aborted meanwhile (the abort told the prefill engine)
        r.kv_seconds = self._wall(max(0.0, end - ready))
        self.core.transfer_done(rid, ok, end)
        self.runner.wake()
        st = self.stats
        if ok:
            st.bytes.observe(self.cfg.transfer.bytes(n, bs))
        else:
            st.fail(why)  # type: ignore[arg-type]
            if self.cfg.load_failure == "recompute":
                st.recomputed += 1
            log.info("KV pull for %s from %s:%s failed: %s", rid, r.host, r.port, why)
        if r.proto == "vllm":
            self._tell(r, "pulled" if ok else "failed")
        else:
            r.state = "done"  # the prefill engine frees the room after its push

    async def _room_pull(self, r: Remote, frm: int, n: int) -> str | None:
        """SGLang: tell the prefill engine where the room's blocks go, wait for its push
        (bounded by the lease); None when pushed, else why not."""
        if not await self._resolve(r):
            return "bootstrap"
        assert r.boot is not None
        room = r.boot.room
        r.push = asyncio.get_running_loop().create_future()
        self.waiting_push[room] = r
        try:
            status, _ = await self._post(r.host, r.port, b"/kvwire/kv/room",  # type: ignore
                                         {"bootstrap_room": room, "dst_host": self.host,
                                          "dst_port": self.kv_port, "from_block": frm,
                                          "num_blocks": n})
            if status != 200:
                return "lease" if status == 410 else "refused"
            try:
                await asyncio.wait_for(asyncio.shield(r.push),
                                       self._wall(self.cfg.lease_s) + EXCHANGE_TIMEOUT)
            except asyncio.TimeoutError:
                return "timeout"
            return None if not isinstance(r.push.result(), str) else r.push.result()
        finally:
            self.waiting_push.pop(room, None)

    def _push_in(self, conn: Request) -> None:
        d = self._body(conn)
        room = self._field(d, "bootstrap_room", int)
        r = self.waiting_push.get(room)
        if r is None or r.push is None or r.push.done():
            raise HttpError(404, f"no request waits for room {room}")
        if "error" in d:  # (a bounded set of reasons: they label a metric)
            r.push.set_result("lease" if "lease" in str(d["error"]) else "refused")
        else:
            hashes = d.get("hashes")
            r.push.set_result(hashes if isinstance(hashes, list) else "bad answer")
        conn.respond(200, b"{}")

    async def _heartbeats(self) -> None:
        """Every third of a lease (wall time), each prefill engine hears which of its
        leases this engine still waits for."""
        every = max(0.05, self._wall(self.cfg.lease_s) / 3)
        while True:
            await asyncio.sleep(every)
            by: dict[tuple[str, int], tuple[list[str], list[int]]] = {}
            for r in self.remotes.values():
                if r.state == "done" or r.host is None or r.port is None:
                    continue
                ids, rooms = by.setdefault((r.host, r.port), ([], []))
                if r.proto == "vllm":
                    ids.append(r.remote_id)  # type: ignore[arg-type]
                elif r.boot is not None:
                    rooms.append(r.boot.room)
            for (host, port), (ids, rooms) in by.items():
                self._spawn(self._beat(host, port, ids, rooms))

    async def _beat(self, host: str, port: int, ids: list[str], rooms: list[int]) -> None:
        try:
            await self._post(host, port, b"/kvwire/kv/heartbeat",
                             {"request_ids": ids, "bootstrap_rooms": rooms})
        except (UpstreamError, asyncio.TimeoutError) as e:
            log.debug("heartbeat to %s:%d: %s", host, port, e)
            if isinstance(e, UpstreamError):
                # the prefill engine is gone (refused or broke the exchange; a slow one
                # times out instead): a push it owes will never come
                for r in list(self.waiting_push.values()):
                    if (r.host, r.port) == (host, port) and r.push is not None \
                            and not r.push.done():
                        r.push.set_result("unreachable")
