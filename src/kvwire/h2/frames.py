"""HTTP/2 frames (RFC 9113 section 4 and 6) as bytes and back: no state, no I/O. A frame is
(type, flags, stream id, payload); :func:`parse` takes as many whole frames as a buffer
holds and says how much it used, so a frame split over reads waits for its rest."""

from __future__ import annotations

__all__ = ["ACK", "CONTINUATION", "DATA", "END_HEADERS", "END_STREAM", "FrameError", "GOAWAY",
           "HEADERS", "PADDED", "PING", "PREFACE", "PRIORITY", "PRIORITY_FLAG", "PUSH_PROMISE",
           "RST_STREAM", "SETTINGS", "WINDOW_UPDATE", "encode_settings", "frame",
           "header_block", "parse", "parse_settings", "unpad"]

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

#: What a client sends first (section 3.4), before its SETTINGS frame.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# error codes (section 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT, \
    STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, \
    CONNECT_ERROR, ENHANCE_YOUR_CALM = range(12)

# settings (section 6.5.2)
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, \
    MAX_HEADER_LIST_SIZE = range(1, 7)

MAX_WINDOW = (1 << 31) - 1


class FrameError(Exception):
    """A frame that breaks the framing rules: ``code`` is the HTTP/2 error code to end the
    connection (or the stream, when ``stream`` is set) with."""

    def __init__(self, code: int, message: str, stream: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.stream = stream


def frame(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One frame's bytes."""
    n = len(payload)
    return bytes((n >> 16 & 0xFF, n >> 8 & 0xFF, n & 0xFF, ftype, flags)) + \
        stream.to_bytes(4, "big") + payload


def parse(buf: bytes | bytearray, max_size: int) -> tuple[list[tuple[int, int, int, bytes]], int]:
    """The whole frames at the start of ``buf`` as (type, flags, stream, payload), and the
    bytes they took. A frame longer than ``max_size`` (the SETTINGS_MAX_FRAME_SIZE this side
    announced) is a FRAME_SIZE_ERROR."""
    out = []
    pos = 0
    size = len(buf)
    while size - pos >= 9:
        n = buf[pos] << 16 | buf[pos + 1] << 8 | buf[pos + 2]
        if n > max_size:
            raise FrameError(FRAME_SIZE_ERROR, f"a frame of {n} bytes (at most {max_size})")
        end = pos + 9 + n
        if end > size:
            break
        out.append((buf[pos + 3], buf[pos + 4],
                    (buf[pos + 5] & 0x7F) << 24 | buf[pos + 6] << 16 | buf[pos + 7] << 8
                    | buf[pos + 8], bytes(buf[pos + 9:end])))
        pos = end
    return out, pos


def unpad(flags: int, payload: bytes) -> bytes:
    """A DATA or HEADERS payload without its padding (PADDED: a length byte first)."""
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise FrameError(PROTOCOL_ERROR, "padding as long as the frame")
    return payload[1:len(payload) - payload[0]]


def encode_settings(settings: dict[int, int]) -> bytes:
    return b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in settings.items())


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    if len(payload) % 6:
        raise FrameError(FRAME_SIZE_ERROR, "a SETTINGS payload not a multiple of 6 bytes")
    return [(int.from_bytes(payload[i:i + 2], "big"), int.from_bytes(payload[i + 2:i + 6], "big"))
            for i in range(0, len(payload), 6)]


# ---------------------------------------------------------------------------- header blocks

#: HPACK's static table names (RFC 7541 appendix A) this side sends, by their index.
_NAME_INDEX = {b":status": 8, b"content-type": 31, b"content-length": 28, b"date": 33,
               b"server": 54}
#: whole static entries (name and value)
_FULL_INDEX = {(b":status", b"200"): 8, (b":status", b"204"): 9, (b":status", b"206"): 10,
               (b":status", b"304"): 11, (b":status", b"400"): 12, (b":status", b"404"): 13,
               (b":status", b"500"): 14}


def _int(value: int, prefix: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 5.1) with ``prefix`` bits, ``first`` the high bits."""
    top = (1 << prefix) - 1
    if value < top:
        return bytes((first | value,))
    out = bytearray((first | top,))
    value -= top
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def header_block(headers: list[tuple[bytes, bytes]] | tuple[tuple[bytes, bytes], ...]) -> bytes:
    """An HPACK block that never touches the dynamic table (static indexes and literals
    without indexing, no Huffman): whatever table size the peer allows, it decodes."""
    out = bytearray()
    for name, value in headers:
        full = _FULL_INDEX.get((name, value))
        if full is not None:
            out += _int(full, 7, 0x80)
            continue
        idx = _NAME_INDEX.get(name)
        if idx is not None:
            out += _int(idx, 4, 0)
        else:
            out += b"\x00" + _int(len(name), 7, 0) + name
        out += _int(len(value), 7, 0) + value
    return bytes(out)
