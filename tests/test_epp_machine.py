"""The endpoint picker's pure per-stream machine (kvwire/epp/machine.py), its protobuf codec
and its gRPC servicer without Envoy: what Envoy is answered in each body mode, for any
chunking of any body (hypothesis), and the corner cases Envoy rarely shows (trailers, a
subset hint, messages out of order, a stream reset mid-answer)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.epp.machine import (
    DESTINATION,
    LENGTH,
    NAMESPACE,
    PIECE,
    SERVED,
    SUBSET,
    SUBSET_NAMESPACE,
    Answer,
    Mode,
    Phase,
    ProtocolError,
    Refusal,
    RequestBody,
    RequestHeaders,
    RequestTrailers,
    ResponseBody,
    ResponseHeaders,
    ResponseTrailers,
    Stream,
    Unsupported,
    completion_tokens,
    subset_of,
)

POST = ((":method", "POST"), (":path", "/v1/completions"), ("content-type", "application/json"))
EP = "10.0.0.7:8000"


def _stream(req: Mode, resp: Mode = Mode.FULL_DUPLEX_STREAMED, **kw) -> Stream:
    s = Stream(**kw)
    s.configure(int(req), int(resp))
    return s


def _split(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(body) + 1) for c in cuts} | {0, len(body)})
    return [body[a:b] for a, b in zip(points, points[1:])] or [b""]


def _echoed(answers: list, phase: Phase) -> bytes:
    return b"".join(a.body for a in answers if isinstance(a, Answer) and a.phase is phase
                    and a.streamed)


@settings(max_examples=150, deadline=None)
@given(body=st.binary(max_size=3 * PIECE + 17), cuts=st.lists(st.integers(0, 1 << 20),
                                                              max_size=8),
       trailers=st.booleans())
def test_full_duplex_asks_once_then_echoes_the_body_exactly(body, cuts, trailers) -> None:
    """Nothing is answered until the body is complete; then the headers answer with the
    pick and the body's length, the body comes back whole in pieces of at most PIECE bytes,
    the last (or the trailers' answer) ending it."""
    s = _stream(Mode.FULL_DUPLEX_STREAMED)
    step = s.receive(RequestHeaders(POST))
    assert not step.answers and step.ask is None
    chunks = _split(body, cuts)
    ask = None
    for i, c in enumerate(chunks):
        step = s.receive(RequestBody(c, end=not trailers and i == len(chunks) - 1))
        assert not step.answers
        ask = step.ask
    if trailers:
        assert ask is None
        step = s.receive(RequestTrailers())
        ask = step.ask
    assert ask is not None and ask.body == body and ask.method == "POST"
    out = s.picked(EP)
    first = out[0]
    assert first.phase is Phase.REQUEST_HEADERS and (DESTINATION, EP) in first.set_headers
    # the length twice (content-length, and LENGTH for the filter that restores it), unless
    # trailers end the body: then it stays chunked
    length = {("content-length", str(len(body))), (LENGTH, str(len(body)))}
    assert length <= set(first.set_headers) if not trailers else \
        not {k for k, _ in first.set_headers} & {"content-length", LENGTH}
    assert first.metadata == ((NAMESPACE, DESTINATION, EP),)
    pieces = [a for a in out if a.phase is Phase.REQUEST_BODY]
    assert all(a.streamed and len(a.body) <= PIECE for a in pieces)
    assert _echoed(out, Phase.REQUEST_BODY) == body
    assert [a.end for a in pieces] == [False] * (len(pieces) - 1) + [not trailers]
    assert (out[-1].phase is Phase.REQUEST_TRAILERS) == trailers


@settings(max_examples=100, deadline=None)
@given(chunks=st.lists(st.binary(max_size=300), max_size=6), trailers=st.booleans(),
       mode=st.sampled_from([Mode.FULL_DUPLEX_STREAMED, Mode.STREAMED, Mode.BUFFERED,
                             Mode.NONE]))
def test_the_response_is_echoed_and_its_first_byte_and_end_reported_once(chunks, trailers,
                                                                         mode) -> None:
    s = _stream(Mode.BUFFERED, mode)
    s.receive(RequestHeaders(POST))
    s.receive(RequestBody(b"{}", end=True))
    s.picked(EP, answer_headers=(("x-kvwire-engine", "e0"),))
    step = s.receive(ResponseHeaders(((":status", "200"),), end=False,
                                     metadata={NAMESPACE: {SERVED: EP}}))
    assert step.status == 200 and step.served == EP and not step.over
    assert step.answers == [Answer(Phase.RESPONSE_HEADERS,
                                   set_headers=(("x-kvwire-engine", "e0"),))]
    firsts = int(step.first_byte)
    assert step.first_byte == (mode is Mode.NONE)
    overs = 0
    echoed = b""
    for i, c in enumerate(chunks):
        step = s.receive(ResponseBody(c, end=not trailers and i == len(chunks) - 1))
        firsts += step.first_byte
        overs += step.over
        (a,) = step.answers
        assert a.phase is Phase.RESPONSE_BODY and a.streamed == (mode is Mode.FULL_DUPLEX_STREAMED)
        echoed += a.body
    if trailers or not chunks:
        step = s.receive(ResponseTrailers())
        firsts += step.first_byte
        overs += step.over
    assert overs == 1 and firsts == 1 and s.done
    if mode is Mode.FULL_DUPLEX_STREAMED:
        assert echoed == b"".join(chunks)


def test_buffered_continues_the_headers_and_picks_in_the_body_s_answer() -> None:
    s = _stream(Mode.BUFFERED, Mode.STREAMED)
    step = s.receive(RequestHeaders(POST, metadata={}))
    assert step.answers == [Answer(Phase.REQUEST_HEADERS)] and step.ask is None
    step = s.receive(RequestBody(b'{"prompt": "x"}', end=True))
    assert step.ask.body == b'{"prompt": "x"}' and not step.answers
    (a,) = s.picked(EP)
    assert a.phase is Phase.REQUEST_BODY and not a.streamed
    assert a.set_headers == ((DESTINATION, EP),) and a.metadata == ((NAMESPACE, DESTINATION, EP),)
    assert s.receive(RequestTrailers()).answers == [Answer(Phase.REQUEST_TRAILERS)]
    step = s.receive(ResponseHeaders(((":status", "503"),), end=True))
    assert step.status == 503 and step.over and step.first_byte and s.done


@pytest.mark.parametrize("mode", list(Mode))
def test_a_request_its_headers_end_is_picked_at_them(mode) -> None:
    s = _stream(mode)
    step = s.receive(RequestHeaders(((":method", "GET"), (":path", "/v1/models")), end=True))
    assert step.ask is not None and step.ask.body is None and step.ask.path == "/v1/models"
    (a,) = s.picked(EP)
    assert a.phase is Phase.REQUEST_HEADERS and a.set_headers == ((DESTINATION, EP),)


def test_streamed_request_bodies_cannot_carry_a_pick() -> None:
    with pytest.raises(Unsupported, match="FULL_DUPLEX_STREAMED or BUFFERED"):
        _stream(Mode.STREAMED).receive(RequestHeaders(POST))


def test_none_picks_at_the_headers_by_load() -> None:
    step = _stream(Mode.NONE).receive(RequestHeaders(POST))
    assert step.ask is not None and step.ask.body is None


def test_refusals_end_the_stream_and_late_messages_are_ignored() -> None:
    s = _stream(Mode.FULL_DUPLEX_STREAMED)
    s.receive(RequestHeaders(POST))
    s.receive(RequestBody(b"{", end=True))
    (r,) = s.refuse(400, b'{"error": {}}')
    assert r == Refusal(400, b'{"error": {}}') and s.done
    assert s.receive(RequestBody(b"late")).answers == []  # (already under way)
    with pytest.raises(ProtocolError):
        s.picked(EP)


def test_a_body_over_the_cap_is_413() -> None:
    s = _stream(Mode.FULL_DUPLEX_STREAMED, max_body=10)
    s.receive(RequestHeaders(POST))
    assert s.receive(RequestBody(b"12345")).answers == []
    (r,) = s.receive(RequestBody(b"678901", end=True)).answers
    assert isinstance(r, Refusal) and r.status == 413 and b"over 10 bytes" in r.body


@pytest.mark.parametrize("events", [
    [RequestBody(b"x", end=True)],
    [RequestHeaders(POST), RequestHeaders(POST)],
    [ResponseHeaders(((":status", "200"),))],
    [RequestHeaders(POST), ResponseBody(b"x")],
], ids=["body first", "headers twice", "response first", "response body early"])
def test_messages_out_of_order_are_protocol_errors(events) -> None:
    s = _stream(Mode.FULL_DUPLEX_STREAMED)
    with pytest.raises(ProtocolError):
        for e in events:
            s.receive(e)


def test_subset_hint_and_usage() -> None:
    assert subset_of({}) is None
    assert subset_of({SUBSET_NAMESPACE: {}}) is None
    assert subset_of({SUBSET_NAMESPACE: {SUBSET: []}}) == frozenset()
    assert subset_of({SUBSET_NAMESPACE: {SUBSET: ["1.2.3.4:80", "5.6.7.8:80, 9.9.9.9:1"]}}) \
        == {"1.2.3.4:80", "5.6.7.8:80", "9.9.9.9:1"}
    assert subset_of({SUBSET_NAMESPACE: {SUBSET: "1.2.3.4:80,5.6.7.8:80"}}) \
        == {"1.2.3.4:80", "5.6.7.8:80"}
    s = _stream(Mode.FULL_DUPLEX_STREAMED)
    s.receive(RequestHeaders(POST, metadata={SUBSET_NAMESPACE: {SUBSET: [EP]}}))
    assert s.receive(RequestBody(b"{}", end=True)).ask.subset == {EP}
    assert completion_tokens(b'..."usage":{"completion_tokens": 7, "prompt_tokens": 3}}') == 7
    assert completion_tokens(b"data: [DONE]") is None


# ------------------------------------------------------------------ the protobuf codec


def test_codec_round_trip() -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from kvwire.epp import messages

    req = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(end_of_stream=False),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=4, response_body_mode=1))
    req.request_headers.headers.headers.add(key=":path", raw_value=b"/v1/completions")
    req.metadata_context.filter_metadata[SUBSET_NAMESPACE].update({SUBSET: [EP]})
    req = pb.ProcessingRequest.FromString(req.SerializeToString())
    assert messages.modes(req) == (4, 1)
    ev = messages.decode(req)
    assert ev == RequestHeaders(((":path", "/v1/completions"),), False,
                                {SUBSET_NAMESPACE: {SUBSET: [EP]}})
    pick = Answer(Phase.REQUEST_HEADERS, set_headers=((DESTINATION, EP),),
                  metadata=((NAMESPACE, DESTINATION, EP),))
    out = messages.encode(pick)
    kept = messages.encode_kept(pick)  # (bytes, built once)
    assert kept == out.SerializeToString() and messages.encode_kept(pick) is kept
    assert messages.serialize(kept) is kept and messages.serialize(out) == kept
    h = out.request_headers.response.header_mutation.set_headers[0].header
    assert (h.key, h.raw_value) == (DESTINATION, EP.encode())
    assert out.dynamic_metadata.fields[NAMESPACE].struct_value.fields[DESTINATION] \
        .string_value == EP
    out = messages.encode(Answer(Phase.RESPONSE_BODY, streamed=True, body=b"ab", end=True))
    sr = out.response_body.response.body_mutation.streamed_response
    assert (sr.body, sr.end_of_stream) == (b"ab", True)
    out = messages.encode(Refusal(429, b"{}", (("retry-after", "1"),)))
    im = out.immediate_response
    assert im.status.code == 429 and im.body == b"{}"
    assert {(o.header.key, o.header.raw_value) for o in im.headers.set_headers} == {
        ("content-type", b"application/json"), ("retry-after", b"1")}
    assert messages.encode(Answer(Phase.RESPONSE_TRAILERS)).HasField("response_trailers")


