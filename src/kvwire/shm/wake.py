"""Futex sleep/wake on a 32-bit word in shared memory.

A futex costs nothing while nobody sleeps: the side that publishes only makes the
``FUTEX_WAKE`` syscall after it has seen a sleeper's flag (see queue.py), and the
kernel re-checks the word under its own lock before sleeping, so a wake issued
between "decide to sleep" and "sleep" is never lost.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

from . import _native

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98,
              "ppc64le": 221, "s390x": 238}.get(platform.machine().lower())
_FUTEX_WAIT = 0  # not FUTEX_PRIVATE_FLAG: the word is shared between processes
_FUTEX_WAKE = 1

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


AVAILABLE = _SYS_FUTEX is not None


def futex_wait(addr: int, expected: int, timeout: float | None) -> int:
    """Sleep while the u32 at ``addr`` equals ``expected``, at most ``timeout`` s.

    Returns 0 (false) on timeout, non-zero otherwise (woken, value changed, or signal).
    The C version returns the CLOCK_MONOTONIC time in ns at which the kernel returned.
    """
    if timeout is None:
        ts = None
    else:
        timeout = max(timeout, 0.0)
        sec = int(timeout)
        ts = ctypes.byref(_Timespec(sec, int((timeout - sec) * 1e9)))
    r = _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT),
                 ctypes.c_uint32(expected & 0xFFFFFFFF), ts, None, ctypes.c_int(0))
    if r == 0:
        return 1
    err = ctypes.get_errno()
    if err == errno.ETIMEDOUT:
        return 0
    if err in (errno.EAGAIN, errno.EINTR):
        return 1
    raise OSError(err, os.strerror(err))


def futex_wake(addr: int, n: int = 0x7FFFFFFF) -> int:
    """Wake up to ``n`` processes sleeping on ``addr``; returns how many woke."""
    r = _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
                 ctypes.c_int(n), None, None, ctypes.c_int(0))
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(r)


if _native.ring is not None:  # same calls in C: no ctypes marshalling, GIL released in C
    futex_wait = _native.ring.futex_wait  # noqa: F811
    futex_wake = _native.ring.futex_wake  # noqa: F811
