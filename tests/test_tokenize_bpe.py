"""kvwire's C encoder of byte-level BPE tokenizer.json pipelines on ASCII text (tokenize/bpe.py,
_bpe.c) gives exactly the ids ``tokenizers`` gives: for Qwen3's real tokenizer.json, the same
file with Llama 3's split pattern (numbers of up to three digits), and Llama 3's pipeline
(ignore_merges); texts drawn by hypothesis over every ASCII character and the pieces the
pattern treats apart, long runs that merge deep, more distinct words than its word table
holds, and two threads at once. An HFTokenizer uses it for ASCII work and the library for
the rest, and says why when a pipeline is not one it takes."""

from __future__ import annotations

import gc
import json
import os
import string
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tokenize_prefix import LLAMA3_SPLIT, llama3, qwen3  # noqa: F401 (fixtures)

from kvwire.tokenize import load_tokenizer
from kvwire.tokenize.bpe import ByteBPE, ascii_runs, byte_bpe, byte_level_alphabet
from kvwire.tokenize.prefix import hf_cuts
from kvwire.tokenize.segments import Plan

pytestmark = pytest.mark.skipif(ByteBPE is None, reason="kvwire.tokenize._bpe is not built")

# What the split pattern tells apart: contractions in any case, letters after a space or a
# punctuation mark, digit runs, punctuation runs with and without a space and newlines after
# them, runs of every kind of whitespace with and without newlines, and every ASCII byte.
ASCII_ATOMS = ["'s", "'S", "'t", "'re", "'RE", "'Ve", "'m", "'ll", "'lL", "'d", "'x", "'",
               "a", "Zq", "word", " the", " cache", "(x", "\tx", "0", "12", "123", "4567",
               ".", "!?", " ...", "--\n", ");\r\n", " ", "  ", "   ", "\n", "\n\n", "\r\n",
               " \n ", "\t", "\x0b", "\x0c", "\r", "\x00", "\x1f", "\x7f", "_", "~"]
ascii_texts = st.lists(st.sampled_from(ASCII_ATOMS)
                       | st.text(alphabet=[chr(i) for i in range(128)], max_size=4),
                       max_size=50).map("".join)


