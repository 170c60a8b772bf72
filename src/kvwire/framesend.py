"""Sending frames on a ZeroMQ socket without giving up the GIL.

pyzmq releases the GIL around every send. On a background thread that shares the GIL
with a busy engine loop, each release hands the GIL to the engine, and the sender then
waits for the interpreter's switch interval (5 ms) to get it back: three frames per
batch, up to 15 ms per batch, and a queue that only grows. Calling libzmq's ``zmq_send``
through ``ctypes.PyDLL`` keeps the GIL for the sub-microsecond the call takes, so the
sender drains a burst in one go and then yields like any Python thread.

The socket handle and the libzmq instance are pyzmq's own (found in this process's
mappings), so nothing else changes. Where libzmq cannot be located this falls back to
pyzmq's send, which is correct, only slower under GIL contention.
"""

from __future__ import annotations

import ctypes
import errno
import functools
from collections.abc import Callable

import zmq
import zmq.backend

__all__ = ["FrameSender"]


@functools.cache
def _zmq_send() -> Callable[..., int] | None:
    path = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:  # pyzmq has loaded libzmq already: use that very library
                if "libzmq" in line:
                    path = line.split()[-1]
                    break
    except OSError:
        return None
    if path is None:
        return None
    try:
        fn = ctypes.PyDLL(path).zmq_send
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn


class FrameSender:
    """``send(frame, flags) -> bool`` for one socket; False means EAGAIN (not sent)."""

    __slots__ = ("send", "native")

    def __init__(self, sock: zmq.Socket) -> None:
        fn = _zmq_send()
        self.native = fn is not None
        if fn is not None:
            handle = ctypes.c_void_p(sock.underlying)

            def send(frame: bytes, flags: int) -> bool:
                if fn(handle, frame, len(frame), flags) >= 0:
                    return True
                err = zmq.zmq_errno()  # libzmq's own errno, same library
                if err == errno.EAGAIN:
                    return False
                raise zmq.ZMQError(err)

        else:
            backend_send = zmq.backend.Socket.send

            def send(frame: bytes, flags: int) -> bool:
                try:
                    backend_send(sock, frame, flags)
                    return True
                except zmq.Again:
                    return False

        self.send = send
