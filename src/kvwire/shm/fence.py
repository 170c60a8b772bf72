"""Memory fences for pure-Python code that shares memory with other processes.

Python cannot emit a fence instruction, so we borrow one from a C call that is
known to contain one:

* x86-64 (TSO): hardware keeps store->store, load->load and load->store order, so
  the data path needs no fence at all. Only store->load can be reordered (Dekker's
  pattern used by the sleep/wake handshake). An uncontended ``threading.Lock``
  acquire+release runs glibc's semaphore fast path, a ``lock cmpxchg``/``lock xadd``,
  and every locked instruction is a full barrier on x86.
* Anything else (aarch64, ...): ``__atomic_fetch_add_4(p, 0, __ATOMIC_SEQ_CST)`` from
  libatomic via ctypes, a fully ordered RMW (``ldaddal`` / ``ldaxr;stlxr;dmb``) that
  orders all earlier and later accesses. ``release()``/``acquire()`` use it too.

When the C accelerator ``_ring`` is active, ``full_fence`` (and, on weakly ordered
CPUs, ``release``/``acquire``) is its ``__atomic_thread_fence(__ATOMIC_SEQ_CST)``
(``mfence`` / ``dmb ish``), and the sleepers' membarrier is a direct syscall.

See docs/shm.md for the full argument.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading
import warnings
from collections.abc import Callable

from . import _native

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _lock_fence() -> Callable[[], None]:
    lock = threading.Lock()
    acquire, release = lock.acquire, lock.release

    def fence() -> None:
        acquire()
        release()

    return fence


def _libatomic_fence() -> Callable[[], None] | None:
    name = ctypes.util.find_library("atomic")
    if not name:
        return None
    try:
        lib = ctypes.CDLL(name)
        fn = lib.__atomic_fetch_add_4
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int]
    word = ctypes.c_uint32(0)
    addr = ctypes.addressof(word)
    seq_cst = 5

    def fence() -> None:
        fn(addr, 0, seq_cst)

    fence._keepalive = word  # type: ignore[attr-defined]
    return fence


def _noop() -> None:
    return None


_ring = _native.ring  # the C accelerator, if built and not disabled (KVWIRE_SHM_PURE=1)

if _X86:
    full_fence: Callable[[], None] = _ring.fence if _ring else _lock_fence()
    #: Orders earlier stores before later stores (writer: payload before seq word).
    release: Callable[[], None] = _noop
    #: Orders earlier loads before later loads (reader: seq word before payload).
    acquire: Callable[[], None] = _noop
    STRONGLY_ORDERED = True
else:  # pragma: no cover - exercised only on weakly ordered CPUs
    _f = _ring.fence if _ring else _libatomic_fence()
    if _f is None:
        warnings.warn(
            "kvwire.shm: libatomic not found on a weakly ordered CPU; falling back to a "
            "lock-based fence that is not a full barrier there. Install libatomic1.",
            RuntimeWarning,
            stacklevel=2,
        )
        _f = _lock_fence()
    full_fence = release = acquire = _f
    STRONGLY_ORDERED = False


# -- asymmetric store->load fence for the sleep/wake handshake ------------------
# The side about to sleep stores its flag, then must not miss a publish; the
# publishing side stores its word, then reads the flag (Dekker). Instead of a
# full fence on the publishing hot path, the sleeping side (rare, about to make a
# syscall anyway) calls membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED), which runs a
# full barrier on every CPU currently running a registered process. Every process
# using kvwire.shm registers. Without membarrier both sides use full_fence().
_SYS_MEMBARRIER = {"x86_64": 324, "amd64": 324, "aarch64": 283, "arm64": 283,
                   "riscv64": 283}.get(platform.machine().lower())
_CMD_QUERY, _CMD_GLOBAL_EXPEDITED, _CMD_REGISTER_GLOBAL_EXPEDITED = 0, 2, 4
_libc = ctypes.CDLL(None, use_errno=True)
_registered_pid = 0


def _membarrier_usable() -> bool:
    if _SYS_MEMBARRIER is None or os.environ.get("KVWIRE_SHM_NO_MEMBARRIER"):
        return False
    mask = _libc.syscall(_SYS_MEMBARRIER, _CMD_QUERY, 0)
    need = _CMD_GLOBAL_EXPEDITED | _CMD_REGISTER_GLOBAL_EXPEDITED
    return mask >= 0 and mask & need == need


ASYMMETRIC = _membarrier_usable()


def register_process() -> None:
    """Make this process a target of the sleepers' membarrier (idempotent, fork-safe)."""
    global _registered_pid, ASYMMETRIC, publish_fence, sleep_fence
    if not ASYMMETRIC or _registered_pid == os.getpid():
        return
    if _libc.syscall(_SYS_MEMBARRIER, _CMD_REGISTER_GLOBAL_EXPEDITED, 0, 0) != 0:
        if _registered_pid:  # pragma: no cover - a forked child failing to re-register
            raise OSError("kvwire.shm: membarrier registration failed in a forked child")
        ASYMMETRIC = False
        publish_fence = sleep_fence = full_fence
        return
    _registered_pid = os.getpid()


def _membarrier() -> None:
    _libc.syscall(_SYS_MEMBARRIER, _CMD_GLOBAL_EXPEDITED, 0, 0)


if _ring:
    _membarrier = _ring.membarrier  # noqa: F811 - same syscall without ctypes' overhead


register_process()  # at import, so ASYMMETRIC is final before users read it (exec resets
# the registration, fork inherits it; register_process() is also called per queue)

#: After a publishing store, before reading the other side's sleep flag.
publish_fence: Callable[[], None] = _noop if ASYMMETRIC else full_fence
#: After setting one's own sleep flag, before re-checking the condition.
sleep_fence: Callable[[], None] = _membarrier if ASYMMETRIC else full_fence

__all__ = ["full_fence", "release", "acquire", "publish_fence", "sleep_fence",
           "register_process", "STRONGLY_ORDERED", "ASYMMETRIC"]
