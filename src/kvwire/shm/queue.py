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

This module holds what every side shares (set-up, the wait engine, lifecycle). Each
side is a subclass with its own hot path: ``MessageQueue(...)`` builds a
``writer.WriterQueue``; ``create_from_handle`` a ``reader.LocalReaderQueue`` or a
``remote_reader.RemoteReaderQueue``. All are ``MessageQueue`` instances. The sides import
this module, never the reverse: each registers itself by name (``side=`` in its class
statement) and the constructors look it up.

The per-message steps run in C (``_ring.c``: ``Writer.put``, ``Reader.get`` /
``wait_get``) when that module is built and ``KVWIRE_SHM_PURE`` is not set; otherwise
in the sides' inlined Python hot paths. Both share the state objects ``self._ws`` /
``self._rs`` with the Python slow paths (waits, fragments, frame tables, remote).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..wire.frames import poll_ms
from . import layout as L
from ._common import (
    _SPIN_NO_YIELD_S,
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_CHUNKS,
    _defaults,
    _ring,
    _yield,
    logger,
)
from .buffer import ShmRingBuffer
from .errors import QueueShutdownError, ShmQueueError
from .fence import publish_fence, register_process, sleep_fence
from .group import group_ops, node_key
from .handle import Handle, as_handle
from .remote import RemotePublisher, RemoteSubscriber
from .serializer import PickleSerializer, Serializer, default_serializer
from .wake import futex_wait, futex_wake

__all__ = ["DEFAULT_MAX_CHUNKS", "DEFAULT_MAX_CHUNK_BYTES", "MessageQueue"]

#: The sides by name ("writer", "local_reader", "remote_reader"): each registers itself when
#: its module is imported (MessageQueue.__init_subclass__).
_SIDES: dict[str, type[MessageQueue]] = {}


