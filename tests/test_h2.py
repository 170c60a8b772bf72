"""kvwire.h2: the frame codec, the pure connection machine (settings, ping, header blocks,
padding, resets, flow control both ways) driven by a client of the test's own, the gRPC
message deframer, and the gRPC server on real sockets under grpc.aio's client (Envoy's
gRPC clients speak the same protocol; tests/test_epp_envoy.py runs the picker on it behind
a real Envoy)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from hpack import Decoder, Encoder
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvwire.h2 import frames as f
from kvwire.h2.connection import Connection, Data, Request, Reset, Terminated
from kvwire.h2.grpc import Abort, Deframer, Server, StatusCode, stream_stream, unary_unary
from kvwire.h2.hpack_decoder import Decoder as OurDecoder
from kvwire.h2.hpack_decoder import HpackError

# ---------------------------------------------------------------------------- frames


def _frames_of(raw: bytes) -> list[tuple[int, int, int, bytes]]:
    got, used = f.parse(raw, 1 << 24)
    assert used == len(raw)
    return got


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 255), st.integers(0, 2**31 - 1),
                          st.binary(max_size=300)), max_size=12),
       st.lists(st.integers(1, 400), max_size=20))
def test_frames_parse_back_however_the_bytes_are_cut(frames, cuts) -> None:
    raw = b"".join(f.frame(*x) for x in frames)
    buf = bytearray()
    got: list = []
    pos = 0
    for n in [*cuts, len(raw)]:
        buf += raw[pos:pos + n]
        pos += n
        more, used = f.parse(buf, 16384)
        del buf[:used]
        got += more
    assert got == frames and not buf


def test_a_frame_past_the_announced_size_is_a_frame_size_error() -> None:
    with pytest.raises(f.FrameError) as e:
        f.parse(f.frame(f.DATA, 0, 1, b"x" * 16385), 16384)
    assert e.value.code == f.FRAME_SIZE_ERROR


_NAMES = st.sampled_from([b":status", b"content-type", b"grpc-status", b"grpc-message",
                          b"content-length", b"x-a", b"server"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_NAMES | st.binary(min_size=1, max_size=200).map(bytes.lower),
                          st.sampled_from([b"200", b"404", b"application/grpc"])
                          | st.binary(max_size=300)), max_size=10))
def test_header_blocks_decode_to_what_was_sent(headers) -> None:
    """Any HPACK decoder, whatever its table, reads this side's blocks back exactly."""
    d = Decoder()
    assert [tuple(h) for h in d.decode(f.header_block(headers), raw=True)] == headers
    assert not d.header_table.dynamic_entries  # (never the dynamic table)


_HEADER = st.tuples(_NAMES | st.sampled_from([b":path", b":method", b"te", b"x-request-id"])
                    | st.binary(min_size=1, max_size=40).map(bytes.lower),
                    st.sampled_from([b"POST", b"/a.B/C", b"trailers"]) | st.binary(max_size=60),
                    st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(_HEADER, max_size=8), st.booleans(),
                          st.none() | st.integers(0, 4096)), max_size=12))
def test_hpack_decoding_matches_the_hpack_package_s_encoder(blocks) -> None:
    """Blocks from another HPACK encoder (Huffman or not, indexed, never-indexed, table
    size changes, evictions) decode to what it encoded, block after block on one
    connection, the kept decodings of repeated blocks included."""
    enc = Encoder()
    ours = OurDecoder(4096)
    for headers, huffman, resize in blocks:
        if resize is not None:
            enc.header_table_size = resize
        block = enc.encode([(n, v, s) for n, v, s in headers], huffman=huffman)
        assert ours.decode(block) == [(n, v) for n, v, _ in headers]
        again = enc.encode([(n, v, s) for n, v, s in headers], huffman=huffman)
        assert ours.decode(again) == [(n, v) for n, v, _ in headers]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_hpack_garbage_is_a_compression_error_only(raw) -> None:
    try:
        OurDecoder(4096).decode(raw)
    except HpackError:
        pass


