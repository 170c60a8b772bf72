"""A text's tokenization split into what is known and what is new, so that only the new part
is tokenized and, being the slow part, can be tokenized on another thread.

A tokenizer cuts the text at its special (added) tokens before anything else, so the pieces
between them -- a chat's turns -- encode independently: each is kept once encoded, whole
(up to :data:`WHOLE_CHARS`), and in chunks when it is long (prefix.py), so that one extending
it pays its new part only.
:meth:`Segments.plan` does the lookups and lists the work (texts to encode), the tokenizer
encodes them (``Tokenizer.run``: the only slow step, touching no cache), and
:meth:`Segments.finish` stores the results and joins the ids. ``encode`` is the three in a row;
the router runs the middle one off its event loop when it is long."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from kvwire.tokenize.prefix import PrefixStore, kept

__all__ = ["Plan", "Segments"]

#: Whole segments kept: at most this many, and at most this many token ids in all (8 bytes
#: each as shared int objects: 32 MB).
SEGMENTS = 8192
SEGMENT_TOKENS = 1 << 22
#: Segments up to this long are also kept whole (a chat turn, a system prompt): seen again,
#: they cost one lookup, where their chunks would cost a walk and their last chunk's tail
#: tokenized again. Longer ones only in chunks: hashing and copying them whole would cost
#: more than it saves.
WHOLE_CHARS = 32768


class Plan:
    """One text's tokenization: ``parts`` are ids already known or indexes into ``work``."""

    __slots__ = ("chars", "chunked", "owned", "parts", "special", "trail", "whole", "work")

    def __init__(self) -> None:
        self.trail: Sequence[int] = ()  # ids put last (an EOS some post-processors add)
        self.special = False  # the work is one whole text, encoded with special tokens added
        self.parts: list[Sequence[int] | int] = []
        self.work: list[str] = []
        self.whole: list[tuple[str, int, int]] = []  # (segment, first part, end part)
        self.owned = False  # parts[0] is a list made for this plan alone
        #: (key, head, head ids, first work, end work): the work after chunk ``key``,
        #: its chunks then its tail, the first led by the stored tail ``head``
        self.chunked: list[tuple[int, str, Sequence[int], int, int]] = []
        self.chars = 0  # characters of work

    def add_work(self, text: str) -> int:
        self.parts.append(len(self.work))
        self.work.append(text)
        self.chars += len(text)
        return len(self.work) - 1

    def sub(self, a: int, b: int) -> Plan:
        """Work items ``a`` to ``b`` as a plan of their own, for ``Tokenizer.run`` (each item
        is encoded alone there, so a plan's work can be run in pieces)."""
        p = Plan()
        p.special = self.special
        p.work = self.work[a:b]
        p.chars = sum(map(len, p.work))
        return p

    def start(self, results: Sequence[Sequence[int]]) -> list[int]:
        """The ids of the text up to its first work item not in ``results`` (the ids of the
        first work items, in order): the start of a prompt, known before the rest is."""
        out: list[int] = []
        n = len(results)
        for part in self.parts:
            if type(part) is int:
                if part >= n:
                    break
                out += results[part]
            else:
                out += part
        return out

    def known_tokens(self) -> int:
        """Ids known without any work: every part that is not work, and the trail."""
        return sum(len(p) for p in self.parts if type(p) is not int) + len(self.trail)


