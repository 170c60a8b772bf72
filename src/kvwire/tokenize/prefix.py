"""Token ids of text already tokenized, kept in chunks, so a prompt that extends one seen
before costs its new part only: a conversation's next request, an agent's growing context, a
completion prompt resent with more at its end.

Exactness rests on the cut: a position where the tokenizer cannot merge across, so that
``encode(a + b) == encode(a) + encode(b)`` whenever ``a + b`` has a cut between them. Which
positions are cuts depends on the tokenizer's normalizer and pre-tokenizer, so each tokenizer
gives its own rule (a zero-width regex, :data:`BUILTIN_CUTS`, :func:`hf_cuts`) or none, and
then only whole segments are kept. The rules are deliberately narrow (a word's end before a
space, a line's end before a letter): they hold for every text, not just the ones tested, and
prose and code have many of them. tests/test_tokenize_prefix.py checks them against
tokenizing whole texts, with hypothesis, for every tokenizer at hand.

A text is cut into chunks at the first cut at least :data:`CHUNK_CHARS` characters after the
previous one, from its start; so two texts agreeing on a prefix agree on its chunks. Each
chunk is stored under a key chained from the chunks before it (as KV blocks are), with its
text to compare, so a hit is exact and never a hash collision. The text after a text's last
chunk (its tail, shorter than a chunk and a cut) is kept too, under the last chunk's key: a
text that goes on past it at a cut (a question added after a document, the next words of an
agent's context) then re-tokenizes none of it, only what is new."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvwire.tokenize.bpe import pipeline_digits, untrack

__all__ = ["BUILTIN_CUTS", "CHUNK_CHARS", "MAX_TOKENS", "PrefixStore", "hf_cuts", "interner",
           "kept"]

#: Characters per chunk, at least: what a prompt that differs from a stored one mid-chunk
#: re-tokenizes at most beyond its new part, against one dict lookup per chunk it reuses.
CHUNK_CHARS = 512
#: Token ids the store keeps at most: 8 bytes each when the ids are shared int objects
#: (:func:`interner`), 64 MB; the least recently used chunks go first. A trace's worth of
#: distinct prompt text (the bundled one: ~4M tokens in its first 300 requests) fits.
MAX_TOKENS = 1 << 23

#: The builtin tokenizer's cuts: its pieces are `` ?\w+``, `` ?[^\w\s]+`` and ``\s+``, and it
#: has no normalizer. After a word character before a space, the word's piece ends (no piece
#: holds a word character and then a space) and the next starts at the space; after a newline
#: before a word character, the whitespace piece ends there (`` ?`` takes a space only).
BUILTIN_CUTS = re.compile(r"(?<=\w)(?= )|(?<=\n)(?=\w)")

#: The ASCII form of the same two cuts, for the byte-level BPE pipelines bpe.py takes (its
#: ``SPLITS``: Qwen2/Qwen3's and Llama 3's Split patterns, behaviour Isolated). Their letters
#: are ``\p{L}``, and ASCII letters pass NFC unchanged and never compose with what stands
#: before them. Their matches never hold a letter and then a space, nor a newline and then a
#: letter, peek at most one character past their end, look never behind, and end a piece the
#: same way at a text's end as before a cut. (GPT-2's pattern does not: ``\s+(?!\S)`` keeps
#: "  \n" whole at a text's end but not before a letter.)
_ASCII_CUTS = re.compile(r"(?<=[A-Za-z])(?= )|(?<=\n)(?=[A-Za-z])")


def kept(ids: Sequence[int]) -> tuple[int, ...]:
    """``ids`` as a tuple to keep, out of the cyclic collector's sight (bpe.untrack)."""
    return untrack(tuple(ids))


def interner(vocab: int | tuple[int, ...]) -> Callable[[Sequence[int]], tuple[int, ...]]:
    """A function giving ``ids`` as a tuple of shared int objects, one per id in the
    vocabulary (``vocab``: its size, or the table ``tuple(range(size))`` to share with an
    encoder that returns its objects): kept ids then cost a pointer each (8 bytes), not a
    new int (36 bytes with its pointer), as the lists ``tokenizers`` returns hold. Ids
    outside the vocabulary are kept as they are. A tuple is taken as interned already (the
    tokenizer's worker thread interns what it encodes, off the event loop that keeps it);
    one that is not only costs memory."""
    table = vocab if isinstance(vocab, tuple) else tuple(range(vocab))
    get = table.__getitem__

    def intern(ids: Sequence[int]) -> tuple[int, ...]:
        if type(ids) is tuple:
            return untrack(ids)
        try:
            if len(ids) > 1:
                return untrack(operator.itemgetter(*ids)(table))
            return tuple(map(get, ids))
        except (IndexError, TypeError):
            return kept(ids)
    return intern


def hf_cuts(tokenizer: Any) -> tuple[re.Pattern[str] | None, str]:
    """The cut rule of a ``tokenizers.Tokenizer``, or None and why not: only pipelines whose
    cuts are proven (module docstring) get one; any other keeps whole-segment tokenization."""
    digits, why = pipeline_digits(tokenizer)
    if digits is None:
        return None, why
    if type(tokenizer.model).__name__ != "BPE" or getattr(tokenizer.model, "dropout", None):
        return None, f"model {type(tokenizer.model).__name__} is not a deterministic BPE"
    return _ASCII_CUTS, ""


