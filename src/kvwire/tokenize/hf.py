"""A model directory's tokenizer: ``tokenizer.json`` through the ``tokenizers`` package, its
chat template through our jinja2 sandbox (template.py), with the same inputs transformers'
``apply_chat_template`` gives it.

Which template, as transformers picks it: ``chat_template.jinja`` (and
``additional_chat_templates/*.jinja``) over ``tokenizer_config.json``'s ``chat_template``,
which is a string or a list of ``{"name", "template"}``; of several, ``tool_use`` when tools
are given and it exists, else ``default``. The template sees the named special tokens
(``bos_token``, ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``, ``cls_token``,
``mask_token``, and the names of a dict ``extra_special_tokens``) as strings, from
tokenizer_config.json, else special_tokens_map.json; the caller's ``chat_template_kwargs``
override them."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvwire.tokenize.base import Plan, Tokenizer, TokenizerError
from kvwire.tokenize.bpe import GIL_CHARS, ascii_runs, byte_bpe
from kvwire.tokenize.prefix import CHUNK_CHARS, PrefixStore, hf_cuts, interner
from kvwire.tokenize.segments import Segments
from kvwire.tokenize.template import ChatTemplate

SEGMENT_CACHE_SIZE = 8192  # text pieces between added tokens (chat turns) kept encoded
#: Characters per chunk of the prefix store when kvwire's C encoder takes the pipeline
#: (prefix.CHUNK_CHARS, 512, otherwise)
BPE_CHUNK_CHARS = 2048
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a str or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: cannot read JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _templates(directory: Path, config: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """name -> (source, origin) of every chat template the directory has."""
    out: dict[str, tuple[str, str]] = {}
    jinja = directory / "chat_template.jinja"
    extra_dir = directory / "additional_chat_templates"
    if jinja.is_file() or extra_dir.is_dir():
        if jinja.is_file():
            out["default"] = (jinja.read_text(encoding="utf-8"), str(jinja))
        if extra_dir.is_dir():
            for f in sorted(extra_dir.glob("*.jinja")):
                out[f.name.removesuffix(".jinja")] = (f.read_text(encoding="utf-8"), str(f))
        return out
    origin = str(directory / "tokenizer_config.json")
    ct = config.get("chat_template")
    if isinstance(ct, str):
        out["default"] = (ct, origin)
    elif isinstance(ct, list):
        for item in ct:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise TokenizerError(f"{origin}: chat_template list items must be "
                                     "{\"name\": str, \"template\": str}")
            out[item["name"]] = (item["template"], f"{origin} [{item['name']}]")
    elif ct is not None:
        raise TokenizerError(f"{origin}: chat_template must be a string or a list, "
                             f"got {type(ct).__name__}")
    return out


class HFTokenizer(Tokenizer):
    """``tokenizer.json`` + chat template of one model directory (module docstring)."""

    releases_gil = True
    inline_chars = 1024
    #: Work of at most this many chars is encoded one text at a time on the worker: a batch
    #: spread over the cores gains it no wall time, and the library's idle threads spin for
    #: work, 0.3 ms of CPU a batch of a few chunks (as much as encoding 300 tokens)
    spread_chars = 8192
    #: ASCII work of at most this many chars is encoded where it is asked for when the C
    #: encoder takes it (bpe.py): ~0.25 ms, less than a hand-over to a worker that may wait
    #: for a core; the encoder keeps the GIL for that much (the loop never waits to take it
    #: back), and lets it go for more
    bpe_inline_chars = GIL_CHARS

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        try:
            from tokenizers import AddedToken
            from tokenizers import Tokenizer as _Fast
        except ImportError as e:
            raise TokenizerError(f"loading {directory} needs the `tokenizers` package "
                                 f"(pip install tokenizers): {e}") from None
        d = Path(directory)
        self.directory = d
        self.name = d.name or str(d)
        tj = d / "tokenizer.json"
        try:
            self._tok = _Fast.from_file(str(tj))
        except Exception as e:  # the Rust side raises a bare Exception on a bad file
            raise TokenizerError(f"{tj}: not a loadable tokenizers file: {e}") from None
        config = _read_json(d / "tokenizer_config.json") if (
            d / "tokenizer_config.json").is_file() else {}
        stmap = _read_json(d / "special_tokens_map.json") if (
            d / "special_tokens_map.json").is_file() else {}
        variables: dict[str, str] = {}
        for key in NAMED_SPECIAL_TOKENS:
            s = _token_str(config.get(key))
            if s is None:
                s = _token_str(stmap.get(key))
            if s is not None:
                variables[key] = s
        extra = config.get("extra_special_tokens")
        if isinstance(extra, dict):  # model-specific named tokens (image_token, ...)
            for key, value in extra.items():
                s = _token_str(value)
                if s is not None:
                    variables[key] = s
        self.special_tokens = dict(variables)
        # transformers makes every named special token an added token (matched whole in the
        # text, never split by the model), appending those the vocabulary lacks; so do we, or
        # a "<s>" that the BPE vocabulary also knows would encode differently.
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        new = [t for t in dict.fromkeys(variables.values()) if t not in added]
        if new:
            self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                          for t in new])
        self.bos_token_id = self._id(variables.get("bos_token"))
        self.eos_token_id = self._id(variables.get("eos_token"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._added_ids: dict[str, int] = {}
        splitter = self._added_token_splitter()
        # tokenizers cuts the text at added tokens before it normalizes and pre-tokenizes,
        # so the pieces between them (a chat's turns) encode independently: each is kept
        # once encoded (segments.py), and a long one in chunks where the pre-tokenizer
        # allows exact cuts (prefix.py), so that a prompt extending it pays its new part only
        cuts, self.prefix_reason = hf_cuts(self._tok)
        self._cuts = cuts  # (also where text mixing ASCII and not is split: bpe.ascii_runs)
        if splitter is None and self._tok.get_added_tokens_decoder():
            cuts, self.prefix_reason = None, ("an added token strips spaces, is a single "
                                              "word or is normalized: whole texts only")
        # tokenizers returns new int objects: what is kept shares one per id instead
        table = tuple(range(self.vocab_size))
        #: kvwire's C encoder of ASCII text for this pipeline (bpe.py), or None and why not:
        #: it sees the text between added tokens, so only where they are cut out first
        self.bpe, self.bpe_reason = byte_bpe(self._tok, table) if (
            splitter is not None or not self._tok.get_added_tokens_decoder()) else (
            None, "added tokens are not cut out before encoding")
        # (with the C encoder, chunks as long as the builtin tokenizer's: re-encoding a
        # chunk costs microseconds, and fewer of them are fewer lookups a prompt)
        store = None if cuts is None else PrefixStore(
            cuts, chunk_chars=BPE_CHUNK_CHARS if self.bpe is not None else CHUNK_CHARS)
        self.segments = Segments(splitter, self._added_ids, store,
                                 max_segments=SEGMENT_CACHE_SIZE)
        self._added_around = self._post_processor_ids()
        self.segments.intern = interner(table)
        if store is not None:
            store.intern = self.segments.intern
        self._templates = {name: ChatTemplate(src, origin=origin, variables=variables)
                           for name, (src, origin) in _templates(d, config).items()}
        self._override: ChatTemplate | None = None

    def use_chat_template(self, source: str, origin: str = "<chat template>") -> None:
        """Render with ``source`` (an engine's ``--chat-template``) instead of the
        directory's templates, given the same special-token variables."""
        self._override = ChatTemplate(source, origin=origin, variables=self.special_tokens)

    def _post_processor_ids(self) -> tuple[list[int], list[int]] | None:
        """``(before, after)``: the ids tokenizer.json's post-processor puts around a single
        text (a BOS; nothing for Qwen's), when the same for every probe; else None (then a
        text encoded with special tokens is encoded whole)."""
        around = None
        for probe in ("a", "Hello world.\n", " 12 x"):
            bare = self._tok.encode(probe, add_special_tokens=False).ids
            full = self._tok.encode(probe, add_special_tokens=True).ids
            n = len(bare)
            for i in range(len(full) - n + 1):
                if full[i:i + n] == bare:
                    cut = (full[:i], full[i + n:])
                    break
            else:
                return None
            if around is None:
                around = cut
            elif cut != around:
                return None
        return around

    def _added_token_splitter(self) -> re.Pattern[str] | None:
        """A regex finding the added tokens where ``tokenizers`` finds them (leftmost, longest
        first), or None when some added token strips spaces, must be a single word or is
        matched after normalization: then only a whole-text encode is exact."""
        added = self._tok.get_added_tokens_decoder()
        if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized
                            for t in added.values()):
            return None
        self._added_ids = {t.content: i for i, t in added.items()}
        return re.compile("|".join(re.escape(c) for c in sorted(self._added_ids, key=len,
                                                                  reverse=True)))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def template_names(self) -> list[str]:
        """Names of the chat templates this model has (``default``, ``tool_use``, ...)."""
        return sorted(self._templates)

    def chat_template(self, tools: list[dict[str, Any]] | None = None) -> ChatTemplate:
        """The template transformers would pick for a chat with/without ``tools`` (the one
        given to :meth:`use_chat_template`, if any, as vLLM's ``--chat-template`` wins)."""
        if self._override is not None:
            return self._override
        if not self._templates:
            raise TokenizerError(f"{self.directory}: no chat template (neither "
                                 "chat_template.jinja nor tokenizer_config.json's chat_template)")
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        if len(self._templates) == 1:
            return next(iter(self._templates.values()))
        raise TokenizerError(f"{self.directory}: several chat templates "
                             f"({', '.join(self.template_names)}) and none named default")

    def plan(self, text: str, add_special_tokens: bool = False) -> Plan:
        """The known and the new of ``text``; ``add_special_tokens`` (tokenizer.json's
        post-processor, e.g. a BOS first) makes the whole text the work."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        if add_special_tokens and self._added_around is not None:
            return self.segments.plan(text, *self._added_around)
        if add_special_tokens:
            p = Plan()
            p.add_work(text)
            p.special = True
            return p
        return self.segments.plan(text)

    def inline(self, plan: Plan) -> bool:
        """Short work, or ASCII work the C encoder takes up to ``bpe_inline_chars``."""
        return plan.chars <= self.inline_chars or (
            self.bpe is not None and plan.chars <= self.bpe_inline_chars
            and not plan.special and all(map(str.isascii, plan.work)))

    def run(self, plan: Plan) -> list[Sequence[int]]:
        """The ids of each text of ``plan.work``: ASCII text by the C encoder when this
        pipeline has one (bpe.py; a text mixing ASCII and other text in runs cut where the
        tokenizer cannot merge across), the rest by ``tokenizers``. Both release the GIL on
        long work; the library spreads a batch of more than ``spread_chars`` over the
        cores."""
        if plan.special:
            return [self._tok.encode(plan.work[0], add_special_tokens=True).ids]
        work = plan.work
        if self.bpe is None:
            return self._library(work, plan.chars)
        if all(map(str.isascii, work)):
            return self.bpe.encode(work)
        # each text as runs cut where the tokenizer cannot merge across: the ASCII ones to
        # the C encoder, the others to the library, each group in one call
        runs = [[(w, True)] if w.isascii() else ascii_runs(w, self._cuts)
                if self._cuts is not None else [(w, False)] for w in work]
        mine = [r for rs in runs for r, a in rs if a]
        rest = [r for rs in runs for r, a in rs if not a]
        it_mine = iter(self.bpe.encode(mine))
        it_rest = iter(self._library(rest, sum(map(len, rest))))
        out: list[Sequence[int]] = []
        intern = self.segments.intern
        for rs in runs:
            if len(rs) == 1:
                out.append(next(it_mine) if rs[0][1] else next(it_rest))
            else:  # (joined, and interned here: tuples of shared ints, as from either)
                out.append(intern([i for _, a in rs for i in next(it_mine if a else it_rest)]))
        return out

    def _library(self, work: list[str], chars: int) -> list[Sequence[int]]:
        """The ids of each of ``work`` (``chars`` characters in all) by ``tokenizers``."""
        if chars <= self.inline_chars:  # (short: no thread pool; the router's loop
            # runs these, and must not be the thread that starts the pool at its priority)
            return [self._tok.encode(w, add_special_tokens=False).ids for w in work]
        out = []
        # (encode_batch_fast: the same ids without offsets, half the time; tokenizers >= 0.21)
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        intern = self.segments.intern
        if chars <= self.spread_chars:  # (a batch of one: the GIL released, not spread)
            return [intern(batch([w], add_special_tokens=False)[0].ids) for w in work]
        for i, e in enumerate(batch(work, add_special_tokens=False)):
            # ~0.1 us an id, with the GIL held: 5 ms for 48k ids. Interned here, on the
            # worker thread, in pieces the loop can run between, not all at once where they
            # are kept (Segments.finish, on the router's loop)
            out.append(intern(e.ids))
            if i % 16 == 15:
                time.sleep(0)  # let a waiting thread (the router's loop) have the GIL now
        return out

    def finish(self, plan: Plan, results: Sequence[Sequence[int]]) -> list[int]:
        """The ids of the planned text; keeps the new segments and chunks."""
        if plan.special:
            return list(results[0])
        return self.segments.finish(plan, results)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``."""
        try:
            return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (TypeError, OverflowError) as e:
            raise TokenizerError(f"cannot decode {list(ids)[:8]!r}...: {e}") from None

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text, as ``apply_chat_template(..., tokenize=False)`` gives it."""
        return self.chat_template(tools).render(messages, tools=tools,
                                                add_generation_prompt=add_generation_prompt,
                                                chat_template_kwargs=chat_template_kwargs,
                                                continue_final_message=continue_final_message)