class MessageQueue:
    """Broadcast queue, drop-in for vLLM's ``MessageQueue`` (same constructor and methods).

    Extra keyword-only knobs: ``serializer`` (default pickle), ``spin_s`` (busy-wait
    before sleeping), ``liveness_interval`` (how often a waiting side checks that its
    peers live; bounds dead-peer detection), ``warn_interval`` (log while waiting),
    ``local_shutdown`` (writer: vLLM's semantics, ``shutdown()`` does not reach the
    readers; default from env ``KVWIRE_SHM_LOCAL_SHUTDOWN``, else off; see docs/shm.md).
    """

    _is_writer = _is_local_reader = _is_remote_reader = False

    def __init_subclass__(cls, side: str | None = None, **kwargs: Any) -> None:
        """A side names itself (``class WriterQueue(MessageQueue, side="writer")``), so
        that the constructors here build it without importing its module (which imports
        this one). The package imports every side (kvwire/shm/__init__.py)."""
        super().__init_subclass__(**kwargs)
        if side is not None:
            _SIDES[side] = cls

    def __new__(cls, *args: Any, **kwargs: Any) -> MessageQueue:
        if cls is MessageQueue:  # the public constructor builds the writer side
            cls = _SIDES["writer"]
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - sides define it
        raise TypeError("use MessageQueue(...) or MessageQueue.create_from_handle(...)")

    # ------------------------------------------------------------------ setup
    def _setup_common(self, serializer: Serializer | None, spin_s: float | None,
                      liveness_interval: float | None, warn_interval: float | None) -> None:
        d_spin, d_live, d_warn = _defaults()
        self._ser: Serializer = serializer or PickleSerializer()
        self._spin_s = d_spin if spin_s is None else spin_s
        self._liveness = d_live if liveness_interval is None else liveness_interval
        self._warn_interval = d_warn if warn_interval is None else warn_interval
        register_process()
        self._cancelled = False
        self._closed = False
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

    @property
    def native(self) -> bool:
        """Whether this queue's per-message path runs in C (kvwire.shm._ring): a local
        ring, pickle, and (writer) no remote readers; else it is the Python one."""
        st = self.__dict__.get("_ws") if self._is_writer else self.__dict__.get("_rs")
        return (_ring is not None and isinstance(st, (_ring.Writer, _ring.Reader))
                and self._pickle_fast and self._remote is None)

    @property
    def shutting_down(self) -> bool:
        """True once ``shutdown()`` or ``close()`` was called on this queue object (as
        vLLM's attribute). A reader learns of its writer's shutdown by the error it raises."""
        return self._cancelled

    def _set_hot(self) -> None:
        """Bundle what the hot paths read, so each reads one attribute (None = slow path)."""
        self._whot = self._rhot = self._wnat = self._rnat = None
        if self.buffer is not None and self.buffer.mm is not None:
            self._set_side_hot()

    def _set_side_hot(self) -> None:
        """The side's own hot-path bundle (the ring is mapped)."""

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
        handle = as_handle(handle)
        ser = serializer or default_serializer(handle.serializer)
        if ser.name != handle.serializer:
            raise ValueError(f"writer uses serializer {handle.serializer!r}, got {ser.name!r}")
        side = "local_reader" if rank in handle.local_reader_ranks else "remote_reader"
        self: MessageQueue = object.__new__(_SIDES[side])
        self._setup_common(ser, spin_s, liveness_interval, warn_interval)
        self.n_reader = handle.n_reader
        self.handle = handle
        self.local_reader_ranks = list(handle.local_reader_ranks)
        self.rank = rank
        self._attach(handle, rank, trust_remote_pickle)
        return self

    def _attach(self, handle: Handle, rank: int, trust_remote_pickle: bool | None) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------- readiness
    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Collective: returns once every reader is attached and the writer said so."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wait_ready(deadline)
        self._ready = True

    def _wait_ready(self, deadline: float | None) -> None:
        raise NotImplementedError

    def _poll_ms(self, deadline: float | None) -> int:
        t = self._liveness
        if deadline is not None:
            t = min(t, max(0.0, deadline - time.monotonic()))
        return poll_ms(t)

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
            with contextlib.suppress(ValueError):  # close() from another thread released mv
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

    # ------------------------------------------------- what the other sides do
    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast ``obj`` (writer only)."""
        raise ShmQueueError("only the writer can enqueue")

    @contextlib.contextmanager
    def acquire_write(self, timeout: float | None = None) -> Iterator[memoryview]:
        """Write one chunk in place (writer only)."""
        raise ShmQueueError("only the writer can acquire_write")
        yield memoryview(b"")  # pragma: no cover

    def drop_reader(self, rank: int) -> None:
        """Stop waiting for reader ``rank`` (writer only)."""
        raise ShmQueueError("only the writer can drop readers")

    def drop_dead_readers(self) -> list[int]:
        """Drop every reader found dead now (writer only)."""
        raise ShmQueueError("only the writer can drop readers")

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """Next message (readers only)."""
        raise ShmQueueError("only readers can dequeue")

    @contextlib.contextmanager
    def acquire_read(self, timeout: float | None = None,
                     indefinite: bool = False) -> Iterator[memoryview]:
        """View of the next chunk's payload (readers only)."""
        raise ShmQueueError("only readers can acquire_read")
        yield memoryview(b"")  # pragma: no cover

    @contextlib.contextmanager
    def dequeue_inplace(self, timeout: float | None = None,
                        indefinite: bool = False) -> Iterator[Any]:
        """Like dequeue; a remote reader gets a plain copy."""
        yield self.dequeue(timeout, indefinite)

    def _released(self, err: BaseException) -> BaseException:
        """The one place a released ring view (``close()`` from another thread while this
        one waited or read) becomes ``QueueShutdownError``; other errors pass unchanged."""
        if self._closed or self._cancelled:
            return QueueShutdownError("queue closed" if self._closed else "cancelled")
        return err

    # ------------------------------------------------------------ lifecycle
    def broadcast_object(self, obj: Any = None) -> Any:
        if self._is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    def shutdown(self) -> None:
        """Writer: tell every reader no message will come (they raise once drained), unless
        ``local_shutdown``. Reader: cancel this process's blocked or future reads. Both
        wake sleepers of this process."""
        self._cancelled = True
        self._w_ok = False
        self._whot = self._rhot = self._wnat = self._rnat = None
        self._shutdown_side()

    def _shutdown_side(self) -> None:
        if self.buffer and self.buffer.mm is not None:
            futex_wake(self._rwake_addr)

    def close(self) -> None:
        """Release this process's resources (a reader also tells the writer it left)."""
        self._close_side()
        self._closed = True
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

    def _close_side(self) -> None:
        """The side's own part of close(), before the ring is unmapped."""

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def create_from_process_group(pg: Any, max_chunk_bytes: int, max_chunks: int,
                                  writer_rank: int = 0, external_writer_handle: Handle | None = None,
                                  blocking: bool = True) -> MessageQueue:
        """Group rank ``writer_rank`` writes; all other ranks read (local if on the writer's node).

        Reader ranks are group ranks. As in vLLM 0.33, ``external_writer_handle`` counts on
        group rank ``writer_rank`` only (other ranks may pass None): that rank hands it to the
        others and every group rank, ``writer_rank`` included, joins that queue as a reader
        with its group rank. Collective; ``blocking`` also waits until ready.
        """
        ops = group_ops(pg)
        mine = external_writer_handle if ops.rank == writer_rank else None
        gathered = ops.all_gather((node_key(), mine))  # one round: node keys and the handle
        keys = [k for k, _ in gathered]
        external = ops.handle(gathered[writer_rank][1])
        if external is not None:
            mq = MessageQueue.create_from_handle(external, ops.rank)
            if blocking:
                mq.wait_until_ready()
            return mq
        readers = [r for r in range(ops.world_size) if r != writer_rank]
        local = [r for r in readers if keys[r] == keys[writer_rank]]
        remote = [r for r in readers if r not in local]
        handle = None
        if ops.rank == writer_rank:
            mq = MessageQueue(len(readers), len(local), local, max_chunk_bytes, max_chunks,
                              remote_reader_ranks=remote)
            handle = mq.export_handle()
        handles = ops.all_gather(handle)
        if ops.rank != writer_rank:
            mq = MessageQueue.create_from_handle(ops.handle(handles[writer_rank]), ops.rank)
        if blocking:
            mq.wait_until_ready()
        return mq

    @staticmethod
    def create_from_process_group_single_reader(
            pg: Any, max_chunk_bytes: int, max_chunks: int, reader_rank: int = 0,
            blocking: bool = False) -> tuple[MessageQueue, list[Handle]]:
        """Each rank creates a queue it writes, read by ``reader_rank`` (reader rank 0 in
        every handle). The reader gets all handles, in group order (others get []), and joins
        them with ``MessageQueue.create_from_handle(h, 0)``.

        As in vLLM 0.33, ``reader_rank`` is a global rank (``torch.distributed.get_rank()``)
        for a torch group; for a stateless group it is the group rank."""
        ops = group_ops(pg)
        reader = ops.group_rank(reader_rank)
        keys = ops.all_gather(node_key())
        same = keys[ops.rank] == keys[reader]
        mq = MessageQueue(1, 1 if same else 0, None, max_chunk_bytes, max_chunks)
        handles = ops.all_gather(mq.export_handle())
        if blocking:
            mq.wait_until_ready()
        if ops.global_rank == reader_rank:
            return mq, [ops.handle(h) for h in handles]
        return mq, []
