"""What ``kvwire engine`` "generates": real text in the tokenizer's vocabulary, deterministic.

A fixed paragraph is tokenized once. A request's output is that paragraph from a sentence
chosen by a stable hash of its prompt: the same prompt always gets the same text, different
prompts usually different text, and the token ids are ones the tokenizer gives back for
that text, so a follow-up chat turn that quotes the answer hits the cached output blocks as
it would on vLLM. Without ``ignore_eos`` the answer ends (EOS, ``finish_reason`` "stop") at
the paragraph's end; with it, the paragraph repeats until ``max_tokens``.

Each token's text is computed once (by prefix decoding), so streaming a token costs a list
lookup, never a decode.
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Sequence

__all__ = ["Output", "TextGen"]

PARAGRAPH = (
    "Cache-aware routing sends each request to the engine that already holds its prefix. "
    "An engine reports every block it stores and every block it evicts, in order, so a "
    "router can follow its cache without asking it anything. "
    "When a stream loses a message, the router replays the gap or takes a snapshot, "
    "and it never guesses. "
    "Long shared prefixes, such as system prompts and earlier turns of a chat, are where "
    "the savings come from: the prefill they would cost is skipped. "
    "A busy engine queues new work behind the running batch, and a router that counts "
    "queued tokens as well as cached ones spreads the load evenly. "
    "This answer is produced by a model of an engine: its words are fixed, and only its "
    "timing and its cache are simulated with care."
)


class Output:
    """One request's output: token ids (EOS last when it stops) and their text pieces."""

    __slots__ = ("ids", "finish_reason", "_gen", "_start", "_n_text")

    def __init__(self, gen: TextGen, start: int, n: int, stop: bool) -> None:
        self._gen = gen
        self._start = start
        L = len(gen.ids)
        if stop:
            self.ids = array("q", gen.ids[start:start + n])
            self._n_text = len(self.ids)
            if gen.eos is not None:
                self.ids.append(gen.eos)
            self.finish_reason = "stop"
        else:
            reps = gen.ids * (1 + (start + n) // L)
            self.ids = array("q", reps[start:start + n])
            self._n_text = n
            self.finish_reason = "length"

    def text(self, k0: int, k1: int) -> str:
        """The text of output tokens ``k0:k1`` (EOS has none)."""
        pieces = self._gen.pieces
        L = len(pieces)
        s = self._start
        return "".join([pieces[(s + k) % L] for k in range(k0, min(k1, self._n_text))])


class TextGen:
    """The paragraph's token ids and per-token text under one tokenizer."""

    def __init__(self, tokenizer, paragraph: str = PARAGRAPH) -> None:
        sentences = [s.strip() + "." for s in paragraph.split(". ") if s.strip()]
        sentences[-1] = sentences[-1].rstrip(".") + "."
        ids: list[int] = []
        starts: list[int] = []
        for s in sentences:
            starts.append(len(ids))
            ids += tokenizer.encode((" " if ids else "") + s, add_special_tokens=False)
        if not ids:
            raise ValueError("the tokenizer gave no tokens for the output paragraph")
        self.ids = ids
        self.starts = starts
        self.eos: int | None = getattr(tokenizer, "eos_token_id", None)
        pieces = []
        prev = ""
        for k in range(len(ids)):
            cur = tokenizer.decode(ids[:k + 1])
            pieces.append(cur[len(prev):])
            prev = cur
        self.pieces = pieces

    def output(self, prompt: Sequence[int], max_tokens: int, ignore_eos: bool) -> Output:
        """The output for ``prompt``: at most ``max_tokens`` tokens."""
        raw = prompt.tobytes() if isinstance(prompt, array) else array("q", prompt).tobytes()
        start = self.starts[zlib.crc32(raw) % len(self.starts)]
        left = len(self.ids) - start  # text tokens before the paragraph's end
        if ignore_eos or max_tokens <= left:
            return Output(self, start, max_tokens, stop=False)
        return Output(self, start, left, stop=True)  # left tokens + EOS <= max_tokens
