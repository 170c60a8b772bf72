"""The builtin tokenizer's C encoder (kvwire/tokenize/_plain.c) against its Python loop.

``encode_plain(text)`` must give exactly the ids the Python loop gives (pieces as
``re.findall`` cuts them, each piece's UTF-8 bytes in pairs), raise what it raises on a
lone surrogate, and let other threads run while it scans a long text."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.tokenize import native
from kvwire.tokenize.builtin import BYTE_BASE, PAIR_BASE, BuiltinTokenizer

try:
    from kvwire.tokenize import _plain
except ImportError as e:  # the C accelerators are optional (setup.py)
    _plain = None
    NOT_BUILT = f"kvwire.tokenize._plain is not built ({e}): build_ext --inplace to test it"


@pytest.fixture(scope="module")
def c_encode() -> Callable[[str], list[int]]:
    if _plain is None:
        pytest.skip(NOT_BUILT)
    return _plain.encode_plain


_REF = BuiltinTokenizer()


def python_plain(text: str) -> list[int]:
    """The Python loop itself (the C twin switched off for the call)."""
    saved = native.encode_plain
    native.encode_plain = None
    try:
        out: list[int] = []
        _REF._encode_plain(text, out)
        return out
    finally:
        native.encode_plain = saved


def outcome(encode: Callable[[str], list[int]], text: str) -> Any:
    """The ids, or everything that tells one UnicodeEncodeError from another."""
    try:
        return encode(text)
    except UnicodeEncodeError as e:
        return ("UnicodeEncodeError", e.encoding, e.object, e.start, e.end, e.reason, str(e))


# Characters where the cut is subtle: ' ' (the only one that leads a word or punctuation
# run), other whitespace (ASCII, Latin-1, wide), '_' (a word character that is not alnum),
# Latin-1 letters, CJK, emoji (4 bytes), combining marks (\w? no: neither), digits of other
# scripts, superscripts and fractions (numeric), punctuation.
SUBTLE = (" ", " ", " ", "\t", "\n", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\u00a0", "\u2028",
          "\u3000", "a", "Z", "z", "0", "9", "_", "é", "ß", "ÿ", "\u00b2", "\u00bd", "日",
          "本", "ア", "한", "😀", "🎉", "\U00020000", "\u0301", "\u0300", "\u20dd", "\u0663",
          "\u2167", ".", ",", "!", "-", "'", '"', "(", "<", "|", "\x00", "\x7f", "\u2014",
          "\u00bf", "\ufeff", "\U0001d7ce")
texts_subtle = st.text(alphabet=st.sampled_from(SUBTLE), max_size=80)
texts_ascii = st.text(alphabet=st.sampled_from(" \t\n_aZ09.!-"), max_size=80)


@settings(max_examples=500)
@given(texts_subtle)
def test_c_equals_python_on_subtle_characters(c_encode, text: str) -> None:
    assert c_encode(text) == python_plain(text)


@settings(max_examples=300)
@given(texts_ascii)
def test_c_equals_python_on_ascii(c_encode, text: str) -> None:
    assert c_encode(text) == python_plain(text)


@settings(max_examples=500)
@given(st.text())
def test_c_equals_python_on_any_text(c_encode, text: str) -> None:
    assert c_encode(text) == python_plain(text)


@settings(max_examples=300)
@given(st.text(alphabet=st.characters(max_codepoint=0xFF)))
def test_c_equals_python_on_latin1(c_encode, text: str) -> None:
    assert c_encode(text) == python_plain(text)


def _long_text(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


@settings(max_examples=30)
@given(seed=st.integers(0, 2**32), extra=st.integers(0, 3000),
       alphabet=st.sampled_from(["".join(SUBTLE), " \t\n_aZ09.!-", " aé\u00a0\n.",
                                 " a\u3000日.", " a😀\u0301\n"]))
def test_c_equals_python_on_long_texts(c_encode, seed: int, extra: int, alphabet: str) -> None:
    """Past the length from which the scan runs without the GIL, every str kind."""
    text = _long_text(random.Random(seed), alphabet, _plain.GIL_THRESHOLD + extra)
    assert c_encode(text) == python_plain(text)


def test_boundaries_at_the_edges(c_encode) -> None:
    for text in ["", " ", "  ", " a", "a ", "  a", " !", " \t", "\t a", "a\n b", "a  b", "_",
                 " _x", "x" * 100_000, " " * 100_000, "!" * 100_000, "ab" * 50_000 + " ",
                 "é" * 20_001, "😀" * 20_001 + " x"]:
        assert c_encode(text) == python_plain(text), text[:20]


def test_threads_encoding_at_once_each_get_their_own_ids(c_encode) -> None:
    """Long texts scan without the GIL, at once in several threads, each into a buffer of its
    own: more threads than buffers kept between calls, texts under and over their size."""
    rng = random.Random(11)
    texts = [_long_text(rng, alphabet, n) for alphabet, n in
             [(" abc.\n", 20_000), (" aé\u00a0.", 50_000), (" a\u3000日.", 30_000),
              (" a😀\u0301\n", 40_000), (" xyz!", 300_000), (" 0123_", 200_000),
              (" pq\t", 90_000), (" é.", 600_000)]]
    want = [python_plain(t) for t in texts]
    start = threading.Barrier(len(texts))
    wrong: list[int] = []

    def run(k: int) -> None:
        start.wait(10)
        for _ in range(4):
            if c_encode(texts[k]) != want[k]:
                wrong.append(k)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and wrong == []


def _pairs(s: str) -> list[int]:
    """The ids of ``s`` taken as one piece."""
    b = s.encode("utf-8")
    ids = [PAIR_BASE + (b[i] << 8 | b[i + 1]) for i in range(0, len(b) - 1, 2)]
    return ids + [BYTE_BASE + b[-1]] if len(b) % 2 else ids


def test_every_code_point_is_classed_as_re_classes_it(c_encode) -> None:
    """Every code point but the surrogates: the words (``\\w``) after a space are one piece,
    the whitespace (``\\s``) after a tab one piece, the rest after '!' one piece. A code point
    the C classes otherwise cuts its run, and with one of the two starts (one byte apart) the
    cut falls inside a pair: other ids."""
    every = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    words = "".join(re.findall(r"\w", every))
    spaces = "".join(re.findall(r"\s", every))
    punct = re.sub(r"[\w\s]", "", every)
    assert len(words) + len(spaces) + len(punct) == len(every)
    assert " " in spaces and "_" in words
    for start, run in [(" ", words), (" a", words), ("\t", spaces), ("\t\t", spaces),
                       ("!", punct), ("!!", punct)]:
        assert c_encode(start + run) == _pairs(start + run), repr(start)


@settings(max_examples=300)
@given(st.text(alphabet=st.one_of(st.sampled_from(SUBTLE),
                                  st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)),
               max_size=40))
def test_lone_surrogates_raise_what_python_raises(c_encode, text: str) -> None:
    assert outcome(c_encode, text) == outcome(python_plain, text)


def test_lone_surrogate_examples(c_encode) -> None:
    for text in ["\ud800", "a \udc00b", "ok words \udfff!", "😀\ud83d", "\ud83d\ude00",
                 "x" * 50_000 + " \ud800 tail", "日" * 50_000 + "\udc80"]:
        c, py = outcome(c_encode, text), outcome(python_plain, text)
        assert c == py and c[0] == "UnicodeEncodeError", repr(text[-10:])
    tok = BuiltinTokenizer()
    with pytest.raises(UnicodeEncodeError):
        tok.encode("<s>fine \ud800")


def test_not_a_str(c_encode) -> None:
    with pytest.raises(TypeError, match="takes a str, got bytes"):
        c_encode(b"abc")

    class S(str):
        pass

    assert c_encode(S("a str subclass, é 😀")) == python_plain("a str subclass, é 😀")


@settings(max_examples=200)
@given(st.lists(st.sampled_from((*SUBTLE, "<s>", "<|im_end|>", "</think>"))).map("".join))
def test_the_tokenizer_gives_the_same_ids_either_way(c_encode, text: str) -> None:
    """Through ``encode`` (special tokens cut first): C and Python agree, and decode undoes it."""
    if native.encode_plain is None:
        pytest.skip(f"the tokenizer does not use the C encoder here: {native.REASON}")
    c = BuiltinTokenizer().encode(text)
    saved = native.encode_plain
    native.encode_plain = None
    try:
        py = BuiltinTokenizer().encode(text)
    finally:
        native.encode_plain = saved
    assert c == py
    assert BuiltinTokenizer().decode(c, skip_special_tokens=False) == text


def _other_thread_ticks_during(call: Callable[[], object]) -> int:
    """How many times another Python thread ran while ``call()`` ran. The switch interval is
    set so long that the interpreter never takes the GIL from this thread in that time, so
    the other thread can only run when ``call`` itself releases the GIL."""
    ticks = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.0001)  # lets the main thread have the GIL back at once

    old = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    thread = threading.Thread(target=spin, daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 10
        while ticks[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ticks[0], "the other thread never ran"
        before = ticks[0]
        call()
        return ticks[0] - before
    finally:
        stop.set()
        sys.setswitchinterval(old)
        thread.join(10)


def _released_in_one_of(tries: int, call: Callable[[], object]) -> bool:
    """A thread that was woken may still wait for a core on a busy host: a few tries."""
    return any(_other_thread_ticks_during(call) > 0 for _ in range(tries))


def test_the_gil_is_released_while_a_long_text_is_scanned(c_encode) -> None:
    text = "".join(" " + c for c in random.Random(7).choices("abcdefghij0123456789", k=2_000_000))
    # The harness sees a call that keeps the GIL: the Python loop, ~0.2 s on a shorter text.
    assert _other_thread_ticks_during(lambda: python_plain(text[:200_000])) == 0
    assert _released_in_one_of(5, lambda: c_encode(text))
    if native.encode_plain is not None:  # and through the tokenizer: it uses the C encoder
        assert _released_in_one_of(5, lambda: BuiltinTokenizer().encode(text))


@settings(max_examples=200)
@given(st.lists(texts_subtle, max_size=8))
def test_each_equals_python_text_by_text(c_encode, texts: list[str]) -> None:
    """``encode_plain_each`` (the tokenizer's work: many texts in one call) is
    ``encode_plain`` of each, whatever the texts."""
    assert _plain.encode_plain_each(texts) == [python_plain(t) for t in texts]
    assert _plain.encode_plain_each(tuple(texts)) == [python_plain(t) for t in texts]


def test_each_lets_go_of_the_gil_for_many_short_texts(c_encode) -> None:
    """A long prompt comes to the encoder as its chunks, each short: together they are long,
    and the GIL is let go for the one scan of them all."""
    rng = random.Random(11)
    texts = [_long_text(rng, " abc.\n", 500) for _ in range(8000)]
    assert _released_in_one_of(5, lambda: _plain.encode_plain_each(texts))
    with pytest.raises(UnicodeEncodeError):
        _plain.encode_plain_each(["fine", "bad \ud800 one", "never scanned"])
    with pytest.raises(TypeError, match="str items"):
        _plain.encode_plain_each(["fine", 3])


def test_a_short_text_keeps_the_gil(c_encode) -> None:
    """Below the threshold the scan is a few tens of microseconds: taking the GIL back could
    cost a whole switch interval, so it is not let go."""
    text = _long_text(random.Random(3), " abc.\n", _plain.GIL_THRESHOLD - 1)
    assert _other_thread_ticks_during(lambda: [c_encode(text) for _ in range(300)]) == 0


def test_kvwire_no_native_turns_it_off() -> None:
    code = ("import kvwire; from kvwire.tokenize import native; "
            "from kvwire.tokenize.builtin import BuiltinTokenizer; "
            "print(native.encode_plain is None, native.REASON, "
            "kvwire.native_status()['builtin_tokenizer'], BuiltinTokenizer().encode('hi there!'), "
            "sep='|')")
    env = {**os.environ, "KVWIRE_NO_NATIVE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out.split("|") == ["True", "KVWIRE_NO_NATIVE set", "python (KVWIRE_NO_NATIVE set)",
                              str(python_plain("hi there!"))]


def test_native_status_reports_it() -> None:
    import kvwire

    status = kvwire.native_status()["builtin_tokenizer"]
    if native.encode_plain is not None:
        assert status == "c"
    else:
        assert status == f"python ({native.REASON})"
