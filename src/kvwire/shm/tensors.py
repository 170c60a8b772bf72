"""CPU torch tensors through the queue as raw pickle-5 buffers, not torch's own pickling.

torch pickles a tensor through ``torch.save`` of its storage: ~0.3 ms to dump and ~1 ms
to load even a 1 KB tensor, and an in-band copy of the bytes. vLLM 0.33's queue sends
CPU tensors' bytes out of band instead (its messages carry tensors); kvwire does the
same, so the swap into vLLM loses nothing: a strided CPU tensor without grad becomes
``(rebuild_tensor, (PickleBuffer(bytes), shape, dtype name))``, its bytes written once
into the ring and copied out once (writable). Anything else keeps torch's reduction.

Only when torch is already imported: ``queue_dumps()`` is ``pickle.dumps`` otherwise, so
processes without torch pay nothing and never import it.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
from collections.abc import Callable
from typing import Any

_cache: list[Callable[..., bytes]] = []


def rebuild_tensor(buf: Any, shape: tuple[int, ...], dtype_name: str) -> Any:
    """The reader's half: a tensor over ``buf`` (copied first if read-only)."""
    import torch

    dtype = getattr(torch, dtype_name)
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"not a torch dtype: {dtype_name!r}")
    mv = memoryview(buf)
    if mv.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if mv.readonly:  # bytes or a ZeroMQ frame: torch wants memory it may write
        buf = bytearray(mv)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def _reduce_tensor(t: Any) -> Any:
    import torch

    if (t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad
            and not t.is_quantized and not t.is_conj() and not t.is_neg()):
        try:
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        except (RuntimeError, TypeError):  # a dtype numpy cannot show as bytes
            pass
        else:
            return rebuild_tensor, (pickle.PickleBuffer(raw), tuple(t.shape),
                                    str(t.dtype).removeprefix("torch."))
    return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _tensor_dumps(torch: Any) -> Callable[..., bytes]:
    table = dict(copyreg.dispatch_table)  # keep what is registered globally
    table[torch.Tensor] = _reduce_tensor

    def dumps(obj: Any, protocol: int = 5, *, buffer_callback: Any = None) -> bytes:
        f = io.BytesIO()
        p = pickle.Pickler(f, protocol, buffer_callback=buffer_callback)
        p.dispatch_table = table
        p.dump(obj)
        return f.getvalue()

    return dumps


def queue_dumps() -> Callable[..., bytes]:
    """``dumps(obj, protocol, buffer_callback=)`` for a writer built now: tensor-aware
    once torch is imported in this process, else ``pickle.dumps``."""
    if _cache:
        return _cache[0]
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "Tensor"):  # absent, or mid-import
        return pickle.dumps
    _cache.append(_tensor_dumps(torch))
    return _cache[0]
