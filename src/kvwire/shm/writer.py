"""The writer side of MessageQueue: publish into the ring, wait for room, watch readers.

Hot path (pure Python, in ``enqueue``): pickle, copy into the next chunk, publish the
seq word, wake only if a reader flagged itself asleep. The C path (``_ring.Writer.put``)
does the same steps; this module holds the slow paths both fall back to.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Iterator
from typing import Any

from . import fence
from . import layout as L
from ._common import (
    _RAW_MIN,
    _SINGLE_META,
    _SLOW,
    _SYM,
    _WEAK,
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_CHUNKS,
    KIND_RAW,
    _as_bytes_view,
    _local_shutdown_env,
    _mono,
    _ring,
    _WState,
)
from .buffer import ShmRingBuffer
from .errors import QueueShutdownError, ReaderDeadError, ShmQueueError
from .fence import acquire, full_fence, publish_fence, release
from .handle import Handle
from .liveness import PidWatch
from .queue import MessageQueue
from .remote import KIND_MSG, KIND_READY, KIND_SHUTDOWN, RemotePublisher, default_ip
from .ring import blocking_readers, can_write, min_live_rseq
from .serializer import Serializer
from .tensors import queue_dumps


class WriterQueue(MessageQueue, side="writer"):
    """The writer: ``MessageQueue(n_reader, n_local_reader, ...)`` builds one."""

    _is_writer = True

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        connect_ip: str | None = None,
        enable_shm_tensor_arena: bool = False,
        *,
        serializer: Serializer | None = None,
        spin_s: float | None = None,
        liveness_interval: float | None = None,
        warn_interval: float | None = None,
        remote_reader_ranks: list[int] | None = None,
        local_shutdown: bool | None = None,
    ) -> None:
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        if len(local_reader_ranks) != n_local_reader:
            raise ValueError("len(local_reader_ranks) must equal n_local_reader")
        if not 0 <= n_local_reader <= n_reader:
            raise ValueError("need 0 <= n_local_reader <= n_reader")
        self._setup_common(serializer, spin_s, liveness_interval, warn_interval)
        # vLLM 0.33's arena maps large CPU tensors zero-copy; here pickle 5 buffers are
        # written into the ring once and copied out once, so the flag is accepted, unused.
        self.enable_shm_tensor_arena = bool(enable_shm_tensor_arena)
        self._dumps = queue_dumps()  # CPU tensors out of band once torch is imported
        self.local_shutdown = _local_shutdown_env() if local_shutdown is None else local_shutdown
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
            self._bind_ring()
            b = self.buffer
            self._ws = (_ring.Writer(b.mm, n_local_reader, b.max_chunk_bytes, self._nchunks,
                                     b.header_size, b.chunk_stride, self._dumps, fence.ASYMMETRIC,
                                     self._spin_s, _RAW_MIN) if _ring else _WState())
        else:
            self._ws = _WState()
        self._ws.next_check = time.monotonic() + self._liveness
        self._update_ok()

    def _set_side_hot(self) -> None:
        if self._w_ok and self._remote is None and self._pickle_fast:
            if _ring:
                self._wnat = self._ws
            elif len(self._sleep_words) == 1:
                self._whot = (self._mv, self._u64, self._slots, self._nchunks,
                              self._cbytes, self._sleep_words[0], self.buffer.mm)

    def _wait_ready(self, deadline: float | None) -> None:
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
        self._w_ok = (not self._shut and not self._broken
                      and not self._dead)
        if self.buffer is not None:
            self._set_hot()

    def _writer_prologue(self) -> None:
        self._update_ok()
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
            main = self._dumps(obj, 5, buffer_callback=bufs.append)
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
            main = self._dumps(obj, 5, buffer_callback=bufs.append)
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

    # ------------------------------------------------------------ lifecycle
    def _shutdown_side(self) -> None:
        if not self._shut:
            self._shut = True
            if not self.local_shutdown:
                self._announce(L.W_SHUTDOWN, KIND_SHUTDOWN)

    def _close_side(self) -> None:
        self.shutdown()
        if self.local_shutdown and not self._closed:
            # The writer leaves for good: even with vLLM's local semantics, readers learn
            # it now instead of waiting until this process exits.
            self._announce(L.W_SHUTDOWN, KIND_SHUTDOWN)
        for w in self._watches:
            if w:
                w.close()
