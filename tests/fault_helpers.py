"""Process entry points and handles for the fault suite (tests/test_faults.py).

Spawned children import this module by name (``tests/`` is on ``sys.path`` under pytest,
and spawn hands the parent's ``sys.path`` to the child), so everything a child runs is a
top-level function here.

* :func:`engine_main`: a seeded :class:`~kvwire.sim.demo.DemoEngine` workload publishing
  through a real :class:`~kvwire.publish.publisher.ZmqEventPublisher` (live PUB + replay ROUTER,
  snapshots, heartbeats) on ``tcp://*:port``; driven over a Pipe by :class:`Engine`, and
  reporting its ground truth (``BlockCache.as_dict()`` of every batch it published, plus
  the engine's own LRU keys) when a run is done.
* :func:`subscriber_main`: a :class:`~kvwire.consume.subscriber.Subscriber` that rebuilds the
  cache; driven by :class:`SubProc` (so it can be SIGKILLed).
* :class:`Rebuild`: what an application does with deliveries (Reset clears, Snapshot
  replaces, Batch applies), checking the per-stream contract as it goes.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import random
import signal
import struct
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from kvwire.consume.stream import Batch, Liveness, Reset, Snapshot, StreamConfig
from kvwire.consume.subscriber import StreamSpec, Subscriber
from kvwire.index.cache import BlockCache
from kvwire.publish.publisher import ZmqEventPublisher
from kvwire.sim.demo import DemoEngine
from kvwire.wire.events import KVEventBatch, encode_batch

CTX = mp.get_context("spawn")

#: Workload shapes: (system prompt lengths, user turn length range).
WORKLOADS = {
    "normal": ((64, 128, 256), (16, 160)),
    "small": ((32, 48), (16, 40)),  # fewer blocks per step: 100k batches in seconds
    "wide": ((384,), (450, 650)),  # ~2.5 KB batches, as in the vLLM runs that found the replay holes
}


class Prompts:
    """Seeded prompts: a few shared system prompts (Zipf-like) plus a random user turn."""

    def __init__(self, seed: int, workload: str = "normal", n_system: int = 8) -> None:
        self.rng = random.Random(seed)
        sys_lens, self.user = WORKLOADS[workload]
        self.systems = [self._tokens(self.rng.choice(sys_lens)) for _ in range(n_system)]
        self.weights = [1.0 / (i + 1) for i in range(n_system)]

    def _tokens(self, n: int) -> list[int]:
        return list(struct.unpack(f">{n}H", self.rng.randbytes(2 * n)))

    def next(self) -> list[int]:
        system = self.rng.choices(self.systems, self.weights)[0]
        return system + self._tokens(self.rng.randrange(*self.user))


class Done(msgspec.Struct):
    """An engine's report at the end of a run."""

    last_seq: int  # publisher's last seq right after the run's last batch
    published: int  # batches published by this engine in all runs
    truth: dict  # BlockCache.as_dict() of everything it published
    lru: list  # the engine's own cache keys (cross-check of the truth)
    seconds: float


# --------------------------------------------------------------------------- engine process


def _bind_publisher(port: int, rport: int, opts: dict, ctx: zmq.Context | None):
    deadline = time.monotonic() + 10.0
    while True:
        try:
            return ZmqEventPublisher(
                endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}",
                heartbeat_interval=opts.get("hb", 0.2), hwm=opts.get("hwm", 100_000),
                buffer_steps=opts.get("buffer_steps", 10_000), snapshot=True, context=ctx,
            )
        except Exception:
            if port == 0 or time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # the killed predecessor's port is not free yet