def test_hpack_a_repeated_block_is_decoded_again_once_the_table_changed() -> None:
    """The kept decoding of a block that refers to the dynamic table is not reused after
    the table changed (the same bytes then mean other headers)."""
    d = OurDecoder(4096)
    add = b"\x40\x01a\x01x"  # literal with incremental indexing: a: x (index 62)
    assert d.decode(add) == [(b"a", b"x")]
    assert d.decode(b"\xbe") == [(b"a", b"x")]  # index 62
    assert d.decode(b"\x40\x01b\x01y") == [(b"b", b"y")]
    assert d.decode(b"\xbe") == [(b"b", b"y")]  # (index 62 is now the newer entry)
    with pytest.raises(HpackError):
        d.decode(b"\x3f\xe2\x1f")  # a table size of 4097: past the 4096 announced
    with pytest.raises(HpackError):
        d.decode(b"\x82\x20")  # a size update after a field


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=2000), max_size=8), st.lists(st.integers(1, 700)))
def test_grpc_messages_come_out_whole_however_the_frames_cut_them(messages, cuts) -> None:
    raw = b"".join(b"\0" + len(m).to_bytes(4, "big") + m for m in messages)
    d = Deframer(1 << 20)
    out: list[bytes] = []
    pos = 0
    total = 0
    for n in cuts:
        total += d.feed(raw[pos:pos + n], False, out)
        pos += n
    total += d.feed(raw[pos:], True, out)
    assert out == messages and total == sum(map(len, messages))


def test_deframer_refuses_compressed_oversized_and_cut_messages() -> None:
    with pytest.raises(Abort) as e:
        Deframer(100).feed(b"\x01\0\0\0\x01x", False, [])
    assert e.value.code is StatusCode.UNIMPLEMENTED
    with pytest.raises(Abort) as e:
        Deframer(100).feed(b"\0\0\0\x01\0", False, [])
    assert e.value.code is StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(Abort) as e:
        Deframer(100).feed(b"\0\0\0\0\x05ab", True, [])
    assert e.value.code is StatusCode.INTERNAL


# ---------------------------------------------------------------------------- the machine


class Peer:
    """A client of the test's own: builds frames (HPACK through the hpack package's
    encoder) and reads what the connection wrote, keeping its flow-control view."""

    def __init__(self, conn: Connection, window: int = 65535) -> None:
        self.conn = conn
        self.enc = Encoder()
        self.window = window  # what this client's SETTINGS gave each stream
        self.conn_window = 65535  # the client's send window towards the server
        self.stream_windows: dict[int, int] = {}
        self.frames: list[tuple[int, int, int, bytes]] = []
        self.events: list = conn.receive(f.PREFACE + f.frame(
            f.SETTINGS, 0, 0, f.encode_settings({f.INITIAL_WINDOW_SIZE: window})))
        self.read()

    def send(self, raw: bytes) -> list:
        ev = self.conn.receive(raw)
        self.events += ev
        self.read()
        return ev

    def read(self) -> list[tuple[int, int, int, bytes]]:
        got = _frames_of(self.conn.take())
        for ftype, flags, sid, payload in got:
            if ftype == f.WINDOW_UPDATE:
                inc = int.from_bytes(payload, "big")
                if sid:
                    self.stream_windows[sid] = self.stream_windows.get(sid, 65535) + inc
                else:
                    self.conn_window += inc
            elif ftype == f.SETTINGS and not flags & f.ACK:
                for k, v in f.parse_settings(payload):
                    if k == f.INITIAL_WINDOW_SIZE:
                        self.server_initial = v
        self.frames += got
        return got

    def open(self, sid: int, end: bool = False, headers=None) -> list:
        block = self.enc.encode(headers or [(":method", "POST"), (":path", "/x"),
                                            (":scheme", "http"), ("content-type", "a")])
        self.stream_windows.setdefault(sid, getattr(self, "server_initial", 65535))
        return self.send(f.frame(f.HEADERS, f.END_HEADERS | (f.END_STREAM if end else 0),
                                 sid, block))

    def data(self, sid: int, payload: bytes, end: bool = False, pad: int | None = None) -> list:
        flags = f.END_STREAM if end else 0
        body = payload
        if pad is not None:
            flags |= f.PADDED
            body = bytes((pad,)) + payload + b"\0" * pad
        self.conn_window -= len(body)
        self.stream_windows[sid] = self.stream_windows.get(sid, 65535) - len(body)
        return self.send(f.frame(f.DATA, flags, sid, body))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10), st.integers(0, 255), st.integers(0, 9),
                          st.binary(max_size=40)), max_size=12), st.binary(max_size=60))