def test_health_request_parser() -> None:
    from kvwire.epp.service import _service_name

    assert _service_name(b"") == ""
    name = b"envoy.service.ext_proc.v3.ExternalProcessor"
    assert _service_name(b"\x0a" + bytes([len(name)]) + name) == name.decode()
    assert _service_name(b"\x0a\x09readiness") == "readiness"
    with pytest.raises(ValueError):
        _service_name(b"\x0d\x00\x00\x00\x00")


def test_grpc_health_and_a_stream_reset_mid_answer(tmp_path) -> None:
    """The servicer alone, on a real gRPC port, with a Picker over a fleet whose one engine
    has not been probed: health says so; a stream that asks and is then cancelled by its
    client mid-answer releases its load and its count."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from kvwire.consume.engine_spec import EngineSpec
    from kvwire.epp.picker import Picker
    from kvwire.epp.service import EXT_PROC, Service
    from kvwire.proxy.fleet import Fleet
    from kvwire.proxy.tokens import Tokens
    from kvwire.routing.core import RouterCore

    spec = EngineSpec.parse("e0=tcp://127.0.0.1:1,url=http://127.0.0.1:9")
    core = RouterCore([spec])
    fleet = Fleet([spec])
    ready = [False]
    svc = Service(Picker(core, fleet, Tokens(fleet, None, "none", 1.0)), lambda: ready[0])

    async def health(ch, name: str) -> int:
        n = name.encode()
        raw = await ch.unary_unary("/grpc.health.v1.Health/Check")(
            b"\x0a" + bytes([len(n)]) + n if n else b"")
        return raw[1]

    async def main() -> None:
        port = await svc.start("127.0.0.1", 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert await health(ch, "") == 1 and await health(ch, "liveness") == 1
            assert await health(ch, EXT_PROC) == 2
            ready[0] = True
            assert await health(ch, "readiness") == 1
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await health(ch, "nope")
            assert e.value.code() is grpc.StatusCode.NOT_FOUND
            call = ch.stream_stream(f"/{EXT_PROC}/Process",
                                    request_serializer=pb.ProcessingRequest.SerializeToString,
                                    response_deserializer=pb.ProcessingResponse.FromString)()
            first = pb.ProcessingRequest(
                request_headers=pb.HttpHeaders(end_of_stream=True),
                protocol_config=pb.ProtocolConfiguration(request_body_mode=4,
                                                         response_body_mode=4))
            for k, v in ((":method", "GET"), (":path", "/v1/models")):
                first.request_headers.headers.headers.add(key=k, raw_value=v.encode())
            await call.write(first)
            got = await call.read()
            h = got.request_headers.response.header_mutation.set_headers[0].header
            assert (h.key, h.raw_value) == (DESTINATION, b"127.0.0.1:9")
            await call.write(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
            await call.read()
            assert fleet.in_flight["e0"] == 1 and fleet.active == 1
            assert sum(core.loads.loads().values()) > 0
            call.cancel()  # (Envoy resets the stream: the client went away)
            for _ in range(200):
                if fleet.active == 0:
                    break
                await asyncio.sleep(0.01)
            assert fleet.in_flight["e0"] == 0 and fleet.active == 0
            assert sum(core.loads.loads().values()) == 0
            assert fleet.counts["epp_streams_cut"] == 1
            # a gateway's subset hint that names no engine of this picker: 503 at once
            call = ch.stream_stream(f"/{EXT_PROC}/Process",
                                    request_serializer=pb.ProcessingRequest.SerializeToString,
                                    response_deserializer=pb.ProcessingResponse.FromString)()
            first.metadata_context.filter_metadata[SUBSET_NAMESPACE].update(
                {SUBSET: ["10.9.9.9:1"]})
            await call.write(first)
            got = await call.read()
            assert got.immediate_response.status.code == 503, got
            assert b"subset" in got.immediate_response.body
            await call.done_writing()
            for _ in range(200):
                if fleet.active == 0:
                    break
                await asyncio.sleep(0.01)
            assert fleet.active == 0 and fleet.requests["none", 503] == 1
            # a request body mode that cannot carry the pick: the stream fails, saying why
            call = ch.stream_stream(f"/{EXT_PROC}/Process",
                                    request_serializer=pb.ProcessingRequest.SerializeToString,
                                    response_deserializer=pb.ProcessingResponse.FromString)()
            streamed = pb.ProcessingRequest(
                request_headers=pb.HttpHeaders(end_of_stream=False),
                protocol_config=pb.ProtocolConfiguration(request_body_mode=1))
            await call.write(streamed)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "FULL_DUPLEX_STREAMED or BUFFERED" in e.value.details()
            assert fleet.counts["epp_unsupported"] == 1
            for _ in range(200):
                if fleet.active == 0:
                    break
                await asyncio.sleep(0.01)
            assert fleet.active == 0
        await svc.stop(None)

    try:
        asyncio.run(main())
    finally:
        core.close()


def test_grpc_over_tls(tmp_path) -> None:
    """``--grpc-tls-cert/--grpc-tls-key``: the same services over TLS (a self-signed
    certificate for 127.0.0.1); a plaintext client is refused."""
    import shutil
    import subprocess

    import grpc

    from kvwire.consume.engine_spec import EngineSpec
    from kvwire.epp.picker import Picker
    from kvwire.epp.service import Service
    from kvwire.h2.grpc import context
    from kvwire.proxy.fleet import Fleet
    from kvwire.proxy.tokens import Tokens
    from kvwire.routing.core import RouterCore

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True, timeout=60)
    spec = EngineSpec.parse("e0=tcp://127.0.0.1:1,url=http://127.0.0.1:9")
    core = RouterCore([spec])
    fleet = Fleet([spec])
    svc = Service(Picker(core, fleet, Tokens(fleet, None, "none", 1.0)), lambda: True)
    creds = context(str(cert), str(key))

    async def main() -> None:
        port = await svc.start("127.0.0.1", 0, creds)
        tls = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", tls) as ch:
            assert await ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=10) \
                == b"\x08\x01"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError):
                await ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=5)
        await svc.stop(None)

    try:
        asyncio.run(main())
    finally:
        core.close()


def test_kvwire_epp_refusals_are_one_line_and_their_exit_status() -> None:
    """No engine with url= (2), half the TLS pair (2), the gRPC port in use (1)."""
    import socket
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvwire", "epp", "--port", "0", *args],
                              capture_output=True, text=True, timeout=120)

    r = run("--engine", "e=tcp://127.0.0.1:5999", "--grpc-port", "0")
    assert r.returncode == 2 and "picks among the engines with url=" in r.stderr, r.stderr
    r = run("--engine", "e=tcp://127.0.0.1:5999,url=http://127.0.0.1:1", "--grpc-tls-cert", "c")
    assert r.returncode == 2 and r.stderr.strip() == (
        "kvwire epp: --grpc-tls-cert and --grpc-tls-key go together"), r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run("--engine", "e=tcp://127.0.0.1:5999,url=http://127.0.0.1:1", "--grpc-port",
                str(port))
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"kvwire epp: cannot listen on 127.0.0.1:{port} (gRPC): in use or not an address "
        "here"), r.stderr
    assert "Traceback" not in r.stderr
