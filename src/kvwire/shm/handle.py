"""The picklable description of a queue that readers need to join it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Handle:
    """What ``MessageQueue.create_from_handle`` needs; plain data, picklable, msgspec-encodable.

    ``buffer_handle`` is ``(n_local_reader, max_chunk_bytes, max_chunks, ring name)``
    or None when there are no local readers; ``remote_subscribe_addr`` is the
    writer's ZeroMQ TCP endpoint or None when there are no remote readers.

    The first seven fields are vLLM 0.33's ``Handle`` fields, in its order, so code that
    reads them (``local_reader_ranks``, ``remote_subscribe_addr``) works unchanged;
    ``local_subscribe_addr``, ``local_notify_addr`` and ``tensor_arena_handle`` are always
    None here (no local socket, no notify socket, no tensor arena).
    """

    local_reader_ranks: list[int] = field(default_factory=list)
    buffer_handle: tuple[int, int, int, str] | None = None
    local_subscribe_addr: str | None = None  # unused; kept for vLLM field compatibility
    local_notify_addr: str | None = None  # unused; kept for vLLM field compatibility
    remote_subscribe_addr: str | None = None
    remote_addr_ipv6: bool = False
    tensor_arena_handle: tuple[int, int, int, str] | None = None  # unused (vLLM's field)
    n_reader: int = 0
    serializer: str = "pickle"
    writer_pid: int = 0


def as_handle(obj: object) -> Handle:
    """``obj`` as a kvwire ``Handle``; a clear error for a handle of vLLM's own queue.

    A process where kvwire's queue was not swapped in exports vLLM's ``Handle`` (it has
    ``local_notify_addr`` but no ``writer_pid``): the two queues cannot talk, so say which
    process is missing the switch instead of failing on an attribute later.
    """
    if isinstance(obj, Handle):
        return obj
    if hasattr(obj, "local_notify_addr") and not hasattr(obj, "writer_pid"):
        raise TypeError(
            f"{type(obj).__module__}.{type(obj).__qualname__} is a handle of vLLM's own "
            "MessageQueue, not kvwire's: the writer's process did not swap the queue in "
            "(set KVWIRE_VLLM_SHM=1 in every vLLM process, or in none)")
    raise TypeError(f"expected a kvwire.shm.Handle, got {type(obj).__qualname__}")