def test_any_frames_give_events_or_end_the_connection_never_an_exception(frames, tail) -> None:
    """Whatever a peer sends after the preface: events, or a GOAWAY and Terminated."""
    c = Connection()
    raw = f.PREFACE + b"".join(f.frame(*x) for x in frames) + tail
    events = c.receive(raw)
    if c.closed:
        assert isinstance(events[-1], Terminated)
        assert _frames_of(c.take())[-1][0] == f.GOAWAY
    assert c.receive(b"more") == [] if c.closed else True


def test_settings_are_acknowledged_and_pings_answered() -> None:
    c = Connection(window=1 << 20)
    first = _frames_of(c.take())
    assert first[0][:3] == (f.SETTINGS, 0, 0)
    assert dict(f.parse_settings(first[0][3]))[f.INITIAL_WINDOW_SIZE] == 1 << 20
    assert first[1][:3] == (f.WINDOW_UPDATE, 0, 0)  # the connection's window too
    p = Peer(c)
    assert (f.SETTINGS, f.ACK, 0, b"") in p.frames
    p.send(f.frame(f.PING, 0, 0, b"12345678"))
    assert p.frames[-1] == (f.PING, f.ACK, 0, b"12345678")
    assert p.send(f.frame(f.PING, f.ACK, 0, b"abcdefgh")) == [] and p.read() == []
    p.send(f.frame(f.SETTINGS, f.ACK, 0))
    p.send(f.frame(0xEE, 0, 0, b"an extension"))  # unknown types are ignored
    assert not c.closed


def test_headers_padded_with_priority_and_continuations() -> None:
    c = Connection()
    p = Peer(c)
    block = p.enc.encode([(":method", "POST"), (":path", "/svc/M"), ("x-long", "v" * 5000)])
    first = b"\x03" + b"\0\0\0\x01\x10" + block[:100] + b"pad"  # PADDED, PRIORITY
    ev = p.send(f.frame(f.HEADERS, f.PADDED | f.PRIORITY_FLAG, 1, first))
    assert ev == []  # (waits for the rest of the block)
    p.send(f.frame(f.CONTINUATION, 0, 1, block[100:3000]))
    ev = p.send(f.frame(f.CONTINUATION, f.END_HEADERS, 1, block[3000:]))
    assert ev == [Request(1, [(b":method", b"POST"), (b":path", b"/svc/M"),
                              (b"x-long", b"v" * 5000)], False)]
    ev = p.data(1, b"hello", pad=20)
    assert ev == [Data(1, b"hello", False, 5)]


def test_a_header_block_cut_by_another_frame_ends_the_connection() -> None:
    c = Connection()
    p = Peer(c)
    p.send(f.frame(f.HEADERS, 0, 1, p.enc.encode([(":path", "/a")])))
    ev = p.send(f.frame(f.DATA, 0, 1, b"x"))
    assert isinstance(ev[-1], Terminated) and ev[-1].code == f.PROTOCOL_ERROR
    assert p.frames[-1][0] == f.GOAWAY and c.closed


def test_padding_is_given_back_at_once() -> None:
    """Padding takes window but no one reads it: its window returns without the
    application consuming anything."""
    c = Connection(window=1024)
    p = Peer(c)
    p.open(1)
    for _ in range(3):
        p.data(1, b"", pad=200)
    assert any(fr[0] == f.WINDOW_UPDATE and fr[2] == 1 for fr in p.frames)


