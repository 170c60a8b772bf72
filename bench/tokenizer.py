"""Benchmark kvwire.tokenize: a ~2k-token chat prompt rendered and tokenized (the router's
and ``kvwire engine``'s per-request cost), against transformers' ``apply_chat_template`` on
the same files in the same run.

The model: Qwen3's tokenizer.json and chat template (tests/data/tokenize/qwen3). The chat:
a system prompt, two tools, and alternating user/assistant turns of varied prose until the
rendered prompt is about ``--tokens`` tokens; each timed call has a new last user turn (a
new request sharing the conversation's history, as a chat client sends it), so no cache of
whole prompts helps; kvwire's cache of encoded turns does (the "cold" row empties it before
every call: the cost of a conversation never seen). Reported: p50/p99 in ms over ``--n`` calls, each call timed alone, for
kvwire ``encode_chat`` (and its two halves, ``render_chat`` and ``encode``), transformers
``apply_chat_template(tokenize=True)`` when importable (a loud SKIPPED row when not), and
the built-in tokenizer's ``encode_chat`` on the same chat.

The "cold" row builds a new tokenizer before every call (not timed): the cost of a
conversation never seen, without reaching into the tokenizer's caches.

**Long prompts** (the second table; ``--long-tokens``, default 30,000 Qwen3 tokens): what a
router pays per request for (a) one long completion prompt of varied prose and (b) one long
chat (Qwen3's template, no tools, through ``encode_engine_chat`` as the router calls it), for
Qwen3's tokenizer and the built-in one, on the same texts:

- *cold*: a prompt never seen: a new tokenizer (built untimed) and a new text every call;
- *warm-extend*: a prompt seen before (tokenized untimed just before) extended by a new part
  of ``--extend`` (default 5%) of its tokens at the end (a new paragraph; in the chat an
  assistant reply and a user turn), a new part every call: how a conversation or an agent's
  context grows, so what the router pays for a prompt it has mostly seen; per 1k tokens of
  the whole prompt and per 1k NEW tokens;
- *library, new part alone*: the tokenizer library's own cost on just the new text of the
  same calls (``tokenizers.Tokenizer.encode`` for Qwen3, a new ``BuiltinTokenizer().encode``
  for the built-in one): the baseline of the target "warm-extend <= 1.2x the library's cost
  on the new tokens + 0.3 ms", printed after the table with the CPU p50s;
- for Qwen3 also the library on the whole text (the price of no cache at all), and the chat's
  render alone: through its template as loaded (Qwen3's is a known text, rendered by
  kvwire.tokenize.known's plain function) and through jinja.

Every call is timed alone: wall time (``perf_counter``) and this process's CPU time
(``process_time``: all its threads, so a tokenizer running on several threads shows CPU above
wall). Columns: p50/p99 ms of each, and the p50s per 1k tokens (of the whole prompt, and of the
new part). ``--quick``: small counts and a 5k-token prompt, seconds (the smoke test's run).

    .venv/bin/python bench/tokenizer.py              # 2k tokens, 500 calls each; 30k long
    .venv/bin/python bench/tokenizer.py --tokens 8000 --n 200
    .venv/bin/python bench/tokenizer.py --long-only --long-tokens 60000 --extend 0.1
    .venv/bin/python bench/tokenizer.py --quick
"""

from __future__ import annotations

import argparse  # noqa: E402
import itertools  # noqa: E402
import lzma  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kvwire.tokenize import BuiltinTokenizer, load_tokenizer  # noqa: E402