def engine_main(conn: Any, port: int, rport: int, seed: int, opts: dict) -> None:
    logging.getLogger("kvwire").setLevel(logging.ERROR)  # the bind-all-interfaces warning
    ctx = None
    if opts.get("sndbuf"):
        ctx = zmq.Context()
        ctx.setsockopt(zmq.SNDBUF, opts["sndbuf"])  # default for the publisher's sockets
    try:
        pub = _bind_publisher(port, rport, opts, ctx)
    except Exception as e:
        conn.send(("error", repr(e)))
        return
    conn.send(("ready", int(pub.endpoint.rsplit(":", 1)[1]),
               int(pub.replay_endpoint.rsplit(":", 1)[1]), pub.epoch, os.getpid()))
    engine = DemoEngine(capacity=opts.get("capacity", 4096))
    prompts = Prompts(seed, opts.get("workload", "normal"))
    truth = BlockCache()
    published = 0
    while True:
        cmd = conn.recv()
        if cmd[0] == "run":
            _, n, rate = cmd
            t0 = time.monotonic()
            nxt = t0
            done = 0
            while done < n:
                batch = engine.step(prompts.next())
                if batch is None:
                    continue
                pub.publish(batch)
                truth.apply(batch)
                done += 1
                if rate:
                    nxt += 1.0 / rate
                    pause = nxt - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)  # pacing the workload, not waiting on a result
            published += n
            last = pub.stats().last_seq
            conn.send(("done", Done(last, published, truth.as_dict(), sorted(engine.lru),
                                    time.monotonic() - t0)))
        elif cmd[0] == "stats":
            conn.send(("stats", msgspec.to_builtins(pub.stats())))
        elif cmd[0] == "stop":
            pub.shutdown(timeout=1.0)
            if ctx is not None:
                ctx.term()
            conn.send(("stopped",))
            return


# --------------------------------------------------------------------------- reference publisher


def _ref_sockets(port: int, rport: int, opts: dict) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, opts.get("hwm", 100))  # vLLM 0.33's default: hwm=100
    router = ctx.socket(zmq.ROUTER)  # no ROUTER_MANDATORY: drops at its HWM, as vLLM's does
    router.setsockopt(zmq.SNDHWM, opts.get("router_hwm", 1000))
    if opts.get("per_send"):
        # Serving an answer over many turns, a publisher must notice that its client is
        # gone (or the next client's request waits behind thousands of dead replies):
        # MANDATORY reports that; a full pipe (Again) is still a silent drop below.
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    for s_ in (pub, router):
        s_.setsockopt(zmq.LINGER, 0)
        if opts.get("sndbuf"):
            s_.setsockopt(zmq.SNDBUF, opts["sndbuf"])
    deadline = time.monotonic() + 10.0
    while True:
        try:
            pub.bind(f"tcp://127.0.0.1:{port}")
            router.bind(f"tcp://127.0.0.1:{rport}")
            return ctx, pub, router
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # the killed predecessor's port is not free yet


