"""Which hot path kvwire.shm uses: the C accelerator ``_ring`` or pure Python.

``_ring`` (src/kvwire/shm/_ring.c) is built by setup.py when a C compiler and Python's
headers are there. It is used unless it cannot be imported, its ring layout differs
from layout.py (a stale build), or ``KVWIRE_SHM_PURE=1`` is set in the environment
(read once, at import; spawned processes inherit it). Both paths speak the same
protocol on the same ring, so a native writer and a pure-Python reader interoperate.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

from . import layout as L

#: Why the C path is off ("" when it is on).
REASON = ""
ring: ModuleType | None = None


def _pure_requested() -> bool:
    return os.environ.get("KVWIRE_SHM_PURE", "").strip().lower() not in ("", "0", "false", "no")


def _expected_layout() -> dict[str, int]:
    return {
        "VERSION": L.VERSION, "LINE": L.LINE, "OFF_WRITER_STATE": L.OFF_WRITER_STATE,
        "OFF_RWAKE": L.OFF_RWAKE, "OFF_WWAKE": L.OFF_WWAKE,
        "OFF_WRITER_SLEEPING": L.OFF_WRITER_SLEEPING, "OFF_SLEEPERS": L.OFF_SLEEPERS,
        "OFF_READERS": L.OFF_READERS, "R_SEQ": L.R_SEQ, "R_STATUS": L.R_STATUS,
        "R_DROPPED": L.R_DROPPED, "R_CLOSED": L.R_CLOSED, "W_SHUTDOWN": L.W_SHUTDOWN,
        "CHUNK_HDR": L.CHUNK_HDR, "C_SEQ": L.C_SEQ, "C_META": L.C_META,
        "SINGLE_HI": L.SINGLE_HI, "F_SINGLE": L.F_SINGLE, "MASK40": L.MASK40,
        "MAX_READERS": L.MAX_READERS,
    }


if _pure_requested():
    REASON = "KVWIRE_SHM_PURE is set"
else:
    try:
        from . import _ring as ring
    except ImportError as e:
        ring = None
        REASON = f"kvwire.shm._ring is not built ({e})"
    else:
        if ring.LAYOUT != _expected_layout():
            warnings.warn("kvwire.shm._ring was built for another ring layout; using the "
                          "pure-Python path (rebuild: pip install -e .)", RuntimeWarning,
                          stacklevel=2)
            ring = None
            REASON = "kvwire.shm._ring does not match layout.py (stale build)"

#: True when MessageQueue's per-message path runs in C.
NATIVE = ring is not None
