"""Whole ZeroMQ messages in and out of pyzmq's sockets, cheaply and without giving up the GIL.

Two costs dominate a small KV event message (three frames) in pyzmq:

* pyzmq releases the GIL around every send. On a background thread that shares the GIL
  with a busy engine loop, each release hands the GIL to the engine, and the sender then
  waits for the interpreter's switch interval (5 ms) to get it back: three frames per
  batch, up to 15 ms per batch, and a queue that only grows.
* Per frame, pyzmq builds a Frame object (or asks ``getsockopt(RCVMORE)``): about
  1.5-2 us per frame on a small machine, most of a subscriber's budget.

So kvwire talks to libzmq directly, keeping the GIL for the microsecond a non-blocking
call takes. Preferred: the optional C module ``kvwire._zmqframes`` (one call per whole
message). Without it: libzmq's ``zmq_send`` through ``ctypes.PyDLL`` per frame, and
pyzmq's Frame-based receive. In every case the libzmq instance and the socket handles are
pyzmq's own (the library found in this process's mappings), so nothing else changes.

Only non-blocking use: these helpers always pass ``NOBLOCK``.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import math
import os
from collections.abc import Callable
from typing import Any

import zmq
import zmq.backend

__all__ = ["FrameSender", "FrameReceiver", "native_status", "poll_ms"]

_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE)


@functools.cache
def poll_ms(seconds: float) -> int:
    """A ``zmq_poll`` timeout for ``seconds``: whole milliseconds, rounded up. pyzmq
    truncates a float, so 0.5 ms would become 0, a spin instead of a wait."""
    return math.ceil(seconds * 1000.0)


def _libzmq() -> ctypes.PyDLL | None:
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
        return ctypes.PyDLL(path)
    except OSError:
        return None


@functools.cache
def _zmq_send() -> Callable[..., int] | None:
    lib = _libzmq()
    if lib is None:
        return None
    try:
        fn = lib.zmq_send
    except AttributeError:
        return None
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _native() -> Any | None:
    """The C module, bound to pyzmq's libzmq; None if it is not built or disabled."""
    if os.environ.get("KVWIRE_NO_NATIVE"):
        return None
    try:
        from . import _zmqframes  # type: ignore[attr-defined]
    except ImportError:
        return None
    lib = _libzmq()
    if lib is None:
        return None
    names = ("zmq_msg_init", "zmq_msg_recv", "zmq_msg_data", "zmq_msg_size", "zmq_msg_more",
             "zmq_msg_close", "zmq_send", "zmq_errno")
    try:
        addrs = [ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names]
    except AttributeError:
        return None
    _zmqframes.bind(*addrs)
    return _zmqframes


def native_status() -> str:
    """Which path moves frames in this process: ``"c"``, ``"ctypes"`` or ``"pyzmq"``."""
    if _native() is not None:
        return "c"
    return "ctypes" if _zmq_send() is not None else "pyzmq"


class FrameSender:
    """Send on one socket: ``send(frame, flags) -> bool`` per frame, or a whole message with
    ``send_message(*frames) -> bool``. False means EAGAIN (nothing of it was queued).
    ``send_batch(topic, [(seq, payload), ...]) -> int``: the messages ``[topic, seq,
    payload]`` in order, in one call; returns how many were queued (a refused one is
    skipped whole, the rest still tried)."""

    __slots__ = ("send", "send_message", "send_batch", "native")

    def __init__(self, sock: zmq.Socket) -> None:
        fn = _zmq_send()
        mod = _native()
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

        if mod is not None:
            native_send, addr = mod.send_frames, sock.underlying

            def send_message(*frames: bytes) -> bool:
                err = native_send(addr, _NOBLOCK, *frames)
                if not err:
                    return True
                if err == errno.EAGAIN:
                    return False
                raise zmq.ZMQError(err)

            native_batch = mod.send_batch

            def send_batch(topic: bytes, messages: list[tuple[bytes, bytes]]) -> int:
                sent, err = native_batch(addr, _NOBLOCK, topic, messages)
                if err:
                    raise zmq.ZMQError(err)
                return sent

        else:

            def send_batch(topic: bytes, messages: list[tuple[bytes, bytes]]) -> int:
                return sum(1 for seq, payload in messages if send_message(topic, seq, payload))

            def send_message(*frames: bytes) -> bool:
                # Every frame checked before the first goes out: never half a message.
                frames = tuple(f if type(f) is bytes else bytes(memoryview(f)) for f in frames)
                last = len(frames) - 1
                for i, f in enumerate(frames):
                    if not send(f, _NOBLOCK | (_MORE if i < last else 0)) and i == 0:
                        return False  # later parts of a message are never refused
                return True

        self.send = send
        self.send_message = send_message
        self.send_batch = send_batch


_recv = zmq.backend.Socket.recv


class FrameReceiver:
    """Whole messages from one socket, never waiting: ``recv() -> list[bytes] | None`` (None:
    nothing waits) and ``recv_many(n) -> list[list[bytes]]`` (up to n, as many as wait now).

    The socket must stay open while its receiver is used (the C path holds its address).
    """

    __slots__ = ("recv", "recv_many", "native")

    def __init__(self, sock: zmq.Socket) -> None:
        mod = _native()
        self.native = mod is not None
        if mod is not None:
            native_recv, native_many, addr = mod.recv_multipart, mod.recv_many, sock.underlying

            def recv() -> list[bytes] | None:
                r = native_recv(addr, _NOBLOCK)
                if type(r) is list:
                    return r
                if r == errno.EAGAIN:
                    return None
                raise zmq.ZMQError(r)

            def recv_many(n: int) -> list[list[bytes]]:
                r = native_many(addr, _NOBLOCK, n)
                if type(r) is list:
                    return r
                raise zmq.ZMQError(r)

        else:

            def recv() -> list[bytes] | None:
                # Frames (copy=False) carry their own "more" flag, far cheaper than pyzmq's
                # per-frame RCVMORE option lookup.
                try:
                    f = _recv(sock, _NOBLOCK, False)
                except zmq.Again:
                    return None
                frames = [f.bytes]
                while f.more:
                    f = _recv(sock, 0, False)  # the rest arrives with the first frame
                    frames.append(f.bytes)
                return frames

            def recv_many(n: int) -> list[list[bytes]]:
                out = []
                for _ in range(n):
                    m = recv()
                    if m is None:
                        break
                    out.append(m)
                return out

        self.recv = recv
        self.recv_many = recv_many
