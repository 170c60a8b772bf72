"""The shared-memory segment: created 0600 in /dev/shm, unlinked at once, shared by fd.

Why unlink immediately: a name in /dev/shm outlives a SIGKILLed owner. Here the
file has a name only between ``open`` and ``unlink`` in the creator; other
processes reopen the still-open file through ``/proc/<creator pid>/fd/<fd>``
(same uid only, like a 0600 file), and the kernel frees the memory when the
last mapping goes away, however the processes end. Nothing is registered with
multiprocessing's resource_tracker, so it has nothing to warn about.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import secrets
from collections.abc import Iterator

from . import layout as L
from .errors import ShmCapacityError, ShmQueueError, WriterDeadError

SHM_DIR = "/dev/shm"


def shm_free_bytes(path: str = SHM_DIR) -> int:
    """Bytes an unprivileged user can still allocate in the shm filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _capacity_error(need: int, free: int) -> ShmCapacityError:
    mib = 1024 * 1024
    return ShmCapacityError(
        errno.ENOSPC,
        f"kvwire.shm: the ring needs {need / mib:.1f} MiB of {SHM_DIR} but only "
        f"{free / mib:.1f} MiB are free. Free space in {SHM_DIR}, lower max_chunk_bytes "
        f"or max_chunks, or give the container more shared memory "
        f"(docker run --shm-size=1g ..., or a Kubernetes emptyDir with medium: Memory).",
    )


