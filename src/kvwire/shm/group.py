"""Process groups that queues are built over (``MessageQueue.create_from_process_group``):
torch.distributed (gloo) or kvwire's own, and the node key that tells which ranks can
share a ring.

``StatelessGroup`` is a minimal collective group over ZeroMQ TCP (rank 0 is the
hub) that encodes with msgpack, never pickle, so exchanging handles through it
executes nothing received from the network. torch is optional: its groups are
used through ``torch.distributed`` only when one is passed in.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from .handle import Handle, as_handle


class StatelessGroup:
    """A tiny process group: ``rank``, ``world_size``, ``all_gather_obj``, ``broadcast_obj``,
    ``barrier``. Objects must be msgpack-encodable (dataclasses and msgspec Structs are)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int,
                 timeout: float = 60.0) -> None:
        self.rank, self.world_size = rank, world_size
        self._ctx = zmq.Context.instance()
        self._timeout_ms = int(timeout * 1000)
        self._enc = msgspec.msgpack.Encoder()
        self._seq = 0
        if rank == 0:
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.IDENTITY, b"r%d" % rank)
            self._sock.connect(f"tcp://{host}:{port}")
        self._sock.setsockopt(zmq.LINGER, 1000)

    @staticmethod
    def create(host: str, port: int, rank: int, world_size: int) -> StatelessGroup:
        return StatelessGroup(host, port, rank, world_size)

    def _recv(self) -> list[bytes]:
        if not self._sock.poll(self._timeout_ms):
            raise TimeoutError("StatelessGroup: a peer did not answer")
        return self._sock.recv_multipart()

    def all_gather_obj(self, obj: Any) -> list[Any]:
        self._seq += 1
        payload = self._enc.encode(obj)
        if self.rank == 0:
            got: dict[int, bytes] = {0: payload}
            while len(got) < self.world_size:
                ident, seq, data = self._recv()
                if int(seq) != self._seq:
                    raise RuntimeError("StatelessGroup: collectives out of step")
                got[int(ident[1:])] = data
            blob = self._enc.encode([msgspec.Raw(got[r]) for r in range(self.world_size)])
            for r in range(1, self.world_size):
                self._sock.send_multipart([b"r%d" % r, blob])
            out = blob
        else:
            self._sock.send_multipart([b"%d" % self._seq, payload])
            (out,) = self._recv()
        return msgspec.msgpack.decode(out)

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        return self.all_gather_obj(obj if self.rank == src else None)[src]

    def barrier(self) -> None:
        self.all_gather_obj(None)

    def close(self) -> None:
        self._sock.close()


def node_key() -> str:
    """Processes with equal keys can share a ring: same boot, same pid and IPC namespaces."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    for ns in ("pid", "ipc", "mnt"):
        try:
            parts.append(os.readlink(f"/proc/self/ns/{ns}"))
        except OSError:
            pass
    return "|".join(parts)


@dataclass
class GroupOps:
    rank: int  # rank in the group
    world_size: int
    stateless: bool
    pg: Any
    global_rank: int  # torch: rank in the default group (vLLM's reader_rank); else = rank

    def all_gather(self, obj: Any) -> list[Any]:
        if self.stateless:
            return self.pg.all_gather_obj(obj)
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def group_rank(self, global_rank: int) -> int:
        """The group rank of a global rank (the same number for stateless groups)."""
        if self.stateless:
            return global_rank
        import torch.distributed as dist

        return dist.get_group_rank(self.pg, global_rank)

    def handle(self, obj: Any) -> Handle | None:
        if obj is None or isinstance(obj, Handle):
            return obj
        if isinstance(obj, dict):  # StatelessGroup sends msgpack: a Handle arrives as a map
            return msgspec.convert(obj, Handle)
        return as_handle(obj)  # a clear error for a handle of vLLM's own queue


def group_ops(pg: Any) -> GroupOps:
    if isinstance(pg, StatelessGroup) or (hasattr(pg, "all_gather_obj")
                                          and hasattr(pg, "world_size")):
        return GroupOps(pg.rank, pg.world_size, True, pg, pg.rank)
    import torch.distributed as dist

    return GroupOps(dist.get_rank(pg), dist.get_world_size(pg), False, pg, dist.get_rank())
