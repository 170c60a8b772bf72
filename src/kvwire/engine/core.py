"""One engine (one DP rank) as the server drives it: arrivals, steps, outputs (pure, no I/O).

:class:`EngineCore` sits between the HTTP layer and :class:`~kvwire.engine.model.EngineModel`.
Requests arrive at model times; :meth:`advance` adds those that have arrived, runs the next
step (or a quiet stretch of steps, never past the next arrival or ``now``), and says which
requests got tokens and which finished. The runner waits until the step's end in wall time
before handing those outputs out, as a real engine's outputs appear when its step ends.

An arrival later than the model's clock waits in :attr:`pending` until the model has
stepped up to it (or goes idle), so a busy model's timeline stays true to the arrivals even
when the CPU lags behind wall time. A request's own TTFT is measured from its true arrival.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..wire.events import Event
from .metrics import EngineStats
from .model import EngineConfig, EngineModel, StepResult
from .request import FINISHED, EngineRequest

__all__ = ["EngineCore", "Handle", "Step"]


class Handle:
    """A request in the core: its model request, arrival, what was handed out, its sink."""

    __slots__ = ("req", "arrival", "sink", "delivered", "aborted", "finish_reason", "index")

    def __init__(self, req: EngineRequest, arrival: float, sink: Callable[[Handle, int, bool],
                 None], finish_reason: str, index: int = 0) -> None:
        self.req = req
        self.arrival = arrival
        self.sink = sink
        self.delivered = 0
        self.aborted = False
        self.finish_reason = finish_reason
        self.index = index

    @property
    def ttft(self) -> float | None:
        t = self.req.first_token_t
        return None if t is None else t - self.arrival


@dataclass(slots=True)
class Step:
    """One :meth:`EngineCore.advance`: when it ends (model time), its KV events, the
    handles with new tokens (finished ones included), and what its stats record when it
    is handed out."""

    end: float
    events: list[Event]
    outputs: list[Handle]
    res: StepResult
    firsts: list[Handle]
    finished: list[Handle]
    itl: Sequence[float]
    #: the scheduler's prefix-cache counters after this step's admissions
    prefix: tuple[int, int, int]


class EngineCore:
    """The model plus arrivals, handles and stats for one rank."""

    def __init__(self, cfg: EngineConfig, max_model_len: int, rank: int = 0) -> None:
        self.model = EngineModel(cfg)
        self.rank = rank
        self.pending: deque[Handle] = deque()
        self.handles: dict[str, Handle] = {}
        self.stats = EngineStats(max_model_len)

    @property
    def idle(self) -> bool:
        return self.model.idle and not self.pending

    @property
    def load(self) -> tuple[int, int]:
        """(waiting, running), vLLM's DP balancing key."""
        m = self.model
        return len(m.waiting) + len(self.pending), len(m.running)

    def gauges(self) -> tuple[int, int, float]:
        m = self.model
        c = m.cache
        return len(m.running), len(m.waiting) + len(self.pending), 1.0 - c.num_free / c.num_blocks

    def submit(self, h: Handle) -> None:
        """Queue a request that arrived at ``h.arrival`` (model time, non-decreasing)."""
        self.handles[h.req.rid] = h
        self.pending.append(h)

    def abort(self, h: Handle) -> bool:
        """Drop a request (its client went away): its blocks are freed at once."""
        if h.aborted or h.req.rid not in self.handles:
            return False
        h.aborted = True
        del self.handles[h.req.rid]
        if h in self.pending:
            self.pending.remove(h)
        else:
            self.model.abort(h.req)
        self.stats.request_success["abort"] += 1
        return True

    def advance(self, now: float) -> Step | None:
        """Add what has arrived, run the next step(s) up to ``now``; None when idle."""
        m = self.model
        pend = self.pending
        while pend and (pend[0].arrival <= m.now or m.idle):
            h = pend.popleft()
            m.add(h.req, now=h.arrival if m.idle else None)
        if m.idle:
            return None
        res = m.step(pend[0].arrival if pend else now)
        handles = self.handles
        outputs = [h for r in m.running
                   if r.num_output > (h := handles[r.rid]).delivered]
        firsts = [handles[r.rid] for r in res.first_tokens]
        finished = [handles.pop(r.rid) for r in res.finished]
        outputs += finished
        itl: Sequence[float] = m.itl
        if itl:
            m.itl = array("d")
        else:
            itl = ()
        return Step(res.end, res.events, outputs, res, firsts, finished, itl,
                    (m.prefix_queries, m.prefix_hits, m.preemptions))

    def deliver(self, step: Step) -> None:
        """Record the step's stats and hand each output its new tokens (skipping requests
        aborted meanwhile). Called at the step's end in wall time: like vLLM, whose
        scheduler stats (prefix-cache queries and hits counted at admission, preemptions)
        and request stats reach /metrics when a step's outputs are processed, so nothing
        shows in /metrics before the step that did it has ended."""
        st = self.stats
        res = step.res
        st.iteration_tokens.observe(res.tokens)
        for h in step.firsts:
            st.ttft.observe(h.req.first_token_t - h.arrival)
        for h in step.finished:
            r = h.req
            st.e2e.observe(r.finish_t - h.arrival)
            st.prompt_tokens += len(r.prompt)
            st.generation_tokens += r.num_output
            st.req_prompt.observe(len(r.prompt))
            st.req_gen.observe(r.num_output)
            st.request_success[h.finish_reason] += 1
        if step.itl:
            st.itl.observe_many(step.itl)
        st.prefix_cache_queries, st.prefix_cache_hits, st.preemptions = step.prefix
        for h in step.outputs:
            if h.aborted:
                continue
            r = h.req
            n = r.num_output
            new = n - h.delivered
            h.delivered = n
            h.sink(h, new, r.status == FINISHED)

    def cache_dump(self) -> dict[str, object]:
        """Every cached GPU block's hash, once per physical block holding it, and how many
        requests are running and waiting, for checking that the published events rebuild
        the cache exactly."""
        c = self.model.cache
        running, waiting = len(self.model.running), len(self.model.waiting) + len(self.pending)
        return {"rank": self.rank, "block_size": c.block_size, "running": running,
                "waiting": waiting,
                "blocks": sorted(h for h, holders in c.cached.items() for _ in holders)}