class ShmRingBuffer:
    """A ring segment: header + ``max_chunks`` chunks of ``max_chunk_bytes``.

    ``name=None`` creates the segment; otherwise ``name`` (from ``.name`` of the
    creator, or a pickled instance) attaches to it. Pickling attaches in the
    receiving process, like vLLM's class of the same name.
    """

    def __init__(self, n_reader: int, max_chunk_bytes: int, max_chunks: int,
                 name: str | None = None) -> None:
        if not 1 <= n_reader <= L.MAX_READERS:
            raise ValueError(f"n_reader must be in 1..{L.MAX_READERS}, got {n_reader}")
        if max_chunk_bytes < 1 or max_chunks < 1:
            raise ValueError("max_chunk_bytes and max_chunks must be positive")
        self.n_reader = n_reader
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self.total_bytes_of_buffer = L.segment_size(n_reader, max_chunk_bytes, max_chunks)
        self.is_creator = name is None
        self._fd = -1
        if name is None:
            self._create()
        else:
            self._attach(name)
        self.mv = memoryview(self.mm)
        self.u64 = self.mv.cast("Q")
        self.u32 = self.mv.cast("I")
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.base_address = ctypes.addressof(self._anchor)
        if self.is_creator:
            self._init_header()
        else:
            self._check_header()
        self.header_size = L.header_size(n_reader)
        self.chunk_stride = L.chunk_stride(max_chunk_bytes)

    # -- creation / attach -------------------------------------------------
    def _create(self) -> None:
        size = self.total_bytes_of_buffer
        free = shm_free_bytes()
        if size > free:
            raise _capacity_error(size, free)
        self._nonce = secrets.token_bytes(L.NONCE_LEN)
        path = os.path.join(SHM_DIR, f"kvwire-{os.getpid()}-{self._nonce.hex()}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            os.unlink(path)
            os.fchmod(fd, 0o600)
            try:
                # Reserve the pages now: a full /dev/shm then fails here, not with SIGBUS later.
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise _capacity_error(size, shm_free_bytes()) from e
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.name = f"{os.getpid()}.{fd}.{self._nonce.hex()}"

    def _attach(self, name: str) -> None:
        try:
            pid_s, fd_s, nonce_hex = name.split(".")
            pid, fd_no, nonce = int(pid_s), int(fd_s), bytes.fromhex(nonce_hex)
        except ValueError as e:
            raise ValueError(f"not a kvwire ring name: {name!r}") from e
        try:
            fd = os.open(f"/proc/{pid}/fd/{fd_no}", os.O_RDWR | os.O_CLOEXEC)
        except (FileNotFoundError, ProcessLookupError) as e:
            if os.path.exists(f"/proc/{pid}"):
                raise ShmQueueError(f"ring {name} is closed to new readers (every reader "
                                    "already joined, or its creator closed it)") from e
            raise WriterDeadError(f"the process {pid} that created ring {name} is gone") from e
        except PermissionError as e:
            raise ShmQueueError(
                f"cannot open ring {name}: it belongs to another user or /proc is restricted"
            ) from e
        try:
            size = os.fstat(fd).st_size
            if size != self.total_bytes_of_buffer:
                raise ShmQueueError(f"ring {name} has size {size}, expected "
                                    f"{self.total_bytes_of_buffer}: wrong ring or parameters")
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._nonce = nonce
        self.name = name

    def _init_header(self) -> None:
        mv = self.mv
        mv[: L.header_size(self.n_reader)] = bytes(L.header_size(self.n_reader))
        self.u32[L.OFF_VERSION // 4] = L.VERSION
        self.u32[L.OFF_NREADER // 4] = self.n_reader
        self.u64[L.OFF_CHUNK_BYTES // 8] = self.max_chunk_bytes
        self.u64[L.OFF_NCHUNKS // 8] = self.max_chunks
        mv[L.OFF_NONCE : L.OFF_NONCE + L.NONCE_LEN] = self._nonce
        self.u32[L.OFF_WRITER_PID // 4] = os.getpid()
        self.u64[L.OFF_MAGIC // 8] = L.MAGIC

    def _check_header(self) -> None:
        ok = (
            self.u64[L.OFF_MAGIC // 8] == L.MAGIC
            and self.u32[L.OFF_VERSION // 4] == L.VERSION
            and bytes(self.mv[L.OFF_NONCE : L.OFF_NONCE + L.NONCE_LEN]) == self._nonce
            and self.u32[L.OFF_NREADER // 4] == self.n_reader
            and self.u64[L.OFF_CHUNK_BYTES // 8] == self.max_chunk_bytes
            and self.u64[L.OFF_NCHUNKS // 8] == self.max_chunks
        )
        if not ok:
            self.close()
            raise ShmQueueError(f"{self.name} is not the expected kvwire ring (stale handle?)")

    # -- accessors -----------------------------------------------------------
    @property
    def writer_pid(self) -> int:
        return self.u32[L.OFF_WRITER_PID // 4]

    @property
    def fd(self) -> int:
        """The creator's file descriptor of the segment (-1 in attached processes)."""
        return self._fd

    def chunk_offset(self, i: int) -> int:
        return self.header_size + i * self.chunk_stride

    def data_offset(self, i: int) -> int:
        return self.chunk_offset(i) + L.CHUNK_HDR

    def reader_offset(self, idx: int) -> int:
        return L.OFF_READERS + idx * L.LINE

    @contextlib.contextmanager
    def get_data(self, current_idx: int) -> Iterator[memoryview]:
        """Writable view of chunk ``current_idx``'s payload area."""
        off = self.data_offset(current_idx)
        with self.mv[off : off + self.max_chunk_bytes] as buf:
            yield buf

    @contextlib.contextmanager
    def get_metadata(self, current_idx: int) -> Iterator[memoryview]:
        """View of chunk ``current_idx``'s 64-byte header (seq word, sizes, flags)."""
        off = self.chunk_offset(current_idx)
        with self.mv[off : off + L.CHUNK_HDR] as buf:
            yield buf

    def close_fd(self) -> None:
        """Creator: forget the fd once every reader mapped the ring; nobody can open it after."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        """Unmap (and, in the creator, close the fd). Safe to call twice."""
        if getattr(self, "mm", None) is None:
            return
        self._anchor = None
        for v in ("u64", "u32", "mv"):
            view = getattr(self, v, None)
            if view is not None:
                view.release()
                setattr(self, v, None)
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds an in-place view; the GC unmaps later
        self.mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __reduce__(self):
        return (self.__class__, (self.n_reader, self.max_chunk_bytes, self.max_chunks, self.name))

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
