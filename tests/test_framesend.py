"""FrameSender: libzmq's zmq_send under the GIL, on pyzmq's own sockets."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from kvwire import framesend
from kvwire.framesend import FrameSender


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
    # A GIL release per frame would cost about a switch interval (5 ms) each: >= 1 s here.
    assert took < 0.5, took
