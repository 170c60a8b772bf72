"""Message serializers: frames out, object back.

A serializer turns an object into frames (frame 0 = main body, the rest =
large buffers written once, out of band) and back. ``loads`` is told where the
frames live:

* ``"copy"``: views of the shared ring that are reused after the call, so the
  result must not reference them (one copy of each large buffer);
* ``"own"``: private memory the result may keep (reassembled or received frames);
* ``"view"``: the in-place API; the result may reference the ring directly.

Trust: ``PickleSerializer`` executes code chosen by whoever wrote the bytes. The
ring is 0600 and reachable only by the same uid, so locally that is the user's
own code; over a socket it is not, which is why remote readers refuse pickle
unless opted in (see queue.py and docs/shm.md). ``MsgspecSerializer`` only ever
builds plain data / declared types.
"""

from __future__ import annotations

import pickle
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

from .tensors import queue_dumps

Mode = Literal["copy", "own", "view"]
_RAW = b"B"  # never a valid pickle (those start with the PROTO opcode 0x80)


@runtime_checkable
class Serializer(Protocol):
    """Pluggable codec; ``name`` travels in the Handle so both sides agree."""

    name: str

    def dumps(self, obj: Any) -> list[Any]: ...

    def loads(self, frames: list[memoryview], mode: Mode) -> Any: ...


class PickleSerializer:
    """Pickle protocol 5 with out-of-band buffers (numpy, PickleBuffer); raw bytes unpickled-free."""

    name = "pickle"

    def dumps(self, obj: Any) -> list[Any]:
        if type(obj) is bytes and len(obj) >= 4096:
            return [_RAW, obj]
        bufs: list[Any] = []
        main = queue_dumps()(obj, 5, buffer_callback=bufs.append)  # tensors: tensors.py
        if bufs:
            return [main, *(b.raw() for b in bufs)]
        return [main]

    def loads(self, frames: list[memoryview], mode: Mode) -> Any:
        main = frames[0]
        if len(main) == 1 and main[0] == 0x42:  # _RAW
            return frames[1] if mode == "view" else bytes(frames[1])
        if len(frames) == 1:
            return pickle.loads(main)
        oob = frames[1:]
        if mode == "copy":
            oob = [bytearray(b) for b in oob]
        return pickle.loads(main, buffers=oob)


class MsgspecSerializer:
    """msgpack via msgspec, decoding into ``type`` (a Struct, dataclass, ...) when given.

    Never executes code from the wire; use it for typed messages and for readers
    that do not trust the writer's network path.
    """

    name = "msgspec"

    def __init__(self, type: Any = Any) -> None:  # noqa: A002 - mirrors msgspec's own API
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(type)

    def dumps(self, obj: Any) -> list[Any]:
        return [self._enc.encode(obj)]

    def loads(self, frames: list[memoryview], mode: Mode) -> Any:
        return self._dec.decode(frames[0])


def default_serializer(name: str) -> Serializer:
    """Serializer to use on a reader when the user passed none."""
    if name == "pickle":
        return PickleSerializer()
    if name == "msgspec":
        return MsgspecSerializer()
    raise ValueError(f"unknown serializer {name!r}; pass serializer= explicitly")