def test_resets_refusals_and_goaway() -> None:
    c = Connection(max_streams=2)
    p = Peer(c)
    p.open(1)
    p.open(3)
    p.open(5)  # past SETTINGS_MAX_CONCURRENT_STREAMS
    assert p.frames[-1] == (f.RST_STREAM, 0, 5, f.REFUSED_STREAM.to_bytes(4, "big"))
    assert p.send(f.frame(f.RST_STREAM, 0, 1, f.CANCEL.to_bytes(4, "big"))) == [
        Reset(1, f.CANCEL)]
    assert p.send(f.frame(f.DATA, 0, 1, b"late")) == []  # (a reset stream's data: dropped)
    c.goaway()
    assert p.read()[-1] == (f.GOAWAY, 0, 0, (5).to_bytes(4, "big") + bytes(4))
    assert p.open(7) == []  # past the GOAWAY: ignored
    c.send_headers(3, [(b":status", b"200")])
    c.send_data(3, b"still served", end=True)
    got = p.read()
    assert got[-2] == (f.DATA, f.END_STREAM, 3, b"still served")
    assert got[-1] == (f.RST_STREAM, 0, 3, bytes(4))  # (its request side was still open)
    ev = p.send(f.frame(f.RST_STREAM, 0, 9, bytes(4)))  # an idle stream
    assert isinstance(ev[-1], Terminated)


def test_trailers_end_the_stream_and_wait_for_the_data() -> None:
    c = Connection()
    p = Peer(c, window=10)
    p.open(1, end=True)
    c.send_headers(1, [(b":status", b"200")])
    c.send_data(1, b"0123456789abcdef")
    c.send_trailers(1, [(b"grpc-status", b"0")])
    got = p.read()
    assert [x[0] for x in got] == [f.HEADERS, f.DATA] and got[1][3] == b"0123456789"
    p.send(f.frame(f.WINDOW_UPDATE, 0, 1, (100).to_bytes(4, "big")))
    got = p.frames[-2:]
    assert got[0] == (f.DATA, 0, 1, b"abcdef")
    assert got[1][:3] == (f.HEADERS, f.END_STREAM | f.END_HEADERS, 1)
    assert Decoder().decode(got[1][3], raw=True) == [(b"grpc-status", b"0")]
    assert c.open_streams() == 0


@example(40_000, [("send", 0, 50_000, True), ("send", 1, 50_000, True),
                  ("stream", 0, 20_000), ("conn", 30_000)])
@settings(max_examples=150, deadline=None)
@given(st.integers(0, 40_000), st.lists(st.one_of(
    st.tuples(st.just("send"), st.integers(0, 2), st.integers(0, 50_000), st.booleans()),
    st.tuples(st.just("conn"), st.integers(1, 70_000)),
    st.tuples(st.just("stream"), st.integers(0, 2), st.integers(1, 70_000)),
    st.tuples(st.just("settings"), st.integers(0, 100_000)),
    st.tuples(st.just("frame"), st.sampled_from([16384, 20000, 1 << 20]))), max_size=30))
