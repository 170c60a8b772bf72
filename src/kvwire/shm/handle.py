"""The picklable description of a queue that readers need to join it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Handle:
    """What ``MessageQueue.create_from_handle`` needs; plain data, picklable, msgspec-encodable.

    ``buffer_handle`` is ``(n_local_reader, max_chunk_bytes, max_chunks, ring name)``
    or None when there are no local readers; ``remote_subscribe_addr`` is the
    writer's ZeroMQ TCP endpoint or None when there are no remote readers.
    """

    local_reader_ranks: list[int] = field(default_factory=list)
    buffer_handle: tuple[int, int, int, str] | None = None
    local_subscribe_addr: str | None = None  # unused; kept for vLLM field compatibility
    remote_subscribe_addr: str | None = None
    remote_addr_ipv6: bool = False
    n_reader: int = 0
    serializer: str = "pickle"
    writer_pid: int = 0
