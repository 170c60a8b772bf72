"""What is on the wire: event types and their dialects (:mod:`.events`), ZeroMQ frames
(:mod:`.frames`), endpoints, CurveZMQ, and the frame layout of the transport and of kvwire's
control extension (:mod:`.protocol`, re-exported here so ``wire.MAGIC`` reads as what it is)."""

from .protocol import (
    DEFAULT_SNAPSHOT_CHUNK,
    END_SEQ,
    MAGIC,
    MAX_SNAPSHOT_CHUNK,
    OP_INFO,
    OP_SNAPSHOT,
    REPLY_ERR,
    REPLY_INFO,
    REPLY_SNAP,
    BadRequest,
    ControlRequest,
    ReplayRequest,
    decode_map,
    err_frames,
    info_frames,
    pack_seq,
    parse_request,
    snap_frames,
    unpack_seq,
)

__all__ = [
    "DEFAULT_SNAPSHOT_CHUNK", "END_SEQ", "MAGIC", "MAX_SNAPSHOT_CHUNK", "OP_INFO", "OP_SNAPSHOT",
    "REPLY_ERR", "REPLY_INFO", "REPLY_SNAP", "BadRequest", "ControlRequest", "ReplayRequest",
    "decode_map", "err_frames", "info_frames", "pack_seq", "parse_request", "snap_frames",
    "unpack_seq",
]