DATA = ROOT / "tests" / "data" / "tokenize" / "qwen3"
WORDS = ("the cache router engine prefix block token stream event latency request model "
         "prompt reply user system tool answer question why how when fast slow memory page "
         "shared index match score load queue batch step time first token Zürich naïve 東京 "
         "hello world, again. (note) [x] {y} 42 3.14 - : ; ! ?").split()
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}},
         {"type": "function", "function": {
             "name": "search", "description": "Search the web",
             "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                            "required": ["q"]}}}]


def prose(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversation(tok: Any, tokens: int, rng: random.Random) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are helpful. " + prose(rng, 60)}]
    while True:
        msgs.append({"role": "user", "content": prose(rng, rng.randint(20, 120))})
        if len(tok.encode_chat(msgs, tools=TOOLS)) >= tokens:
            return msgs
        msgs.append({"role": "assistant", "content": prose(rng, rng.randint(40, 200))})


def timed(fn: Callable[[int], Any], n: int) -> tuple[float, float]:
    for i in range(min(20, n)):  # warm-up: template compile, caches
        fn(i)
    samples = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        fn(i)
        samples.append((time.perf_counter_ns() - t0) / 1e6)
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(0.99 * len(samples)))]


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


# ------------------------------------------------------------------------------ long prompts

SYLLABLES = ("ka to ri mun sel ver an dor pla que ith os bre lum tra ne gi fo wel cas min zu "
             "har pe ol stru ex con de ly ment ing tion al").split()


class Prose:
    """Varied prose: a Zipf-weighted vocabulary (the bench's words first, the most frequent,
    then 4,000 made-up words of 1-4 syllables), sentences of 4-24 words with capitals,
    commas, numbers and ``.?!``, paragraphs of 3-8 sentences; sized in tokens of ``count``."""

    def __init__(self, rng: random.Random, count: Callable[[str], int]) -> None:
        made = ("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
                for _ in range(4000))
        self.words = list(dict.fromkeys([*WORDS, *made]))
        self.cum = list(itertools.accumulate(1.0 / (r + 1) for r in range(len(self.words))))
        self.rng, self.count = rng, count

    def sentence(self) -> str:
        rng = self.rng
        ws = rng.choices(self.words, cum_weights=self.cum, k=rng.randint(4, 24))
        for i in range(1, len(ws) - 1):
            if rng.random() < 0.08:
                ws[i] += ","
            elif rng.random() < 0.03:
                ws[i] = str(rng.randint(0, 99999))
        return " ".join(ws).capitalize() + rng.choice(".....?!")

    def paragraph(self) -> str:
        return " ".join(self.sentence() for _ in range(self.rng.randint(3, 8)))

    def text(self, tokens: int) -> str:
        """Sentences, in paragraphs of 3-8, until they count at least ``tokens``."""
        parts: list[str] = []
        n = left = 0
        while n < tokens:
            if not left:
                left = self.rng.randint(3, 8)
                if parts:
                    parts.append("\n\n")
            parts.append((" " if parts and parts[-1] != "\n\n" else "") + self.sentence())
            n += self.count(parts[-1])
            left -= 1
        return "".join(parts)


class LongRow:
    """One row of the long-prompt table: per-call wall and CPU ms, prompt and new tokens."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.tokens: list[int] = []
        self.new: list[int] = []

    def run(self, n: int, setup: Callable[[int], Any], call: Callable[[Any], Any],
            new_tokens: Callable[[int], int] | None = None) -> LongRow:
        """``n`` calls of ``call(setup(i))``, only ``call`` timed; ``len`` of its result is
        the prompt's tokens; ``new_tokens(i)`` the new part's, when there is one."""
        for i in range(n):
            arg = setup(i)
            w0, c0 = time.perf_counter_ns(), time.process_time_ns()
            out = call(arg)
            c1, w1 = time.process_time_ns(), time.perf_counter_ns()
            self.wall.append((w1 - w0) / 1e6)
            self.cpu.append((c1 - c0) / 1e6)
            self.tokens.append(len(out))
            if new_tokens is not None:
                self.new.append(new_tokens(i))
        return self

    def line(self) -> str:
        wall, cpu = statistics.median(self.wall), statistics.median(self.cpu)
        k = statistics.median(self.tokens) / 1000
        cells = [f"{len(self.wall):5d}", f"{statistics.median(self.tokens):7.0f}",
                 f"{statistics.median(self.new):6.0f}" if self.new else f"{'-':>6s}",
                 f"{wall:8.2f}", f"{p99(self.wall):8.2f}", f"{cpu:8.2f}", f"{p99(self.cpu):8.2f}",
                 f"{wall / k:7.3f}", f"{cpu / k:7.3f}"]
        if self.new:
            kn = statistics.median(self.new) / 1000
            cells += [f"{wall / kn:7.3f}", f"{cpu / kn:7.3f}"]
        else:
            cells += [f"{'-':>7s}"] * 2
        return f"{self.name:50s} " + " ".join(cells)


LONG_HEADER = (f"{'':50s} {'calls':>5s} {'tokens':>7s} {'new':>6s} {'wall p50':>8s} "
               f"{'wall p99':>8s} {'CPU p50':>8s} {'CPU p99':>8s} {'wall/1k':>7s} {'CPU/1k':>7s} "
               f"{'wall/1k':>7s} {'CPU/1k':>7s}\n{'':50s} {'':>5s} {'':>7s} {'':>6s} "
               f"{'ms':>8s} {'ms':>8s} {'ms':>8s} {'ms':>8s} {'tokens':>7s} {'tokens':>7s} "
               f"{'new':>7s} {'new':>7s}")


def long_chat(prose_: Prose, tokens: int) -> list[dict[str, str]]:
    """A system prompt, then user/assistant turns of 1-3 paragraphs, ending with a user turn,
    until the turns count at least ``tokens``."""
    msgs = [{"role": "system", "content": "You are helpful. " + prose_.paragraph()}]
    n = prose_.count(msgs[0]["content"])
    while n < tokens or msgs[-1]["role"] != "user":
        role = "user" if msgs[-1]["role"] != "user" else "assistant"
        msgs.append({"role": role, "content": "\n\n".join(
            prose_.paragraph() for _ in range(prose_.rng.randint(1, 3)))})
        n += prose_.count(msgs[-1]["content"]) + 4
    return msgs


def long_rows(kind: str, make: Callable[[], Any], lib_new: Callable[[], Callable[[str], Any]],
              lib_whole: Callable[[str], Any] | None, shape: str, texts: dict[str, Any],
              n_cold: int, n_warm: int) -> list[LongRow]:
    """The cold, warm-extend and library rows of one tokenizer (``make`` builds a new one)
    for one prompt shape: ``text`` (a completion prompt, encoded as the router encodes one:
    ``add_special_tokens=True``) or ``chat`` (``encode_engine_chat``)."""
    if shape == "text":
        def enc(tok: Any, prompt: Any) -> list[int]:
            return tok.encode(prompt, add_special_tokens=True)
    else:
        def enc(tok: Any, prompt: Any) -> list[int]:
            return tok.encode_engine_chat(prompt)
    colds, base, exts, news = (texts[k] for k in ("cold", "base", "ext", "new"))
    fresh: list[Any] = [None]

    def cold_setup(i: int) -> Any:
        fresh[0] = None  # the previous one freed before the next is built
        fresh[0] = make()
        return colds[i % len(colds)]

    rows = [LongRow(f"{kind} {shape}, cold (new tokenizer, new prompt)").run(
        n_cold, cold_setup, lambda p: enc(fresh[0], p))]
    fresh[0] = None
    if lib_whole is not None:
        rows.append(LongRow("  tokenizers library, whole prompt").run(
            n_warm, lambda i: colds[i % len(colds)], lib_whole))
    tok = make()
    for i in range(min(3, n_warm)):  # warm-up: the template's first renders, the caches
        enc(tok, base)
        enc(tok, exts[-1 - i])
    new_len = [len(lib_new()(t)) for t in news]

    def warm_setup(i: int) -> Any:
        enc(tok, base)  # the prompt as last seen, untimed (the conversation's last request)
        return exts[i % len(exts)]

    rows.append(LongRow(f"{kind} {shape}, warm-extend (seen + new part)").run(
        n_warm, warm_setup, lambda p: enc(tok, p), lambda i: new_len[i % len(news)]))
    rows.append(LongRow("  library, the new part alone").run(  # (lib_new() not timed)
        n_warm, lambda i: (lib_new(), news[i % len(news)]), lambda a: a[0](a[1]),
        lambda i: new_len[i % len(news)]))
    return rows


def render_line(tok: Any, chats: list[Any], n: int) -> None:
    """The chat's render alone (CPU p50 of ``render_engine_chat``'s template step), through
    the tokenizer's template as loaded (known.py's plain path when its text is known) and
    through jinja, on the same chats."""
    from kvwire.tokenize import ChatTemplate

    ct = tok.chat_template()
    jinja = ChatTemplate(ct.source, origin=ct.origin, variables=ct.variables, fast=False)
    msgs = [tok.engine_messages(c) for c in chats]

    def p50(t: Any) -> float:
        cpu = []
        for i in range(n):
            c0 = time.process_time_ns()
            t.render(msgs[i % len(msgs)])
            cpu.append((time.process_time_ns() - c0) / 1e6)
        return statistics.median(cpu)

    print(f"  the chat's render alone ({statistics.median(len(m) for m in msgs):.0f} messages), "
          f"CPU p50: as loaded ({ct.fast_path or 'jinja'}) {p50(ct):.2f} ms, "
          f"jinja {p50(jinja):.2f} ms", flush=True)


def long_prompts(qwen_dir: Path, tokens: int, extend: float, n_cold: int, n_warm: int) -> None:
    """The long-prompt table (module docstring) and the target comparison under it."""
    from tokenizers import Tokenizer as Lib

    lib = Lib.from_file(str(qwen_dir / "tokenizer.json"))

    def count(s: str) -> int:
        return len(lib.encode(s, add_special_tokens=False))

    rng = random.Random(11)
    pr = Prose(rng, count)
    n_new = max(1, int(tokens * extend))
    text = {"cold": [pr.text(tokens) for _ in range(max(1, n_cold))], "base": pr.text(tokens)}
    text["new"] = ["\n\n" + pr.text(n_new) for _ in range(max(1, n_warm))]
    text["ext"] = [text["base"] + t for t in text["new"]]
    chats = {"cold": [long_chat(pr, tokens) for _ in range(max(1, n_cold))],
             "base": long_chat(pr, tokens)}
    turns = [[{"role": "assistant", "content": pr.text(n_new // 2)},
              {"role": "user", "content": pr.text(n_new - n_new // 2)}]
             for _ in range(max(1, n_warm))]
    chats["ext"] = [chats["base"] + t for t in turns]
    print(f"\nlong prompts: ~{tokens} Qwen3 tokens of varied prose (a text prompt; a chat of "
          f"{len(chats['base'])} messages), extended by ~{extend:.0%} ({n_new} tokens) a call; "
          f"{n_cold} cold calls, {n_warm} warm a row", flush=True)
    # the baselines' own library object (the one above counted every word made here, which
    # fills its word cache), having seen the base prompt once, as the router's has
    base_lib = Lib.from_file(str(qwen_dir / "tokenizer.json"))
    base_lib.encode(text["base"], add_special_tokens=False)
    print(LONG_HEADER)
    out: list[LongRow] = []
    for kind in ("qwen3", "builtin"):
        if kind == "qwen3":
            def make() -> Any:
                return load_tokenizer(qwen_dir)

            def lib_new() -> Callable[[str], list[int]]:
                return lambda s: base_lib.encode(s, add_special_tokens=False).ids

            def lib_whole(s: str) -> list[int]:
                return base_lib.encode(s, add_special_tokens=True).ids
        else:
            make, lib_whole = BuiltinTokenizer, None

            def lib_new() -> Callable[[str], list[int]]:
                return BuiltinTokenizer().encode  # a new one: no cache helps the baseline
        probe = make()
        # the chats' new text: what the extended prompt renders beyond the seen one
        chat_new = [probe.render_chat(e)[len(os.path.commonprefix(
            [probe.render_chat(chats["base"]), probe.render_chat(e)])):] for e in chats["ext"]]
        del probe
        for shape, texts in (("text", text), ("chat", {**chats, "new": chat_new})):
            rows = long_rows(kind, make, lib_new, lib_whole if shape == "text" else None,
                             shape, texts, n_cold, n_warm)
            for r in rows:
                print(r.line(), flush=True)
            out += rows
        if kind == "qwen3":
            render_line(make(), chats["ext"], n_warm)
    print("\ntarget (the router's CPU per request, here the tokenizer's alone): warm-extend "
          "<= 1.2x the library's CPU on the new part + 0.3 ms; p50s:")
    for i in range(len(out) - 1):
        w, b = out[i], out[i + 1]
        if "warm-extend" in w.name:
            cw, cb = statistics.median(w.cpu), statistics.median(b.cpu)
            seen = 1 - statistics.median(w.new) / statistics.median(w.tokens)
            lim = 1.2 * cb + 0.3
            print(f"  {w.name.split(',')[0]:8s} {w.name.split(',')[1].strip()[:4]}: "
                  f"{cw:.2f} ms vs 1.2 x {cb:.2f} + 0.3 = {lim:.2f} ms "
                  f"{'MET' if cw <= lim else 'MISSED'}; {seen:.0%} seen, <= 1 ms "
                  f"{'MET' if cw <= 1.0 else 'MISSED'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000, help="prompt length to build (default 2000)")
    ap.add_argument("--n", type=int, default=500, help="timed calls per row (default 500)")
    ap.add_argument("--cold-n", type=int, default=30,
                    help="calls of the rows that build a new tokenizer a call (default 30)")
    ap.add_argument("--long-tokens", type=int, default=30000,
                    help="long prompts' length in Qwen3 tokens (default 30000; 0: no long rows)")
    ap.add_argument("--long-n", type=int, default=100,
                    help="warm calls per long row (default 100)")
    ap.add_argument("--extend", type=float, default=0.05,
                    help="the new part of a warm-extend call, of the prompt (default 0.05)")
    ap.add_argument("--long-only", action="store_true", help="only the long-prompt table")
    ap.add_argument("--quick", action="store_true",
                    help="seconds: --n 30 --cold-n 3 --long-tokens 5000 --long-n 10")
    args = ap.parse_args()
    if args.quick:
        args.n, args.cold_n, args.long_n = min(args.n, 30), min(args.cold_n, 3), min(args.long_n, 10)
        args.long_tokens = min(args.long_tokens, 5000)
    if args.tokens < 50 or args.n < 1 or args.cold_n < 1 or args.long_n < 1:
        ap.error("--tokens must be >= 50 and --n, --cold-n, --long-n >= 1")
    if args.long_tokens and args.long_tokens < 200 or not 0 < args.extend <= 1:
        ap.error("--long-tokens must be 0 or >= 200, --extend in (0, 1]")
    if args.long_only and not args.long_tokens:
        ap.error("--long-only needs --long-tokens > 0")

    tmp = Path(tempfile.mkdtemp(prefix="kvwire-tokbench-"))
    try:
        (tmp / "tokenizer.json").write_bytes(lzma.decompress((DATA / "tokenizer.json.xz").read_bytes()))
        shutil.copy(DATA / "tokenizer_config.json", tmp)
        if not args.long_only:
            chat_rows(tmp, args)
        if args.long_tokens:
            long_prompts(tmp, args.long_tokens, args.extend, args.cold_n, args.long_n)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def chat_rows(tmp: Path, args: argparse.Namespace) -> None:
    """The first table: a ~``--tokens`` chat with a new last user turn a call."""
    tok = load_tokenizer(tmp)
    rng = random.Random(7)
    msgs = conversation(tok, args.tokens, rng)
    lasts = [prose(rng, rng.randint(20, 120)) + f" #{i}" for i in range(args.n + 20)]

    def chat(i: int) -> list[dict[str, Any]]:
        return msgs[:-1] + [{"role": "user", "content": lasts[i % len(lasts)]}]

    texts = [tok.render_chat(chat(i), tools=TOOLS) for i in range(64)]
    n_tokens = statistics.median(len(tok.encode(t)) for t in texts)
    print(f"chat: {len(msgs)} messages, 2 tools, ~{n_tokens:.0f} Qwen3 tokens "
          f"({statistics.median(len(t) for t in texts):.0f} chars); {args.n} calls a row "
          f"({args.cold_n} cold)", flush=True)
    cold = LongRow("").run(args.cold_n, lambda i: (load_tokenizer(tmp), texts[i % len(texts)]),
                           lambda a: a[0].encode(a[1]))
    rows: list[tuple[str, tuple[float, float] | None]] = [
        ("kvwire encode_chat (render + encode)", timed(lambda i: tok.encode_chat(chat(i), tools=TOOLS), args.n)),
        ("  kvwire render_chat only", timed(lambda i: tok.render_chat(chat(i), tools=TOOLS), args.n)),
        ("  kvwire encode only, turns cached", timed(lambda i: tok.encode(texts[i % len(texts)]), args.n)),
        ("  kvwire encode only, cold (new tokenizer)", (statistics.median(cold.wall), p99(cold.wall))),
    ]
    try:
        from transformers import AutoTokenizer
        ref = AutoTokenizer.from_pretrained(str(tmp))
        assert ref.apply_chat_template(chat(0), tools=TOOLS, add_generation_prompt=True,
                                       tokenize=True)["input_ids"] == tok.encode_chat(chat(0), tools=TOOLS)
        rows.append(("transformers apply_chat_template(tokenize=True)", timed(
            lambda i: ref.apply_chat_template(chat(i), tools=TOOLS, add_generation_prompt=True,
                                              tokenize=True), args.n)))
    except ImportError as e:
        rows.append((f"transformers: SKIPPED ({e}; `make test` installs it)", None))
    builtin = BuiltinTokenizer()
    rows.append((f"builtin encode_chat (~{len(builtin.encode_chat(chat(0), tools=TOOLS))} ids)",
                 timed(lambda i: builtin.encode_chat(chat(i), tools=TOOLS), args.n)))
    print(f"{'':52s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for name, r in rows:
        print(f"{name:52s} " + (f"{r[0]:8.3f} {r[1]:8.3f}" if r else f"{'-':>8s} {'-':>8s}"))


if __name__ == "__main__":
    main()
