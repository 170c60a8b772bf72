"""MessageQueue: one writer broadcasts every message, in order, to N readers.

Local readers read a shared-memory ring (see ring.py / layout.py for the slot
protocol, fence.py for memory ordering, wake.py for sleeping). Remote readers
get the same frames over ZeroMQ TCP (remote.py). Messages larger than a chunk
are streamed through consecutive chunks, so they stay in order with no socket.

Hot path, per message and side: no syscall. A side only spins briefly
(``spin_s``), then flags itself asleep in shared memory and futex-waits; the
other side makes the wake syscall only when it sees that flag. While waiting,
peers' liveness is checked every ``liveness_interval`` so a dead peer turns
into a typed error instead of a hang.

The per-message steps run in C (``_ring.c``: ``Writer.put``, ``Reader.get`` /
``wait_get``) when that module is built and ``KVWIRE_SHM_PURE`` is not set; otherwise
in the inlined Python hot paths below. Both share the state objects ``self._ws`` /
``self._rs`` with the Python slow paths (waits, fragments, frame tables, remote).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..wire.frames import poll_ms
from . import _native, fence
from . import layout as L
from .buffer import ShmRingBuffer
from .errors import QueueShutdownError, ReaderDeadError, ShmQueueError, WriterDeadError
from .fence import acquire, full_fence, publish_fence, register_process, release, sleep_fence
from .handle import Handle
from .liveness import PidWatch
from .remote import (
    KIND_MSG,
    KIND_READY,
    KIND_SHUTDOWN,
    RemotePublisher,
    RemoteSubscriber,
    default_ip,
)
from .ring import blocking_readers, can_write, min_live_rseq
from .serializer import PickleSerializer, Serializer, default_serializer
from .wake import futex_wait, futex_wake

logger = logging.getLogger("kvwire.shm")
_mono = time.monotonic
_yield = os.sched_yield
_SPIN_NO_YIELD_S = 50e-6
_dumps = pickle.dumps
_loads = pickle.loads
_RAW_MIN = 4096  # smaller bytes are cheaper pickled (one frame, no frame table)
_WEAK = not fence.STRONGLY_ORDERED  # data path needs release/acquire fences
_SYM = not fence.ASYMMETRIC  # no membarrier: the publishing side needs a full fence too
_SINGLE_HI = L.SINGLE_HI
_SINGLE_META = L.SINGLE_HI << 40
_MASK40 = L.MASK40
_OFF_WSLEEP = L.OFF_WRITER_SLEEPING
_ring = _native.ring  # C hot path (None: pure Python; see _native.py)
_SLOW = _ring.SLOW if _ring else object()
_NOT_READY = _ring.NOT_READY if _ring else 1
_NOT_SIMPLE = _ring.NOT_SIMPLE if _ring else 2
_COPY_MAX = 1 << 16  # single frames up to this size are copied out, then unpickled

KIND_RAW = b"W"
DEFAULT_MAX_CHUNK_BYTES = 10 * 1024 * 1024
DEFAULT_MAX_CHUNKS = 10


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    return float(v) if v else default


def _defaults() -> tuple[float, float, float]:
    spin = _env_float("KVWIRE_SHM_SPIN_US", 200.0) * 1e-6
    live = _env_float("KVWIRE_SHM_LIVENESS_S", 0.1)
    warn = _env_float("KVWIRE_SHM_WARN_INTERVAL",
                      _env_float("VLLM_RINGBUFFER_WARNING_INTERVAL", 60.0))
    return spin, live, warn


def _trust_env() -> bool:
    return os.environ.get("KVWIRE_SHM_TRUST_REMOTE_PICKLE", "") in ("1", "true", "yes")


class _WState:
    """Writer state of the pure-Python path (the C ``_ring.Writer`` has the same fields)."""

    __slots__ = ("wseq", "min_rseq", "next_check")

    def __init__(self) -> None:
        self.wseq = 0  # messages published
        self.min_rseq = 0  # cached position of the slowest live reader
        self.next_check = 0.0  # monotonic time of the next liveness check


class _RState:
    """Reader state of the pure-Python path (the C ``_ring.Reader`` has the same field)."""

    __slots__ = ("rseq",)

    def __init__(self, rseq: int) -> None:
        self.rseq = rseq  # messages consumed (our rseq word in the ring holds the same)


def _as_bytes_view(f: Any) -> memoryview:
    v = f if isinstance(f, memoryview) else memoryview(f)
    if v.format != "B" or v.ndim != 1:
        v = v.cast("B")
    return v


class MessageQueue:
    """Broadcast queue, drop-in for vLLM's ``MessageQueue`` (same constructor and methods).

    Extra keyword-only knobs: ``serializer`` (default pickle), ``spin_s`` (busy-wait
    before sleeping), ``liveness_interval`` (how often a waiting side checks that its
    peers live; bounds dead-peer detection), ``warn_interval`` (log while waiting).
    """

    # ------------------------------------------------------------------ setup
    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        connect_ip: str | None = None,
        *,
        serializer: Serializer | None = None,
        spin_s: float | None = None,
        liveness_interval: float | None = None,
        warn_interval: float | None = None,
        remote_reader_ranks: list[int] | None = None,
    ) -> None:
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        if len(local_reader_ranks) != n_local_reader:
            raise ValueError("len(local_reader_ranks) must equal n_local_reader")
        if not 0 <= n_local_reader <= n_reader:
            raise ValueError("need 0 <= n_local_reader <= n_reader")
        self._setup_common(serializer, spin_s, liveness_interval, warn_interval)
        self._is_writer = True
        self._is_local_reader = self._is_remote_reader = False
        self._cbytes = max_chunk_bytes
        self.n_reader = n_reader
        self.n_local_reader = n_local_reader
        self.local_reader_ranks = list(local_reader_ranks)
        self.n_remote_reader = n_reader - n_local_reader
        if remote_reader_ranks is None:  # the smallest ranks that are not local
            free = (r for r in range(n_reader + n_local_reader) if r not in local_reader_ranks)
            remote_reader_ranks = [next(free) for _ in range(n_reader - n_local_reader)]
        self.remote_ranks = list(remote_reader_ranks)
        self.buffer = (ShmRingBuffer(n_local_reader, max_chunk_bytes, max_chunks)
                       if n_local_reader else None)
        self._remote = (RemotePublisher(connect_ip or os.environ.get("KVWIRE_HOST_IP")
                                        or default_ip(), self.n_remote_reader)
                        if self.n_remote_reader else None)
        self._remote_live = dict.fromkeys(self.remote_ranks, True)
        self.handle = Handle(
            local_reader_ranks=list(self.local_reader_ranks),
            buffer_handle=((n_local_reader, max_chunk_bytes, max_chunks, self.buffer.name)
                           if self.buffer else None),
            remote_subscribe_addr=self._remote.addr if self._remote else None,
            remote_addr_ipv6=self._remote.ipv6 if self._remote else False,
            n_reader=n_reader,
            serializer=self._ser.name,
            writer_pid=os.getpid(),
        )
        self._live = [True] * n_local_reader
        self._watches: list[PidWatch | None] = [None] * n_local_reader
        self._dead: set[int] = set()
        self._broken: str | None = None
        if self.buffer:
            self._bind_ring()  # creates self._ws (C Writer or _WState)
        else:
            self._ws = _WState()
        self._ws.next_check = time.monotonic() + self._liveness
        self._update_ok()

    def _setup_common(self, serializer: Serializer | None, spin_s: float | None,
                      liveness_interval: float | None, warn_interval: float | None) -> None:
        d_spin, d_live, d_warn = _defaults()
        self._ser: Serializer = serializer or PickleSerializer()
        self._spin_s = d_spin if spin_s is None else spin_s
        self._liveness = d_live if liveness_interval is None else liveness_interval
        self._warn_interval = d_warn if warn_interval is None else warn_interval
        register_process()
        self._cancelled = False
        self._shut = False
        self._w_ok = False
        self._whot: tuple | None = None
        self._rhot: tuple | None = None
        self._wnat: Any = None  # _ring.Writer while the C hot path may be used
        self._rnat: Any = None  # _ring.Reader while the C hot path may be used
        self._oob: list[Any] = []
        self._pickle_fast = type(self._ser) is PickleSerializer
        self._ready = False
        self.buffer: ShmRingBuffer | None = None
        self._remote: RemotePublisher | None = None
        self._sub: RemoteSubscriber | None = None

    def _bind_ring(self) -> None:
        """Precompute word indices so the hot path is plain indexing."""
        b = self.buffer
        assert b is not None
        self._mv, self._u64, self._u32 = b.mv, b.u64, b.u32
        self._nchunks = n = b.max_chunks
        self._cbytes = b.max_chunk_bytes
        self._data_off = [b.data_offset(i) for i in range(n)]
        self._seq_idx = [(b.chunk_offset(i) + L.C_SEQ) // 8 for i in range(n)]
        self._nbytes_idx = [(b.chunk_offset(i) + L.C_NBYTES) // 8 for i in range(n)]
        self._total_idx = [(b.chunk_offset(i) + L.C_TOTAL) // 8 for i in range(n)]
        self._meta_idx = [(b.chunk_offset(i) + L.C_META) // 8 for i in range(n)]
        self._slots = [(self._data_off[i], self._seq_idx[i], self._meta_idx[i])
                       for i in range(n)]
        nl = b.n_reader
        self._rseq_idx = [(b.reader_offset(i) + L.R_SEQ) // 8 for i in range(nl)]
        self._pid_idx = [(b.reader_offset(i) + L.R_PID) // 4 for i in range(nl)]
        self._status_idx = [(b.reader_offset(i) + L.R_STATUS) // 4 for i in range(nl)]
        self._sleep_words = [L.OFF_SLEEPERS // 8 + j for j in range((nl + 7) // 8)]
        self._rwake_idx = L.OFF_RWAKE // 4
        self._wwake_idx = L.OFF_WWAKE // 4
        self._rwake_addr = b.base_address + L.OFF_RWAKE
        self._wwake_addr = b.base_address + L.OFF_WWAKE
        self._state_idx = L.OFF_WRITER_STATE // 4
        if self._is_writer:
            self._ws = (_ring.Writer(b.mm, nl, b.max_chunk_bytes, n, b.header_size,
                                     b.chunk_stride, _dumps, fence.ASYMMETRIC, self._spin_s,
                                     _RAW_MIN) if _ring else _WState())

    @property
    def native(self) -> bool:
        """Whether this queue's per-message path runs in C (kvwire.shm._ring): a local
        ring, pickle, and (writer) no remote readers; else it is the Python one."""
        st = self.__dict__.get("_ws") if self._is_writer else self.__dict__.get("_rs")
        return (_ring is not None and isinstance(st, (_ring.Writer, _ring.Reader))
                and self._pickle_fast and self._remote is None)

    def _set_hot(self) -> None:
        """Bundle what the hot paths read, so each reads one attribute (None = slow path)."""
        self._whot = self._rhot = self._wnat = self._rnat = None
        if self.buffer is None or self.buffer.mm is None:
            return
        if self._is_writer:
            if self._w_ok and self._remote is None and self._pickle_fast:
                if _ring:
                    self._wnat = self._ws
                elif len(self._sleep_words) == 1:
                    self._whot = (self._mv, self._u64, self._slots, self._nchunks,
                                  self._cbytes, self._sleep_words[0], self.buffer.mm)
        elif self._is_local_reader:
            if _ring and self._pickle_fast:
                self._rnat = self._rs
            else:
                self._rhot = (self._mv, self._u64, self._slots, self._nchunks,
                              self._my_rseq_idx, self.buffer.mm)

    def export_handle(self) -> Handle:
        return self.handle

    @staticmethod
    def create_from_handle(
        handle: Handle,
        rank: int,
        *,
        serializer: Serializer | None = None,
        trust_remote_pickle: bool | None = None,
        spin_s: float | None = None,
        liveness_interval: float | None = None,
        warn_interval: float | None = None,
    ) -> MessageQueue:
        """Join as reader ``rank``: local if the rank is in ``handle.local_reader_ranks``.

        A remote reader refuses a pickle-serialized queue unless
        ``trust_remote_pickle=True`` (or env ``KVWIRE_SHM_TRUST_REMOTE_PICKLE=1``):
        unpickling bytes from a socket runs code chosen by whoever can reach it.
        """
        self = MessageQueue.__new__(MessageQueue)
        ser = serializer or default_serializer(handle.serializer)
        if ser.name != handle.serializer:
            raise ValueError(f"writer uses serializer {handle.serializer!r}, got {ser.name!r}")
        self._setup_common(ser, spin_s, liveness_interval, warn_interval)
        self._is_writer = False
        self.n_reader = handle.n_reader
        self.handle = handle
        self.local_reader_ranks = list(handle.local_reader_ranks)
        self.rank = rank
        if rank in handle.local_reader_ranks:
            self._is_local_reader, self._is_remote_reader = True, False
            assert handle.buffer_handle is not None
            n_local, cbytes, nchunks, name = handle.buffer_handle
            self.buffer = ShmRingBuffer(n_local, cbytes, nchunks, name)
            self._bind_ring()
            self._idx = idx = handle.local_reader_ranks.index(rank)
            if self._u32[self._status_idx[idx]] != L.R_EMPTY:
                raise ShmQueueError(f"reader rank {rank} is already attached to this queue")
            self._my_rseq_idx = self._rseq_idx[idx]
            self._my_status_idx = self._status_idx[idx]
            self._my_sleep_off = L.OFF_SLEEPERS + idx
            b = self.buffer
            self._rs = (_ring.Reader(b.mm, n_local, cbytes, nchunks, b.header_size,
                                     b.chunk_stride, idx, _loads, fence.ASYMMETRIC,
                                     self._spin_s, _COPY_MAX)
                        if _ring else _RState(self._u64[self._my_rseq_idx]))
            self._writer_watch = PidWatch(self.buffer.writer_pid)
            self._u32[self._pid_idx[idx]] = os.getpid()
            release()
            self._u32[self._my_status_idx] = L.R_ATTACHED
            self._wake_writer()
            self._set_hot()
        else:
            self._is_local_reader, self._is_remote_reader = False, True
            if handle.remote_subscribe_addr is None:
                raise ValueError(f"rank {rank} is not local and the queue has no remote endpoint")
            trust = _trust_env() if trust_remote_pickle is None else trust_remote_pickle
            if ser.name == "pickle" and not trust:
                raise ShmQueueError(
                    "remote reader: refusing to unpickle messages received over TCP. Use "
                    "serializer=MsgspecSerializer(...) on both sides, or opt in with "
                    "trust_remote_pickle=True / KVWIRE_SHM_TRUST_REMOTE_PICKLE=1 if every "
                    "host that can reach the writer's port is trusted."
                )
            self._sub = RemoteSubscriber(handle.remote_subscribe_addr, rank,
                                         handle.remote_addr_ipv6)
        return self

    # ------------------------------------------------------------- readiness
    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Collective: returns once every reader is attached and the writer said so."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._is_writer:
            self._writer_wait_ready(deadline)
        elif self._is_local_reader:
            state = self._state_idx
            self._wait(lambda: self._u32[state] != L.W_INIT or self._cancelled, deadline,
                       self._rwake_idx, self._rwake_addr, self._my_sleep_off,
                       self._check_writer_alive_ready, lambda s: f"rank {self.rank}: writer not "
                       f"ready after {s:.1f}s", warn=True)
            if self._cancelled:
                raise QueueShutdownError("cancelled")
        else:
            assert self._sub is not None
            while True:
                if self._sub.wait(self._poll_ms(deadline)):
                    frames = self._sub.recv()
                    kind = frames[0].bytes
                    if kind == KIND_READY:
                        break
                    if kind == KIND_SHUTDOWN:
                        raise QueueShutdownError("writer shut down the queue")
                elif deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError("writer not ready")
                if self._cancelled:
                    raise QueueShutdownError("cancelled")
        self._ready = True

    def _poll_ms(self, deadline: float | None) -> int:
        t = self._liveness
        if deadline is not None:
            t = min(t, max(0.0, deadline - time.monotonic()))
        return poll_ms(t)

    def _writer_wait_ready(self, deadline: float | None) -> None:
        while True:
            local_ok = all(self._u32[i] != L.R_EMPTY for i in self._status_idx) \
                if self.buffer else True
            if self._remote:
                self._remote.poll_events(0)
            if local_ok and (self._remote is None or self._remote.all_joined()):
                break
            if deadline is not None and time.monotonic() >= deadline:
                missing = [self.local_reader_ranks[i] for i, s in enumerate(self._status_idx)
                           if self._u32[s] == L.R_EMPTY] if self.buffer else []
                if self._remote:
                    missing += sorted(set(self.remote_ranks) - self._remote.joined) or [
                    f"{self.n_remote_reader - len(self._remote.joined)} remote"]
                raise TimeoutError(f"reader rank(s) {missing} never joined")
            if self._remote:
                self._remote.poll_events(2)
            else:
                time.sleep(0.001)
        if self.buffer:
            for i in range(self.n_local_reader):
                self._watches[i] = PidWatch(self._u32[self._pid_idx[i]])
            # Everyone mapped the ring: close our fd so nobody else can open it.
            self.buffer.close_fd()
        self._announce(L.W_READY, KIND_READY)

    def _announce(self, state: int, kind: bytes) -> None:
        """Writer: publish a new writer state (ready, shut down) to every reader."""
        if self.buffer and self.buffer.mm is not None:
            release()
            self._u32[self._state_idx] = state
            publish_fence()
            self._wake_readers()
        if self._remote:
            self._remote.send(kind, [])

    # ----------------------------------------------------------- wait engine
    def _wait(self, cond: Callable[[], bool], deadline: float | None, word_idx: int,
              word_addr: int, flag_off: int, check: Callable[[], None],
              describe: Callable[[float], str], warn: bool, spin: float | None = None) -> None:
        """Spin, then sleep on a futex word until ``cond()``; see module docstring.

        ``spin`` overrides ``spin_s`` (0 after the C hot path already spun)."""
        mono = time.monotonic
        start = mono()
        spin_end = start + (self._spin_s if spin is None else spin)
        if deadline is not None:
            spin_end = min(spin_end, deadline)
        yield_after = start + _SPIN_NO_YIELD_S
        while not cond():
            t = mono()
            if t >= spin_end:
                break
            if t >= yield_after:
                _yield()  # a long wait: let a peer that shares our core run
        else:
            return
        mv, u32 = self._mv, self._u32
        next_check = start
        next_warn = start + self._warn_interval if warn and self._warn_interval > 0 else math.inf
        try:
            while True:
                g = u32[word_idx]
                mv[flag_off] = 1
                sleep_fence()
                if cond():
                    return
                t = mono()
                if t >= next_check:
                    check()
                    next_check = t + self._liveness
                    continue
                if deadline is not None and t >= deadline:
                    raise TimeoutError(describe(t - start))
                if t >= next_warn:
                    logger.warning("kvwire.shm: %s", describe(t - start))
                    next_warn = t + self._warn_interval
                until = min(next_check, next_warn, math.inf if deadline is None else deadline)
                futex_wait(word_addr, g, until - t)
                if cond():  # woken for our condition: leave without re-arming (no fence)
                    return
        finally:
            mv[flag_off] = 0

    def _wake_readers(self) -> None:
        u32 = self._u32
        u32[self._rwake_idx] = (u32[self._rwake_idx] + 1) & 0xFFFFFFFF
        futex_wake(self._rwake_addr)

    def _wake_writer(self) -> None:
        publish_fence()
        if self._mv[L.OFF_WRITER_SLEEPING]:
            u32 = self._u32
            u32[self._wwake_idx] = (u32[self._wwake_idx] + 1) & 0xFFFFFFFF
            futex_wake(self._wwake_addr)

    # ---------------------------------------------------------------- writer
    def _refresh_min(self) -> None:
        u64, u32, live = self._u64, self._u32, self._live
        for i, sidx in enumerate(self._status_idx):
            if live[i] and u32[sidx] in (L.R_DROPPED, L.R_CLOSED):
                live[i] = False
        ws = self._ws
        ws.min_rseq = min_live_rseq([u64[j] for j in self._rseq_idx], live, ws.wseq)
        acquire()

    def _writable(self) -> bool:
        if self._cancelled:
            return True
        self._refresh_min()
        return can_write(self._ws.wseq, self._ws.min_rseq, self._nchunks)

    def _lagging_ranks(self) -> list[int]:
        rseqs = [self._u64[j] for j in self._rseq_idx]
        idx = blocking_readers(rseqs, self._live, self._ws.wseq, self._nchunks)
        return [self.local_reader_ranks[i] for i in idx]

    def _scan_dead(self) -> list[int]:
        dead = []
        for i in range(self.n_local_reader):
            if not self._live[i]:
                continue
            if self._u32[self._status_idx[i]] in (L.R_DROPPED, L.R_CLOSED):
                self._live[i] = False
                continue
            w = self._watches[i]
            if w is None:
                pid = self._u32[self._pid_idx[i]]
                if pid:
                    w = self._watches[i] = PidWatch(pid)
            if w is not None and not w.alive():
                dead.append(self.local_reader_ranks[i])
        if self._remote:
            self._remote.poll_events(0)
            dead += [r for r in self._remote.gone if self._remote_live.get(r, True)]
        return dead

    def _check_readers(self) -> None:
        self._ws.next_check = time.monotonic() + self._liveness
        dead = self._scan_dead()
        if dead:
            self._dead.update(dead)
            self._update_ok()
        if self._dead:
            raise ReaderDeadError(sorted(self._dead), "detected by the writer")

    def _wait_writable(self, deadline: float | None, spin: float | None = None) -> None:
        self._wait(self._writable, deadline, self._wwake_idx, self._wwake_addr,
                   L.OFF_WRITER_SLEEPING, self._check_readers,
                   lambda s: f"writer: no free chunk for {s:.1f}s; reader rank(s) "
                   f"{self._lagging_ranks()} are behind", warn=True, spin=spin)
        if self._cancelled:
            raise QueueShutdownError("cancelled")

    def _acquire_slot(self, deadline: float | None, spin: float | None = None) -> int:
        wseq = self._ws.wseq
        if wseq - self._ws.min_rseq >= self._nchunks and not self._writable():
            self._wait_writable(deadline, spin)
        return wseq % self._nchunks

    def _publish(self, slot: int, nbytes: int, total: int, flags: int, nframes: int) -> None:
        u64 = self._u64
        if nframes > L.MAX_FRAMES:
            raise ShmQueueError(f"too many out-of-band buffers ({nframes})")
        u64[self._total_idx[slot]] = total
        u64[self._meta_idx[slot]] = L.meta(nbytes, flags, nframes)
        if _WEAK:
            release()
        ws = self._ws
        ws.wseq = wseq = ws.wseq + 1
        u64[self._seq_idx[slot]] = wseq  # the publishing store
        publish_fence()
        for w in self._sleep_words:
            if u64[w]:
                self._wake_readers()
                break

    def _update_ok(self) -> None:
        self._w_ok = (self._is_writer and not self._shut and not self._broken
                      and not self._dead)
        if self.buffer is not None:
            self._set_hot()

    def _writer_prologue(self) -> None:
        self._update_ok()
        if not self._is_writer:
            raise ShmQueueError("only the writer can enqueue")
        if self._shut:
            raise QueueShutdownError("queue was shut down")
        if self._broken:
            raise ShmQueueError(self._broken)
        if self._dead or time.monotonic() >= self._ws.next_check:
            self._check_readers()

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast ``obj``. ``timeout`` bounds the wait for a free chunk (TimeoutError)."""
        nat = self._wnat
        if nat is not None:
            # C hot path (_ring.c): pickle, one frame, one chunk, publish, wake sleepers.
            r = nat.put(obj) if timeout is None else nat.put(obj, timeout)
            if r is None:
                return
            if r is not _SLOW:  # pickled but not published: the general path writes it
                main, bufs = r
                # C already spun on a still-full ring: go straight to the sleep phase
                spun = nat.wseq - nat.min_rseq >= self._nchunks
                self._writer_prologue()
                self._write_frames([main, *(b.raw() for b in bufs)] if bufs else [main],
                                   timeout, 0.0 if spun else None)
                return
            # else: large bytes, sent without pickle below
        hot = self._whot
        if hot is not None and (type(obj) is not bytes or len(obj) < _RAW_MIN):
            # Hot path: pickle, one frame, one chunk, no remote; no syscall unless a
            # reader sleeps. Same steps as _write_frames + _publish, inlined.
            bufs = self._oob
            main = _dumps(obj, 5, buffer_callback=bufs.append)
            ws = self._ws
            wseq = ws.wseq
            mv, u64, slots, nchunks, cbytes, sleep_w0, mm = hot
            n = len(main)
            if (not bufs and n <= cbytes and wseq - ws.min_rseq < nchunks
                    and (wseq & 63 or _mono() < ws.next_check)):
                off, sidx, midx = slots[wseq % nchunks]
                mm[off : off + n] = main
                u64[midx] = n | _SINGLE_META
                if _WEAK:
                    release()
                ws.wseq = wseq = wseq + 1
                u64[sidx] = wseq  # the publishing store
                if _SYM:
                    full_fence()
                if u64[sleep_w0]:
                    self._wake_readers()
                return
            if bufs:
                frames: list[Any] | None = [main, *(b.raw() for b in bufs)]
                bufs.clear()
            else:
                frames = None
            self._writer_prologue()
            self._write_frames([main] if frames is None else frames, timeout)
            return
        if not self._w_ok or _mono() >= self._ws.next_check:
            self._writer_prologue()
        if self._pickle_fast and (type(obj) is not bytes or len(obj) < _RAW_MIN):
            bufs = self._oob
            main = _dumps(obj, 5, buffer_callback=bufs.append)
            if bufs:
                frames: list[Any] | None = [main, *(b.raw() for b in bufs)]
                bufs.clear()
            else:
                frames = None
        else:
            frames = self._ser.dumps(obj)
            if len(frames) == 1:
                main, frames = frames[0], None
        if self.buffer is not None:
            if frames is None and len(main) <= self._cbytes:
                # Hot path: one chunk, one frame. No syscall unless a reader sleeps.
                wseq = self._ws.wseq
                if wseq - self._ws.min_rseq >= self._nchunks and not self._writable():
                    self._wait_writable(None if timeout is None else _mono() + timeout)
                slot = wseq % self._nchunks
                off = self._data_off[slot]
                n = len(main)
                self._mv[off : off + n] = main
                self._publish(slot, n, n, L.F_SINGLE, 1)
            else:
                self._write_frames([main] if frames is None else frames, timeout)
        if self._remote is not None:
            self._remote.send(KIND_MSG, [main] if frames is None else frames)

    def _write_frames(self, frames: list[Any], timeout: float | None,
                      spin: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        cbytes = self._cbytes
        if len(frames) == 1:
            main = frames[0]
            n = len(main)
            if n <= cbytes:
                slot = self._acquire_slot(deadline, spin)
                off = self._data_off[slot]
                self._mv[off : off + n] = main
                self._publish(slot, n, n, L.F_SINGLE, 1)
                return
        views = [_as_bytes_view(f) for f in frames]
        nf = len(views)
        table = struct.pack(f"<{nf}Q", *(len(v) for v in views))
        segs: list[tuple[int, memoryview]] = [(0, memoryview(table))]
        pos = L.round_up(len(table), L.LINE)
        for v in views:
            segs.append((pos, v))
            pos = L.round_up(pos + len(v), L.LINE)
        total = segs[-1][0] + len(segs[-1][1])
        if total <= cbytes:
            slot = self._acquire_slot(deadline, spin)
            base = self._data_off[slot]
            mv = self._mv
            for soff, v in segs:
                mv[base + soff : base + soff + len(v)] = v
            self._publish(slot, total, total, L.F_FRAMED, nf)
            return
        self._write_fragments(segs, total, nf, deadline)

    def _write_fragments(self, segs: list[tuple[int, memoryview]], total: int, nf: int,
                         deadline: float | None) -> None:
        """Stream a message larger than a chunk through consecutive chunks.

        ``timeout`` covers the whole message. If it expires (or a reader dies) after
        the first fragment went out, readers hold half a message: the queue is marked
        broken and further enqueues raise; recreate it.
        """
        cbytes, mv = self._cbytes, self._mv
        pos = 0
        first = True
        while pos < total:
            try:
                slot = self._acquire_slot(deadline)
            except (TimeoutError, QueueShutdownError):
                if not first:
                    self._broken = "a large message was interrupted; recreate the queue"
                    self._update_ok()
                raise
            except ReaderDeadError:
                if not first:
                    self._broken = "a reader died during a large message; recreate the queue"
                    self._update_ok()
                raise
            end = min(pos + cbytes, total)
            base = self._data_off[slot] - pos
            for soff, v in segs:
                s0, s1 = max(pos, soff), min(end, soff + len(v))
                if s0 < s1:
                    mv[base + s0 : base + s1] = v[s0 - soff : s1 - soff]
            flags = L.F_FRAGMENT | (L.F_LAST if end == total else 0)
            self._publish(slot, end - pos, total, flags, nf)
            pos = end
            first = False

    @contextlib.contextmanager
    def acquire_write(self, timeout: float | None = None) -> Iterator[memoryview]:
        """Write one chunk in place; it is published when the block exits without error."""
        self._writer_prologue()
        if self.buffer is None:
            buf = bytearray(self._cbytes)
            yield memoryview(buf)
            assert self._remote is not None
            self._remote.send(KIND_RAW, [buf])
            return
        slot = self._acquire_slot(None if timeout is None else time.monotonic() + timeout)
        off = self._data_off[slot]
        view = self._mv[off : off + self._cbytes]
        try:
            yield view
        finally:
            view.release()
        self._publish(slot, self._cbytes, self._cbytes, L.F_RAW, 0)
        if self._remote:
            self._remote.send(KIND_RAW, [self._mv[off : off + self._cbytes]])

    def drop_reader(self, rank: int) -> None:
        """Stop waiting for reader ``rank`` (dead or unwanted); the others go on."""
        if not self._is_writer:
            raise ShmQueueError("only the writer can drop readers")
        if rank in self.local_reader_ranks:
            i = self.local_reader_ranks.index(rank)
            self._live[i] = False
            self._u32[self._status_idx[i]] = L.R_DROPPED
            self._refresh_min()
        elif self._remote is not None:
            self._remote_live[rank] = False
        else:
            raise ValueError(f"no reader rank {rank}")
        self._dead.discard(rank)
        self._update_ok()

    def drop_dead_readers(self) -> list[int]:
        """Drop every reader found dead now; returns their ranks."""
        dead = sorted(set(self._scan_dead()) | self._dead)
        for r in dead:
            self.drop_reader(r)
        return dead

    # ---------------------------------------------------------------- reader
    def _check_writer_alive_ready(self) -> None:
        if not self._writer_watch.alive() and self._u32[self._state_idx] == L.W_INIT:
            raise WriterDeadError("the writer died before the queue was ready")

    def _read_begin(self, deadline: float | None, indefinite: bool,
                    spin: float | None = None) -> int:
        rseq = self._rs.rseq
        slot = rseq % self._nchunks
        sidx = self._seq_idx[slot]
        want = rseq + 1
        u64, u32, state = self._u64, self._u32, self._state_idx
        if u64[sidx] != want:
            if self._cancelled:
                raise QueueShutdownError("cancelled")

            def cond() -> bool:
                return u64[sidx] == want or u32[state] == L.W_SHUTDOWN or self._cancelled

            def check() -> None:
                if not self._writer_watch.alive() and u64[sidx] != want:
                    raise WriterDeadError(f"reader rank {self.rank}: the writer (pid "
                                          f"{self._writer_watch.pid}) died")
                if u32[self._my_status_idx] == L.R_DROPPED:
                    raise QueueShutdownError(f"reader rank {self.rank} was dropped by the writer")

            self._wait(cond, deadline, self._rwake_idx, self._rwake_addr, self._my_sleep_off,
                       check, lambda s: f"reader rank {self.rank}: no message for {s:.1f}s",
                       warn=not indefinite, spin=spin)
            if u64[sidx] != want:
                if self._cancelled:
                    raise QueueShutdownError("cancelled")
                raise QueueShutdownError("writer shut down the queue")
        acquire()
        return slot

    def _read_end(self) -> None:
        if self._u32[self._my_status_idx] == L.R_DROPPED:
            raise QueueShutdownError(f"reader rank {self.rank} was dropped by the writer")
        release()
        rs = self._rs
        rs.rseq = rseq = rs.rseq + 1
        self._u64[self._my_rseq_idx] = rseq
        self._wake_writer()

    def _frames_at(self, slot: int) -> tuple[int, list[memoryview]]:
        meta = self._u64[self._meta_idx[slot]]
        flags = L.meta_flags(meta)
        off = self._data_off[slot]
        view = self._mv[off : off + L.meta_nbytes(meta)]
        if flags & L.F_SINGLE:
            return flags, [view]
        if flags & L.F_FRAMED:
            return flags, _parse_frames(view, L.meta_nframes(meta))
        return flags, [view]

    def _read_fragments(self, slot: int, deadline: float | None, indefinite: bool) -> Any:
        total = self._u64[self._total_idx[slot]]
        nf = L.meta_nframes(self._u64[self._meta_idx[slot]])
        out = bytearray(total)
        pos = 0
        while True:
            meta = self._u64[self._meta_idx[slot]]
            flags, n = L.meta_flags(meta), L.meta_nbytes(meta)
            off = self._data_off[slot]
            out[pos : pos + n] = self._mv[off : off + n]
            pos += n
            self._read_end()
            if flags & L.F_LAST:
                break
            slot = self._read_begin(None, indefinite)
        return self._ser.loads(_parse_frames(memoryview(out), nf), "own")

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """Next message. TimeoutError after ``timeout``; no wait log if ``indefinite``."""
        nat = self._rnat
        if nat is not None:
            # C hot path (_ring.c): spin briefly, copy one pickle frame out, hand the
            # chunk back, wake a sleeping writer, unpickle.
            obj = nat.get() if timeout is None else nat.get(timeout)
            if obj is not _SLOW:
                return obj
            return self._dequeue_native_slow(nat, timeout, indefinite)
        if self._is_local_reader:
            hot = self._rhot
            if hot is None:
                raise QueueShutdownError("cancelled" if self._cancelled else "queue closed")
            rs = self._rs
            rseq = rs.rseq
            mv, u64, slots, nchunks, my_rseq_idx, mm = hot
            off, sidx, midx = slots[rseq % nchunks]
            if u64[sidx] != rseq + 1:
                self._read_begin(None if timeout is None else _mono() + timeout, indefinite)
            if _WEAK:
                acquire()
            w = u64[midx]
            n = w & _MASK40
            if w >> 40 != _SINGLE_HI or n > _COPY_MAX or not self._pickle_fast:
                return self._dequeue_general(rseq % nchunks, timeout, indefinite)
            data = mm[off : off + n]  # a bytes copy: unpickling bytes is cheaper than a view
            # A seq word that moved on means the writer dropped us and reused the chunk.
            if _WEAK:
                acquire()
            if u64[sidx] != rseq + 1:
                self._torn()
            # Hand the chunk back (as _read_end, inlined) before unpickling our copy.
            if _WEAK:
                release()
            rs.rseq = rseq = rseq + 1
            u64[my_rseq_idx] = rseq
            if _SYM:
                full_fence()
            if mv[_OFF_WSLEEP]:
                self._wake_writer()
            return _loads(data)
        if self._is_remote_reader:
            kind, frames = self._remote_recv(timeout, indefinite)
            if kind == KIND_RAW:
                return frames[0].bytes
            return self._ser.loads([f.buffer for f in frames], "own")
        raise ShmQueueError("only readers can dequeue")

    def _dequeue_native_slow(self, nat: Any, timeout: float | None, indefinite: bool) -> Any:
        """After ``_ring.Reader.get`` returned SLOW (``nat.why`` says why).

        Not ready: C spun already, so sleep at once, one futex round at a time in C
        (``wait_get`` takes the message itself when woken), with the same liveness
        checks, deadline and wait logs between rounds as ``_wait``."""
        why = nat.why
        if why == _NOT_SIMPLE:
            return self._dequeue_general(nat.rseq % self._nchunks, timeout, indefinite)
        if why != _NOT_READY:
            self._torn()
        try:
            return self._native_wait(nat, timeout, indefinite)
        except (ValueError, AttributeError):
            if self._cancelled:  # close() from another thread released the ring under us
                raise QueueShutdownError("queue closed") from None
            raise

    def _native_wait(self, nat: Any, timeout: float | None, indefinite: bool) -> Any:
        start = _mono()
        deadline = None if timeout is None else start + timeout
        next_check = start
        warn = not indefinite and self._warn_interval > 0
        next_warn = start + self._warn_interval if warn else math.inf
        u32, state = self._u32, self._state_idx
        while True:
            if self._cancelled:
                raise QueueShutdownError("cancelled")
            if u32[state] == L.W_SHUTDOWN:  # drained: everything published was read
                obj = nat.get(0)
                if obj is _SLOW and nat.why == _NOT_READY:
                    raise QueueShutdownError("writer shut down the queue")
            else:
                t = _mono()
                if t >= next_check:
                    self._check_writer_for(nat.rseq)
                    next_check = t + self._liveness
                if deadline is not None and t >= deadline:
                    raise TimeoutError(f"reader rank {self.rank}: no message for "
                                       f"{t - start:.1f}s")
                if t >= next_warn:
                    logger.warning("kvwire.shm: reader rank %d: no message for %.1fs",
                                   self.rank, t - start)
                    next_warn = t + self._warn_interval
                until = min(next_check, next_warn, math.inf if deadline is None else deadline)
                obj = nat.wait_get(until - t)
            if obj is not _SLOW:
                return obj
            why = nat.why
            if why == _NOT_SIMPLE:
                return self._dequeue_general(nat.rseq % self._nchunks, timeout, indefinite)
            if why != _NOT_READY:
                self._torn()

    def _check_writer_for(self, rseq: int) -> None:
        """Liveness check of a reader waiting for message ``rseq`` (as _read_begin's)."""
        if (not self._writer_watch.alive()
                and self._u64[self._seq_idx[rseq % self._nchunks]] != rseq + 1):
            raise WriterDeadError(f"reader rank {self.rank}: the writer (pid "
                                  f"{self._writer_watch.pid}) died")
        if self._u32[self._my_status_idx] == L.R_DROPPED:
            raise QueueShutdownError(f"reader rank {self.rank} was dropped by the writer")

    def _torn(self) -> None:
        """The chunk we were reading was reused: we were dropped (or the ring is corrupt)."""
        if self._u32[self._my_status_idx] == L.R_DROPPED:
            raise QueueShutdownError(f"reader rank {self.rank} was dropped by the writer")
        raise ShmQueueError(f"reader rank {self.rank}: chunk reused while being read")

    def _dequeue_general(self, slot: int, timeout: float | None, indefinite: bool) -> Any:
        flags = L.meta_flags(self._u64[self._meta_idx[slot]])
        if flags & L.F_FRAGMENT:
            return self._read_fragments(slot, None, indefinite)
        _, frames = self._frames_at(slot)
        try:
            if flags & L.F_RAW:
                obj: Any = bytes(frames[0])
            else:
                obj = self._ser.loads(frames, "copy")
        finally:
            for f in frames:
                f.release()
        self._read_end()
        return obj

    def _remote_recv(self, timeout: float | None, indefinite: bool) -> tuple[bytes, list[Any]]:
        sub = self._sub
        assert sub is not None
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        next_warn = start + self._warn_interval if self._warn_interval > 0 else math.inf
        while True:
            if self._cancelled:
                raise QueueShutdownError("cancelled")
            if sub.wait(self._poll_ms(deadline)):
                frames = sub.recv()
                kind = frames[0].bytes
                if kind == KIND_SHUTDOWN:
                    raise QueueShutdownError("writer shut down the queue")
                if kind == KIND_READY:
                    continue
                return kind, frames[1:]
            if sub.disconnected:
                raise WriterDeadError(f"reader rank {self.rank}: lost the writer's connection")
            t = time.monotonic()
            if deadline is not None and t >= deadline:
                raise TimeoutError(f"reader rank {self.rank}: no message for {t - start:.1f}s")
            if not indefinite and t >= next_warn:
                logger.warning("kvwire.shm: reader rank %d: no message for %.1fs",
                               self.rank, t - start)
                next_warn = t + self._warn_interval

    @contextlib.contextmanager
    def acquire_read(self, timeout: float | None = None,
                     indefinite: bool = False) -> Iterator[memoryview]:
        """View of the next chunk's payload, in place; the chunk is released on exit."""
        if self._is_remote_reader:
            kind, frames = self._remote_recv(timeout, indefinite)
            yield frames[-1].buffer if frames else memoryview(b"")
            return
        if not self._is_local_reader:
            raise ShmQueueError("only readers can acquire_read")
        deadline = None if timeout is None else time.monotonic() + timeout
        slot = self._read_begin(deadline, indefinite)
        off = self._data_off[slot]
        n = L.meta_nbytes(self._u64[self._meta_idx[slot]])
        view = self._mv[off : off + n]
        try:
            yield view
        finally:
            with contextlib.suppress(BufferError):
                view.release()
        self._read_end()

    @contextlib.contextmanager
    def dequeue_inplace(self, timeout: float | None = None,
                        indefinite: bool = False) -> Iterator[Any]:
        """Like dequeue, but large buffers (bytes, numpy via pickle 5) are views of the ring.

        Valid only inside the block: the chunk is handed back to the writer on exit.
        Messages larger than a chunk are reassembled (copied) as in ``dequeue``.
        """
        if not self._is_local_reader:
            yield self.dequeue(timeout, indefinite)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        slot = self._read_begin(deadline, indefinite)
        flags = L.meta_flags(self._u64[self._meta_idx[slot]])
        if flags & L.F_FRAGMENT:
            yield self._read_fragments(slot, deadline, indefinite)
            return
        _, frames = self._frames_at(slot)
        obj = frames[0] if flags & L.F_RAW else self._ser.loads(frames, "view")
        try:
            yield obj
        finally:
            del obj
            for f in frames:
                with contextlib.suppress(BufferError):
                    f.release()
        self._read_end()

    # ------------------------------------------------------------ lifecycle
    def broadcast_object(self, obj: Any = None) -> Any:
        if self._is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    def shutdown(self) -> None:
        """Writer: tell every reader no message will come (they raise once drained).
        Reader: cancel this process's blocked or future reads. Both wake sleepers."""
        self._cancelled = True
        self._w_ok = False
        self._whot = self._rhot = self._wnat = self._rnat = None
        if self._is_writer and not self._shut:
            self._shut = True
            self._announce(L.W_SHUTDOWN, KIND_SHUTDOWN)
        elif self.buffer and self.buffer.mm is not None:
            futex_wake(self._rwake_addr)

    def close(self) -> None:
        """Release this process's resources (a reader also tells the writer it left)."""
        if self._is_writer:
            self.shutdown()
            for w in self._watches:
                if w:
                    w.close()
        elif self._is_local_reader and self.buffer and self.buffer.mm is not None:
            self.shutdown()  # a thread of ours blocked in dequeue wakes and raises
            if self._u32[self._my_status_idx] == L.R_ATTACHED:
                self._u32[self._my_status_idx] = L.R_CLOSED
                self._wake_writer()
            self._writer_watch.close()
        self._whot = self._rhot = self._wnat = self._rnat = None
        for attr in ("_ws", "_rs"):  # a C state object holds an export of the mapping
            st = self.__dict__.get(attr)
            if st is not None and hasattr(st, "release"):
                st.release()
        for attr in ("_mv", "_u64", "_u32"):
            self.__dict__.pop(attr, None)
        if self.buffer:
            self.buffer.close()
        if self._remote:
            self._remote.close()
            self._remote = None
        if self._sub:
            self._sub.close()
            self._sub = None

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def create_from_process_group(pg: Any, max_chunk_bytes: int, max_chunks: int,
                                  writer_rank: int = 0, external_writer_handle: Handle | None = None,
                                  blocking: bool = True) -> MessageQueue:
        """One writer in ``pg`` (or an external one), every other rank a reader."""
        from .group import create_from_process_group

        return create_from_process_group(pg, max_chunk_bytes, max_chunks, writer_rank,
                                         external_writer_handle, blocking)

    @staticmethod
    def create_from_process_group_single_reader(
            pg: Any, max_chunk_bytes: int, max_chunks: int, reader_rank: int = 0,
            blocking: bool = False) -> tuple[MessageQueue, list[Handle]]:
        """Every rank writes its own queue read by ``reader_rank``; it gets all handles."""
        from .group import create_from_process_group_single_reader

        return create_from_process_group_single_reader(pg, max_chunk_bytes, max_chunks,
                                                       reader_rank, blocking)


def _parse_frames(view: memoryview, nframes: int) -> list[memoryview]:
    lens = struct.unpack_from(f"<{nframes}Q", view, 0)
    off = L.round_up(8 * nframes, L.LINE)
    frames = []
    for n in lens:
        frames.append(view[off : off + n])
        off = L.round_up(off + n, L.LINE)
    return frames