class PrefixStore:
    """Chunks of text with their token ids, keyed by chained hashes (module docstring).
    Bounded by :data:`MAX_TOKENS`; a chunk used again moves to the young end.

    Not locked: one thread plans and records (the proxy's event loop), whatever thread
    encodes the work in between."""

    def __init__(self, cuts: re.Pattern[str], chunk_chars: int = CHUNK_CHARS,
                 max_tokens: int = MAX_TOKENS) -> None:
        if chunk_chars < 1 or max_tokens < 1:
            raise ValueError("chunk_chars and max_tokens must be >= 1")
        self._find = cuts.search
        self._at = cuts.match  # (its lookbehind sees the text before the position)
        self.chunk_chars = chunk_chars
        self.max_tokens = max_tokens
        #: key -> (previous key, chunk text, ids); a tail under ``hash((key, None))``
        #: where ``key`` is the chunk before it. Every entry's ids are its text's, encoded
        #: alone: an entry found under another's key by a hash collision is still exact.
        self._chunks: dict[int, tuple[int, str, tuple[int, ...]]] = {}
        self.tokens = 0
        #: how ids are kept (:func:`interner` for ids that are not shared int objects)
        self.intern: Callable[[Sequence[int]], tuple[int, ...]] = kept
        self.hits = 0  # chunks reused
        self.misses = 0  # chunks tokenized

    def __len__(self) -> int:
        return len(self._chunks)

    def _ends(self, text: str, start: int) -> Iterator[int]:
        """The chunk ends of ``text`` after ``start``, in order: the first cut at least
        ``chunk_chars`` after the previous end, while one is."""
        find, step, n = self._find, self.chunk_chars, len(text)
        pos = start
        while pos + step < n:
            m = find(text, pos + step)
            if m is None:
                return
            pos = m.start()
            yield pos

    def cuts(self, text: str, start: int = 0) -> list[int]:
        """The chunk ends of ``text`` after ``start`` (itself a chunk end, or 0)."""
        return list(self._ends(text, start))

    def cover(self, text: str) -> tuple[list[int], int, int]:
        """``(ids, end, key)``: the ids of the longest stored run of ``text``'s chunks from
        its start, where that run ends, and the key to chain the next chunk to."""
        ids: list[int] = []
        chunks = self._chunks
        pos = key = 0
        for end in self._ends(text, 0):
            piece = text[pos:end]
            k = hash((key, piece))
            e = chunks.get(k)
            if e is None or e[0] != key or e[1] != piece:
                break
            ids += e[2]
            chunks[k] = chunks.pop(k, e)  # young again
            self.hits += 1
            pos, key = end, k
        return ids, pos, key

    def tail(self, text: str, pos: int, key: int) -> tuple[tuple[int, ...], int]:
        """``(ids, end)``: the stored tail after the chunk ``key`` (ending at ``pos``) when
        ``text`` goes on with it up to its end or a cut, else ``((), pos)``."""
        k = hash((key, None))
        e = self._chunks.get(k)
        if e is None or e[0] != key:
            return (), pos
        piece = e[1]
        end = pos + len(piece)
        if not text.startswith(piece, pos) or (end < len(text) and self._at(text, end) is None):
            return (), pos
        self._chunks[k] = self._chunks.pop(k)  # young again
        self.hits += 1
        return e[2], end

    def add(self, key: int, pieces: Sequence[str], ids: Sequence[Sequence[int]],
            head: str = "", head_ids: Sequence[int] = ()) -> None:
        """Store ``pieces`` (their ``ids``, each encoded alone) that follow the chunk ``key``:
        chunks, then the text's tail; ``head`` (a stored tail, ``head_ids`` its ids) leads
        the first."""
        if head:
            pieces = [head + pieces[0], *pieces[1:]]
            ids = [kept(tuple(head_ids) + self.intern(ids[0])), *ids[1:]]
        n = len(pieces) - 1
        for i, (piece, piece_ids) in enumerate(zip(pieces, ids)):
            k = hash((key, piece)) if i < n else hash((key, None))
            self._put(k, (key, piece, self.intern(piece_ids)))
            key = k
        if self.tokens > self.max_tokens:
            self._evict()

    def _put(self, k: int, entry: tuple[int, str, tuple[int, ...]]) -> None:
        old = self._chunks.pop(k, None)
        if old is not None:
            self.tokens -= len(old[2])
        self._chunks[k] = entry
        self.tokens += len(entry[2])
        self.misses += 1

    def _evict(self) -> None:
        """Drop the oldest chunks until 1/64 of the bound is free (dicts keep order): a
        little at a time, as it runs on the event loop (a quarter of the default bound at
        once held it for 25 ms)."""
        chunks = self._chunks
        excess = self.tokens - (self.max_tokens - self.max_tokens // 64)
        oldest = []  # only the keys dropped: not a copy of every key at each eviction
        for k, e in chunks.items():
            if excess <= 0:
                break
            oldest.append(k)
            excess -= len(e[2])
        for k in oldest:
            self.tokens -= len(chunks.pop(k)[2])
