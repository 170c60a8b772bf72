"""A consumer process for the durable-resume test: follows a JetStream stream with a durable
consumer and appends one JSON line per item to a file (kind, stream, epoch, seq, the batch or the
snapshot's blocks as msgpack hex; flushed), committing after each slice.
Usage: python _nats_consume_proc.py URL DURABLE OUTFILE [ITEMS_PER_SLICE (default 50)]"""

from __future__ import annotations

import json
import sys

import msgspec

from kvwire.consume.items import Batch, Reset, Snapshot
from kvwire.consume.subscriber import Subscriber
from kvwire.nats.streams import NatsStreams
from kvwire.wire.events import encode_batch

_enc = msgspec.msgpack.Encoder()


def main() -> None:
    url, durable, path = sys.argv[1:4]
    per = int(sys.argv[4]) if len(sys.argv) > 4 else 50
    with open(path, "a") as out, Subscriber([NatsStreams(url, durable=durable)]) as sub:
        print("ready", flush=True)
        while True:
            items = sub.poll_many(0.2, max_items=per)
            for it in items:
                kind = {Batch: "batch", Reset: "reset", Snapshot: "snapshot"}.get(type(it), "?")
                body = (encode_batch(it.batch) if type(it) is Batch else
                        _enc.encode(it.blocks) if type(it) is Snapshot else b"")
                out.write(json.dumps([kind, it.stream, getattr(it, "epoch", None),
                                      getattr(it, "seq", None), body.hex()]) + "\n")
            out.flush()
            if items:
                sub.commit()


if __name__ == "__main__":
    main()
