"""Is a peer process still alive? Checked only while a side waits, at a bounded rate.

``pidfd_open`` is used because ``os.kill(pid, 0)`` says "alive" for a zombie (a
SIGKILLed child its parent has not reaped yet) and for a recycled pid.
"""

from __future__ import annotations

import os
import select


class PidWatch:
    """Watches one pid; ``alive()`` costs one non-blocking poll."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        self._dead = False
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._dead = True
        except (AttributeError, OSError):
            self._fd = None  # no pidfd support: fall back to /proc

    def alive(self) -> bool:
        if self._dead:
            return False
        if self._fd is not None:
            r, _, _ = select.select([self._fd], [], [], 0)
            if r:
                self._dead = True
        else:
            try:
                with open(f"/proc/{self.pid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
                self._dead = state in (b"Z", b"X")
            except (FileNotFoundError, ProcessLookupError, IndexError):
                self._dead = True
        return not self._dead

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()