def ref_engine_main(conn: Any, port: int, rport: int, seed: int, opts: dict) -> None:
    """vLLM's ZmqEventPublisher as its transport spec describes it, written from the spec: one
    sending loop owns the PUB and the ROUTER; between two live sends it serves one waiting
    replay request, the whole answer at once (``per_send=None``, as vLLM does) or
    ``per_send`` messages of it per live send (the answer then follows the ring as it moves,
    evictions included). No INFO, no snapshots, no heartbeats: a reference publisher.
    ``pause_replay`` leaves the ROUTER unread (a sending loop busy elsewhere)."""
    try:
        ctx, pub, router = _ref_sockets(port, rport, opts)
    except Exception as e:
        conn.send(("error", repr(e)))
        return
    steps = opts.get("buffer_steps", 20_000)
    ring: dict[int, bytes] = {}  # the last ``steps`` batches by seq (contiguous)
    per_send = opts.get("per_send")
    conn.send(("ready", int(pub.getsockopt(zmq.LAST_ENDPOINT).rsplit(b":", 1)[1]),
               int(router.getsockopt(zmq.LAST_ENDPOINT).rsplit(b":", 1)[1]), None, os.getpid()))
    engine = DemoEngine(capacity=opts.get("capacity", 1500))
    prompts = Prompts(seed, opts.get("workload", "wide"))
    truth = BlockCache()
    history: list[KVEventBatch] = []
    seq = 0
    paused = False
    serving: list | None = None  # [identity, next seq]
    counts = {"replay_requests": 0, "replay_sent": 0, "payload_bytes": 0}
    job: list | None = None  # [left, rate, next send time, t0, n]
    todo: list[tuple[KVEventBatch, bytes]] = []

    def serve(budget: int | None) -> None:
        nonlocal serving
        if serving is None:
            if paused or not router.poll(0):
                return
            frames = router.recv_multipart()
            if len(frames) != 3:
                return  # the reference ignores malformed requests
            counts["replay_requests"] += 1
            serving = [frames[0], int.from_bytes(frames[2], "big")]
        ident, cursor = serving
        cursor = max(cursor, seq - len(ring))  # evicted meanwhile: the answer skips them
        n = 0
        while cursor < seq:
            if budget is not None and n >= budget:
                serving[1] = cursor
                return
            try:
                router.send_multipart([ident, b"", b"", cursor.to_bytes(8, "big"),
                                       ring[cursor]], zmq.NOBLOCK)
                counts["replay_sent"] += 1
            except zmq.Again:
                pass  # the HWM: dropped, as without MANDATORY
            except zmq.ZMQError:  # EHOSTUNREACH: the client is gone
                serving = None
                return
            n += 1
            cursor += 1
        try:
            router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""],
                                  zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # dropped (HWM) or the client is gone
        serving = None

    try:
        while True:
            while conn.poll(0 if job else 0.005):
                cmd = conn.recv()
                if cmd[0] == "run":
                    # The workload is built first (its hashing costs ~0.6 ms a batch), so
                    # the sends themselves run at the rate asked (thousands a second).
                    todo = []
                    while len(todo) < cmd[1]:
                        b_ = engine.step(prompts.next())
                        if b_ is not None:
                            todo.append((b_, encode_batch(b_, "vllm")))
                    todo.reverse()
                    job = [cmd[1], cmd[2], time.monotonic(), time.monotonic(), cmd[1]]
                elif cmd[0] == "pause_replay":
                    paused = cmd[1]
                    conn.send(("paused", paused))
                elif cmd[0] == "stats":
                    conn.send(("stats", dict(counts, seq=seq - 1,
                                             oldest=seq - len(ring) if ring else -1)))
                elif cmd[0] == "truth_since":
                    c = BlockCache()
                    for b in history[cmd[1] + 1:]:
                        c.apply(b)
                    conn.send(("truth", c.as_dict()))
                elif cmd[0] == "stop":
                    conn.send(("stopped",))
                    return
            serve(per_send)  # replay between live sends, as the reference does
            if job is None:
                continue
            batch, payload = todo.pop()
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])  # drops at the HWM
            ring[seq] = payload
            if len(ring) > steps:
                del ring[seq - steps]
            truth.apply(batch)
            history.append(batch)
            counts["payload_bytes"] += len(payload)
            seq += 1
            job[0] -= 1
            if job[0] == 0:
                conn.send(("done", Done(seq - 1, seq, truth.as_dict(), sorted(engine.lru),
                                        time.monotonic() - job[3])))
                job = None
            elif job[1]:
                job[2] += 1.0 / job[1]
                pause = job[2] - time.monotonic()
                if pause > 0:
                    time.sleep(pause)  # pacing the workload, not waiting on a result
    finally:
        pub.close()
        router.close()
        ctx.term()


