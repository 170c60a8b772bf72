"""A byte-level BPE ``tokenizer.json`` (Qwen2/Qwen3's, Llama 3's pipeline) encoded by kvwire's
own C code (``_bpe.c``) when the text is ASCII: the ids ``tokenizers`` gives, for a fraction
of its CPU. A router tokenizes every new prompt on the cores its engines also need, and the
library's general machinery (a regex engine, offsets, per-call setup) is most of that cost.

Only a pipeline whose every step is known on ASCII is taken: an NFC normalizer (or none), a
Split of one of the pre-tokenizer patterns below, behaviour Isolated, then ByteLevel without
its own regex or prefix space, and a BPE model with no dropout and no word prefix or suffix
(``ignore_merges`` on or off). Any other pipeline, any text that is not
ASCII, and a build without the C extension keep ``tokenizers``; :func:`byte_bpe` says why."""

from __future__ import annotations

import json
import os
import re
from typing import Any

__all__ = ["GIL_CHARS", "SPLITS", "ByteBPE", "ascii_runs", "byte_bpe", "byte_level_alphabet",
           "untrack"]


def _as_is(ids: tuple[int, ...]) -> tuple[int, ...]:
    return ids


#: Work of at most this many characters is encoded with the GIL held (_bpe.c says why).
GIL_CHARS = 16384
#: ``untrack(t) -> t``: a tuple of ids kept for long (the chunks and segments a tokenizer
#: keeps) out of the cyclic collector's sight, as it would be after its first collection;
#: until then every young collection walks each id of it (_bpe.c). As is without C.
untrack = _as_is
try:
    from kvwire.tokenize._bpe import GIL_CHARS, ByteBPE
    from kvwire.tokenize._bpe import untrack as _untrack
    REASON = "KVWIRE_NO_NATIVE set" if os.environ.get("KVWIRE_NO_NATIVE") else ""
    if not REASON:
        untrack = _untrack
except ImportError as e:  # not built
    ByteBPE = None
    REASON = f"not built ({e})"

#: Split patterns the C scanner implements -> how many digits a number piece takes.
SPLITS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": 1,
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": 3,
}


def byte_level_alphabet() -> dict[str, int]:
    """The ByteLevel pre-tokenizer's character for each byte -> that byte (GPT-2's table:
    printable Latin-1 bytes stand for themselves, the others for 256 + their order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    out = {chr(b): b for b in kept}
    n = 0
    for b in range(256):
        if b not in out.values():
            out[chr(256 + n)] = b
            n += 1
    return out


def pipeline_digits(tokenizer: Any) -> tuple[int | None, str]:
    """How many digits a number piece takes in a ``tokenizers.Tokenizer`` whose normalizer
    and pre-tokenizer are the ones named in the module docstring; else None and why not."""
    norm = tokenizer.normalizer
    if norm is not None and json.loads(norm.__getstate__()).get("type") != "NFC":
        return None, f"normalizer {type(norm).__name__} is not NFC"
    pre = tokenizer.pre_tokenizer
    state = json.loads(pre.__getstate__()) if pre is not None else {}
    steps = state.get("pretokenizers") if state.get("type") == "Sequence" else [state]
    if not (isinstance(steps, list) and len(steps) == 2):
        return None, f"pre-tokenizer {state.get('type')!r} is not a known split + byte level"
    split, byte_level = steps
    pattern = (split.get("pattern") or {}).get("Regex")
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" \
            or split.get("invert") or pattern not in SPLITS:
        return None, "pre-tokenizer split pattern is not a known one"
    if byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex") \
            or byte_level.get("add_prefix_space"):
        return None, "pre-tokenizer's byte-level step splits or adds a prefix space"
    return SPLITS[pattern], ""


def byte_bpe(tokenizer: Any, table: tuple[int, ...]) -> tuple[Any, str]:
    """A ``ByteBPE`` for a ``tokenizers.Tokenizer`` (its ids returned as ``table``'s int
    objects), or None and why not (module docstring)."""
    if ByteBPE is None or REASON:
        return None, f"C byte-level BPE {REASON}"
    digits, why = pipeline_digits(tokenizer)
    if digits is None:
        return None, why
    if type(tokenizer.model).__name__ != "BPE":
        return None, f"model {type(tokenizer.model).__name__} is not BPE"
    model = json.loads(tokenizer.model.__getstate__())
    if model.get("dropout") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix"):
        return None, "BPE model has dropout or a word prefix or suffix"
    vocab: dict[str, int] = model.get("vocab") or {}
    alphabet = byte_level_alphabet()
    whole = None
    if model.get("ignore_merges"):  # (a piece that is a token is that token)
        whole = []
        for token, i in vocab.items():
            try:
                whole.append((bytes(alphabet[c] for c in token), i))
            except KeyError:  # (a character no byte maps to: never a piece)
                continue
    try:
        byte_ids = [vocab[c] for c, _ in sorted(alphabet.items(), key=lambda cb: cb[1])]
        merges = []
        for m in model.get("merges") or ():
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            merges.append((vocab[a], vocab[b], vocab[a + b]))
    except KeyError as e:
        return None, f"BPE vocabulary lacks {e.args[0]!r} (a byte or a merge's part)"
    except (TypeError, ValueError):
        return None, "BPE merges are not pairs of tokens"
    return ByteBPE(byte_ids, merges, digits, table, whole), ""


_NON_ASCII = re.compile(r"[^\x00-\x7f]+")
#: How far before a non-ASCII character a cut is looked for: the library takes at most this
#: much ASCII text around it that the C encoder could have taken.
_LOOK_BACK = 256


def ascii_runs(text: str, cuts: re.Pattern[str]) -> list[tuple[str, bool]]:
    """``text`` as runs ``(run, is_ascii)`` that join back to it, cut only at ``cuts``
    (prefix.py's rule: the ids of the runs, each encoded alone, are the ids of the whole), so
    that prose with a few non-ASCII characters (a curly quote, an accented name) has most
    of its text encoded by the C encoder and only the words around them by the library. A
    text mostly not ASCII is one run: finding cuts would cost more than it saves."""
    spans = [m.span() for m in _NON_ASCII.finditer(text)]
    if not spans or 4 * sum(b - a for a, b in spans) > len(text):
        return [(text, not spans)]
    lib: list[list[int]] = []  # [start, end) of the runs left to the library, at cuts
    for a, b in spans:
        if lib and a < lib[-1][1]:
            continue  # (inside the last run, which ends at a cut past its own characters)
        start = lib[-1][1] if lib else 0
        for m in cuts.finditer(text, max(start, a - _LOOK_BACK), a):
            start = m.start()
        m = cuts.search(text, b)
        end = m.start() if m is not None else len(text)
        if lib and start <= lib[-1][1]:
            lib[-1][1] = end
        else:
            lib.append([start, end])
    out: list[tuple[str, bool]] = []
    pos = 0
    for start, end in lib:
        if start > pos:
            out.append((text[pos:start], True))
        out.append((text[start:end], False))
        pos = end
    if pos < len(text):
        out.append((text[pos:], True))
    return out
