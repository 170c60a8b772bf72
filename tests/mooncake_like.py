"""A stand-in for Mooncake Store's KV event publisher on real ZeroMQ sockets, replaying the
vendored vectors (tests/data/rfc1527_mooncake.json) with their own seq frames (from 1)."""

from __future__ import annotations

from typing import Any

import zmq


class MooncakeLike:
    """Mooncake Store's publisher as its vectors show it, on real sockets: PUB frames
    ``[topic, seq, payload]`` numbered from 1, and a ROUTER that answers a replay request
    with every batch from the asked seq on (vLLM's replay layout), then the end marker.
    Written here on raw pyzmq (kvwire's own publisher numbers from 0)."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ring = [[bytes.fromhex(f) for f in m["frames_hex"]] for m in messages]

    def publish_all(self) -> None:
        for frames in self.ring:
            self.pub.send_multipart(frames)

    def serve(self, stop: Any) -> None:
        """Answer replay requests until ``stop`` (a threading.Event) is set."""
        while not stop.is_set():
            if not self.router.poll(20, zmq.POLLIN):
                continue
            req = self.router.recv_multipart()
            if len(req) != 3 or req[1] != b"" or len(req[2]) != 8:
                continue  # not a replay request (kvwire's INFO): ignored, as Mooncake does
            ident, first = req[0], int.from_bytes(req[2], "big")
            for topic, seq, payload in self.ring:
                if int.from_bytes(seq, "big") >= first:
                    self.router.send_multipart([ident, b"", topic, seq, payload])
            self.router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])

    def close(self) -> None:
        self.pub.close()
        self.router.close()
        self.ctx.term()