def test_sending_never_exceeds_the_peer_s_windows_and_keeps_order(initial, ops) -> None:
    """Whatever the peer's windows and frame size do, no DATA frame exceeds the
    connection's or its stream's window, each stream's bytes come in order, and once the
    windows open all of it arrives, its end last."""
    c = Connection()
    sids = (1, 3, 5)
    p = Peer(c, window=initial)
    for s in sids:
        p.open(s, end=True)
    conn_w = 65535
    init = initial
    max_frame = 16384
    stream_w = dict.fromkeys(sids, initial)
    sent = {s: bytearray() for s in sids}
    got = {s: bytearray() for s in sids}
    ended = dict.fromkeys(sids, False)
    closed: set[int] = set()
    counter = 0
    seen = len(p.frames)

    def check() -> None:
        nonlocal conn_w, seen
        p.read()
        new, seen = p.frames[seen:], len(p.frames)
        for ftype, flags, sid, payload in new:
            if ftype != f.DATA:
                continue
            assert sid not in closed
            assert len(payload) <= conn_w and len(payload) <= stream_w[sid], (
                len(payload), conn_w, stream_w[sid])
            assert len(payload) <= max_frame
            conn_w -= len(payload)
            stream_w[sid] -= len(payload)
            got[sid] += payload
            if flags & f.END_STREAM:
                closed.add(sid)

    for op in ops:
        if op[0] == "send":
            s = sids[op[1]]
            if ended[s]:
                continue
            data = bytes((counter + i) & 0xFF for i in range(op[2]))
            counter += 1
            sent[s] += data
            c.send_data(s, data, end=op[3])
            ended[s] = op[3]
        elif op[0] == "conn":
            conn_w += op[1]
            p.send(f.frame(f.WINDOW_UPDATE, 0, 0, op[1].to_bytes(4, "big")))
        elif op[0] == "stream":
            s = sids[op[1]]
            if s not in closed:
                stream_w[s] += op[2]
            p.send(f.frame(f.WINDOW_UPDATE, 0, s, op[2].to_bytes(4, "big")))
        elif op[0] == "settings":
            for s in sids:
                stream_w[s] += op[1] - init
            init = op[1]
            p.send(f.frame(f.SETTINGS, 0, 0, f.encode_settings({f.INITIAL_WINDOW_SIZE: op[1]})))
        else:
            max_frame = op[1]
            p.send(f.frame(f.SETTINGS, 0, 0, f.encode_settings({f.MAX_FRAME_SIZE: op[1]})))
        check()
        for s in sids:
            assert sent[s].startswith(got[s])
    for s in sids:  # everything opens: all of it arrives
        if not ended[s]:
            c.send_data(s, b"", end=True)
        if s not in closed:
            stream_w[s] += 10_000_000
            p.send(f.frame(f.WINDOW_UPDATE, 0, s, (10_000_000).to_bytes(4, "big")))
    conn_w += 10_000_000
    p.send(f.frame(f.WINDOW_UPDATE, 0, 0, (10_000_000).to_bytes(4, "big")))
    check()
    assert got == sent and closed == set(sids) and not c.closed


@settings(max_examples=100, deadline=None)
@given(st.integers(1024, 100_000), st.lists(st.integers(1, 20_000), min_size=1, max_size=40),
       st.booleans())
def test_receiving_gives_back_what_the_application_used(window, chunks, reads) -> None:
    """A client that sends as much as the windows it was given allow: with an application
    that uses every byte, all of it goes through (the windows reopen); with one that reads
    nothing, the stream stops after one window and the connection stays usable."""
    c = Connection(window=window)
    p = Peer(c)
    p.open(1)
    p.stream_windows[1] = window  # (the server's SETTINGS: every stream gets `window`)
    p.conn_window = window
    total = 0
    queue = list(chunks)
    while queue:
        room = min(p.conn_window, p.stream_windows[1], 16384)
        if room <= 0:
            break
        n = min(queue[0], room)
        queue[0] -= n
        if not queue[0]:
            queue.pop(0)
        for ev in p.data(1, b"x" * n):
            assert isinstance(ev, Data)
            total += ev.flow
            if reads:
                c.consumed(1, ev.flow)
        p.read()
    assert not c.closed
    if reads:
        assert not queue and total == sum(chunks)
    else:
        assert total <= window
        if sum(chunks) > window:
            assert queue and total == window  # (held: one window, no more)
        p.open(3)  # another stream still flows (the connection's window was given back)
        assert p.data(3, b"y" * 100) == [Data(3, b"y" * 100, False, 100)]


# ---------------------------------------------------------------------------- on sockets


def _run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))


def _echo_server(events: dict) -> Server:
    async def echo(requests, ctx):
        events["started"].set()
        try:
            async for m in requests:
                if m == b"abort":
                    await ctx.abort(StatusCode.FAILED_PRECONDITION, "asked to: é 100%")
                if m == b"hang":
                    await asyncio.Event().wait()
                yield m
        finally:
            events["ended"].set()

    async def check(raw, ctx):
        return b"\x08\x01" if raw == b"" else b"\x08\x02"

    return Server({"/t.S/Echo": stream_stream(echo), "/t.S/Check": unary_unary(check)},
                  window=65535)