class Engine:
    """Parent-side handle of one engine process (``ref=True``: the reference publisher)."""

    def __init__(self, seed: int, port: int = 0, rport: int = 0, ref: bool = False,
                 **opts: Any) -> None:
        self.seed = seed
        self.conn, child = CTX.Pipe()
        main = ref_engine_main if ref else engine_main
        self.proc = CTX.Process(target=main, args=(child, port, rport, seed, opts),
                                daemon=True, name=f"kvwire-engine-{seed}")
        self.proc.start()
        child.close()
        self.done: Done | None = None
        self.stopped = False
        msg = self._recv(60.0, "engine start")
        assert msg[0] == "ready", f"engine did not start: {msg}"
        _, self.port, self.rport, self.epoch, self.pid = msg

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.rport}"

    def spec(self, name: str = "e") -> StreamSpec:
        return StreamSpec(name, self.endpoint, "", self.replay_endpoint)

    def _recv(self, timeout: float, what: str) -> Any:
        if not self.conn.poll(timeout):
            raise AssertionError(f"{what}: no answer from engine {self.seed} in {timeout}s")
        return self.conn.recv()

    def run(self, n: int, rate: float | None = None) -> None:
        """Start publishing ``n`` batches (paced at ``rate``/s, or flat out); returns at once."""
        self.done = None
        self.conn.send(("run", n, rate))

    def poll_done(self) -> Done | None:
        if self.done is None and self.conn.poll(0):
            msg = self.conn.recv()
            assert msg[0] == "done", msg
            self.done = msg[1]
        return self.done

    def wait_done(self, timeout: float) -> Done:
        msg = self._recv(timeout, "engine run")
        assert msg[0] == "done", msg
        self.done = msg[1]
        return self.done

    def stats(self) -> dict:
        self.conn.send(("stats",))
        msg = self._recv(10.0, "engine stats")
        return msg[1]

    def pause_replay(self, paused: bool) -> None:
        """Reference publisher only: stop / resume reading replay requests."""
        self.conn.send(("pause_replay", paused))
        assert self._recv(10.0, "pause replay") == ("paused", paused)

    def truth_since(self, seq: int) -> dict:
        """Reference publisher only: the cache that the batches after ``seq`` describe."""
        self.conn.send(("truth_since", seq))
        return self._recv(30.0, "truth since")[1]

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.signal(signal.SIGCONT)  # a stopped process cannot die cleanly otherwise
            self.proc.kill()
        self.proc.join(10)
        self.conn.close()

    def close(self) -> None:
        """Graceful stop if possible, kill otherwise; always reaps the process."""
        try:
            if self.proc.is_alive() and not self.stopped:
                self.signal(signal.SIGCONT)
                self.conn.send(("stop",))
                deadline = time.monotonic() + 5.0
                while self.proc.is_alive() and time.monotonic() < deadline:
                    if self.conn.poll(0.1):
                        msg = self.conn.recv()
                        if msg[0] == "stopped":
                            break
                self.stopped = True
                self.proc.join(5)
        except (OSError, EOFError, BrokenPipeError):
            pass
        finally:
            _reap(self.proc, self.conn)


def _reap(proc: Any, conn: Any) -> None:
    """Kill a child that did not stop by itself, wait for it, close its pipe: no orphans."""
    if proc.is_alive():
        proc.kill()
    proc.join(10)
    conn.close()


# --------------------------------------------------------------------------- rebuild


class Rebuild:
    """Applies deliveries of one stream and checks ``Reset, Snapshot(N), Batch(N+1), ...``."""

    def __init__(self) -> None:
        self.cache: BlockCache | None = None
        self.next: int | None = None
        self.epoch: int | None = None
        self.exact = False
        self.resets: list[str] = []
        self.snapshots: list[tuple[int, bool, int | None, int]] = []  # seq, exact, epoch, n
        self.liveness: list[tuple[bool, float]] = []
        self.batches = 0
        self._need_snapshot = False
        self.first_snapshot_at: float | None = None
        self.first_batch_after_snapshot_at: float | None = None

    def feed(self, d: Any) -> None:
        t = type(d)
        if t is Batch:
            assert not self._need_snapshot, "Batch between Reset and Snapshot"
            assert self.next is not None and d.seq == self.next, (d.seq, self.next)
            assert d.epoch == self.epoch, (d.epoch, self.epoch)
            self.next += 1
            self.cache.apply(d.batch)  # type: ignore[union-attr]
            self.batches += 1
            if self.first_batch_after_snapshot_at is None:
                self.first_batch_after_snapshot_at = time.monotonic()
        elif t is Reset:
            self.resets.append(d.reason)
            self.cache = BlockCache()
            self.next = None
            self._need_snapshot = True
        elif t is Snapshot:
            assert self._need_snapshot, "Snapshot without a Reset before it"
            self._need_snapshot = False
            c = self.cache = BlockCache()
            c.apply_events(d.blocks)
            self.next = d.seq + 1
            self.epoch = d.epoch
            self.exact = d.exact
            self.snapshots.append((d.seq, d.exact, d.epoch, d.block_count))
            if self.first_snapshot_at is None:
                self.first_snapshot_at = time.monotonic()
        elif t is Liveness:
            self.liveness.append((d.alive, time.monotonic()))
        else:  # pragma: no cover
            raise AssertionError(f"unexpected delivery {d!r}")

    @property
    def last_seq(self) -> int:
        return -2 if self.next is None else self.next - 1

    def as_dict(self) -> dict:
        return {} if self.cache is None else self.cache.as_dict()

    def state(self) -> dict:
        return {"last_seq": self.last_seq, "epoch": self.epoch, "exact": self.exact,
                "resets": list(self.resets), "snapshots": list(self.snapshots),
                "batches": self.batches, "liveness": [a for a, _ in self.liveness]}


