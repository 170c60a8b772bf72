"""Tokenizing what is new only (tokenize/prefix.py, segments.py) gives exactly the ids of
tokenizing the whole text in one go: the cut rules on their own (the builtin tokenizer's, and
the byte-level one for every split pattern taken as proven: Qwen3's real tokenizer.json,
Llama 3's pipeline), the chunk store across texts that extend, fork and repeat each other,
and chats that grow turn by turn, sent through the proxy's chat encoding, under every
vendored chat template."""

from __future__ import annotations

import asyncio
import json
import lzma
import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tokenize import _vllm_chatml

from kvwire.tokenize import BuiltinTokenizer, load_tokenizer
from kvwire.tokenize.prefix import BUILTIN_CUTS, PrefixStore, hf_cuts
from kvwire.tokenize.segments import Segments

DATA = Path(__file__).resolve().parent / "data" / "tokenize"

# Pieces chosen to sit on every side of a cut: word characters of several kinds, each kind of
# space, newlines, punctuation runs, contractions, digits, marks that NFC composes (and a
# letter that NFC replaces), CJK, emoji, and the special tokens both tokenizers know.
ATOMS = ["a", "Z", "x", "word", "_", "9", "123", " ", "  ", "\n", "\n\n", "\r\n", "\t", " \n",
         ".", "!?", "'s", "'ll", "'", "é", "e\u0301", "\u0301", "\u212b", "東京", "ß", "🙂",
         "\u00a0", "\u3000", "(", "-", " the", " cache", "\nfoo", "bar\n",
         "<|im_start|>", "<|im_end|>", "<s>"]
texts = st.lists(st.sampled_from(ATOMS) | st.text(max_size=3), max_size=60).map("".join)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Qwen3's tokenizer directory, decompressed from the vendored .xz."""
    pytest.importorskip("tokenizers", reason="the `tokenizers` package (kvwire[tokenize])")
    d = tmp_path_factory.mktemp("qwen3")
    (d / "tokenizer.json").write_bytes(
        lzma.decompress((DATA / "qwen3" / "tokenizer.json.xz").read_bytes()))
    (d / "tokenizer_config.json").write_bytes((DATA / "qwen3" / "tokenizer_config.json")
                                              .read_bytes())
    return d


def _builtin_whole(text: str) -> list[int]:
    """The builtin tokenizer with no chunk store: each segment tokenized whole."""
    tok = BuiltinTokenizer()
    tok.segments.store = None
    return tok.encode(text)


def _small_chunks(tok: Any, chunk: int) -> Any:
    """``tok`` with empty caches and chunks of ``chunk`` characters, so that short texts
    have many cuts."""
    old = tok.segments
    tok.segments = Segments(old.splitter, old.special,
                            PrefixStore(old.store._find.__self__, chunk_chars=chunk))
    return tok


_HF: dict[Path, Any] = {}


def _hf(d: Path) -> Any:
    """One loaded HFTokenizer per directory (loading Qwen3's takes a second)."""
    if d not in _HF:
        _HF[d] = load_tokenizer(d)
    return _HF[d]


def _cut_points(pattern: re.Pattern[str], text: str) -> list[int]:
    return [m.start() for m in pattern.finditer(text)]


@settings(max_examples=400, deadline=None)
@given(texts)
def test_builtin_cut_rule_splits_exactly(text: str) -> None:
    """Every cut the rule finds: the ids of the two sides are the ids of the whole."""
    tok = BuiltinTokenizer()
    plain = tok.segments.special  # the rule holds within a segment: no special tokens
    text = re.sub("|".join(map(re.escape, plain)), "", text)
    whole = _builtin_whole(text)
    for c in _cut_points(BUILTIN_CUTS, text):
        assert _builtin_whole(text[:c]) + _builtin_whole(text[c:]) == whole, (text, c)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(texts, min_size=1, max_size=6), st.integers(1, 12), st.data())
def test_builtin_store_equals_whole(parts: list[str], chunk: int, data: Any) -> None:
    """Texts that extend, fork from and repeat each other, tokenized through one store with
    small chunks: each one's ids are the ids of tokenizing it whole."""
    tok = _small_chunks(BuiltinTokenizer(), chunk)
    seen: list[str] = []
    for p in parts:
        base = data.draw(st.sampled_from(seen)) if seen else ""
        cut = data.draw(st.integers(0, len(base)))
        text = base[:cut] + p if data.draw(st.booleans()) else base + p
        assert tok.encode(text) == _builtin_whole(text), text
        assert tok.encode(text, add_special_tokens=True) == \
            [tok.bos_token_id] + _builtin_whole(text)
        seen.append(text)


