"""Bad input at scale: 10^5 generated garbage cases, each counted, nothing crashes or hangs.

Real sockets on loopback; the generators are seeded so a failure reproduces.
"""

from __future__ import annotations

import random
import time

import msgspec
import zmq

from kvwire.publish.publisher import ZmqEventPublisher
from kvwire.wire import protocol
from kvwire.wire.events import BatchDecoder, DecodeError, KVEventBatch, encode_batch

N_CASES = 100_000


def garbage_request(rng: random.Random) -> tuple[list[bytes], bool]:
    """A request after the DEALER's own framing; returns (frames, is_valid)."""
    kind = rng.randrange(9)
    if kind == 0:  # random frames, random count
        return [rng.randbytes(rng.randrange(0, 40)) for _ in range(rng.randrange(0, 6))], False
    if kind == 1:  # right shape, wrong seq length
        n = rng.choice([0, 1, 7, 9, 16])
        return [b"", rng.randbytes(n)], False
    if kind == 2:  # missing delimiter
        return [rng.randbytes(8)], False
    if kind == 3:  # top bit set: read unsigned, as the reference does, so past the end
        return [b"", (-rng.randrange(1, 1 << 40)).to_bytes(8, "big", signed=True)], True
    if kind == 4:  # bad control ops
        return [b"", protocol.MAGIC, rng.randbytes(rng.randrange(0, 12))], False
    if kind == 5:  # control op with wrong arity
        return [b"", protocol.MAGIC, b"INFO", rng.randbytes(3)], False
    if kind == 6:  # snapshot with a malformed chunk-size frame
        return [b"", protocol.MAGIC, b"SNAPSHOT", rng.randbytes(rng.choice([0, 1, 3, 5, 8]))], False
    if kind == 7:  # wrong magic
        return [b"", rng.randbytes(4), b"INFO"], False
    return [b"", protocol.pack_seq(rng.randrange(1 << 40, 1 << 50))], True  # past the end: valid


def test_publisher_replay_socket_survives_1e5_garbage_requests(tmp_path) -> None:
    rng = random.Random(1234)
    pub = ZmqEventPublisher(
        endpoint=f"ipc://{tmp_path}/live", replay_endpoint=f"ipc://{tmp_path}/replay",
        heartbeat_interval=None, topic="t",
    )
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"t")
        sub.connect(pub.endpoint)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, 0)
        dealer.connect(pub.replay_endpoint)
        expected_bad = valid = 0
        for i in range(N_CASES):
            frames, ok = garbage_request(rng)
            if not frames:
                continue  # a DEALER cannot send an empty message
            dealer.send_multipart(frames)
            if ok:
                valid += 1
            else:
                expected_bad += 1
            if i % 2000 == 0:  # live publishing keeps going under the flood
                pub.publish(KVEventBatch(time.time(), [], 0))
            if i % 500 == 0:  # drain replies so the dealer's queue stays small
                while dealer.poll(0):
                    dealer.recv_multipart()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            while dealer.poll(0):
                dealer.recv_multipart()
            st = pub.stats()
            if st.bad_requests + st.replay_requests >= expected_bad + valid:
                break
            time.sleep(0.01)
        st = pub.stats()
        assert st.bad_requests == expected_bad
        assert st.replay_requests == valid
        # Still healthy: a real replay gets every batch and the end marker...
        while dealer.poll(100):
            dealer.recv_multipart()
        dealer.send_multipart([b"", protocol.pack_seq(0)])
        seqs = []
        while True:
            assert dealer.poll(5000), "publisher stopped answering after the flood"
            f = dealer.recv_multipart()
            if f[2] == protocol.END_SEQ:
                break
            seqs.append(protocol.unpack_seq(f[2]))
        assert seqs == list(range(st.last_seq + 1))
        # ...and live publishing still reaches subscribers.
        pub.publish(KVEventBatch(time.time(), [], 0))
        assert sub.poll(5000)
    finally:
        pub.shutdown(timeout=1)
        ctx.destroy(linger=0)


def random_msgpack(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.randrange(-(1 << 63), 1 << 64)
    if kind == 1:
        return rng.random() * 1e12
    if kind == 2:
        return rng.randbytes(rng.randrange(0, 40))
    if kind == 3:
        return rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "x"])
    if kind == 4:
        return None
    if kind == 5:
        return rng.choice([True, False])
    if kind == 6:
        return [random_msgpack(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    if kind == 7:
        keys = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                "lora_id", "medium", "zzz"]
        return {rng.choice(keys): random_msgpack(rng, depth + 1) for _ in range(rng.randrange(6))}
    ev = rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared"])
    return [ev] + [random_msgpack(rng, depth + 1) for _ in range(rng.randrange(0, 7))]


def garbage_payload(rng: random.Random) -> bytes:
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 200))
    if kind == 1:  # a batch shape with random events
        events = [random_msgpack(rng, 1) for _ in range(rng.randrange(0, 5))]
        return msgspec.msgpack.encode([rng.random() * 1e9, events, rng.choice([None, 3])])
    if kind == 2:  # a real batch, truncated or bit-flipped
        good = encode_batch(KVEventBatch(1.0, [], 0))
        b = bytearray(good + rng.randbytes(rng.randrange(0, 20)))
        if b and rng.random() < 0.5:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b[: rng.randrange(len(b) + 1)])
    return msgspec.msgpack.encode(random_msgpack(rng))


def test_decoder_survives_1e5_garbage_payloads() -> None:
    rng = random.Random(99)
    dec = BatchDecoder(on_error=lambda e: None)
    not_batches = 0
    for _ in range(N_CASES):
        p = garbage_payload(rng)
        try:
            b = dec.decode(p)
        except DecodeError as e:
            assert str(e)
            not_batches += 1
        else:
            assert isinstance(b, KVEventBatch)
    assert dec.bad_payloads == not_batches
    assert dec.batches + not_batches == N_CASES
    assert dec.bad_events > 0 and not_batches > 0