def pump(sub: Subscriber, rb: Rebuild, until: Callable[[], bool], timeout: float,
         what: str = "condition") -> None:
    """Feed deliveries to ``rb`` until ``until()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not until():
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{what}: not met in {timeout}s; rebuild {rb.state()}; "
                                 f"stats {sub.stats()}")
        item = sub.poll(min(left, 0.05))
        if item is not None:
            rb.feed(item)


# --------------------------------------------------------------------------- subscriber process


def subscriber_main(conn: Any, spec: tuple, cfg: dict) -> None:
    cfg = dict(cfg)
    rcvhwm, rcvbuf = cfg.pop("rcvhwm", 100_000), cfg.pop("rcvbuf", None)
    ctx = zmq.Context()
    if rcvbuf:
        ctx.setsockopt(zmq.RCVBUF, rcvbuf)  # small kernel buffers: a stall overflows them
    sub = Subscriber([StreamSpec(*spec)], config=StreamConfig(**cfg), ctx=ctx, rcvhwm=rcvhwm)
    rb = Rebuild()
    conn.send(("ready", os.getpid()))
    try:
        while True:
            item = sub.poll(0.02)
            if item is not None:
                rb.feed(item)
            while conn.poll(0):
                cmd = conn.recv()
                if cmd == "state":
                    st = msgspec.to_builtins(sub.stats()[spec[0]].stream)
                    conn.send(("state", rb.state(), st))
                elif cmd == "cache":
                    conn.send(("cache", rb.as_dict()))
                elif cmd == "stop":
                    conn.send(("stopped",))
                    return
    except BaseException as e:  # a broken contract: tell the test, then die
        try:
            conn.send(("error", repr(e)))
        except OSError:
            pass
        raise
    finally:
        sub.close()
        ctx.term()


class Child:
    """A spawned process driven over a Pipe: ``target(conn, *args)`` answers ``("ready", ...)``
    first, then one message per command asked. It can be SIGKILLed; ``close`` leaves no
    orphan either way."""

    def __init__(self, target: Callable[..., None], args: tuple, name: str) -> None:
        self.name = name
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=target, args=(child, *args), daemon=True, name=name)
        self.proc.start()
        child.close()
        msg = self._ask(None, 60.0)
        assert msg[0] == "ready", msg

    def _ask(self, cmd: str | None, timeout: float) -> Any:
        if cmd is not None:
            try:
                self.conn.send(cmd)
            except OSError:  # it died; its last words (an "error") may still be in the pipe
                pass
        if not self.conn.poll(timeout):
            raise AssertionError(f"{self.name} process: no answer to {cmd!r} in {timeout}s")
        msg = self.conn.recv()
        assert msg[0] != "error", f"{self.name} process failed: {msg[1]}"
        return msg

    def cache(self) -> dict:
        return self._ask("cache", 30.0)[1]

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        self.conn.close()

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send("stop")
                if self.conn.poll(5):
                    self.conn.recv()
                self.proc.join(5)
        except (OSError, EOFError, BrokenPipeError):
            pass
        finally:
            _reap(self.proc, self.conn)


class SubProc(Child):
    """Parent-side handle of one subscriber process."""

    def __init__(self, spec: StreamSpec, cfg: dict) -> None:
        super().__init__(subscriber_main,
                         ((spec.name, spec.endpoint, spec.topic, spec.replay_endpoint), cfg),
                         "kvwire-subscriber")

    def state(self) -> tuple[dict, dict]:
        _, rb, st = self._ask("state", 10.0)
        return rb, st

    def wait(self, cond: Callable[[dict, dict], bool], timeout: float, what: str) -> dict:
        """Poll the process's state (every 20 ms) until ``cond(rebuild, stats)`` holds."""
        deadline = time.monotonic() + timeout
        while True:
            rb, st = self.state()
            if cond(rb, st):
                return rb
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not met in {timeout}s; rebuild {rb}; stats {st}")
            self.conn.poll(0.02)  # nothing arrives unasked: a bounded 20 ms pause
