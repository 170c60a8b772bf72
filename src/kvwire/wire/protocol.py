"""Frames of the transport (spec section 3) and of kvwire's control extension.

Pure functions from frames to values and back, shared by publisher, subscriber and CLI so
the byte layout lives in exactly one place. See docs/protocol.md.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "END_SEQ",
    "MAGIC",
    "ControlRequest",
    "ReplayRequest",
    "BadRequest",
    "pack_seq",
    "unpack_seq",
    "parse_request",
]

MAGIC = b"KVW1"
OP_INFO = b"INFO"
OP_SNAPSHOT = b"SNAPSHOT"
REPLY_INFO = b"INFO"
REPLY_SNAP = b"SNAP"
REPLY_ERR = b"ERR"
END_SEQ = b"\xff" * 8  # -1 as a signed 64-bit big-endian int: the replay end marker

DEFAULT_SNAPSHOT_CHUNK = 1024
MAX_SNAPSHOT_CHUNK = 65536

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


def pack_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def unpack_seq(frame: bytes) -> int:
    """Decode an 8-byte big-endian seq (signed, so the end marker reads as -1)."""
    if len(frame) != 8:
        raise ValueError(f"seq frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


class ReplayRequest(msgspec.Struct, frozen=True):
    start: int


class ControlRequest(msgspec.Struct, frozen=True):
    op: bytes
    chunk_blocks: int = DEFAULT_SNAPSHOT_CHUNK


class BadRequest(msgspec.Struct, frozen=True):
    reason: str


def parse_request(frames: list[bytes]) -> ReplayRequest | ControlRequest | BadRequest:
    """Classify what a client sent to the replay socket (identity already stripped)."""
    if not frames or frames[0] != b"":
        return BadRequest("missing empty delimiter frame")
    body = frames[1:]
    if len(body) == 1:
        if len(body[0]) != 8:
            return BadRequest(f"replay seq frame must be 8 bytes, got {len(body[0])}")
        # Unsigned, as the reference reads it: 0xff..ff is just past the end.
        return ReplayRequest(int.from_bytes(body[0], "big"))
    if len(body) >= 2 and body[0] == MAGIC:
        op = body[1]
        if op == OP_INFO and len(body) == 2:
            return ControlRequest(OP_INFO)
        if op == OP_SNAPSHOT and len(body) in (2, 3):
            chunk = DEFAULT_SNAPSHOT_CHUNK
            if len(body) == 3:
                if len(body[2]) != 4:
                    return BadRequest("snapshot chunk size frame must be 4 bytes")
                chunk = max(1, min(MAX_SNAPSHOT_CHUNK, int.from_bytes(body[2], "big")))
            return ControlRequest(OP_SNAPSHOT, chunk)
        return BadRequest(f"unknown control op {op[:16]!r} with {len(body)} frames")
    return BadRequest(f"expected 1 frame after the delimiter, got {len(body)}")


def info_frames(info: dict[str, Any]) -> list[bytes]:
    return [b"", MAGIC, REPLY_INFO, _enc.encode(info)]


def snap_frames(header: dict[str, Any], payload: bytes) -> list[bytes]:
    return [b"", MAGIC, REPLY_SNAP, _enc.encode(header), payload]


def err_frames(message: str) -> list[bytes]:
    return [b"", MAGIC, REPLY_ERR, message.encode()]


def decode_map(frame: bytes) -> dict[str, Any]:
    """Decode a control-reply map, raising ValueError if it is not one."""
    try:
        obj = _dec.decode(frame)
    except msgspec.DecodeError as e:
        raise ValueError(f"control reply is not msgpack: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"control reply must be a map, got {type(obj).__name__}")
    return obj