def _qwen3_with_llama3_split(src: Path, tmp_path_factory: Any) -> Path:
    d = tmp_path_factory.mktemp("qwen3_digits3")
    data = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = LLAMA3_SPLIT
    (d / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    return d


_LIBS: dict[str, Any] = {}


def _pipeline(name: str, request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """(tokenizers.Tokenizer, ByteBPE) for a pipeline, loaded once."""
    if name not in _LIBS:
        from tokenizers import Tokenizer as Fast
        if name == "qwen3":
            lib = Fast.from_file(str(request.getfixturevalue("qwen3") / "tokenizer.json"))
        elif name == "qwen3-digits3":
            d = _qwen3_with_llama3_split(request.getfixturevalue("qwen3"),
                                         request.getfixturevalue("tmp_path_factory"))
            lib = Fast.from_file(str(d / "tokenizer.json"))
        else:
            lib = request.getfixturevalue("llama3")
        table = tuple(range(lib.get_vocab_size(with_added_tokens=True)))
        bpe, why = byte_bpe(lib, table)
        assert bpe is not None, why
        _LIBS[name] = (lib, bpe)
    return _LIBS[name]


PIPELINES = ["qwen3", "qwen3-digits3", "llama3"]


@settings(max_examples=500, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@pytest.mark.parametrize("pipeline", PIPELINES)
@given(texts=st.lists(ascii_texts, min_size=1, max_size=4))
def test_ids_equal_the_library(pipeline: str, request: pytest.FixtureRequest,
                               texts: list[str]) -> None:
    """Each text's ids, encoded together in one call, are what tokenizers gives for it."""
    lib, bpe = _pipeline(pipeline, request)
    want = [e.ids for e in lib.encode_batch(texts, add_special_tokens=False)]
    assert [list(ids) for ids in bpe.encode(texts)] == want


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_long_runs_and_prose_equal_the_library(pipeline: str,
                                               request: pytest.FixtureRequest) -> None:
    """Pieces far longer than a word (a heap of merges, not the word table) and a long
    prompt: also past the size where the GIL is let go."""
    lib, bpe = _pipeline(pipeline, request)
    texts = ["a" * 5000, "ab" * 3000, " " * 4000 + "x", "\n" * 3000, "=" * 6000 + "\n\n",
             "1234567890" * 500, "Hello" * 2000, "'s" * 1000,
             " ".join(f"The router's engine {i} took {i * 37} tokens; it'll send it."
                      for i in range(3000))]
    want = [e.ids for e in lib.encode_batch(texts, add_special_tokens=False)]
    assert [list(ids) for ids in bpe.encode(texts)] == want


def test_more_words_than_the_word_table_holds(request: pytest.FixtureRequest) -> None:
    """Over 100k distinct words (the table keeps 49k before it starts again), each seen
    twice: the same ids as the library, the second time from the table."""
    lib, bpe = _pipeline("qwen3", request)
    letters = string.ascii_lowercase
    words = [letters[i % 26] + letters[i // 26 % 26] + letters[i // 676 % 26] + "q"
             + letters[i // 17576 % 26] for i in range(110_000)]
    texts = [" ".join(words[i:i + 5000]) for i in range(0, len(words), 5000)]
    want = [e.ids for e in lib.encode_batch(texts, add_special_tokens=False)]
    assert [list(ids) for ids in bpe.encode(texts)] == want
    assert [list(ids) for ids in bpe.encode(texts)] == want


def test_two_threads_at_once(request: pytest.FixtureRequest) -> None:
    """Two threads encoding long texts at the same time (one of them without the word
    table, which the other holds) both get the library's ids."""
    lib, bpe = _pipeline("qwen3", request)
    texts = [" ".join(f"w{t}x{i % 701} said {i}" for i in range(20_000)) for t in range(2)]
    want = [e.ids for e in lib.encode_batch(texts, add_special_tokens=False)]
    got: dict[int, list[list[int]]] = {}
    barrier = threading.Barrier(2)

    def run(t: int) -> None:
        barrier.wait()
        got[t] = [list(bpe.encode([texts[t]])[0]) for _ in range(5)]

    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert got[0] == [want[0]] * 5 and got[1] == [want[1]] * 5


def test_ids_are_the_tables_int_objects(request: pytest.FixtureRequest) -> None:
    """The ids come back as tuples of the table's own int objects (what prefix.py's interner
    keeps), not new ones."""
    lib, _ = _pipeline("qwen3", request)
    table = tuple(range(lib.get_vocab_size(with_added_tokens=True)))
    bpe, _ = byte_bpe(lib, table)
    (ids,) = bpe.encode(["A long prompt of 12345 words, and more."])
    assert type(ids) is tuple and ids and all(i is table[i] for i in ids)


def test_bad_input_is_refused_clearly(request: pytest.FixtureRequest) -> None:
    _, bpe = _pipeline("qwen3", request)
    with pytest.raises(ValueError, match="ASCII"):
        bpe.encode(["caf\u00e9"])
    with pytest.raises(TypeError, match="str"):
        bpe.encode([b"bytes"])
    with pytest.raises(ValueError, match="256"):
        ByteBPE([0] * 10, [], 1, ())
    assert bpe.encode([]) == [] and bpe.encode([""]) == [()]


def test_hf_tokenizer_uses_it_for_ascii_work_only(request: pytest.FixtureRequest) -> None:
    """A plan whose work mixes ASCII and other text: the ASCII items come from the C encoder
    (tuples of the shared ints), the others from the library; the joined ids are the
    library's on the whole text."""
    from tokenizers import Tokenizer as Fast
    d = request.getfixturevalue("qwen3")
    tok = load_tokenizer(d)
    assert tok.bpe is not None and tok.bpe_reason == ""
    lib = Fast.from_file(str(d / "tokenizer.json"))
    text = ("<|im_start|>user\nplain words here<|im_end|>\n<|im_start|>assistant\n"
            "caf\u00e9 \u6771\u4eac and more<|im_end|>\n<|im_start|>user\nback to ASCII")
    plan = tok.plan(text)
    assert [w.isascii() for w in plan.work] == [True, True, False, True, True]
    results = tok.run(plan)
    shared = tok.segments.intern(list(range(tok.vocab_size)))
    for w, r in zip(plan.work, results):
        if w.isascii():
            assert type(r) is tuple and all(i is shared[i] for i in r)
    assert tok.finish(plan, results) == lib.encode(text, add_special_tokens=False).ids


MIXED_ATOMS = [*ASCII_ATOMS, " word", "Zurich ", "\u201cquoted\u201d", "it\u2019s", "caf\u00e9",
               "e\u0301", "\u0301", "\u212b", "\u6771\u4eac", "\U0001f642", "\u00a0", "\u3000",
               " \u00fcber", "\u2014", "\u2026\n"]
mixed_texts = st.lists(st.sampled_from(MIXED_ATOMS), max_size=80).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(texts=st.lists(mixed_texts, min_size=1, max_size=4))
def test_text_mixing_ascii_and_not_equals_the_library(request: pytest.FixtureRequest,
                                                      texts: list[str]) -> None:
    """Work that mixes ASCII and other text: cut into runs at the tokenizer's cuts (joined,
    they are the text; every boundary a cut), the ASCII ones encoded in C, the others by the
    library: the ids are the library's for each whole text."""
    d = request.getfixturevalue("qwen3")
    tok = _hf(d)
    lib = _pipeline("qwen3", request)[0]
    cuts, _ = hf_cuts(lib)
    for t in texts:
        runs = ascii_runs(t, cuts)
        assert "".join(r for r, _ in runs) == t
        pos = 0
        for r, _ in runs[:-1]:
            pos += len(r)
            assert cuts.match(t, pos) is not None, (t, pos)
        assert all(r.isascii() for r, a in runs if a)
    plan = Plan()
    for t in texts:
        plan.add_work(t)
    want = [e.ids for e in lib.encode_batch(texts, add_special_tokens=False)]
    assert [list(ids) for ids in tok.run(plan)] == want


def test_prose_with_a_few_non_ascii_characters_is_mostly_encoded_in_c(
        request: pytest.FixtureRequest) -> None:
    """A curly quote or an accented word in English prose leaves the library only the
    words around it."""
    lib = _pipeline("qwen3", request)[0]
    cuts, _ = hf_cuts(lib)
    text = " ".join(f"The engine\u2019s answer {i} was \u201cfine\u201d, said Jos\u00e9 at "
                    f"the caf\u00e9." if i % 10 == 0 else f"The router sent request {i} on."
                    for i in range(400))
    runs = ascii_runs(text, cuts)
    assert sum(len(r) for r, a in runs if a) > 0.8 * len(text)
    assert sum(len(r) for r, a in runs if not a) < 0.2 * len(text)
    cjk = "\u6771\u4eac\u306e\u5929\u6c17 " * 100 + "a few ASCII words"
    assert ascii_runs(cjk, cuts) == [(cjk, False)]  # (mostly not ASCII: one run)


_TOKS: dict[Path, Any] = {}


def _hf(d: Path) -> Any:
    if d not in _TOKS:
        _TOKS[d] = load_tokenizer(d)
    return _TOKS[d]


def test_pipelines_it_does_not_take_say_why(tmp_path: Path,
                                            request: pytest.FixtureRequest) -> None:
    """Another normalizer, GPT-2's split, a BPE with dropout: no C encoder, a reason, and
    the library's ids still."""
    from tokenizers import Tokenizer as Fast
    src = request.getfixturevalue("qwen3")
    base = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    cases = {
        "lowercase": (lambda d: d.update(normalizer={"type": "Lowercase"}), "normalizer"),
        "gpt2": (lambda d: d["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(
            Regex=r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"),
            "split pattern"),
        "dropout": (lambda d: d["model"].update(dropout=0.5), "dropout"),
    }
    for name, (change, why) in cases.items():
        d = tmp_path / name
        d.mkdir()
        data = json.loads(json.dumps(base))
        change(data)
        (d / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
        lib = Fast.from_file(str(d / "tokenizer.json"))
        bpe, reason = byte_bpe(lib, ())
        assert bpe is None and why in reason, (name, reason)
        tok = load_tokenizer(d)
        assert tok.bpe is None and why in tok.bpe_reason
        if name != "dropout":  # (dropout draws merges at random)
            text = "Some TEXT, it's 2026!\n  done"
            assert tok.encode(text) == lib.encode(text, add_special_tokens=False).ids


def test_byte_level_alphabet_is_the_librarys() -> None:
    """Our byte -> character table maps text's UTF-8 bytes as tokenizers' ByteLevel does."""
    pytest.importorskip("tokenizers")
    from tokenizers.pre_tokenizers import ByteLevel
    ours = byte_level_alphabet()
    assert sorted(ours.values()) == list(range(256))
    assert sorted(ours) == sorted(ByteLevel.alphabet())
    inv = {b: c for c, b in ours.items()}
    sample = "".join(map(chr, range(0x800))) + "\u4e00\uffff\U0001f642\U0010ffff"
    pre = ByteLevel(add_prefix_space=False, use_regex=False)
    assert pre.pre_tokenize_str(sample)[0][0] == "".join(inv[b] for b in sample.encode())


def test_no_native_keeps_the_library() -> None:
    """KVWIRE_NO_NATIVE: no C encoder, and the reason says so."""
    out = subprocess.run(
        [sys.executable, "-c", "from kvwire.tokenize import bpe; print(bpe.REASON)"],
        env={**os.environ, "KVWIRE_NO_NATIVE": "1"}, capture_output=True, text=True,
        timeout=60, check=True)
    assert "KVWIRE_NO_NATIVE" in out.stdout


def _tracked_id_tuples() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is tuple and len(o) >= 64)


@pytest.mark.skipif(bool(os.environ.get("KVWIRE_NO_NATIVE")), reason="KVWIRE_NO_NATIVE set")
@pytest.mark.parametrize("which", ["qwen3", "builtin"])
def test_kept_ids_are_out_of_the_cyclic_collectors_sight(which: str,
                                                        request: pytest.FixtureRequest) -> None:
    """The ids a tokenizer keeps (its chunks and whole segments: millions in a router) are
    tuples of ints, which hold no references, so they are kept untracked by the cyclic
    collector from the start, as it would leave them after its first look: until then every
    young collection walked each id of every tuple made since the last one (30-50 ms pauses
    on the router's loop). Whatever path made them: the C encoder, the library's ids
    interned (a text that is not ASCII), the builtin tokenizer's."""
    tok = load_tokenizer(str(request.getfixturevalue("qwen3")) if which == "qwen3" else None)
    words = [f"w{i:x}q" for i in range(4000)]
    before = _tracked_id_tuples()
    for k in range(3):
        text = " ".join(words[k * 1000:(k + 1) * 1000]) + " café " + " ".join(words[-500:])
        tok.encode(text)
        tok.encode(text + " and more")  # (its chunks and tail, found again)
    assert _tracked_id_tuples() <= before, (before, _tracked_id_tuples())
    if which == "qwen3":
        assert not any(gc.is_tracked(t) for t in tok.bpe.encode(["some ascii text " * 20]))
