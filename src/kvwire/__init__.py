"""kvwire: KV-cache event streams of LLM inference engines.

The names a user needs are here, at the top level::

    from kvwire import ZmqEventPublisher, KVEventBatch, BlockStored, Subscriber, StreamSpec

They are imported lazily, on first use, so ``import kvwire`` itself loads neither pyzmq nor
msgspec (tests/test_api.py checks it). Each name is the object of the module that defines it,
so the deep paths (``kvwire.publish.publisher.ZmqEventPublisher``, ...) keep working and name
the same thing.
"""

# Not `from typing import TYPE_CHECKING`: importing typing alone would cost more than all
# of this module (about 7 ms). Type checkers read a variable of this name as True.
TYPE_CHECKING = False

__version__ = "0.1.0"

# name -> the module that defines it. __all__ (a literal, for linters and type checkers) and
# the TYPE_CHECKING block below list the same names; tests/test_api.py checks they agree.
_API: dict[str, str] = {
    # engines: the publisher and what it publishes
    "ZmqEventPublisher": "kvwire.publish.publisher",
    "KVEventBatch": "kvwire.wire.events",
    "BlockStored": "kvwire.wire.events",
    "BlockRemoved": "kvwire.wire.events",
    "AllBlocksCleared": "kvwire.wire.events",
    "decode_batch": "kvwire.wire.events",
    "encode_batch": "kvwire.wire.events",
    # routers: the reliable subscriber, what it delivers, and what to do with it
    "Subscriber": "kvwire.consume.subscriber",
    "StreamSpec": "kvwire.consume.subscriber",
    "Batch": "kvwire.consume.stream",
    "Reset": "kvwire.consume.stream",
    "Snapshot": "kvwire.consume.stream",
    "BlockCache": "kvwire.index.cache",
    "PrefixIndex": "kvwire.index.prefix",
    "RoutingPolicy": "kvwire.routing.policy",
    # one-to-many IPC in shared memory
    "MessageQueue": "kvwire.shm.queue",
}

__all__ = [
    "AllBlocksCleared", "Batch", "BlockCache", "BlockRemoved", "BlockStored", "KVEventBatch",
    "MessageQueue", "PrefixIndex", "Reset", "RoutingPolicy", "Snapshot", "StreamSpec",
    "Subscriber", "ZmqEventPublisher", "__version__", "decode_batch", "encode_batch",
    "native_status",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on use
    from typing import Any

    from kvwire.consume.stream import Batch, Reset, Snapshot
    from kvwire.consume.subscriber import StreamSpec, Subscriber
    from kvwire.index.cache import BlockCache
    from kvwire.index.prefix import PrefixIndex
    from kvwire.publish.publisher import ZmqEventPublisher
    from kvwire.routing.policy import RoutingPolicy
    from kvwire.shm.queue import MessageQueue
    from kvwire.wire.events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        decode_batch,
        encode_batch,
    )


def __getattr__(name: str) -> "Any":
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'kvwire' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def native_status() -> dict[str, str]:
    """Which optional C accelerators this process uses (see setup.py): ``frames`` is
    ``"c"``, ``"ctypes"`` or ``"pyzmq"``; ``shm``, ``index``, ``route_body`` (the
    service's token-id parser), ``index_walk`` (the indexer API's per-medium walk),
    ``query_answer`` (its ``/query`` answer bytes), ``builtin_tokenizer`` (the builtin
    tokenizer's text-to-ids loop), ``bpe_tokenizer`` (byte-level BPE tokenizer.json files on
    ASCII text; else the ``tokenizers`` library) and ``event_ids`` (the token ids of large
    event batches) are ``"c"`` or ``"python (<why>)"``."""
    from .index import keys as index_keys
    from .shm import NATIVE, _native
    from .wire.frames import native_status as frames_status

    shm = "c" if NATIVE else f"python ({getattr(_native, 'REASON', 'not built')})"
    index = "c" if index_keys.NATIVE else f"python ({index_keys.REASON or 'not built'})"
    from .routing import tokens

    body = "c" if tokens.parse_route_body is not None else f"python ({tokens.REASON})"
    from .tokenize import native as tokenize_native

    plain = ("c" if tokenize_native.encode_plain is not None
             else f"python ({tokenize_native.REASON})")
    from .tokenize import bpe

    bpe_status = "c" if bpe.ByteBPE is not None and not bpe.REASON else f"python ({bpe.REASON})"
    import os

    from .index import walk
    from .indexer import indexer
    from .wire import events

    def built(mod: object) -> str:
        if os.environ.get("KVWIRE_NO_NATIVE"):
            return "python (KVWIRE_NO_NATIVE set)"
        return "c" if mod is not None else "python (not built)"

    return {"frames": frames_status(), "shm": shm, "index": index, "route_body": body,
            "index_walk": built(walk.tier_walk), "query_answer": built(indexer._c_answer),
            "builtin_tokenizer": plain, "bpe_tokenizer": bpe_status,
            "event_ids": built(events._int_list)}