def test_grpc_aio_calls_many_at_once_and_large_messages_both_ways() -> None:
    """grpc-core's client: 200 streams on one connection, unary calls, and 2 MB messages
    each way (past every window: flow control both directions)."""
    grpc = pytest.importorskip("grpc")

    async def main() -> None:
        events = {"started": asyncio.Event(), "ended": asyncio.Event()}
        server = _echo_server(events)
        port = await server.start("127.0.0.1", 0)
        async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 8 << 20)]
        ) as ch:
            echo = ch.stream_stream("/t.S/Echo")

            async def one(i: int) -> None:
                call = echo()
                for j in range(3):
                    await call.write(f"{i}:{j}".encode())
                    assert await call.read() == f"{i}:{j}".encode()
                await call.done_writing()
                assert await call.read() is grpc.aio.EOF
                assert await call.code() is grpc.StatusCode.OK

            await asyncio.gather(*(one(i) for i in range(200)))
            big = bytes(range(256)) * (2 << 12)  # 2 MiB
            call = echo()
            await call.write(big)
            assert await call.read() == big
            await call.done_writing()
            assert await ch.unary_unary("/t.S/Check")(b"") == b"\x08\x01"
            assert await ch.unary_unary("/t.S/Check")(b"\x0a\x01x") == b"\x08\x02"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary("/t.S/Nope")(b"")
            assert e.value.code() is grpc.StatusCode.UNIMPLEMENTED
        await server.stop(None)

    _run(main())


