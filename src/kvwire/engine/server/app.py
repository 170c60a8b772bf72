"""``kvwire engine``'s application: vLLM's HTTP API in front of the engine model.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed or not),
``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``, ``GET /health``,
``GET /metrics``, and kvwire's ``GET /kvwire/cache`` (every rank's cached block hashes, to
check that the published events rebuild them); for SGLang's router ``GET /server_info``
(and ``/get_server_info``), ``/model_info`` and ``/get_load``. With a role (or a KV side
channel) the engine takes either side of a prefill/decode pair in vLLM's or SGLang's
protocol (:mod:`.pd`). One :class:`EngineCore` and
:class:`Runner` per DP rank, each publishing its KV events at ``port + rank``; a request
goes to the rank with the least load (waiting x 4 + running, vLLM's DP balancing).

A request's life: decode and check (ApiError -> vLLM's status and error object), tokenize,
pick its output (:mod:`kvwire.engine.textgen`), submit at the model's current time; the runner's step
ends call the request's sink, which writes SSE chunks or, at the end, the whole response.
A client that disconnects aborts its requests, which frees their blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from ...http1 import HttpError, reason
from ...http1.server import Request, Routes, Server
from ..core import EngineCore, Handle
from ..metrics import render, render_transfer
from ..model import EngineConfig
from ..request import EngineRequest
from ..textgen import Output, TextGen
from .openai import (
    DONE,
    ApiError,
    Bootstrap,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    KVTransferParams,
    Shape,
    TokenizeRequest,
    bootstrap_params,
    decode_request,
    error_body,
    prompt_inputs,
    transfer_params,
    usage,
)
from .runner import Runner

__all__ = ["EngineApp", "EngineOptions"]

log = logging.getLogger("kvwire.engine")
_enc = msgspec.json.Encoder().encode
#: A decode-side request with this header (kvwire's router sends it) gets its stream's
#: head with its first token, once its KV transfer is over, carrying
#: ``x-kvwire-kv-transfer-seconds``; without it the head goes at once, as vLLM's does.
HOLD_HEAD = b"x-kvwire-hold-head"


@dataclass
class EngineOptions:
    """Everything ``kvwire engine`` is told (see its ``--help``)."""

    model: str = "kvwire-engine"
    loras: list[str] = field(default_factory=list)
    config: EngineConfig = field(default_factory=EngineConfig)
    max_model_len: int = 32768
    dp_size: int = 1
    speed: float = 1.0
    events: str | None = "tcp://*:5557"
    replay: str | None = None
    topic: str = ""
    dialect: str = "vllm"
    #: "kvwire" (heartbeats, snapshots) or "reference" (as vLLM's own publisher: neither)
    publisher: str = "kvwire"
    #: the KV side channel's port (0: any free one; None: none, unless the role needs one)
    kv_port: int | None = None
    #: SGLang's bootstrap server's port (None: 8998 on a prefill engine, else none)
    bootstrap_port: int | None = None

    @property
    def disaggregated(self) -> bool:
        """Whether this engine takes part in P/D pairs (a side channel is opened)."""
        return (self.config.role != "both" or self.kv_port is not None
                or self.bootstrap_port is not None)

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.disaggregated and self.dp_size != 1:
            raise ValueError(f"--role {self.config.role} (or a KV side channel) needs "
                             f"--dp-size 1, got {self.dp_size}")
        if self.config.role == "decode" and self.bootstrap_port is not None:
            raise ValueError("--bootstrap-port is for prefill (or both) engines, not decode")
        if self.publisher not in ("kvwire", "reference"):
            raise ValueError(f"publisher must be 'kvwire' or 'reference', got {self.publisher!r}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        names = [self.model, *self.loras]
        if len(set(names)) != len(names):
            raise ValueError(f"model and LoRA names must differ: {names}")


class _Job:
    """One HTTP generation request: its connection, shape and choices (one per prompt)."""

    __slots__ = ("app", "conn", "shape", "stream", "usage", "timing", "handles", "outputs",
                 "left", "started", "rank", "finished", "kv", "failed", "remote", "head",
                 "kv_s")

    def __init__(self, app: EngineApp, conn: Request, shape: Shape, stream: bool,
                 include_usage: bool, timing: bool) -> None:
        self.app = app
        self.conn = conn
        self.shape = shape
        self.stream = stream
        self.usage = include_usage
        self.timing = timing
        self.handles: list[Handle] = []
        self.outputs: list[Output] = []
        self.left = 0
        self.started: list[bool] = []
        self.rank = 0
        self.finished = False
        #: vLLM's prefill side: answer with the lease's ``kv_transfer_params``
        self.kv = False
        #: why a choice failed (its KV pull, under --kv-load-failure fail), or None
        self.failed: str | None = None
        #: the decode side of a P/D pair asked (:data:`HOLD_HEAD`) to send its stream's head
        #: with the first token, saying how long the KV transfer took
        #: (``x-kvwire-kv-transfer-seconds``)
        self.remote = False
        self.head = False  # a stream's head was sent
        self.kv_s: float | None = None  # the longest KV wait of its choices (wall seconds)

    def start(self) -> None:
        """Send a stream's head: at once, or (the decode side of a pair) with the first
        token, once every KV transfer that token needed is done."""
        if not self.head:
            self.head = True
            self.conn.start(200, ((b"content-type", b"text/event-stream; charset=utf-8"),
                                  (b"cache-control", b"no-cache"), *self._kv_header()))

    def _kv_header(self) -> list[tuple[bytes, bytes]]:
        if self.kv_s is None:
            return []
        return [(b"x-kvwire-kv-transfer-seconds", b"%.6f" % self.kv_s)]

    def _kv_seen(self, h: Handle) -> None:
        """A choice's first token: its KV transfer (if any) is over."""
        pd = self.app.pd
        s = pd.kv_seconds(h.req.rid) if pd is not None else None
        if s is not None and (self.kv_s is None or s > self.kv_s):
            self.kv_s = s

    def sink(self, h: Handle, new: int, finished: bool) -> None:
        i = h.index
        if finished and h.req.failed:
            self._fail(h)
            return
        if self.stream:
            out = self.outputs[i]
            k = h.delivered
            text = out.text(k - new, k)
            conn, shape = self.conn, self.shape
            first = not self.started[i]
            if first:
                self.started[i] = True
                self._kv_seen(h)
                self.start()
                if self.shape.chat:
                    conn.send(shape.chunk(i, "", first=True))
            if finished:
                conn.send(shape.final_chunk(i, text, h.finish_reason,
                                            self._timing(h) if self.timing else None,
                                            self._kv(h)))
            elif text:
                conn.send(shape.chunk(i, text))
        elif not self.started[i]:
            self.started[i] = True
            self._kv_seen(h)
        if finished:
            self.left -= 1
            if self.left == 0:
                self._done()

    def _kv(self, h: Handle) -> dict[str, Any] | None:
        if not self.kv:
            return None
        pd = self.app.pd
        return {"kv_transfer_params": pd.kv_params(h.req.rid) if pd is not None else None}

    def _fail(self, h: Handle) -> None:
        """A choice whose KV could not be loaded (``--kv-load-failure fail``): the request
        ends with vLLM's error answer (an SSE error event when streaming)."""
        if self.finished or h.index < 0:
            return
        h.index = -1  # (told once)
        self.failed = (f"KV transfer for {h.req.rid} failed and --kv-load-failure is "
                       "'fail'")
        self.finished = True
        self.abort_rest()
        body = error_body(500, self.failed, "InternalServerError")
        if self.stream:
            self.start()  # (as vLLM: a 200 stream that ends with the error event)
            self.conn.send(b"data: " + body + b"\n\n")
            self.conn.end(DONE)
        else:
            self.conn.respond(500, body)

    def _timing(self, h: Handle) -> dict[str, Any]:
        r = h.req
        return {"rank": self.rank, "arrival": h.arrival, "first_token": r.first_token_t, "finish": r.finish_t,
                "ttft": h.ttft, "cached_tokens": r.cached_tokens, "preemptions": r.preemptions}

    def _usage(self) -> dict[str, Any]:
        p = sum(len(h.req.prompt) for h in self.handles)
        c = sum(h.req.num_output for h in self.handles)
        cached = sum(max(h.req.cached_tokens, 0) for h in self.handles)
        return usage(p, c, cached)

    def _done(self) -> None:
        self.finished = True
        if self.stream:
            self.start()
            if self.usage:
                self.conn.send(self.shape.usage_chunk(self._usage()))
            self.conn.end(DONE)
        else:
            choices = [(o.text(0, h.req.num_output), h.finish_reason)
                       for o, h in zip(self.outputs, self.handles)]
            extra = [self._timing(h) for h in self.handles] if self.timing else None
            self.conn.respond(200, self.shape.full(choices, self._usage(), extra,
                                                   self._kv(self.handles[0])),
                              self._kv_header())

    def abort(self) -> None:
        """The client went away: drop every unfinished choice (frees its blocks)."""
        if self.finished:
            return
        self.abort_rest()

    def abort_rest(self) -> None:
        core = self.app.cores[self.rank]
        pd = self.app.pd
        for h in self.handles:
            if core.abort(h):
                self.app.aborted += 1
                if pd is not None:
                    pd.ended(h)


