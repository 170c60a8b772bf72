"""One engine (one DP rank) as the server drives it: arrivals, steps, outputs (pure, no I/O).

:class:`EngineCore` sits between the HTTP layer and :class:`~kvwire.engine.model.EngineModel`.
Requests arrive at model times; :meth:`advance` adds those that have arrived, runs the next
step (or a quiet stretch of steps, never past the next arrival or ``now``), and says which
requests got tokens and which finished. The runner waits until the step's end in wall time
before handing those outputs out, as a real engine's outputs appear when its step ends.

An arrival later than the model's clock waits in :attr:`pending` until the model has
stepped up to it (or goes idle), so a busy model's timeline stays true to the arrivals even
when the CPU lags behind wall time. A request's own TTFT is measured from its true arrival.

Disaggregated roles: the end of a pull (:meth:`transfer_done`) is an outside event like an
arrival, applied in time order when the model reaches it; :meth:`advance` also frees the
leases due (``Step.expired``). The transfer counters live here for ``/metrics``.
"""

from __future__ import annotations

from array import array
from bisect import insort
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..wire.events import Event
from .metrics import EngineStats, Histogram
from .model import EngineConfig, EngineModel, Lease, StepResult
from .request import FINISHED, EngineRequest

__all__ = ["EngineCore", "Handle", "Step", "TRANSFER_BUCKETS"]

#: seconds, for a histogram of pull times (1 ms to a minute)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)


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
    #: leases freed because they expired (request ids), since the previous step
    expired: list[str] = field(default_factory=list)
    #: remote-prefill requests whose pull starts now (``req.pull_from``/``pull_blocks``)
    pulls: list[Handle] = field(default_factory=list)
    #: remote-prefill requests that prefill here instead (their remote lease can go)
    local_prefills: list[Handle] = field(default_factory=list)
    #: requests whose pull failed under ``load_failure="fail"`` (ended, no output)
    failed: list[Handle] = field(default_factory=list)


