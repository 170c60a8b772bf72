"""kvwire: KV-cache event streams of LLM inference engines."""

__version__ = "0.1.0"


def native_status() -> dict[str, str]:
    """Which optional C accelerators this process uses (see setup.py): ``frames`` is
    ``"c"``, ``"ctypes"`` or ``"pyzmq"``; ``shm`` is ``"c"`` or ``"python (<why>)"``."""
    from .frames import native_status as frames_status
    from .shm import NATIVE, _native

    shm = "c" if NATIVE else f"python ({getattr(_native, 'REASON', 'not built')})"
    return {"frames": frames_status(), "shm": shm}
