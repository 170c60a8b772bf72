"""The publisher's messages as a stream machine reads them: the live frames and the replies
on the request socket (replay, INFO, SNAPSHOT chunks, errors), parsed strictly, so that
anything else is a :class:`FrameError` naming what was wrong."""

from __future__ import annotations

import msgspec

from ..wire import protocol

__all__ = ["ErrorReply", "FrameError", "InfoReply", "Reply", "ReplayEnd", "ReplayMessage",
           "SnapshotChunk", "SnapshotHeader", "parse_live", "parse_reply"]

# --------------------------------------------------------------------------- parsed frames


class FrameError(ValueError):
    """A multipart message that is not any message of the protocol."""


class InfoReply(msgspec.Struct, frozen=True, kw_only=True):
    """The INFO map (docs/protocol.md, 2.1); unknown keys are ignored."""

    epoch: int
    version: int = 1
    seq: int = -1
    oldest: int = -1
    topic: str = ""
    rank: int | None = None
    heartbeat_interval: float | None = None
    snapshot: bool = False
    buffer_steps: int = 0
    dialect: str = "vllm"


class SnapshotHeader(msgspec.Struct, frozen=True):
    epoch: int
    seq: int
    chunk: int
    chunks: int
    blocks: int = 0


class ReplayMessage(msgspec.Struct, frozen=True):
    seq: int
    payload: bytes


class ReplayEnd(msgspec.Struct, frozen=True):
    pass


class SnapshotChunk(msgspec.Struct, frozen=True):
    header: SnapshotHeader
    payload: bytes


class ErrorReply(msgspec.Struct, frozen=True):
    message: str


Reply = ReplayMessage | ReplayEnd | InfoReply | SnapshotChunk | ErrorReply

_info_dec = msgspec.msgpack.Decoder(InfoReply)
_snap_dec = msgspec.msgpack.Decoder(SnapshotHeader)


def parse_live(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of a live message; raises :class:`FrameError`."""
    if len(frames) != 3:
        raise FrameError(f"live message must have 3 frames, got {len(frames)}")
    topic, seq_f, payload = frames
    if len(seq_f) != 8:
        raise FrameError(f"live seq frame must be 8 bytes, got {len(seq_f)}")
    seq = int.from_bytes(seq_f, "big", signed=True)
    if seq < 0:
        raise FrameError(f"live seq must be >= 0, got {seq}")
    return bytes(topic), seq, bytes(payload)


def parse_reply(frames: list[bytes]) -> Reply:
    """Classify one message from the replay socket, as a DEALER receives it.

    Accepts both replay layouts (with and without the topic frame).
    """
    if not frames or frames[0] != b"":
        raise FrameError("reply lacks the empty delimiter frame")
    body = frames[1:]
    n = len(body)
    if n >= 2 and body[0] == protocol.MAGIC and len(body[1]) != 8:
        op = body[1]
        try:
            if op == protocol.REPLY_INFO and n == 3:
                return _info_dec.decode(body[2])
            if op == protocol.REPLY_SNAP and n == 4:
                return SnapshotChunk(_snap_dec.decode(body[2]), bytes(body[3]))
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise FrameError(f"bad {op[:8]!r} reply: {e}") from None
        if op == protocol.REPLY_ERR and n == 3:
            return ErrorReply(bytes(body[2]).decode("utf-8", "replace"))
        raise FrameError(f"unknown control reply {op[:16]!r} with {n} frames")
    if n == 3:  # topic, seq, payload
        seq_f, payload = body[1], body[2]
    elif n == 2:  # pre-0.26 layout: seq, payload
        seq_f, payload = body[0], body[1]
    else:
        raise FrameError(f"replay reply must have 2 or 3 frames after the delimiter, got {n}")
    if len(seq_f) != 8:
        raise FrameError(f"replay seq frame must be 8 bytes, got {len(seq_f)}")
    seq = int.from_bytes(seq_f, "big", signed=True)
    if seq == -1:
        return ReplayEnd()
    if seq < 0:
        raise FrameError(f"replay seq must be >= 0 or -1, got {seq}")
    return ReplayMessage(seq, bytes(payload))
