"""Constants, defaults and small helpers shared by the queue's sides (queue.py, writer.py,
reader.py, remote_reader.py)."""

from __future__ import annotations

import logging
import os
import pickle
import struct
import time
from typing import Any

from . import _native, fence
from . import layout as L

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


_local_shutdown_default = [False]  # set_local_shutdown_default(); one cell, process-wide


def _local_shutdown_env() -> bool:
    """``KVWIRE_SHM_LOCAL_SHUTDOWN=1``: vLLM's semantics (a writer's shutdown() stays local).

    Unset or empty: the process default (kvwire's semantics unless
    ``set_local_shutdown_default(True)``, as ``kvwire.plugins.vllm_shm.install()`` does).
    """
    v = os.environ.get("KVWIRE_SHM_LOCAL_SHUTDOWN", "").strip().lower()
    if not v:
        return _local_shutdown_default[0]
    return v in ("1", "true", "yes")


def set_local_shutdown_default(on: bool) -> bool:
    """Default of ``local_shutdown`` for writers built from now on in this process, when
    ``KVWIRE_SHM_LOCAL_SHUTDOWN`` is unset; returns the previous default."""
    prev = _local_shutdown_default[0]
    _local_shutdown_default[0] = bool(on)
    return prev


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


def _parse_frames(view: memoryview, nframes: int) -> list[memoryview]:
    lens = struct.unpack_from(f"<{nframes}Q", view, 0)
    off = L.round_up(8 * nframes, L.LINE)
    frames = []
    for n in lens:
        frames.append(view[off : off + n])
        off = L.round_up(off + n, L.LINE)
    return frames