def test_status_a_reset_mid_stream_and_a_deadline_end_the_handler() -> None:
    """An abort's status and message come back (percent-encoded on the wire); a client
    that cancels mid-stream (RST_STREAM) and one whose grpc-timeout passes: the handler is
    cancelled, its ``finally`` runs, and the server serves on."""
    grpc = pytest.importorskip("grpc")

    async def main() -> None:
        events = {"started": asyncio.Event(), "ended": asyncio.Event()}
        server = _echo_server(events)
        port = await server.start("127.0.0.1", 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            echo = ch.stream_stream("/t.S/Echo")
            call = echo()
            await call.write(b"abort")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert e.value.details() == "asked to: é 100%"
            for how in ("cancel", "deadline"):
                events["started"].clear()
                events["ended"].clear()
                call = echo(timeout=0.5 if how == "deadline" else None)
                await call.write(b"first")
                assert await call.read() == b"first"
                await call.write(b"hang")
                await events["started"].wait()
                assert not events["ended"].is_set()
                if how == "cancel":
                    call.cancel()
                await asyncio.wait_for(events["ended"].wait(), 5)
                assert server.calls() == 0
            call = echo()
            await call.write(b"after")
            assert await call.read() == b"after"
            await call.done_writing()
        await server.stop(None)

    _run(main())


async def _raw_client(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Encoder]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(f.PREFACE + f.frame(f.SETTINGS, 0, 0))
    return r, w, Encoder()


async def _read_frame(r: asyncio.StreamReader) -> tuple[int, int, int, bytes]:
    head = await r.readexactly(9)
    n = int.from_bytes(head[:3], "big")
    payload = await r.readexactly(n)
    return head[3], head[4], int.from_bytes(head[5:], "big") & 0x7FFFFFFF, payload


def test_raw_frames_a_split_prefix_and_goaway_on_stop() -> None:
    """A message whose length prefix is cut over DATA frames (padded, headers in
    CONTINUATIONs) is echoed whole; stop() sends GOAWAY, and the call under way still
    finishes within the grace."""

    async def main() -> None:
        events = {"started": asyncio.Event(), "ended": asyncio.Event()}
        server = _echo_server(events)
        port = await server.start("127.0.0.1", 0)
        r, w, enc = await _raw_client(port)
        block = enc.encode([(":method", "POST"), (":scheme", "http"), (":path", "/t.S/Echo"),
                            ("content-type", "application/grpc"), ("te", "trailers")])
        w.write(f.frame(f.HEADERS, 0, 1, block[:4]) +
                f.frame(f.CONTINUATION, f.END_HEADERS, 1, block[4:]))
        msg = b"\0\0\0\0\x0bhello world"
        w.write(f.frame(f.DATA, 0, 1, msg[:3]) +
                f.frame(f.DATA, f.PADDED, 1, b"\x04" + msg[3:9] + b"\0" * 4) +
                f.frame(f.DATA, 0, 1, msg[9:]))
        seen: list = []
        while not any(x[0] == f.DATA for x in seen):
            seen.append(await asyncio.wait_for(_read_frame(r), 5))
        assert [x[3] for x in seen if x[0] == f.DATA] == [msg]
        stopping = asyncio.create_task(server.stop(5))
        while seen[-1][0] != f.GOAWAY:
            seen.append(await asyncio.wait_for(_read_frame(r), 5))
        assert seen[-1][3][:4] == (1).to_bytes(4, "big")  # the last stream it serves
        w.write(f.frame(f.DATA, f.END_STREAM, 1, b""))  # the call ends: OK trailers
        while seen[-1][0] != f.HEADERS:
            seen.append(await asyncio.wait_for(_read_frame(r), 5))
        assert seen[-1][1] & f.END_STREAM
        assert (b"grpc-status", b"0") in Decoder().decode(seen[-1][3], raw=True)
        await asyncio.wait_for(stopping, 10)
        assert events["ended"].is_set()
        w.close()
        # grpc-timeout: the server itself ends a call past it, with DEADLINE_EXCEEDED
        server = _echo_server(events)
        port = await server.start("127.0.0.1", 0)
        r, w, enc = await _raw_client(port)
        w.write(f.frame(f.HEADERS, f.END_HEADERS, 1, enc.encode([
            (":method", "POST"), (":scheme", "http"), (":path", "/t.S/Echo"),
            ("content-type", "application/grpc"), ("grpc-timeout", "200m")])) +
            f.frame(f.DATA, 0, 1, b"\0\0\0\0\x04hang"))
        seen = []
        while not (seen and seen[-1][0] == f.HEADERS and seen[-1][1] & f.END_STREAM):
            seen.append(await asyncio.wait_for(_read_frame(r), 5))
        assert (b"grpc-status", b"4") in Decoder().decode(seen[-1][3], raw=True)
        w.close()
        await server.stop(None)

    _run(main())


def test_a_port_in_use_is_an_oserror() -> None:
    async def main() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            with pytest.raises(OSError):
                await Server({}).start("127.0.0.1", s.getsockname()[1])

    _run(main())


def test_a_handler_waits_while_the_peer_s_window_is_shut() -> None:
    """Answers queue for a peer that gives no window only up to a bound: past it the
    handler waits (bounded memory), and goes on once WINDOW_UPDATEs come; every byte then
    arrives, in order."""
    produced: list[int] = []
    piece = bytes(range(256)) * 2400  # 600 KiB

    async def flood(requests, ctx):
        async for _ in requests:
            for i in range(4):
                produced.append(i)
                yield piece

    async def main() -> None:
        server = Server({"/t.S/Flood": stream_stream(flood)})
        port = await server.start("127.0.0.1", 0)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(f.PREFACE + f.frame(f.SETTINGS, 0, 0, f.encode_settings(
            {f.INITIAL_WINDOW_SIZE: 0})))
        enc = Encoder()
        w.write(f.frame(f.HEADERS, f.END_HEADERS, 1, enc.encode([
            (":method", "POST"), (":scheme", "http"), (":path", "/t.S/Flood"),
            ("content-type", "application/grpc")])) +
            f.frame(f.DATA, f.END_STREAM, 1, b"\0\0\0\0\0"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while len(produced) < 2 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # (time for it to go on, were it not waiting)
        assert produced == [0, 1]  # 1.2 MiB queued: past the bound, it waits
        w.write(f.frame(f.WINDOW_UPDATE, 0, 1, (10 << 20).to_bytes(4, "big")) +
                f.frame(f.WINDOW_UPDATE, 0, 0, (10 << 20).to_bytes(4, "big")))
        body = bytearray()
        while True:
            ftype, flags, sid, payload = await asyncio.wait_for(_read_frame(r), 5)
            if ftype == f.DATA:
                body += payload
            if ftype == f.HEADERS and flags & f.END_STREAM:
                break
        assert produced == [0, 1, 2, 3]
        one = b"\0" + len(piece).to_bytes(4, "big") + piece
        assert body == one * 4
        w.close()
        await server.stop(None)

    _run(main())
