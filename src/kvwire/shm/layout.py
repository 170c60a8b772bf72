"""Byte layout of a ring segment. All words are naturally aligned little-endian.

```
header (64-byte lines)
  line 0   magic u64 | version u32 | n_reader u32 | max_chunk_bytes u64 | max_chunks u64
           | nonce 16B | writer_pid u32 | writer_state u32
  line 1   rwake u32        futex word readers sleep on, bumped by the writer
  line 2   wwake u32 | writer_sleeping u8   futex word the writer sleeps on
  line 3   reader sleeping flags, one byte per reader
  line 4+r reader r: rseq u64 | pid u32 | status u32
chunks (stride = 64 + max_chunk_bytes rounded up to 64)
  +0  seq u64 (written last) | unused u64 | meta u64 | total u64 (fragments only)
      meta = nbytes (bits 0-39) | flags << 40 (bits 40-47) | nframes << 48 (bits 48-63)
  +64 payload
```
"""

from __future__ import annotations

MAGIC = 0x31304D4853575B4B  # b"K[WSHM01" little-endian
VERSION = 1
LINE = 64
MAX_READERS = 64

# line 0
OFF_MAGIC = 0
OFF_VERSION = 8
OFF_NREADER = 12
OFF_CHUNK_BYTES = 16
OFF_NCHUNKS = 24
OFF_NONCE = 32
NONCE_LEN = 16
OFF_WRITER_PID = 48
OFF_WRITER_STATE = 52
OFF_RWAKE = 1 * LINE
OFF_WWAKE = 2 * LINE
OFF_WRITER_SLEEPING = 2 * LINE + 8
OFF_SLEEPERS = 3 * LINE
OFF_READERS = 4 * LINE

# reader line fields (relative)
R_SEQ = 0
R_PID = 8
R_STATUS = 12

# writer_state
W_INIT = 0
W_READY = 1
W_SHUTDOWN = 2

# reader status
R_EMPTY = 0
R_ATTACHED = 1
R_DROPPED = 2
R_CLOSED = 3

# chunk header fields (relative)
CHUNK_HDR = LINE
C_SEQ = 0
C_NBYTES = 8
C_META = 16
C_TOTAL = 24

# chunk flags
F_SINGLE = 1  # payload is exactly frame 0 (the common small-message case)
F_FRAMED = 2  # payload is a frame table followed by frames
F_RAW = 4  # written through acquire_write: the whole chunk is the user's
F_FRAGMENT = 8  # part of a message larger than a chunk; ``total`` is the full size
F_LAST = 16  # last fragment

PAGE = 4096


MASK40 = (1 << 40) - 1
MAX_FRAMES = 0xFFFF


def meta(nbytes: int, flags: int, nframes: int) -> int:
    """One word tells a reader the size and shape of the chunk (one store, one load)."""
    return nbytes | (flags << 40) | (nframes << 48)


def meta_nbytes(w: int) -> int:
    return w & MASK40


def meta_flags(w: int) -> int:
    return (w >> 40) & 0xFF


def meta_nframes(w: int) -> int:
    return w >> 48


SINGLE_HI = F_SINGLE | (1 << 8)  # meta >> 40 of a one-frame single-chunk message


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def header_size(n_reader: int) -> int:
    return round_up(OFF_READERS + n_reader * LINE, PAGE)


def chunk_stride(max_chunk_bytes: int) -> int:
    return CHUNK_HDR + round_up(max_chunk_bytes, LINE)


def segment_size(n_reader: int, max_chunk_bytes: int, max_chunks: int) -> int:
    return round_up(header_size(n_reader) + max_chunks * chunk_stride(max_chunk_bytes), PAGE)