class EngineApp:
    """The engines (one per DP rank), their runners and publishers, and the HTTP routes."""

    def __init__(self, opts: EngineOptions, tokenizer) -> None:
        self.opts = opts
        self.tok = tokenizer
        tokenizer.warm()  # (before it serves: the first chat request would wait for it)
        self.textgen = TextGen(tokenizer)
        cache_tokens = opts.config.num_gpu_blocks * opts.config.block_size
        self.max_model_len = min(opts.max_model_len, cache_tokens)
        self.vocab = int(getattr(tokenizer, "vocab_size", 1 << 31))
        cfg = replace(opts.config, lora_names=tuple(opts.loras))
        self.cores = [EngineCore(cfg, self.max_model_len, rank) for rank in range(opts.dp_size)]
        self.runners: list[Runner] = []
        self.publishers: list[Any] = []
        self.lora_ids = {name: i + 1 for i, name in enumerate(opts.loras)}
        self.created = int(time.time())
        self.errors: Counter[int] = Counter()
        self.aborted = 0
        self._ids = itertools.count()
        self._turn = itertools.count()
        self._prefix = os.urandom(4).hex()
        self.server: Server | None = None
        self.port = 0
        self.pd = None
        if opts.disaggregated:
            from .pd import PD

            boot = opts.bootstrap_port
            if boot is None and opts.config.role == "prefill":
                boot = 8998  # SGLang's default
            self.pd = PD(self.cores, self.runners, opts.kv_port or 0, boot)
        self.routes = r = Routes(render=_render, headers=(b"x-data-parallel-rank", HOLD_HEAD),
                                 fallback=self._not_found, fail_started="end")
        r.add("POST", "/v1/completions", lambda c: self._generate(c, False))
        r.add("POST", "/v1/chat/completions", lambda c: self._generate(c, True))
        r.add("GET", "/v1/models", self._models)
        r.add("POST", "/tokenize", self._tokenize)
        r.add("POST", "/detokenize", self._detokenize)
        r.add("GET", "/health", lambda c: c.respond(200, b"", ctype=b"text/plain"))
        r.add("GET", "/metrics", self._metrics)
        r.add("GET", "/kvwire/cache", self._cache)
        for path in ("/server_info", "/get_server_info"):  # SGLang's router reads these
            r.add("GET", path, self._server_info)
        r.add("GET", "/model_info", self._model_info)
        r.add("GET", "/get_load", self._get_load)
        r.on_error = self._refused

    # ------------------------------------------------------------------ lifecycle

    def _publisher(self, rank: int):
        from ...publish.publisher import ZmqEventPublisher

        ref = self.opts.publisher == "reference"
        return ZmqEventPublisher(
            data_parallel_rank=rank, endpoint=self.opts.events,
            replay_endpoint=self.opts.replay, topic=self.opts.topic, dialect=self.opts.dialect,
            heartbeat_interval=None if ref else 1.0, snapshot=not ref)

    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
        """Bind the publishers and the HTTP port, start the clocks; the HTTP port."""
        try:
            if self.opts.events:
                for rank in range(self.opts.dp_size):
                    self.publishers.append(self._publisher(rank))
            t0 = time.monotonic()
            for rank, core in enumerate(self.cores):
                pub = self.publishers[rank] if self.publishers else None
                self.runners.append(Runner(core, self.opts.speed, pub, t0=t0, pd=self.pd))
            self.server = Server(self.routes)
            await self.server.start(host=host, port=port)
            if self.pd is not None:
                self.pd.host = host
                await self.pd.start()
        except BaseException:
            if self.server is not None:
                self.server.close(connections=True)
            if self.pd is not None:
                await self.pd.stop()
            for p in self.publishers:
                p.shutdown(timeout=0)
            raise
        for r in self.runners:
            r.start()
        self.port = self.server.port
        return self.port

    @property
    def event_endpoints(self) -> list[str]:
        return [p.endpoint for p in self.publishers]

    @property
    def replay_endpoints(self) -> list[str | None]:
        return [p.replay_endpoint for p in self.publishers]

    async def stop(self, timeout: float = 2.0) -> None:
        """Stop serving, stop the clocks, flush the publishers."""
        if self.server is not None:
            self.server.close()
        if self.pd is not None:
            await self.pd.stop()
        for r in self.runners:
            await r.stop()
        for p in self.publishers:
            await asyncio.to_thread(p.shutdown, timeout)

    # ------------------------------------------------------------------ routing

    def _not_found(self, conn: Request) -> None:
        """vLLM's answers to a path it does not serve, or a method its path does not take."""
        if conn.path in self.routes.paths:
            raise ApiError(405, "Method Not Allowed", "Method Not Allowed")
        raise ApiError(404, f"Not Found: {conn.path.decode(errors='replace')}",
                       "NotFoundError")

    def _refused(self, conn: Request, e: HttpError) -> None:
        if e.status == 413 or e.reason == "internal":  # (refused before routing, or a
            return  # failure of ours, logged: not a bad request of the API's)
        self.errors[e.status] += 1
        log.debug("%s %s -> %d %s", conn.method, conn.path, e.status, e.message)

    def _lora(self, model: str | None) -> int | None:
        if model is None or model == self.opts.model:
            return None
        lid = self.lora_ids.get(model)
        if lid is None:
            raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: "
                           f"{self.opts.model}.", "NotFoundError", "model")
        return lid

    def _check_ids(self, ids: list[int], param: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab):
            bad = next(t for t in ids if t < 0 or t >= self.vocab)
            raise ApiError(400, f"Token id {bad} is out of vocabulary", param=param)

    def _pick(self) -> int:
        n = len(self.cores)
        if n == 1:
            return 0
        first = next(self._turn) % n  # ties go round the ranks
        order = [(first + k) % n for k in range(n)]
        return min(order, key=lambda i: (lambda w, r: w * 4 + r)(*self.cores[i].load))

    def _header_rank(self, value: bytes) -> int:
        """The DP rank a router chose (``X-data-parallel-rank``), as vLLM honours it."""
        try:
            rank = int(value)
        except ValueError:
            rank = -1
        if not 0 <= rank < len(self.cores):
            raise ApiError(400, f"X-data-parallel-rank {value.decode(errors='replace')!r} is "
                           f"not a rank of this engine (0..{len(self.cores) - 1})",
                           param="X-data-parallel-rank")
        return rank

    def _generate(self, conn: Request, chat: bool) -> None:
        req = decode_request(conn.body, ChatRequest if chat else CompletionRequest)
        lora = self._lora(req.model)
        tok = self.tok
        from ...tokenize import TokenizerError

        prompts: list[list[int]] = []
        try:
            if chat:
                prompts.append(tok.encode_engine_chat(  # rendered as vLLM renders it
                    req.messages, tools=req.tools,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    reasoning_effort=req.reasoning_effort, documents=req.documents,
                    chat_template_kwargs=req.chat_template_kwargs))
            else:
                for p in prompt_inputs(req.prompt):
                    if isinstance(p, str):
                        prompts.append(tok.encode(p, add_special_tokens=req.add_special_tokens))
                    else:
                        self._check_ids(p, "prompt")
                        prompts.append(p)
        except TokenizerError as e:
            raise ApiError(400, str(e), param="messages" if chat else "prompt") from None
        limit = self.max_model_len
        for ids in prompts:
            if not ids:
                raise ApiError(400, "The decoder prompt cannot be empty", param="prompt")
            if len(ids) >= limit:
                raise ApiError(400, f"This model's maximum context length is {limit} tokens. "
                               f"However, your prompt contains {len(ids)} input tokens, which "
                               "exceeds this limit even without any output tokens. Please "
                               "reduce the length of the input prompt.", param="input_tokens")
        kv = transfer_params(req.kv_transfer_params)
        boots = bootstrap_params(req, len(prompts))
        side = self._pd_side(kv, boots, len(prompts)) if kv or boots else None
        n = next(self._ids)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self._prefix}{n:x}"
        shape = Shape(chat, rid, req.model or self.opts.model)
        stream = bool(req.stream)
        so = req.stream_options
        job = _Job(self, conn, shape, stream, bool(so and so.include_usage), req.kvwire_timing)
        rank = self._pick() if conn.dp_rank is None else self._header_rank(conn.dp_rank)
        core, runner = self.cores[rank], self.runners[rank]
        now = runner.now()
        job.kv = side == "prefill" and kv is not None
        pd = self.pd
        for i, ids in enumerate(prompts):
            mt = limit - len(ids) if req.max_tokens is None else min(req.max_tokens,
                                                                     limit - len(ids))
            if side == "prefill":
                mt = 1  # its decode runs on the decode engine
            out = self.textgen.output(ids, mt, req.ignore_eos)
            er = EngineRequest(f"{rid}-{i}", ids, len(out.ids), lora, req.cache_salt,
                               output=out.ids)
            if side == "prefill":
                er.remote_decode = True
            elif side == "decode":
                er.remote_prefill = True
            h = Handle(er, now, job.sink, out.finish_reason, i)
            if pd is not None and side is not None:
                if side == "decode":
                    pd.track(h, kv, boots[i] if boots else None)
                elif boots:
                    pd.open_room(boots[i].room, er.rid)
            job.handles.append(h)
            job.outputs.append(out)
            job.started.append(False)
        job.left = len(job.handles)
        job.rank = rank
        for h in job.handles:
            core.submit(h)
        conn.on_close = job.abort
        job.remote = side == "decode" and conn.header(HOLD_HEAD) is not None
        if stream and not job.remote:
            job.start()
        runner.wake()

    def _pd_side(self, kv: KVTransferParams | None, boots: list[Bootstrap] | None,
                 n: int) -> str:
        """Which side of a P/D pair a request asks this engine to be: "prefill" (compute
        the prompt and hold its KV for the decode engine) or "decode" (take the prompt's
        KV from the prefill engine); ApiError 400 when this engine cannot."""
        role = self.opts.config.role
        if kv is not None and boots is not None:
            raise ApiError(400, "kv_transfer_params and bootstrap_room: one P/D protocol "
                           "per request", param="kv_transfer_params")
        param = "kv_transfer_params" if kv is not None else "bootstrap_room"
        if self.pd is None:
            raise ApiError(400, f"{param}: this engine takes no part in disaggregated "
                           "serving (start it with --role prefill|decode or --kv-port)",
                           param=param)
        if kv is not None:
            if n != 1:
                raise ApiError(400, "kv_transfer_params: one prompt per request", param=param)
            side = "prefill" if kv.do_remote_decode else "decode"
            param = "kv_transfer_params.do_remote_" + ("decode" if side == "prefill"
                                                       else "prefill")
        else:
            assert boots is not None
            side = role if role != "both" else (
                "prefill" if boots[0].port == self.pd.bootstrap_port else "decode")
        if role != "both" and side != role:
            raise ApiError(400, f"{param}: asks for the {side} side of a pair from a "
                           f"{role} engine", param=param)
        return side

    def _server_info(self, conn: Request) -> None:
        """SGLang's ``/server_info``, the parts a router reads (no ``model_path``: there
        is no checkpoint to load a tokenizer from)."""
        cfg = self.opts.config
        pd = self.pd
        mode = "null" if cfg.role == "both" else cfg.role
        conn.respond(200, _enc({
            "served_model_name": self.opts.model, "model_id": self.opts.model,
            "tp_size": 1, "dp_size": self.opts.dp_size, "page_size": cfg.block_size,
            "max_total_num_tokens": cfg.num_gpu_blocks * cfg.block_size,
            "context_length": self.max_model_len, "max_running_requests": cfg.max_num_seqs,
            "disaggregation_mode": mode,
            "disaggregation_bootstrap_port": pd.bootstrap_port if pd is not None else None,
            "kv_port": pd.kv_port if pd is not None else None,
            "version": "kvwire"}))

    def _model_info(self, conn: Request) -> None:
        conn.respond(200, _enc({"model_name": self.opts.model, "is_generation": True,
                                "has_image_understanding": False,
                                "has_audio_understanding": False,
                                "preferred_sampling_params": None}))

    def _get_load(self, conn: Request) -> None:
        """SGLang's ``/get_load``: per DP rank, requests running and waiting and the
        tokens they hold."""
        out = []
        for c in self.cores:
            waiting, running = c.load
            m = c.model
            used = (m.cache.num_blocks - m.cache.num_free) * m.cfg.block_size
            out.append({"dp_rank": c.rank, "num_reqs": waiting + running,
                        "num_waiting_reqs": waiting, "num_tokens": used,
                        "num_pending_tokens": 0, "ts_tic": time.time()})
        conn.respond(200, _enc(out))

    def _models(self, conn: Request) -> None:
        def card(name: str, parent: str | None) -> dict[str, Any]:
            return {"id": name, "object": "model", "created": self.created, "owned_by": "vllm",
                    "root": name, "parent": parent, "max_model_len": self.max_model_len,
                    "permission": [{"id": f"modelperm-{self._prefix}", "object":
                                    "model_permission", "created": self.created,
                                    "allow_create_engine": False, "allow_sampling": True,
                                    "allow_logprobs": True, "allow_search_indices": False,
                                    "allow_view": True, "allow_fine_tuning": False,
                                    "organization": "*", "group": None, "is_blocking": False}]}

        data = [card(self.opts.model, None)] + [card(n, self.opts.model) for n in self.opts.loras]
        conn.respond(200, _enc({"object": "list", "data": data}))

    def _tokenize(self, conn: Request) -> None:
        from ...tokenize import TokenizerError

        req = decode_request(conn.body, TokenizeRequest)
        self._lora(req.model)
        try:
            if req.messages is not None:
                ids = self.tok.encode_engine_chat(
                    req.messages, tools=req.tools,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    chat_template_kwargs=req.chat_template_kwargs)
            elif req.prompt is not None:
                add = True if req.add_special_tokens is None else req.add_special_tokens
                ids = self.tok.encode(req.prompt, add_special_tokens=add)
            else:
                raise ApiError(400, "Either `prompt` or `messages` is required.", param="prompt")
        except TokenizerError as e:
            raise ApiError(400, str(e)) from None
        strs = [self.tok.decode([t], skip_special_tokens=False) for t in ids] \
            if req.return_token_strs else None
        conn.respond(200, _enc({"count": len(ids), "max_model_len": self.max_model_len,
                                "tokens": ids, "token_strs": strs}))

    def _detokenize(self, conn: Request) -> None:
        req = decode_request(conn.body, DetokenizeRequest)
        self._lora(req.model)
        self._check_ids(req.tokens, "tokens")
        conn.respond(200, _enc({"prompt": self.tok.decode(req.tokens)}))

    def _metrics(self, conn: Request) -> None:
        engines = [({"model_name": self.opts.model, "engine": str(c.rank)}, c.stats, c.gauges)
                   for c in self.cores]
        extra = {"bad_requests": sum(self.errors.values()), "aborted_requests": self.aborted,
                 "published_batches": sum(r.published for r in self.runners)}
        text = render(engines, extra)
        if self.pd is not None:
            c = self.cores[0]
            self.pd.stats.rooms = len(self.pd.rooms)
            text += render_transfer({"model_name": self.opts.model, "engine": "0",
                                     "role": self.opts.config.role},
                                    c.transfer_counts, c.transfer_seconds, self.pd.stats)
        conn.respond(200, text, ctype=b"text/plain; version=0.0.4; charset=utf-8")

    def _cache(self, conn: Request) -> None:
        """Each rank's dump taken between its steps (:meth:`Runner.at_quiet`), with the
        seq of the last batch its publisher took: exact at that seq, under load too."""
        ranks: list[dict[str, Any] | None] = [None] * len(self.cores)

        def take(rank: int) -> None:
            d = self.cores[rank].cache_dump()
            if self.publishers:  # the last batch the dump includes (a heartbeat's at worst)
                d["seq"] = self.publishers[rank].stats().last_seq
            ranks[rank] = d
            if all(r is not None for r in ranks):
                conn.respond(200, _enc({"ranks": ranks}))

        for rank, runner in enumerate(self.runners):
            runner.at_quiet(lambda r=rank: take(r))


def _render(e: HttpError) -> bytes:
    """vLLM's error object; an error of the HTTP layer (bad HTTP, a body over the cap) is
    typed by its reason phrase."""
    return error_body(e.status, e.message, e.type or reason(e.status).decode(), e.param)
