"""kvwire.wire.frames: whole messages in and out of pyzmq's own sockets via libzmq, GIL kept."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from kvwire.wire import frames as framesend
from kvwire.wire.frames import FrameReceiver, FrameSender, native_status


@pytest.fixture
def pair(tmp_path):
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind(f"ipc://{tmp_path}/p")
    b.connect(f"ipc://{tmp_path}/p")
    b.send(b"hello")  # a PAIR accepts non-blocking sends only once connected: wait for it
    assert a.poll(10_000) and a.recv() == b"hello"
    yield a, b
    ctx.destroy(linger=0)


def test_native_send_delivers_multipart(pair) -> None:
    a, b = pair
    s = FrameSender(a)
    assert s.native  # on Linux with pyzmq's bundled libzmq
    assert s.send(b"topic", zmq.SNDMORE | zmq.NOBLOCK)
    assert s.send(b"\x00" * 8, zmq.SNDMORE | zmq.NOBLOCK)
    assert s.send(b"payload", zmq.NOBLOCK)
    assert b.poll(5000)
    assert b.recv_multipart() == [b"topic", b"\x00" * 8, b"payload"]


def test_eagain_is_false_not_an_exception(tmp_path) -> None:
    ctx = zmq.Context()
    try:
        lonely = ctx.socket(zmq.PAIR)  # no peer: a non-blocking send cannot be queued
        lonely.bind(f"ipc://{tmp_path}/none")
        assert FrameSender(lonely).send(b"x", zmq.NOBLOCK) is False
    finally:
        ctx.destroy(linger=0)


def test_fallback_to_pyzmq_send(pair, monkeypatch) -> None:
    # Forcing a fault that cannot happen here for real: libzmq not found in /proc/self/maps.
    monkeypatch.setattr(framesend, "_zmq_send", lambda: None)
    a, b = pair
    s = FrameSender(a)
    assert not s.native
    assert s.send(b"one", zmq.NOBLOCK)
    assert b.poll(5000) and b.recv() == b"one"


def test_native_send_keeps_the_gil(pair) -> None:
    """A busy Python thread does not slow the sender to one frame per switch interval."""
    a, _ = pair
    a.setsockopt(zmq.SNDHWM, 0)
    s = FrameSender(a)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    th = threading.Thread(target=spin)
    th.start()
    try:
        t = time.perf_counter()
        for _ in range(2000):
            s.send(b"x" * 100, zmq.NOBLOCK)
        took = time.perf_counter() - t
    finally:
        stop.set()
        th.join()
    # A GIL release per frame would cost a switch interval (5 ms) each, as the spinning
    # thread keeps the GIL until forced: ~10 s here. Kept well clear of a busy host's time.
    assert took < 2.0, took


@pytest.fixture(params=["c", "python"])
def path(request, monkeypatch):
    """Both receive/send paths: the C module, and the fallback for installs without a
    compiler (forced here by hiding the module; on this machine it is built)."""
    if request.param == "python":
        monkeypatch.setattr(framesend, "_native", lambda: None)
    elif framesend._native() is None:
        pytest.fail("kvwire.wire._zmqframes is not built: `pip install -e .` needs gcc and "
                    "Python's headers (or set KVWIRE_NO_NATIVE=1 to test the fallback only)")
    return request.param


def test_native_module_is_built_here() -> None:
    import os

    if os.environ.get("KVWIRE_NO_NATIVE"):
        assert native_status() != "c"
    else:
        assert native_status() == "c"


def test_whole_messages_round_trip(pair, path) -> None:
    a, b = pair
    tx, rx = FrameSender(a), FrameReceiver(b)
    assert rx.recv() is None and rx.recv_many(10) == []  # nothing waits: never blocks
    big = bytes(range(256)) * 4096  # 1 MiB
    msgs = [(b"topic", b"\x00" * 8, b"payload"), (b"",), (b"", b"", b""), (big, b"x"),
            tuple(bytes([i]) for i in range(40))]
    for m in msgs:
        assert tx.send_message(*m)
    got: list[list[bytes]] = []
    deadline = time.monotonic() + 10
    while len(got) < len(msgs) and time.monotonic() < deadline:
        first = rx.recv()
        if first is None:
            b.poll(100)
            continue
        got.append(first)
        got += rx.recv_many(2)  # at most two more per call
    assert got == [list(m) for m in msgs]


def test_recv_many_stops_at_its_limit(pair, path) -> None:
    a, b = pair
    tx, rx = FrameSender(a), FrameReceiver(b)
    for i in range(10):
        assert tx.send_message(b"t", i.to_bytes(8, "big"))
    seen: list[list[bytes]] = []
    deadline = time.monotonic() + 10
    while len(seen) < 10 and time.monotonic() < deadline:
        part = rx.recv_many(3)
        assert len(part) <= 3
        seen += part
        if not part:
            b.poll(100)
    assert [int.from_bytes(m[1], "big") for m in seen] == list(range(10))


def test_send_batch_sends_each_message_in_order(pair, path) -> None:
    a, b = pair
    tx, rx = FrameSender(a), FrameReceiver(b)
    msgs = [(i.to_bytes(8, "big"), b"p%d" % i * i) for i in range(50)]
    assert tx.send_batch(b"topic", msgs) == 50
    assert tx.send_batch(b"topic", []) == 0
    got: list[list[bytes]] = []
    deadline = time.monotonic() + 10
    while len(got) < 50 and time.monotonic() < deadline:
        got += rx.recv_many(64) or ([] if b.poll(100) else [])
    assert got == [[b"topic", s, p] for s, p in msgs]


def test_send_batch_counts_refused_messages(tmp_path, path) -> None:
    ctx = zmq.Context()
    try:
        lonely = ctx.socket(zmq.PAIR)  # no peer: every non-blocking send is refused
        lonely.bind(f"ipc://{tmp_path}/none")
        assert FrameSender(lonely).send_batch(b"t", [(b"1" * 8, b"x"), (b"2" * 8, b"y")]) == 0
    finally:
        ctx.destroy(linger=0)


def test_bad_frame_type_sends_nothing(pair, path) -> None:
    a, b = pair
    tx = FrameSender(a)
    with pytest.raises(TypeError):
        tx.send_message(b"first", 42)  # type: ignore[arg-type]
    assert tx.send_message(b"next")
    assert b.poll(5000) and b.recv_multipart() == [b"next"]  # no half message before it


def test_errors_other_than_eagain_raise(tmp_path, path) -> None:
    ctx = zmq.Context()
    try:
        rep = ctx.socket(zmq.REP)  # a REP must receive before it may send: EFSM
        rep.bind(f"ipc://{tmp_path}/rep")
        with pytest.raises(zmq.ZMQError) as e:
            FrameSender(rep).send_message(b"x")
        assert e.value.errno == zmq.EFSM
        req = ctx.socket(zmq.REQ)  # a REQ must send before it may receive: EFSM
        req.connect(f"ipc://{tmp_path}/rep")
        with pytest.raises(zmq.ZMQError) as e:
            FrameReceiver(req).recv()
        assert e.value.errno == zmq.EFSM
        with pytest.raises(zmq.ZMQError):
            FrameReceiver(req).recv_many(5)
    finally:
        ctx.destroy(linger=0)


def test_native_calls_check_their_arguments() -> None:
    mod = framesend._native()
    if mod is None:
        pytest.skip("kvwire.wire._zmqframes not built")
    with pytest.raises(TypeError):
        mod.recv_many(1)
    with pytest.raises(TypeError):
        mod.send_frames(1, 0)  # no frame
    with pytest.raises(ValueError):
        mod.recv_multipart(0, zmq.NOBLOCK)  # a null socket address never reaches libzmq


def test_package_reports_its_native_paths() -> None:
    import os

    import kvwire
    from kvwire import shm

    st = kvwire.native_status()
    assert st["frames"] == native_status()
    assert (st["shm"] == "c") == shm.NATIVE
    if not os.environ.get("KVWIRE_NO_NATIVE") and not os.environ.get("KVWIRE_SHM_PURE"):
        # this project's machines build all
        assert st == {"frames": "c", "shm": "c", "index": "c", "route_body": "c",
                      "index_walk": "c", "query_answer": "c", "builtin_tokenizer": "c",
                      "bpe_tokenizer": "c", "event_ids": "c"}
