"""Tokenizing long new text away from the event loop, so that a never-seen 30k-token prompt
does not hold up every other request's stream on the one thread that serves them all.

The tokenizer plans on the loop (lookups of what it has seen: quick), and the new text is
encoded on the loop when it is short (handing it over costs more), else on a worker thread
when the tokenizer lets go of the GIL while it works (``tokenizers``' Rust; the builtin
tokenizer's C encoder), else in a worker process; the workers run at the lowest CPU priority
(Linux's ``SCHED_IDLE``), below the loop's. At most ``queue`` prompts wait off the loop
for the ids to route them by, running or waiting; a request past that is refused with 429
and counted, rather than waiting behind work that may take seconds.

A prompt with much new text can be routed on its start (:meth:`Offload.encode_start`): the
start is encoded first, and longer starts if a route needs them, by a thread of its own that
short work goes to, so it never waits behind the long rests; the rest then goes on while the
request is served, in a queue of its own, as long (more rests in hand would keep more text
for later requests, and spend more CPU beside the requests now). With that queue
full, a rest is skipped: the router sheds work it does for later requests (a skipped rest
keeps no chunks, and only its start is predicted), not the requests."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ..http1 import HttpError
from ..tokenize.segments import Plan

__all__ = ["Offload", "Partial"]

log = logging.getLogger("kvwire.proxy.offload")

#: How much lower the workers' CPU priority is than the loop's (a nice value), where
#: ``SCHED_IDLE`` is refused.
NICE = 10


def _lower_priority() -> None:
    """Run in each worker as it starts. When the cores are short, the loop, which moves every
    stream, must run first and a long prompt wait. On Linux a thread has its own scheduling
    policy (and the threads it starts inherit it: ``tokenizers``' pool): ``SCHED_IDLE``
    gives the worker a core only beside what ordinary threads leave, and one of them that
    wakes takes the core at once; a nice value only weighs it less, and short streams beside
    never-seen 30k-token prompts waited about twice as long at p99 with nice 10 (docs/
    benchmarks.md). Elsewhere the policy would be the process's, so nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (OSError, AttributeError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, 0) + NICE)
    except OSError:
        pass


#: A long prompt's first characters of new text (whole work items, at least this many)
#: encoded before the rest, to route it on: about 1k tokens, past the end of what engines
#: hold of it unless they hold that much of its new text too.
START_CHARS = 4096
#: Work of at most this many characters (a start, a short prompt's new text) goes to a
#: thread of its own, not behind the long rests queued for the workers.
FAST_CHARS = 2 * START_CHARS
#: A start an engine holds whole grows by as much again, at most this many characters a step
#: (on the thread for short work: a step holds up the starts behind it).
GROW_CHARS = 4 * START_CHARS


class Partial:
    """A long prompt's ids known in part (:meth:`Offload.encode_start`): ``ids``, its
    start; ``tokens``, its whole length, estimated at the start's characters per token;
    ``done``: the ids are the whole prompt's. Until :meth:`routed` (or :meth:`release`) it
    holds a place in the queue of prompts waiting for their route. :meth:`extend` encodes
    more of its new text, on the thread for short work (a start never waits behind long
    work); :meth:`routed` starts its rest on the workers, if they have room for it."""

    __slots__ = ("_head", "_held", "_k", "_off", "_plan", "_worked", "done", "ids", "rest",
                 "tokens")

    def __init__(self, off: Offload, plan: Plan, head: list[Sequence[int]],
                 worked: bool) -> None:
        self._off = off
        self._plan = plan
        self._head = head
        self._k = len(head)
        self._worked = worked
        self._held = True
        #: the task encoding the rest once routed (its whole ids, kept when it ends,
        #: whoever waits); None: not started (the workers had as many rests as they take)
        self.rest: asyncio.Task | None = None
        self.ids: list[int] = []
        self.tokens = 0
        self.done = False
        self._known()

    def _known(self) -> None:
        plan, head = self._plan, self._head
        if self._k == len(plan.work):
            self.ids = self._off.tok.finish(plan, head)
            self.tokens, self.done = len(self.ids), True
            return
        self.ids = plan.start(head)
        chars = sum(map(len, plan.work[:self._k]))
        done = sum(map(len, head))
        # the rest's length at the start's own characters per token
        left = round((plan.chars - chars) * done / chars) if chars else 0
        self.tokens = plan.known_tokens() + done + left

    async def extend(self) -> None:
        """Encode as much new text again as is known (at most :data:`GROW_CHARS`, whole
        work items), on the thread for short work: the start grows until it settles the
        route or is the whole prompt (``done``)."""
        work, k = self._plan.work, self._k
        j = _items(work, k, min(max(sum(map(len, work[:k])), START_CHARS), GROW_CHARS))
        results, worked = await self._off._short(self._plan.sub(k, j), fast=True)
        self._worked = self._worked and worked
        self._head = [*self._head, *results]
        self._k = j
        self._known()

    def routed(self) -> asyncio.Task | None:
        """The prompt is routed: its place among those waiting for a route is given back,
        and its rest starts on the workers if they have fewer than ``queue`` rests (else it
        is skipped: the router sheds work for later requests, not requests). The rest's
        task, or None."""
        self.release()
        off = self._off
        if self.done or off.rests >= off.queue:
            return None
        off.rests += 1
        plan, head, k, tok = self._plan, self._head, self._k, off.tok

        async def rest() -> list[int]:
            place = _Place(off, False, "rests")  # (given back once its ids are kept)
            try:
                results, worked = await off._run(plan.sub(k, len(plan.work)), place)
                off.offloaded += self._worked and worked
                return tok.finish(plan, [*head, *results])
            finally:
                place.let_go()

        self.rest = asyncio.get_running_loop().create_task(rest())
        self.rest.add_done_callback(_retrieved)
        return self.rest

    def release(self) -> None:
        """Give back the place among prompts waiting for a route (once; any path)."""
        if self._held:
            self._held = False
            self._off.pending -= 1


def _items(work: list[str], k: int, chars: int) -> int:
    """The end of the work items from ``k`` on that hold at least ``chars`` characters
    (whole items; all of them if they hold fewer)."""
    n = 0
    while k < len(work) and n < chars:
        n += len(work[k])
        k += 1
    return k


def _retrieved(task: asyncio.Task) -> None:
    """A rest nobody awaited (its request ended first) ends without a warning."""
    if not task.cancelled():
        task.exception()


class _Place:
    """One encode's place in a queue (``pending``, or ``rests``), whose worker may outlive
    its caller: given back once the worker is done and the place is let go, in either
    order (both on the loop)."""

    __slots__ = ("attr", "done", "gone", "off")

    def __init__(self, off: Offload, gone: bool, attr: str = "pending") -> None:
        self.off = off
        self.attr = attr
        self.done = False
        self.gone = gone

    def _give_back(self) -> None:
        setattr(self.off, self.attr, getattr(self.off, self.attr) - 1)

    def worker_done(self) -> None:
        if self.done:
            return
        self.done = True
        if self.gone:
            self._give_back()

    def let_go(self) -> None:
        if not self.gone:
            self.gone = True
            if self.done:
                self._give_back()


class Offload:
    """Encodes a prompt's new text for :class:`~.tokens.Tokens`; ``threads`` workers (0:
    everything on the loop), ``queue`` encodes off the loop at most."""

    def __init__(self, tokenizer: Any, threads: int = 2, queue: int = 16) -> None:
        if threads < 0 or queue < 1:
            raise ValueError("tokenize threads must be >= 0 and the queue >= 1")
        self.tok = tokenizer
        self.threads = threads
        self.queue = queue
        self.pending = 0  # encodes off the loop now (running or waiting) for a route
        #: rests of prompts routed on their start being encoded now (running or waiting)
        self.rests = 0
        self.inline = 0  # encodes done on the loop
        self.offloaded = 0  # encodes done by a worker
        self.shed = 0  # requests refused with 429: the queue was full
        self.by_load = 0  # requests the queue was full for, routed by load instead (not shed)
        self.broken = 0  # times a worker process died and the workers were started anew
        self._pool: concurrent.futures.Executor | None = None
        #: one more thread for starts and other short work (at most :data:`FAST_CHARS`), so
        #: that they never wait behind the long rests queued for the workers
        self._fast: concurrent.futures.Executor | None = None
        self._elsewhere = None
        if tokenizer is not None and threads and not tokenizer.releases_gil:
            self._elsewhere = tokenizer.run_elsewhere()
            if self._elsewhere is None:
                log.warning("tokenizer %s holds the GIL while it encodes and cannot run in "
                            "another process: long prompts are tokenized on the event loop",
                            tokenizer.name)
                self.threads = 0

    @property
    def mode(self) -> str:
        """``"threads"``, ``"processes"`` or ``"loop"``: where long new text is encoded."""
        if not self.threads:
            return "loop"
        return "processes" if self._elsewhere is not None else "threads"

    async def encode(self, text: str, add_special_tokens: bool = False,
                     shed: bool = True) -> list[int]:
        """The ids of ``text``: the new part encoded here or by a worker; 429 when the
        workers' queue is full, counted as ``shed`` when the request is refused for it, else
        (``shed`` false: the caller routes it by load) as ``by_load``."""
        return await self._whole(self.tok.plan(text, add_special_tokens), shed)

    async def _whole(self, plan: Plan, shed: bool) -> list[int]:
        tok = self.tok
        if not plan.work:
            return tok.finish(plan, [])
        if tok.inline(plan) or not self.threads:
            self.inline += 1
            return tok.finish(plan, tok.run(plan))
        self._admit(shed)
        results, worked = await self._run(plan, _Place(self, True))
        self.offloaded += worked
        return tok.finish(plan, results)

    async def encode_start(self, text: str, add_special_tokens: bool = False,
                           shed: bool = True) -> list[int] | Partial:
        """As :meth:`encode`, but a long prompt's new text of more than :data:`START_CHARS`
        characters comes as a :class:`Partial`: the ids of its start, encoded first, so the
        caller can route it as soon as a start says where its cached prefix ends."""
        tok = self.tok
        plan = tok.plan(text, add_special_tokens)
        k = _items(plan.work, 0, START_CHARS)
        if (k >= len(plan.work) or plan.special or not self.threads
                or tok.inline(plan)):
            return await self._whole(plan, shed)
        self._admit(shed)  # (held by the Partial until it is routed)
        start = plan.sub(0, k)
        try:
            head, worked = await self._short(start)
            return Partial(self, plan, head, worked)
        except BaseException:
            self.pending -= 1
            raise

    def _admit(self, shed: bool) -> None:
        """Take a place in the queue, or 429."""
        if self.pending >= self.queue:
            if shed:
                self.shed += 1
            else:
                self.by_load += 1
            raise HttpError(429, f"the router's tokenizer has {self.pending} long prompts in "
                            "hand, its limit (--tokenize-queue); retry later",
                            type="RateLimitError", headers=((b"retry-after", b"1"),))
        self.pending += 1

    async def _short(self, plan: Plan, fast: bool = False) -> tuple[list[Sequence[int]], bool]:
        """A start, or more of one: encoded here when that costs less than handing it over,
        else by a worker (:meth:`_run`; ``fast``: on the thread for short work)."""
        if self.tok.inline(plan):
            return self.tok.run(plan), True
        return await self._run(plan, fast=fast)

    async def _run(self, plan: Plan, place: _Place | None = None, fast: bool = False
                   ) -> tuple[list[Sequence[int]], bool]:
        """``plan``'s work encoded by a worker, and True; or, the workers broken, on the
        loop, and False (counted as ``inline``). ``place``, the queue's place it holds, is
        given back once the worker is done and the place let go (:meth:`_Place.let_go`),
        even when the caller is gone before."""
        tok = self.tok
        pool = self._executor(plan, fast)
        try:
            try:
                if self._elsewhere is not None:
                    fut = pool.submit(self._elsewhere, plan.work, plan.special)
                else:
                    fut = pool.submit(tok.run, plan)
            except BaseException:
                if place is not None:
                    place.worker_done()
                raise
            if place is not None:
                loop = asyncio.get_running_loop()

                def finished(_: object) -> None:
                    try:
                        loop.call_soon_threadsafe(place.worker_done)
                    except RuntimeError:  # the loop has closed: nothing left to count for
                        pass

                fut.add_done_callback(finished)
            return await asyncio.wrap_future(fut), True
        except concurrent.futures.BrokenExecutor as e:
            if place is not None:  # (no worker runs it now)
                place.worker_done()
            return self._broken(pool, e, plan), False

    def _broken(self, pool: concurrent.futures.Executor, e: Exception,
                plan: Plan) -> list[Sequence[int]]:
        """A worker process died (killed, out of memory): new workers for the next long
        prompt; this one is encoded on the loop (late, but answered)."""
        log.warning("tokenize workers broke (%s): starting new ones; this prompt is encoded "
                    "on the event loop", e)
        if self._pool is pool:
            self._pool = None
        if self._fast is pool:
            self._fast = None
        pool.shutdown(wait=False, cancel_futures=True)
        self.broken += 1
        self.inline += 1
        return self.tok.run(plan)

    def _executor(self, plan: Plan, fast: bool = False) -> concurrent.futures.Executor:
        """The thread for short work (``fast``: whatever its size), else the workers."""
        if self._elsewhere is None and (fast or plan.chars <= FAST_CHARS):  # (threads only)
            if self._fast is None:
                self._fast = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="kvwire-tokenize-start",
                    initializer=_lower_priority)
            return self._fast
        return self._pool or self._start()

    def _start(self) -> concurrent.futures.Executor:
        if self._elsewhere is not None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.threads, mp_context=multiprocessing.get_context("spawn"),
                initializer=_lower_priority)
        else:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.threads, thread_name_prefix="kvwire-tokenize", initializer=_lower_priority)
        return self._pool

    def close(self) -> None:
        """Stop the workers (what they hold is dropped: its requests are ending too)."""
        for pool in (self._pool, self._fast):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._fast = None
