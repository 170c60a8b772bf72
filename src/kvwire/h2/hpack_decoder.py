"""HPACK decoding (RFC 7541) for the server's request header blocks. The static table and
the Huffman code are the RFC's, taken from the ``hpack`` package; the decoding is here so
that it knows when its dynamic table changes: a gRPC client sends the same block for every
call on a connection (Envoy: the method's ``:path`` as a literal without indexing, the rest
indexed), and a block decoded while the table stood as it stands now decodes the same
again, so it is decoded once (no Huffman, no parsing) per table state."""

from __future__ import annotations

from collections import deque

from hpack.exceptions import HPACKError
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

__all__ = ["Decoder", "HpackError"]

#: index 1..61 (RFC 7541 appendix A)
_STATIC: tuple[tuple[bytes, bytes], ...] = HeaderTable.STATIC_TABLE
_NSTATIC = len(_STATIC)
_KEEP_BLOCKS = 256
_KEEP_BLOCK_SIZE = 1024


class HpackError(Exception):
    """A header block that does not decode (the connection's COMPRESSION_ERROR)."""


class Decoder:
    """One connection's decoding context. ``max_table``: the SETTINGS_HEADER_TABLE_SIZE
    this side announced (the peer may lower the table's size, never raise it past this);
    ``max_list``: the largest decoded header list (names, values, 32 bytes each)."""

    def __init__(self, max_table: int = 4096, max_list: int = 1 << 16) -> None:
        self.entries: deque[tuple[bytes, bytes]] = deque()  # newest first
        self.size = 0
        self.max_size = max_table
        self.limit = max_table
        self.max_list = max_list
        self.generation = 0  # counts every change of the dynamic table
        self._blocks: dict[bytes, tuple[int, list[tuple[bytes, bytes]]]] = {}

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """The (name, value) list of one complete header block, in order."""
        kept = self._blocks.get(block)
        if kept is not None and kept[0] == self.generation:
            return list(kept[1])
        generation = self.generation
        try:
            headers = self._decode(block)
        except (IndexError, HPACKError) as e:
            raise HpackError(f"a header block that does not decode: {e or 'cut short'}"
                             ) from None
        if self.generation == generation and len(block) <= _KEEP_BLOCK_SIZE:
            if len(self._blocks) >= _KEEP_BLOCKS:
                self._blocks.clear()
            self._blocks[block] = (generation, headers)
            return list(headers)
        return headers

    def _decode(self, data: bytes) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        pos = 0
        end = len(data)
        total = 0
        while pos < end:
            b = data[pos]
            if b & 0x80:  # indexed field (6.1)
                index, pos = _integer(data, pos, 7)
                header = self._get(index)
            elif b & 0x40:  # literal with incremental indexing (6.2.1)
                header, pos = self._literal(data, pos, 6)
                self._add(header)
            elif b & 0x20:  # dynamic table size update (6.3)
                if out:
                    raise HpackError("a table size update after a header field")
                size, pos = _integer(data, pos, 5)
                if size > self.limit:
                    raise HpackError(f"a table size of {size} past the {self.limit} allowed")
                self.max_size = size
                self._evict(0)
                self.generation += 1
                continue
            else:  # literal without indexing (6.2.2) or never indexed (6.2.3)
                header, pos = self._literal(data, pos, 4)
            total += len(header[0]) + len(header[1]) + 32
            if total > self.max_list:
                raise HpackError(f"a header list past {self.max_list} bytes")
            out.append(header)
        return out

    def _get(self, index: int) -> tuple[bytes, bytes]:
        if index <= 0:
            raise HpackError("index 0")
        if index <= _NSTATIC:
            return _STATIC[index - 1]
        i = index - _NSTATIC - 1
        if i >= len(self.entries):
            raise HpackError(f"index {index} past the table")
        return self.entries[i]

    def _literal(self, data: bytes, pos: int, prefix: int) -> tuple[tuple[bytes, bytes], int]:
        index, pos = _integer(data, pos, prefix)
        if index:
            name = self._get(index)[0]
        else:
            name, pos = _string(data, pos)
        value, pos = _string(data, pos)
        return (name, value), pos

    def _add(self, header: tuple[bytes, bytes]) -> None:
        size = len(header[0]) + len(header[1]) + 32
        self.generation += 1
        if size > self.max_size:  # (4.4: empties the table, adds nothing)
            self.entries.clear()
            self.size = 0
            return
        self._evict(size)
        self.entries.appendleft(header)
        self.size += size

    def _evict(self, room: int) -> None:
        entries = self.entries
        while entries and self.size + room > self.max_size:
            name, value = entries.pop()
            self.size -= len(name) + len(value) + 32


def _integer(data: bytes, pos: int, prefix: int) -> tuple[int, int]:
    """An integer with an N-bit prefix (5.1) at ``pos``; it and the position after it."""
    top = (1 << prefix) - 1
    value = data[pos] & top
    pos += 1
    if value < top:
        return value, pos
    shift = 0
    while True:
        b = data[pos]
        pos += 1
        value += (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise HpackError("an integer past 2^32")


def _string(data: bytes, pos: int) -> tuple[bytes, int]:
    """A string literal (5.2): raw or Huffman-coded."""
    huffman = data[pos] & 0x80
    n, pos = _integer(data, pos, 7)
    end = pos + n
    if end > len(data):
        raise HpackError("a string past the block's end")
    raw = data[pos:end]
    return (decode_huffman(raw) if huffman else raw), end
