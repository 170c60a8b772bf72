"""kvwire: KV-cache event streams of LLM inference engines."""

__version__ = "0.1.0"


def native_status() -> dict[str, str]:
    """Which optional C accelerators this process uses (see setup.py): ``frames`` is
    ``"c"``, ``"ctypes"`` or ``"pyzmq"``; ``shm``, ``index`` and ``route_body`` (the
    service's token-id parser) are ``"c"`` or ``"python (<why>)"``."""
    from .index import keys as index_keys
    from .shm import NATIVE, _native
    from .wire.frames import native_status as frames_status

    shm = "c" if NATIVE else f"python ({getattr(_native, 'REASON', 'not built')})"
    index = "c" if index_keys.NATIVE else f"python ({index_keys.REASON or 'not built'})"
    from .router import tokens

    body = "c" if tokens.parse_route_body is not None else f"python ({tokens.REASON})"
    return {"frames": frames_status(), "shm": shm, "index": index, "route_body": body}