class EngineCore:
    """The model plus arrivals, handles and stats for one rank."""

    def __init__(self, cfg: EngineConfig, max_model_len: int, rank: int = 0) -> None:
        self.model = EngineModel(cfg)
        self.rank = rank
        self.pending: deque[Handle] = deque()
        self.handles: dict[str, Handle] = {}
        self.stats = EngineStats(max_model_len)
        #: pulls that ended, (model time, order, request id, ok), applied in time order
        self._done: list[tuple[float, int, str, bool]] = []
        self._done_n = 0
        self._expired: list[str] = []
        self._failed: list[Handle] = []
        self._pull_t: dict[str, float] = {}
        #: how long each pull took (model seconds, from its step's end to its end)
        self.transfer_seconds = Histogram(TRANSFER_BUCKETS)
        #: pulls whose request was aborted (its client went away) before the pull's end
        #: was applied: neither ok nor failed
        self.transfers_aborted = 0

    @property
    def idle(self) -> bool:
        """Nothing to run, queued, transferring or about to end a transfer (leases aside:
        see :meth:`next_expiry`)."""
        return self.model.idle and not self.pending and not self._done

    @property
    def load(self) -> tuple[int, int]:
        """(waiting, running), vLLM's DP balancing key (transferring requests wait, as
        vLLM counts its requests waiting for remote KV)."""
        m = self.model
        return m.num_waiting + len(self.pending), len(m.running)

    def gauges(self) -> tuple[int, int, float]:
        m = self.model
        c = m.cache
        return (len(m.running), m.num_waiting + len(self.pending),
                1.0 - c.num_free / c.num_blocks)

    # ------------------------------------------------------------------ transfers

    @property
    def transfer_counts(self) -> dict[str, int]:
        """Counters for ``/metrics``: transfers started/ok/failed, blocks and bytes pulled,
        blocks held under leases, leases expired and released, local prefills chosen;
        ``started`` = ``ok`` + ``failed`` + ``aborted`` + ``transferring`` (in progress)."""
        m = self.model
        return {"started": m.transfers_started, "ok": m.transfers_ok,
                "failed": m.transfers_failed, "aborted": self.transfers_aborted,
                "transferring": len(self._pull_t), "blocks": m.blocks_pulled,
                "bytes": m.cfg.transfer.bytes(m.blocks_pulled, m.cfg.block_size),
                "held_blocks": m.held_blocks, "leases": len(m.leases),
                "leases_expired": m.leases_expired, "leases_released": m.leases_released,
                "local_prefills": m.local_prefill_count}

    def transfer_done(self, rid: str, ok: bool, now: float) -> bool:
        """``rid``'s pull ended at model time ``now`` (applied when the model gets there);
        False if ``rid`` is not transferring here."""
        req = self.model.transferring.get(rid)
        if req is None:
            return False
        self._done_n += 1
        insort(self._done, (now, self._done_n, rid, ok))
        return True

    def release(self, rid: str) -> bool:
        """Free a lease (pulled, or the decode side no longer needs it)."""
        return self.model.release(rid)

    def extend(self, rid: str, until: float) -> bool:
        """Hold a lease until at least ``until`` (a decode side's heartbeat)."""
        return self.model.extend(rid, until)

    def read(self, rid: str, now: float) -> Lease | None:
        """The lease of ``rid`` if alive at ``now``."""
        return self.model.read(rid, now)

    def expire(self, now: float) -> list[str]:
        """Free the leases due by ``now``; also reported in the next :class:`Step`."""
        gone = self.model.expire(now)
        self._expired += gone
        return gone

    def take_expired(self) -> list[str]:
        """The leases expired since the last step or call."""
        out, self._expired = self._expired, []
        return out

    def next_expiry(self) -> float | None:
        return self.model.next_expiry()

    def next_due(self) -> float | None:
        """When an idle core has work next without an arrival: the next lease to expire
        or the next pull to end (model time), or None."""
        e = self.model.next_expiry()
        if self._done:
            d = self._done[0][0]
            return d if e is None else min(d, e)
        return e

    def _apply_done(self, t: float, rid: str, ok: bool) -> None:
        m = self.model
        req = m.transferring.get(rid)
        if req is None:
            return  # aborted meanwhile
        m.transfer_done(req, ok, now=t if not m.runnable else None)
        start = self._pull_t.pop(rid, None)
        if start is not None:
            self.transfer_seconds.observe(max(0.0, t - start))
        if req.failed:  # "fail" policy: the request ends without output
            h = self.handles.pop(rid, None)
            if h is not None:
                rs = self.stats.request_success
                rs["error"] = rs.get("error", 0) + 1
                self._failed.append(h)

    def take_failed(self) -> list[Handle]:
        """Requests failed by their pull since the last step or call (the server answers
        them with an error)."""
        out, self._failed = self._failed, []
        return out

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
        if self._pull_t.pop(h.req.rid, None) is not None:  # its pull had started
            self.transfers_aborted += 1
            self._done = [d for d in self._done if d[2] != h.req.rid]  # (its end, if known)
        if h in self.pending:
            self.pending.remove(h)
        else:
            self.model.abort(h.req)
        self.stats.request_success["abort"] += 1
        return True

    def advance(self, now: float) -> Step | None:
        """Free the leases due by ``now``, add what has arrived and apply the pulls that
        ended (in time order), run the next step(s) up to ``now``; None when nothing is
        runnable."""
        m = self.model
        if m.leases:
            self.expire(now)
        pend, done = self.pending, self._done
        while pend or done:
            ta = pend[0].arrival if pend else None
            td = done[0][0] if done else None
            if ta is not None and (td is None or ta <= td):
                if ta > m.now and m.runnable:
                    break
                h = pend.popleft()
                m.add(h.req, now=ta if not m.runnable else None)
            else:
                assert td is not None
                # (idle, a pull is applied only once it is due: applied early, the idle
                # model jumped to its end, and requests arriving meanwhile waited for it)
                if td > (m.now if m.runnable else now):
                    break
                _, _, rid, ok = done.pop(0)
                self._apply_done(td, rid, ok)
        if not m.runnable:
            return None
        nxt = now
        if pend:
            nxt = min(nxt, pend[0].arrival)
        if done:
            nxt = min(nxt, done[0][0])
        res = m.step(nxt)
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
        step = Step(res.end, res.events, outputs, res, firsts, finished, itl,
                    (m.prefix_queries, m.prefix_hits, m.preemptions))
        if self._expired:
            step.expired = self.take_expired()
        if self._failed:
            step.failed = self.take_failed()
        if res.pulls:
            step.pulls = [handles[r.rid] for r in res.pulls]
            for r in res.pulls:
                self._pull_t[r.rid] = res.end
        if res.local_prefills:
            step.local_prefills = [handles[r.rid] for r in res.local_prefills]
        return step

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
        m = self.model
        c = m.cache
        running, waiting = len(m.running), m.num_waiting + len(self.pending)
        return {"rank": self.rank, "block_size": c.block_size, "running": running,
                "waiting": waiting,
                "blocks": sorted(h for h, holders in c.cached.items() for _ in holders)}
