"""The local reader side of MessageQueue: read the ring in this host's shared memory.

Hot path (pure Python, in ``dequeue``): check the chunk's seq word, copy one pickle
frame out, hand the chunk back, wake the writer only if it flagged itself asleep, then
unpickle. The C path (``_ring.Reader.get`` / ``wait_get``) does the same steps; this
module holds the slow paths both fall back to (sleeping, fragments, frame tables).

A ``close()`` from another thread while one waits releases the ring's views under it;
``MessageQueue._released`` turns that into ``QueueShutdownError`` (the public methods
here catch it in one ``except`` each).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

from . import fence
from . import layout as L
from ._common import (
    _COPY_MAX,
    _MASK40,
    _NOT_READY,
    _NOT_SIMPLE,
    _OFF_WSLEEP,
    _SINGLE_HI,
    _SLOW,
    _SYM,
    _WEAK,
    _loads,
    _mono,
    _parse_frames,
    _ring,
    _RState,
    logger,
)
from .buffer import ShmRingBuffer
from .errors import QueueShutdownError, ShmQueueError, WriterDeadError
from .fence import acquire, full_fence, release
from .handle import Handle
from .liveness import PidWatch
from .queue import MessageQueue

_RELEASED = (ValueError, AttributeError, TypeError)  # what a released/unmapped view raises


class LocalReaderQueue(MessageQueue, side="local_reader"):
    """A reader on the writer's host: ``create_from_handle`` builds one for a local rank."""

    _is_local_reader = True

    def _attach(self, handle: Handle, rank: int, trust_remote_pickle: bool | None) -> None:
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

    def _set_side_hot(self) -> None:
        if _ring and self._pickle_fast:
            self._rnat = self._rs
        else:
            self._rhot = (self._mv, self._u64, self._slots, self._nchunks,
                          self._my_rseq_idx, self.buffer.mm)

    def _wait_ready(self, deadline: float | None) -> None:
        state = self._state_idx
        self._wait(lambda: self._u32[state] != L.W_INIT or self._cancelled, deadline,
                   self._rwake_idx, self._rwake_addr, self._my_sleep_off,
                   self._check_writer_alive_ready, lambda s: f"rank {self.rank}: writer not "
                   f"ready after {s:.1f}s", warn=True)
        if self._cancelled:
            raise QueueShutdownError("cancelled")

    def _close_side(self) -> None:
        if self.buffer and self.buffer.mm is not None:
            self.shutdown()  # a thread of ours blocked in dequeue wakes and raises
            if self._u32[self._my_status_idx] == L.R_ATTACHED:
                self._u32[self._my_status_idx] = L.R_CLOSED
                self._wake_writer()
            self._writer_watch.close()

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
        try:
            nat = self._rnat
            if nat is not None:
                # C hot path (_ring.c): spin briefly, copy one pickle frame out, hand the
                # chunk back, wake a sleeping writer, unpickle.
                obj = nat.get() if timeout is None else nat.get(timeout)
                if obj is not _SLOW:
                    return obj
                return self._dequeue_native_slow(nat, timeout, indefinite)
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
        except _RELEASED as e:
            raise self._released(e) from None
        return _loads(data)

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
        return self._native_wait(nat, timeout, indefinite)

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

    @contextlib.contextmanager
    def acquire_read(self, timeout: float | None = None,
                     indefinite: bool = False) -> Iterator[memoryview]:
        """View of the next chunk's payload, in place; the chunk is released on exit."""
        deadline = None if timeout is None else _mono() + timeout
        try:
            slot = self._read_begin(deadline, indefinite)
            off = self._data_off[slot]
            n = L.meta_nbytes(self._u64[self._meta_idx[slot]])
            view = self._mv[off : off + n]
        except _RELEASED as e:
            raise self._released(e) from None
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
        deadline = None if timeout is None else _mono() + timeout
        try:
            slot = self._read_begin(deadline, indefinite)
            flags = L.meta_flags(self._u64[self._meta_idx[slot]])
            if flags & L.F_FRAGMENT:
                obj = self._read_fragments(slot, deadline, indefinite)
                frames: list[memoryview] = []
            else:
                _, frames = self._frames_at(slot)
                obj = frames[0] if flags & L.F_RAW else self._ser.loads(frames, "view")
        except _RELEASED as e:
            raise self._released(e) from None
        if not frames:
            yield obj
            return
        try:
            yield obj
        finally:
            del obj
            for f in frames:
                with contextlib.suppress(BufferError):
                    f.release()
        self._read_end()
