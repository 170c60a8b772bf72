"""The benches' child processes: started by spawn (a clean interpreter each, as a separate
engine or router would be) with a pipe back, and read with a deadline so a stuck child
fails the bench with a message instead of hanging it."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

CTX = mp.get_context("spawn")


def spawn(target: Any, *args: Any) -> tuple[Any, Any]:
    """Start ``target(conn, *args)`` in a child; returns (process, our end of the pipe)."""
    a, b = CTX.Pipe()
    p = CTX.Process(target=target, args=(b, *args), daemon=True)
    p.start()
    b.close()
    return p, a


def recv(conn: Any, timeout: float, what: str = "child") -> Any:
    if not conn.poll(timeout):
        raise RuntimeError(f"{what}: no answer in {timeout}s")
    return conn.recv()
