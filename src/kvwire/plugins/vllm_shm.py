"""Swap vLLM's shared-memory ``MessageQueue`` for ``kvwire.shm.MessageQueue`` (opt-in).

vLLM's plugin hook (``kvwire.plugins.vllm.register``) calls :func:`install` in every vLLM
process when ``KVWIRE_VLLM_SHM=1``; nothing here runs otherwise. The swap replaces the
name ``MessageQueue`` in ``vllm.distributed.device_communicators.shm_broadcast`` (read
lazily by ``parallel_state``) and in every already-imported module that bound the name
with ``from ... import MessageQueue`` (the executors); modules imported later bind
kvwire's class by themselves.

Every process that shares a queue must make the same choice: a kvwire reader cannot
join a vLLM writer (``create_from_handle`` names the missing switch). Writers built
after :func:`install` use vLLM's shutdown semantics (``shutdown()`` stays in the writer's
process) unless ``KVWIRE_SHM_LOCAL_SHUTDOWN`` is set; see docs/shm.md.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from ..shm import NATIVE, MessageQueue
from ..shm._common import set_local_shutdown_default

__all__ = ["SHM_MODULE", "install", "installed", "uninstall"]

SHM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
# a child of vLLM's logger: the line shows in vLLM's log, in its format
logger = logging.getLogger("vllm.kvwire.shm")

_lock = threading.Lock()
_original: Any = None  # vLLM's class while installed
_patched: list[str] = []  # modules whose MessageQueue we replaced
_prev_local_shutdown = False


def installed() -> bool:
    """Whether vLLM's ``shm_broadcast.MessageQueue`` is kvwire's in this process."""
    mod = sys.modules.get(SHM_MODULE)
    return mod is not None and getattr(mod, "MessageQueue", None) is MessageQueue


def install() -> list[str]:
    """Make vLLM use ``kvwire.shm.MessageQueue`` in this process; idempotent.

    Returns the modules patched (empty when already installed). Raises ImportError,
    naming what is missing, if vLLM's shm_broadcast cannot be imported.
    """
    global _original, _prev_local_shutdown
    with _lock:
        if installed():
            return []
        try:
            import importlib

            mod = importlib.import_module(SHM_MODULE)
        except ImportError as e:
            raise ImportError(f"KVWIRE_VLLM_SHM: cannot import vLLM's {SHM_MODULE} ({e}); "
                              "the shm queue swap needs vllm and torch") from e
        original = mod.MessageQueue
        patched = []
        for name, m in list(sys.modules.items()):
            if m is None or name == __name__:
                continue
            try:
                bound = m.__dict__.get("MessageQueue")
            except AttributeError:  # an odd module object without a __dict__
                continue
            if bound is original:
                m.MessageQueue = MessageQueue
                patched.append(name)
        _original = original
        _patched[:] = patched
        _prev_local_shutdown = set_local_shutdown_default(True)
    logger.info("kvwire: vLLM's shm MessageQueue is now kvwire.shm.MessageQueue "
                "(%s hot path; patched %s)", "C" if NATIVE else "Python", ", ".join(patched))
    return patched


def uninstall() -> None:
    """Put vLLM's own class back wherever :func:`install` replaced it (for tests)."""
    global _original
    with _lock:
        if _original is None:
            return
        # also vLLM modules imported after install() (they bound kvwire's class)
        late = [n for n, m in list(sys.modules.items())
                if n.startswith("vllm.") and m is not None
                and getattr(m, "__dict__", {}).get("MessageQueue") is MessageQueue]
        for name in dict.fromkeys([*_patched, *late]):
            m = sys.modules.get(name)
            if m is not None and m.__dict__.get("MessageQueue") is MessageQueue:
                m.MessageQueue = _original
        _patched.clear()
        _original = None
        set_local_shutdown_default(_prev_local_shutdown)
