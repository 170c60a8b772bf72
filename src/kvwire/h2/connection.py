"""The server side of one HTTP/2 connection as a pure state machine (no sockets, no clock,
no asyncio): :meth:`Connection.receive` takes the bytes that came and returns what they
meant (:class:`Request`, :class:`Data`, :class:`Reset`, :class:`GoAway`,
:class:`Terminated`); the ``send_*`` methods queue frames; :meth:`Connection.take` hands
over the bytes to write. Everything the peer needs no answer from the application for is
answered here: SETTINGS and their ACK, PING, WINDOW_UPDATE, flow control both ways.

Flow control. Sending: DATA never exceeds the peer's windows (the connection's and the
stream's, changed by its SETTINGS_INITIAL_WINDOW_SIZE and WINDOW_UPDATE); what does not fit
waits in the stream's queue, in order, and a stream's trailers go after its last byte.
Receiving: the connection window is given back as data arrives (batched, half a window at a
time); a stream's window only when the application says it used the bytes
(:meth:`Connection.consumed`), so a stream whose reader stalls holds at most one window of
the peer's data here."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from . import frames as f
from .frames import FrameError
from .hpack_decoder import Decoder, HpackError

__all__ = ["Connection", "Data", "GoAway", "Request", "Reset", "Terminated"]


@dataclass(slots=True)
class Request:
    """A stream's first header block (``end``: it also ended the stream: no body), or its
    trailers (``trailers``; they always end it)."""

    stream: int
    headers: list[tuple[bytes, bytes]]
    end: bool
    trailers: bool = False


@dataclass(slots=True)
class Data:
    """Body bytes of a stream (``end``: the peer's last). ``flow``: the bytes they took of
    the stream's window, to give back with :meth:`Connection.consumed` once used."""

    stream: int
    data: bytes
    end: bool
    flow: int


@dataclass(slots=True)
class Reset:
    """The peer reset a stream (RST_STREAM, ``code`` its error code): it wants no more."""

    stream: int
    code: int


@dataclass(slots=True)
class GoAway:
    """The peer will open no stream past ``last_stream``."""

    last_stream: int
    code: int


@dataclass(slots=True)
class Terminated:
    """The connection is over (a GOAWAY was queued naming ``code``): close it once written."""

    code: int
    message: str


class _Stream:
    __slots__ = ("id", "send_window", "recv_window", "unacked", "queue", "queued", "trailers",
                 "remote_open", "local_open", "headers_done")

    def __init__(self, sid: int, send_window: int, recv_window: int) -> None:
        self.id = sid
        self.send_window = send_window
        self.recv_window = recv_window
        self.unacked = 0  # bytes used and not yet given back
        self.queue: deque[bytes] = deque()  # DATA payloads waiting for window
        self.queued = 0
        self.trailers: bytes | None = None  # a header block to send after the queue
        self.remote_open = True
        self.local_open = True
        self.headers_done = False  # the first header block arrived (a second is trailers)


class Connection:
    """One server connection. ``max_streams``: SETTINGS_MAX_CONCURRENT_STREAMS (a stream
    past it is refused with REFUSED_STREAM); ``window``: the initial window this side gives
    each stream (and the connection); ``max_frame``: the largest frame accepted."""

    def __init__(self, *, max_streams: int = 1000, window: int = 1 << 20,
                 max_frame: int = 16384, max_header_list: int = 1 << 16) -> None:
        self.max_streams = max_streams
        self.window = window
        self.max_frame = max_frame
        self.out = bytearray()
        self.streams: dict[int, _Stream] = {}
        self.peer_window = 65535  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self.peer_max_frame = 16384
        self.send_window = 65535  # the connection's, towards the peer
        self.recv_window = window  # the connection's, from the peer
        self.recv_unacked = 0
        self.last_stream = 0  # the highest stream id the peer opened
        self.goaway_sent: int | None = None  # the last stream id the GOAWAY named
        self.closed = False
        self.blocked: dict[int, None] = {}  # streams with data waiting for the connection window
        self._buf = bytearray()
        self._preface = False
        self._block: bytearray | None = None  # a header block awaiting its CONTINUATIONs
        self._block_stream = 0
        self._block_end = False
        self._decoder = Decoder(4096, max_header_list)
        self.out += f.frame(f.SETTINGS, 0, 0, f.encode_settings({
            f.MAX_CONCURRENT_STREAMS: max_streams, f.INITIAL_WINDOW_SIZE: window,
            f.MAX_FRAME_SIZE: max_frame, f.MAX_HEADER_LIST_SIZE: max_header_list}))
        if window > 65535:
            self.out += f.frame(f.WINDOW_UPDATE, 0, 0, (window - 65535).to_bytes(4, "big"))

    # ------------------------------------------------------------------ what came

    def receive(self, data: bytes) -> list[object]:
        """The events ``data`` completes (frames split over calls wait for their rest)."""
        if self.closed:
            return []
        buf = self._buf
        buf += data
        events: list[object] = []
        try:
            if not self._preface:
                if len(buf) < len(f.PREFACE):
                    if not f.PREFACE.startswith(bytes(buf)):
                        raise FrameError(f.PROTOCOL_ERROR, "not the HTTP/2 client preface")
                    return events
                if not buf.startswith(f.PREFACE):
                    raise FrameError(f.PROTOCOL_ERROR, "not the HTTP/2 client preface")
                del buf[:len(f.PREFACE)]
                self._preface = True
            got, used = f.parse(buf, self.max_frame)
            if used:
                del buf[:used]
            for ftype, flags, sid, payload in got:
                if self._block is not None and ftype != f.CONTINUATION:
                    raise FrameError(f.PROTOCOL_ERROR, "a header block cut by another frame")
                if ftype == f.DATA:
                    self._data(flags, sid, payload, events)
                elif ftype == f.HEADERS:
                    self._headers(flags, sid, payload, events)
                elif ftype == f.CONTINUATION:
                    self._continuation(flags, sid, payload, events)
                elif ftype == f.WINDOW_UPDATE:
                    self._window_update(sid, payload)
                elif ftype == f.SETTINGS:
                    self._settings(flags, sid, payload)
                elif ftype == f.PING:
                    if sid or len(payload) != 8:
                        raise FrameError(f.PROTOCOL_ERROR if sid else f.FRAME_SIZE_ERROR,
                                         "a bad PING")
                    if not flags & f.ACK:
                        self.out += f.frame(f.PING, f.ACK, 0, payload)
                elif ftype == f.RST_STREAM:
                    if not sid or len(payload) != 4:
                        raise FrameError(f.PROTOCOL_ERROR, "a bad RST_STREAM")
                    if sid > self.last_stream:
                        raise FrameError(f.PROTOCOL_ERROR, "RST_STREAM of an idle stream")
                    s = self.streams.pop(sid, None)
                    self.blocked.pop(sid, None)
                    if s is not None:
                        events.append(Reset(sid, int.from_bytes(payload, "big")))
                elif ftype == f.GOAWAY:
                    if sid or len(payload) < 8:
                        raise FrameError(f.PROTOCOL_ERROR, "a bad GOAWAY")
                    events.append(GoAway(int.from_bytes(payload[:4], "big") & 0x7FFFFFFF,
                                         int.from_bytes(payload[4:8], "big")))
                elif ftype == f.PRIORITY:
                    if not sid or len(payload) != 5:
                        raise FrameError(f.PROTOCOL_ERROR, "a bad PRIORITY")
                elif ftype == f.PUSH_PROMISE:
                    raise FrameError(f.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
                # other types are extensions: ignored (section 4.1)
        except FrameError as e:
            self.terminate(e.code, str(e))
            events.append(Terminated(e.code, str(e)))
        return events

    def _data(self, flags: int, sid: int, payload: bytes, events: list[object]) -> None:
        n = len(payload)
        if not sid:
            raise FrameError(f.PROTOCOL_ERROR, "DATA on stream 0")
        if n > self.recv_window:
            raise FrameError(f.FLOW_CONTROL_ERROR, "DATA past the connection window")
        self.recv_window -= n
        self.recv_unacked += n
        if self.recv_unacked >= self.window >> 1:
            self.out += f.frame(f.WINDOW_UPDATE, 0, 0, self.recv_unacked.to_bytes(4, "big"))
            self.recv_window += self.recv_unacked
            self.recv_unacked = 0
        s = self.streams.get(sid)
        if s is None or not s.remote_open:
            if sid > self.last_stream:
                raise FrameError(f.PROTOCOL_ERROR, "DATA on an idle stream")
            if s is not None:  # half-closed (remote): a stream error
                self._reset(s, f.STREAM_CLOSED)
            return  # a stream this side closed or reset: ignored (section 5.1)
        if not s.headers_done:
            raise FrameError(f.PROTOCOL_ERROR, "DATA before HEADERS")
        if n > s.recv_window:
            self._reset(s, f.FLOW_CONTROL_ERROR)
            events.append(Reset(sid, f.FLOW_CONTROL_ERROR))
            return
        s.recv_window -= n
        data = f.unpad(flags, payload)
        pad = n - len(data)
        if pad:  # padding is nobody's to use: given back at once
            self.consumed(sid, pad)
        end = bool(flags & f.END_STREAM)
        if end:
            s.remote_open = False
            if not s.local_open:
                self._forget(s)
        events.append(Data(sid, data, end, n - pad))

    def _headers(self, flags: int, sid: int, payload: bytes, events: list[object]) -> None:
        if not sid:
            raise FrameError(f.PROTOCOL_ERROR, "HEADERS on stream 0")
        payload = f.unpad(flags, payload)
        if flags & f.PRIORITY_FLAG:
            if len(payload) < 5:
                raise FrameError(f.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            payload = payload[5:]
        if flags & f.END_HEADERS:
            self._block_done(sid, payload, bool(flags & f.END_STREAM), events)
        else:
            self._block = bytearray(payload)
            self._block_stream = sid
            self._block_end = bool(flags & f.END_STREAM)

    def _continuation(self, flags: int, sid: int, payload: bytes, events: list[object]) -> None:
        if self._block is None or sid != self._block_stream:
            raise FrameError(f.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        self._block += payload
        if len(self._block) > 1 << 20:
            raise FrameError(f.ENHANCE_YOUR_CALM, "a header block over 1 MiB")
        if flags & f.END_HEADERS:
            block, self._block = bytes(self._block), None
            self._block_done(sid, block, self._block_end, events)

    def _block_done(self, sid: int, block: bytes, end: bool, events: list[object]) -> None:
        try:  # decoded whatever the stream's state: the dynamic table must follow the peer's
            headers = self._decoder.decode(block)
        except HpackError as e:
            raise FrameError(f.COMPRESSION_ERROR, str(e)) from None
        s = self.streams.get(sid)
        if s is not None:
            if not s.remote_open:
                self._reset(s, f.STREAM_CLOSED)
                return
            if not end:
                raise FrameError(f.PROTOCOL_ERROR, "trailers that do not end the stream")
            s.remote_open = False
            if not s.local_open:
                self._forget(s)
            events.append(Request(sid, headers, True, trailers=True))
            return
        if sid <= self.last_stream:  # a stream already closed
            if sid & 1 == 0:
                raise FrameError(f.PROTOCOL_ERROR, "HEADERS on an even stream id")
            return
        if sid & 1 == 0:
            raise FrameError(f.PROTOCOL_ERROR, "a client stream with an even id")
        self.last_stream = sid
        if self.goaway_sent is not None:
            return  # past the GOAWAY: ignored (the peer retries it elsewhere)
        s = _Stream(sid, self.peer_window, self.window)
        s.headers_done = True
        if len(self.streams) >= self.max_streams:
            self.out += f.frame(f.RST_STREAM, 0, sid, f.REFUSED_STREAM.to_bytes(4, "big"))
            return
        self.streams[sid] = s
        if end:
            s.remote_open = False
        events.append(Request(sid, headers, end))

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise FrameError(f.FRAME_SIZE_ERROR, "a WINDOW_UPDATE not 4 bytes")
        inc = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if not sid:
            if not inc:
                raise FrameError(f.PROTOCOL_ERROR, "a connection WINDOW_UPDATE of 0")
            self.send_window += inc
            if self.send_window > f.MAX_WINDOW:
                raise FrameError(f.FLOW_CONTROL_ERROR, "the connection window past 2^31-1")
            for b in list(self.blocked):
                if self.send_window <= 0:
                    break
                s = self.streams.get(b)
                del self.blocked[b]
                if s is not None:
                    self._pump(s)
            return
        s = self.streams.get(sid)
        if s is None:
            if sid > self.last_stream:
                raise FrameError(f.PROTOCOL_ERROR, "WINDOW_UPDATE of an idle stream")
            return
        if not inc:
            self._reset(s, f.PROTOCOL_ERROR)
            return
        s.send_window += inc
        if s.send_window > f.MAX_WINDOW:
            self._reset(s, f.FLOW_CONTROL_ERROR)
            return
        if s.queue or s.trailers is not None:
            self._pump(s)

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            raise FrameError(f.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & f.ACK:
            if payload:
                raise FrameError(f.FRAME_SIZE_ERROR, "a SETTINGS ACK with a payload")
            return
        for key, value in f.parse_settings(payload):
            if key == f.INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    raise FrameError(f.FLOW_CONTROL_ERROR, "an initial window past 2^31-1")
                delta = value - self.peer_window
                self.peer_window = value
                for s in self.streams.values():
                    s.send_window += delta
            elif key == f.MAX_FRAME_SIZE:
                if not 16384 <= value <= 16777215:
                    raise FrameError(f.PROTOCOL_ERROR, "a MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
            elif key == f.ENABLE_PUSH and value > 1:
                raise FrameError(f.PROTOCOL_ERROR, "ENABLE_PUSH not 0 or 1")
            # HEADER_TABLE_SIZE: this side's blocks never use the dynamic table
        self.out += f.frame(f.SETTINGS, f.ACK, 0)
        for s in list(self.streams.values()):
            if s.queue or s.trailers is not None:
                self._pump(s)

    # ------------------------------------------------------------------ what goes

    def consumed(self, sid: int, n: int) -> None:
        """The application used ``n`` bytes of a stream's DATA: its window opens again
        (a WINDOW_UPDATE once half a window is owed)."""
        s = self.streams.get(sid)
        if s is None or not s.remote_open or n <= 0:
            return
        s.unacked += n
        if s.unacked >= self.window >> 1:
            self.out += f.frame(f.WINDOW_UPDATE, 0, sid, s.unacked.to_bytes(4, "big"))
            s.recv_window += s.unacked
            s.unacked = 0

    def send_headers(self, sid: int, headers: list[tuple[bytes, bytes]] | bytes,
                     end: bool = False) -> None:
        """A response's header block (a list, or a block from :func:`.frames.header_block`),
        ``end``: with nothing after it."""
        s = self.streams.get(sid)
        if s is None or not s.local_open:
            return
        block = headers if isinstance(headers, bytes) else f.header_block(headers)
        self._write_block(sid, block, end)
        if end:
            self._local_end(s)

    def send_data(self, sid: int, data: bytes, end: bool = False) -> None:
        """Body bytes, sent as the windows allow (the rest waits, in order)."""
        s = self.streams.get(sid)
        if s is None or not s.local_open or s.trailers is not None:
            return
        n = len(data)
        if not s.queue and n <= s.send_window and n <= self.send_window \
                and n <= self.peer_max_frame:
            s.send_window -= n
            self.send_window -= n
            self.out += f.frame(f.DATA, f.END_STREAM if end else 0, sid, data)
            if end:
                self._local_end(s)
            return
        if data:
            s.queue.append(data)
            s.queued += n
        if end:
            s.trailers = b""  # (an empty DATA frame with END_STREAM once the queue is out)
        self._pump(s)

    def send_trailers(self, sid: int, headers: list[tuple[bytes, bytes]] | bytes) -> None:
        """The last header block of a stream, after every byte queued before it."""
        s = self.streams.get(sid)
        if s is None or not s.local_open or s.trailers is not None:
            return
        s.trailers = headers if isinstance(headers, bytes) else f.header_block(headers)
        self._pump(s)

    def reset(self, sid: int, code: int = f.CANCEL) -> None:
        """End a stream at once (RST_STREAM): queued data is dropped."""
        s = self.streams.get(sid)
        if s is not None:
            self._reset(s, code)

    def terminate(self, code: int = f.NO_ERROR, message: str = "") -> None:
        """GOAWAY and close: no stream continues."""
        if self.closed:
            return
        self.goaway(code, message)
        self.closed = True

    def goaway(self, code: int = f.NO_ERROR, message: str = "") -> None:
        """GOAWAY naming the last stream the peer opened: streams under way go on, new ones
        are ignored (the peer opens them on another connection)."""
        self.goaway_sent = self.last_stream
        self.out += f.frame(f.GOAWAY, 0, 0, self.last_stream.to_bytes(4, "big")
                            + code.to_bytes(4, "big") + message.encode()[:256])

    def take(self) -> bytes:
        """The bytes to write now (and forget)."""
        out = bytes(self.out)
        self.out.clear()
        return out

    def open_streams(self) -> int:
        return len(self.streams)

    def pending(self, sid: int) -> int:
        """Bytes of a stream still waiting for window."""
        s = self.streams.get(sid)
        return 0 if s is None else s.queued

    # ------------------------------------------------------------------ inside

    def _write_block(self, sid: int, block: bytes, end: bool) -> None:
        size = self.peer_max_frame
        flags = f.END_STREAM if end else 0
        if len(block) <= size:
            self.out += f.frame(f.HEADERS, flags | f.END_HEADERS, sid, block)
            return
        self.out += f.frame(f.HEADERS, flags, sid, block[:size])
        for i in range(size, len(block), size):
            last = i + size >= len(block)
            self.out += f.frame(f.CONTINUATION, f.END_HEADERS if last else 0, sid,
                                block[i:i + size])

    def _pump(self, s: _Stream) -> None:
        queue = s.queue
        while queue:
            room = min(s.send_window, self.send_window, self.peer_max_frame)
            if room <= 0:
                if self.send_window <= 0 and s.send_window > 0:
                    self.blocked[s.id] = None
                return
            chunk = queue[0]
            if len(chunk) > room:
                queue[0] = chunk[room:]
                chunk = chunk[:room]
            else:
                queue.popleft()
            n = len(chunk)
            s.queued -= n
            s.send_window -= n
            self.send_window -= n
            last = not queue and s.trailers == b""
            self.out += f.frame(f.DATA, f.END_STREAM if last else 0, s.id, chunk)
            if last:
                self._local_end(s)
                return
        if s.trailers is not None:
            if s.trailers:
                self._write_block(s.id, s.trailers, True)
            else:
                self.out += f.frame(f.DATA, f.END_STREAM, s.id)
            self._local_end(s)

    def _local_end(self, s: _Stream) -> None:
        s.local_open = False
        s.trailers = None
        if s.remote_open:  # the answer is whole: the peer need send no more (section 8.1)
            self.out += f.frame(f.RST_STREAM, 0, s.id, f.NO_ERROR.to_bytes(4, "big"))
        self._forget(s)

    def _reset(self, s: _Stream, code: int) -> None:
        self.out += f.frame(f.RST_STREAM, 0, s.id, code.to_bytes(4, "big"))
        self._forget(s)

    def _forget(self, s: _Stream) -> None:
        self.streams.pop(s.id, None)
        self.blocked.pop(s.id, None)