def test_builtin_long_extension_reuses_chunks() -> None:
    """A prompt that extends one seen before at a cut is planned as its stored chunks and
    tail plus the new part: the work is the new part, whatever the prompt's length; and so on
    for the next one. Extended past a point that is no cut, the tail is tokenized again."""
    tok = BuiltinTokenizer()
    store = tok.segments.store
    base = " ".join(f"w{i % 97}x" for i in range(20_000))
    tok.encode(base)
    for new in (" and a new question at the end", " then another", " and " * 300 + "more"):
        text = base + new
        plan = tok.plan(text)
        assert plan.work and "".join(plan.work) == new, plan.work[:3]
        assert tok.finish(plan, tok.run(plan)) == _builtin_whole(text)
        base = text
    assert store.hits >= len(base) // store.chunk_chars - 2
    text = base + "s, glued to the last word"  # its last word goes on: no cut before "s"
    plan = tok.plan(text)
    assert plan.chars > len("s, glued to the last word")
    assert tok.finish(plan, tok.run(plan)) == _builtin_whole(text)


#: Llama 3's pre-tokenizer split pattern, as Meta's tokenizer.json gives it (not vendored: the
#: pipeline is rebuilt around it below).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.fixture(scope="module")
def llama3() -> Any:
    """Llama 3's pipeline: no normalizer, its split pattern then byte level without a regex,
    a byte-level BPE (``ignore_merges``, as Llama 3's); the BPE is a small one trained here
    on the test texts' atoms and prose, since the pattern decides the cuts, not the merges."""
    pytest.importorskip("tokenizers", reason="the `tokenizers` package (kvwire[tokenize])")
    from tokenizers import Regex, Tokenizer, pre_tokenizers, trainers
    from tokenizers.models import BPE

    t = Tokenizer(BPE())
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    corpus = ["".join(ATOMS[i:] + ATOMS[:i]) for i in range(len(ATOMS))] + [
        "The cache router's engine took 12,345 tokens; it'll send the prefix.\n" * 3,
        "  Zürich\n\n東京 🙂 \tWORDS words 2026-12-02 don't\r\n"]
    t.train_from_iterator(corpus * 4, trainers.BpeTrainer(
        vocab_size=1200, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.model.ignore_merges = True
    assert len(t.get_vocab()) > 256 + 100, "the BPE learned few merges"
    return t


@settings(max_examples=300, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture])
@pytest.mark.parametrize("pipeline", ["qwen3", "llama3"])
@given(text=texts)
def test_hf_cut_rule_splits_exactly(pipeline: str, request: pytest.FixtureRequest,
                                    text: str) -> None:
    """The ASCII cut rule against tokenizers' own encode of the whole text, for every split
    pattern whose cuts prefix.py takes as proven: Qwen3's (its real tokenizer.json: NFC
    normalizer, Qwen2's pattern, byte-level BPE) and Llama 3's (its pipeline, a BPE trained
    here)."""
    if pipeline == "qwen3":
        from tokenizers import Tokenizer as Fast
        fast = _fast(request.getfixturevalue("qwen3"), Fast)
    else:
        fast = request.getfixturevalue("llama3")
    cuts, why = hf_cuts(fast)
    assert cuts is not None, why
    added = [t.content for t in fast.get_added_tokens_decoder().values()]
    text = re.sub("|".join(map(re.escape, added)), "", text)
    whole = fast.encode(text, add_special_tokens=False).ids
    for c in _cut_points(cuts, text):
        left = fast.encode(text[:c], add_special_tokens=False).ids
        right = fast.encode(text[c:], add_special_tokens=False).ids
        assert left + right == whole, (text, c)


_FAST: dict[Path, Any] = {}


def _fast(d: Path, cls: Any) -> Any:
    if d not in _FAST:
        _FAST[d] = cls.from_file(str(d / "tokenizer.json"))
    return _FAST[d]


@settings(max_examples=200, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(texts, min_size=1, max_size=6), st.integers(1, 12), st.booleans(), st.data())
def test_qwen3_store_equals_whole(qwen3: Path, parts: list[str], chunk: int, batch: bool,
                                  data: Any) -> None:
    """As for the builtin tokenizer: extending, forking and repeated texts through one
    store with small chunks, each against tokenizers' encode of the whole text; the work
    encoded one text at a time (short: on the router's loop) or as one batch (long: a
    worker's)."""
    from tokenizers import Tokenizer as Fast
    fast = _fast(qwen3, Fast)
    tok = _small_chunks(_hf(qwen3), chunk)
    tok.inline_chars = 0 if batch else 1 << 30
    tok.spread_chars = data.draw(st.sampled_from([0, 1 << 30]), label="spread")
    seen: list[str] = []
    for p in parts:
        base = data.draw(st.sampled_from(seen)) if seen else ""
        cut = data.draw(st.integers(0, len(base)))
        text = base[:cut] + p if data.draw(st.booleans()) else base + p
        assert tok.encode(text) == fast.encode(text, add_special_tokens=False).ids, text
        assert tok.encode(text, add_special_tokens=True) == \
            fast.encode(text, add_special_tokens=True).ids, text
        seen.append(text)


TEMPLATES = ["qwen3", "deepseek_v3", "mistral_v7"]


@pytest.mark.parametrize("template", ["builtin", *TEMPLATES])
def test_growing_chats_equal_whole_text(template: str, qwen3: Path, tmp_path: Path) -> None:
    """A conversation sent again with each new turn, and a long single message that grows
    (an agent's context), under each vendored chat template: the router's ids (store,
    small chunks) equal a fresh tokenizer's whole-text ids, request after request."""
    if template == "builtin":
        tok = BuiltinTokenizer()
        fresh = _builtin_whole
    else:
        d = tmp_path / template
        d.mkdir()
        os.symlink(qwen3 / "tokenizer.json", d / "tokenizer.json")
        for f in (DATA / template).iterdir():
            if f.name != "tokenizer.json.xz":
                (d / f.name).write_bytes(f.read_bytes())
        tok = load_tokenizer(d)
        fast = tok._tok  # with the template's special tokens added, as the router has them

        def fresh(text: str) -> list[int]:
            return fast.encode(text, add_special_tokens=False).ids
    _small_chunks(tok, 64)
    words = ("the cache router's engine prefix block, token stream; event latency\n"
             "request model 12 prompt reply user system tool answer Zürich 東京 🙂").split(" ")
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse.\n"}]
    context = ""
    for turn in range(12):
        said = " ".join(words[(turn * 7 + i) % len(words)] for i in range(40 + turn * 9))
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": said})
        context += said + "\n"
        for chat in (messages if messages[-1]["role"] == "user" else messages[:-1],
                     [{"role": "user", "content": context}]):
            text = tok.render_chat(chat, add_generation_prompt=True)
            assert tok.encode(text) == fresh(text), (template, turn)
    assert tok.segments.store.hits > 0, "no chunk was ever reused"


@pytest.mark.parametrize("single", ["<|endoftext|> $A", "$A <|im_end|>", "<|im_start|> $A <|im_end|>"])
def test_post_processor_ids_go_around_the_store(qwen3: Path, tmp_path: Path,
                                                single: str) -> None:
    """A post-processor that adds a BOS (or an EOS) to a text encoded with special tokens:
    the router still tokenizes only the new part, and the ids are tokenizers' own."""
    from tokenizers import Tokenizer as Fast
    from tokenizers.processors import TemplateProcessing
    fast = Fast.from_file(str(qwen3 / "tokenizer.json"))
    names = [t for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>") if t in single]
    fast.post_processor = TemplateProcessing(
        single=single, special_tokens=[(t, fast.token_to_id(t)) for t in names])
    d = tmp_path / "bos"
    d.mkdir()
    fast.save(str(d / "tokenizer.json"))
    tok = _small_chunks(load_tokenizer(d), 16)
    base = "The cache router sends each prompt where its prefix is.\n" * 20
    for text in (base, base + "And one more line", base[:300] + " forked here"):
        assert tok.encode(text, add_special_tokens=True) == \
            fast.encode(text, add_special_tokens=True).ids
    plan = tok.plan(base + "And a new end", add_special_tokens=True)
    assert not plan.special and plan.chars < 100


def test_pipelines_without_proven_cuts_keep_whole_segments(tmp_path: Path) -> None:
    """A tokenizer whose pre-tokenizer is not one whose cuts are proven gets no chunk store,
    and says why (the router says it once at start)."""
    pytest.importorskip("tokenizers", reason="the `tokenizers` package (kvwire[tokenize])")
    from tokenizers import Tokenizer as Fast
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel
    t = Fast(BPE())
    t.pre_tokenizer = ByteLevel(add_prefix_space=False)  # GPT-2's regex: not proven
    d = tmp_path / "gpt2ish"
    d.mkdir()
    t.save(str(d / "tokenizer.json"))
    tok = load_tokenizer(d)
    assert tok.segments.store is None
    assert "split" in tok.prefix_reason or "pre-tokenizer" in tok.prefix_reason
    assert hf_cuts(t)[0] is None


def test_store_is_bounded_and_never_serves_a_collision() -> None:
    """The store keeps at most its token bound, dropping the oldest chunks first, and a
    chunk whose key matches but whose text or chain does not is a miss."""
    store = PrefixStore(BUILTIN_CUTS, chunk_chars=4, max_tokens=100)
    seg = Segments(None, {}, store)
    tok = BuiltinTokenizer()
    tok.segments = seg
    for i in range(200):
        text = f"doc{i} " + " ".join(f"w{i}x{j}" for j in range(30))
        assert tok.encode(text) == _builtin_whole(text)
        assert store.tokens <= 100
    assert 0 < len(store) < 200
    # a forged entry under the key the next chunk will look up: its text differs
    text = "alpha beta gamma delta epsilon"
    key = hash((0, text[:5]))
    store._chunks[key] = (0, "alphX", (1, 2, 3))
    assert store.cover(text)[1] == 0


def test_store_evicts_a_little_at_a_time() -> None:
    """Past its bound the store drops only the oldest 1/64 of it: eviction runs on the
    router's loop, so each one is short, never a quarter of a full store at once."""
    store = PrefixStore(BUILTIN_CUTS, chunk_chars=4, max_tokens=6400)
    seg = Segments(None, {}, store)
    tok = BuiltinTokenizer()
    tok.segments = seg
    lows = []
    for i in range(400):
        before = store.tokens
        tok.encode(f"doc{i} " + " ".join(f"w{i}x{j}" for j in range(30)))
        if store.tokens < before:  # evicted
            lows.append(store.tokens)
    assert lows, "never evicted"
    assert all(6400 - 100 - 20 <= low <= 6400 - 100 for low in lows), lows


@pytest.mark.parametrize("spread", [True, False])
def test_qwen3_ids_come_from_the_worker_interned(qwen3: Path, spread: bool) -> None:
    """The worker's path hands back ids as tuples of the interned ints (done on the thread
    that encodes, not on the loop that keeps them), and the joined ids equal the library's,
    the batch spread over the cores or encoded one text at a time."""
    from tokenizers import Tokenizer

    tok = load_tokenizer(str(qwen3))
    tok.spread_chars = 0 if spread else 1 << 30
    lib = Tokenizer.from_file(str(qwen3 / "tokenizer.json"))
    # (mostly not ASCII: the library's path, not kvwire's C encoder's, which
    # test_tokenize_bpe.py holds to the same)
    text = " ".join(f"chunk{i} 東京の天気は晴れ" for i in range(1500))
    plan = tok.plan(text)
    assert plan.chars > tok.inline_chars  # the batch path, as the router's workers run it
    results = tok.run(plan)
    shared = tok.segments.intern(list(range(tok.vocab_size)))
    assert all(type(r) is tuple for r in results)
    assert all(i is shared[i] for r in results for i in r)
    assert tok.finish(plan, results) == lib.encode(text, add_special_tokens=False).ids


def test_segments_finish_checks_its_results() -> None:
    tok = BuiltinTokenizer()
    plan = tok.plan("a new text")
    with pytest.raises(ValueError, match="1 work items"):
        tok.finish(plan, [])


def test_every_pattern_taken_as_proven_is_tested(qwen3: Path, llama3: Any) -> None:
    """The split patterns prefix.py takes as proven are exactly those the cut-rule test
    runs: Qwen3's as its file gives it (not a copy of it here), and Llama 3's pipeline
    (saved and read back as a tokenizer.json would be)."""
    from kvwire.tokenize import bpe
    tested = set()
    for state in (json.loads((qwen3 / "tokenizer.json").read_text(encoding="utf-8")),
                  json.loads(llama3.to_str())):
        tested.add(state["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"])
    assert tested == set(bpe.SPLITS)


def test_a_repeated_long_turn_costs_no_tokenizing() -> None:
    """A chat turn long enough to be kept in chunks, seen again whole (the same history
    resent): one lookup, no work; a very long one, kept in chunks only, with its tail: a walk,
    no work either."""
    from kvwire.tokenize.segments import WHOLE_CHARS

    tok = BuiltinTokenizer()
    turn = " ".join(f"word{i % 50}" for i in range(2000))  # ~14k characters
    chat = f"<|im_start|>user\n{turn}<|im_end|>\n<|im_start|>assistant\n"
    first = tok.encode(chat)
    plan = tok.plan(chat)
    assert plan.work == [] and tok.finish(plan, []) == first == _builtin_whole(chat)
    huge = " ".join(f"word{i % 50}" for i in range(WHOLE_CHARS // 4))
    tok.encode(huge)
    plan = tok.plan(huge)
    assert plan.work == [] and tok.finish(plan, []) == _builtin_whole(huge)


def test_kept_ids_share_one_int_object_per_id(qwen3: Path) -> None:
    """tokenizers returns new int objects for every id: what the stores keep shares one per
    id (8 bytes an id, not 36), with the same values; an id outside the table is kept as is."""
    from kvwire.tokenize.prefix import interner

    intern = interner(200_000)
    a, b = intern([int("150000"), 7, int("150000")]), intern([int("150000")])
    assert a == (150000, 7, 150000) and a[0] is a[2] is b[0]
    assert intern([]) == () and intern([5]) == (5,)
    assert intern([300_000, 1]) == (300_000, 1)
    tok = load_tokenizer(qwen3)
    text = "The router keeps what it tokenized. " * 200
    assert tok.encode(text) == tok.encode(text) == _fast(qwen3, _fast_cls()).encode(
        text, add_special_tokens=False).ids
    kept = [ids for (_, _, ids) in tok.segments.store._chunks.values()]
    assert kept and all(type(ids) is tuple for ids in kept)
    big = [i for ids in kept for i in ids if i > 256]
    assert big and all(i is tok.segments.intern([i])[0] for i in big)


def _fast_cls() -> Any:
    from tokenizers import Tokenizer as Fast
    return Fast


# ------------------------------------------------------------------ chats through the proxy

#: Text that looks like some template's markers (turn delimiters, think and tool wrappers,
#: another model's special tokens), put into contents; some are added tokens of the tokenizer.
MARKERS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>",
           "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<s>", "</s>",
           "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[TOOL_CALLS]", "<\uff5cUser\uff5c>",
           "<\uff5cAssistant\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
           "<\uff5ctool\u2581outputs\u2581begin\uff5c>", "user", "assistant\n", "\n\n"]
#: prose (words and spaces: many cuts) mixed with atoms, markers and any text
prose = st.lists(st.sampled_from(["the", "cache", "Router", "engine's", "prefix\n", "token.",
                                  "Zürich", "東京", "12", "x", "\n", ""]),
                 max_size=20).map(" ".join)
contents = st.lists(st.sampled_from(ATOMS + MARKERS) | st.text(max_size=4) | prose,
                    max_size=12).map("".join)
CHAT_TEMPLATES = ["builtin", "qwen3", "deepseek_v3", "mistral_v7", pytest.param(
    "vllm_chatml", marks=pytest.mark.skipif(
        _vllm_chatml() is None, reason="vllm is missing (its template_chatml.jinja); `make "
        "test` installs it (the ENGINES stamp)"))]
#: the roles Mistral v7's template takes after each (None: first); another becomes a user turn
MISTRAL_AFTER = {None: ("system", "user"), "system": ("user", "assistant", "system"),
                 "user": ("assistant", "system", "user"),
                 "assistant": ("assistant", "user", "tool"),
                 "tool": ("assistant", "tool", "user")}


@pytest.fixture(scope="module")
def chat_proxies(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """template -> a Proxy (no engine reached: only its tokens are asked for) with the
    tokenizer ``kvwire serve --tokenizer`` would load for that template, built on demand."""
    from kvwire.consume.engine_spec import EngineSpec
    from kvwire.proxy.proxy import Proxy
    from kvwire.routing.core import RouterCore

    made: dict[str, Any] = {}

    def get(template: str) -> Any:
        if template not in made:
            if template == "builtin":
                tok = load_tokenizer(None)
            else:
                d = tmp_path_factory.mktemp(template)
                os.symlink(qwen3 / "tokenizer.json", d / "tokenizer.json")
                if template == "vllm_chatml":
                    src = _vllm_chatml()
                    assert src is not None
                    (d / "tokenizer_config.json").write_text(json.dumps(
                        {"eos_token": "<|im_end|>",
                         "chat_template": src.read_text(encoding="utf-8")}), encoding="utf-8")
                else:
                    for f in (DATA / template).iterdir():
                        if f.name != "tokenizer.json.xz":
                            (d / f.name).write_bytes(f.read_bytes())
                tok = load_tokenizer(d)
            made[template] = Proxy(RouterCore([EngineSpec(
                "e0", "tcp://127.0.0.1:9", url="http://127.0.0.1:9")]), tok)
        return made[template]

    yield get
    for p in made.values():
        p.close_pools()


def _fresh_caches(tok: Any, chunk: int) -> None:
    """``tok`` with empty caches, chunks of ``chunk`` characters, ids kept as it keeps them."""
    old = tok.segments
    store = PrefixStore(old.store._find.__self__, chunk_chars=chunk)
    store.intern = old.store.intern
    tok.segments = Segments(old.splitter, old.special, store, old.max_segments)
    tok.segments.intern = old.intern


def _chat(data: Any, template: str) -> list[dict[str, Any]]:
    """A conversation the template takes: any order of its roles (system turns first and
    later, runs of one role, tool turns), assistant turns with reasoning or tool calls where
    the template writes them, contents that repeat and extend earlier ones (an agent's
    growing context) or hold other templates' markers."""
    mistral = template == "mistral_v7"
    out: list[dict[str, Any]] = []
    said: dict[str, list[str]] = {}  # by role
    for _ in range(data.draw(st.integers(1, 8), label="turns")):
        role = data.draw(st.sampled_from(("system", "user", "assistant", "tool")))
        if mistral and role not in MISTRAL_AFTER[out[-1]["role"] if out else None]:
            role = "user"  # (the template raises for that order)
        content = data.draw(contents)
        if said.get(role) and data.draw(st.integers(0, 2)):
            content = data.draw(st.sampled_from(said[role][::-1])) + content
        if mistral and role == "assistant" and not content:
            content = "ok"  # (it raises for an empty assistant turn)
        said.setdefault(role, []).append(content)
        m: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            if template == "qwen3" and data.draw(st.booleans()):
                m["reasoning_content"] = data.draw(contents)
            if data.draw(st.integers(0, 3)) == 0:  # (rendered by jinja: no plain path)
                m["tool_calls"] = [{"id": "call00001", "type": "function", "function": {
                    "name": "lookup", "arguments": json.dumps({"q": data.draw(contents)})}}]
        elif role == "tool":
            m["tool_call_id"] = "call00001"  # (Mistral's: 9 characters)
        out.append(m)
    return out


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.parametrize("template", CHAT_TEMPLATES)
@given(data=st.data())
def test_growing_chats_through_the_proxy_equal_whole_text(template: str, chat_proxies: Any,
                                                          data: Any) -> None:
    """A conversation sent again after each new turn, tokenized as ``kvwire serve`` does (the
    request body decoded, the chat rendered as vLLM renders it, the new text encoded on the
    loop or by the proxy's workers, the caches warm from the earlier requests, small chunks):
    every request's ids are those of tokenizing its rendered text whole in one go, under every
    vendored chat template (and vLLM's ChatML) with its tokenizer."""
    from kvwire.proxy.body import generation

    proxy = chat_proxies(template)
    tok = proxy.tok
    _fresh_caches(tok, data.draw(st.integers(1, 6), label="chunk"))
    if template == "builtin":
        whole = _builtin_whole
    else:  # the same tokenizers object, with the template's special tokens added
        def whole(text: str) -> list[int]:
            return tok._tok.encode(text, add_special_tokens=False).ids
    chat = _chat(data, template)
    thinking = data.draw(st.sampled_from([None, True, False]), label="enable_thinking")
    kwargs = None if thinking is None else {"enable_thinking": thinking}

    async def send_each() -> list[tuple[str, list[int]]]:
        out = []
        for n in range(1, len(chat) + 1):
            raw = json.dumps({"model": "m", "messages": chat[:n],
                              "chat_template_kwargs": kwargs}).encode()
            body = generation(raw, True)
            if template != "builtin":  # (its C encoder is the same function either way)
                tok.inline_chars = data.draw(st.sampled_from([1 << 30, 0]), label="worker")
            ids = await proxy.tokens.prompt(body, True)
            text = tok.render_engine_chat(body.messages, chat_template_kwargs=kwargs)
            out.append((text, list(ids)))
        return out

    for text, ids in asyncio.run(send_each()):
        assert ids == whole(text), (template, text)
