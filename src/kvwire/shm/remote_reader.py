"""The remote reader side of MessageQueue: the writer's frames over ZeroMQ TCP (remote.py).

Hot path: one ``recv`` of a multipart message and the serializer's ``loads``; the waits
poll at ``liveness_interval`` so a lost connection becomes ``WriterDeadError``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

from ._common import KIND_RAW, _trust_env, logger
from .errors import QueueShutdownError, ShmQueueError, WriterDeadError
from .handle import Handle
from .queue import MessageQueue
from .remote import KIND_READY, KIND_SHUTDOWN, RemoteSubscriber


class RemoteReaderQueue(MessageQueue, side="remote_reader"):
    """A reader on another host: ``create_from_handle`` builds one for a non-local rank."""

    _is_remote_reader = True

    def _attach(self, handle: Handle, rank: int, trust_remote_pickle: bool | None) -> None:
        if handle.remote_subscribe_addr is None:
            raise ValueError(f"rank {rank} is not local and the queue has no remote endpoint")
        trust = _trust_env() if trust_remote_pickle is None else trust_remote_pickle
        if self._ser.name == "pickle" and not trust:
            raise ShmQueueError(
                "remote reader: refusing to unpickle messages received over TCP. Use "
                "serializer=MsgspecSerializer(...) on both sides, or opt in with "
                "trust_remote_pickle=True / KVWIRE_SHM_TRUST_REMOTE_PICKLE=1 if every "
                "host that can reach the writer's port is trusted."
            )
        self._sub = RemoteSubscriber(handle.remote_subscribe_addr, rank,
                                     handle.remote_addr_ipv6)

    def _wait_ready(self, deadline: float | None) -> None:
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

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """Next message. TimeoutError after ``timeout``; no wait log if ``indefinite``."""
        kind, frames = self._remote_recv(timeout, indefinite)
        if kind == KIND_RAW:
            return frames[0].bytes
        return self._ser.loads([f.buffer for f in frames], "own")

    @contextlib.contextmanager
    def acquire_read(self, timeout: float | None = None,
                     indefinite: bool = False) -> Iterator[memoryview]:
        """The next message's last frame (a remote reader has no chunk to lend)."""
        kind, frames = self._remote_recv(timeout, indefinite)
        yield frames[-1].buffer if frames else memoryview(b"")

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