class Segments:
    """The known part of texts: whole segments, and chunks of long ones in ``store`` (None:
    whole segments only). ``splitter`` finds the special tokens (``special`` gives their
    ids); None: the text is one segment."""

    def __init__(self, splitter: re.Pattern[str] | None, special: dict[str, int],
                 store: PrefixStore | None, max_segments: int = SEGMENTS,
                 max_tokens: int = SEGMENT_TOKENS) -> None:
        self.splitter = splitter
        self.special = special
        self.store = store
        self.max_segments = max_segments
        self.max_tokens = max_tokens
        self._whole: dict[str, Sequence[int]] = {}  # never mutated once kept
        #: how ids are kept: as a tuple, or prefix.py's ``interner`` for ids that are not
        #: shared int objects (the store's too); a new object, as it may be given the
        #: list returned to the caller
        self.intern: Callable[[Sequence[int]], Sequence[int]] = kept
        self._whole_tokens = 0

    def plan(self, text: str, lead: Sequence[int] = (), trail: Sequence[int] = ()) -> Plan:
        """Look up every segment of ``text``; what is not known becomes work. ``lead`` and
        ``trail``: ids put first and last (a BOS, an EOS)."""
        p = Plan()
        p.trail = trail
        if lead:
            p.parts.append(lead)
        if self.splitter is None:
            self._segment(text, p)
            return p
        pos = 0
        special = self.special
        for m in self.splitter.finditer(text):
            if m.start() > pos:
                self._segment(text[pos:m.start()], p)
            p.parts.append((special[m.group()],))
            pos = m.end()
        if pos < len(text):
            self._segment(text[pos:], p)
        return p

    def _segment(self, seg: str, p: Plan) -> None:
        store = self.store
        whole = len(seg) <= WHOLE_CHARS
        if whole:
            ids = self._whole.get(seg)
            if ids is not None:
                p.parts.append(ids)
                return
        first = len(p.parts)
        if store is not None and len(seg) > 2 * store.chunk_chars:
            known, pos, key = store.cover(seg)
            if known:
                if not p.parts:  # (only a text's first part can be extended in place)
                    p.owned = True
                p.parts.append(known)
            head_ids, end = store.tail(seg, pos, key)
            if head_ids:
                p.parts.append(head_ids)
            if end < len(seg):  # (else the tail ended the segment: nothing new)
                w0, start = len(p.work), end
                for b in store.cuts(seg, pos):  # (all past the tail: it holds no chunk end)
                    p.add_work(seg[start:b])  # (empty when the tail ends at a chunk end)
                    start = b
                p.add_work(seg[start:])
                p.chunked.append((key, seg[pos:end], head_ids, w0, len(p.work)))
        else:
            p.add_work(seg)
        if whole:
            p.whole.append((seg, first, len(p.parts)))

    def finish(self, p: Plan, results: Sequence[Sequence[int]]) -> list[int]:
        """The ids of the planned text, given the ids of its work in order; keeps them."""
        if len(results) != len(p.work):
            raise ValueError(f"{len(results)} results for {len(p.work)} work items")
        store = self.store
        for key, head, head_ids, a, b in p.chunked:
            store.add(key, p.work[a:b], results[a:b], head, head_ids)  # type: ignore[union-attr]
        parts = p.parts
        if p.owned:  # the first part is a list the plan made (a chunk walk's ids): extended,
            out = parts[0]  # not copied
            starts = [0, len(out)]  # where each part begins in out
            parts = parts[1:]
        else:
            out, starts = [], [0]
        for part in parts:
            out += results[part] if type(part) is int else part
            starts.append(len(out))
        n = len(out)
        # every part shared ints already (what is kept is, and so is what comes back as a
        # tuple from the encoder): a copy is enough, not a lookup per id
        keep = kept if all(type(r) is tuple for r in results) else self.intern
        for seg, a, b in p.whole:
            lo, hi = starts[a], starts[b]
            # a text that is one segment (a completion prompt) keeps its ids without the
            # slice: a copy less of ids that may be tens of thousands
            self._keep(seg, keep(out if lo == 0 and hi == n else out[lo:hi]))
        if p.trail:
            out += p.trail
        return out

    def _keep(self, seg: str, ids: Sequence[int]) -> None:
        whole = self._whole
        old = whole.pop(seg, None)
        if old is not None:
            self._whole_tokens -= len(old)
        if len(whole) >= self.max_segments or self._whole_tokens + len(ids) > self.max_tokens:
            # drop the oldest half (dicts keep order)
            for k in list(whole)[:max(len(whole) // 2, 1)]:
                e = whole.pop(k, None)
                if e is not None:
                    self._whole_tokens -= len(e)
        if len(ids) <= self.max_tokens:
            whole[seg] = ids
            self._whole_tokens += len(ids)
