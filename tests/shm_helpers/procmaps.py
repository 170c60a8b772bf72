"""Who still holds a kvwire ring: a mapping in /proc/<pid>/maps or an open fd.

A ring is unlinked from /dev/shm right after creation, so listing /dev/shm proves nothing
about leaks; its pages live until the last mapping and the last fd are gone. The kernel
still names them ``/dev/shm/kvwire-<creator pid>-<nonce> (deleted)``, which is what these
helpers look for, in every process this user can read.
"""

from __future__ import annotations

import os


def segment_path(name: str) -> str:
    """The (deleted) path of the ring whose ``ShmRingBuffer.name`` is ``name`` (pid.fd.nonce)."""
    pid, _fd, nonce = name.split(".")
    return f"/dev/shm/kvwire-{pid}-{nonce}"


def holders(name: str) -> dict[int, list[str]]:
    """pid -> ["map"] and/or ["fd"] for every process that still maps or has open the ring."""
    path = segment_path(name)
    found: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/maps") as f:
                if any(path in line for line in f):
                    found.setdefault(pid, []).append("map")
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(path):
                        found.setdefault(pid, []).append("fd")
                        break
                except OSError:
                    continue
        except OSError:  # the process exited meanwhile, or is not ours to read
            continue
    return found

