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

    .venv/bin/python bench/tokenizer.py              # 2k tokens, 500 calls each
    .venv/bin/python bench/tokenizer.py --tokens 8000 --n 200
"""

from __future__ import annotations

import argparse  # noqa: E402
import lzma  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000, help="prompt length to build (default 2000)")
    ap.add_argument("--n", type=int, default=500, help="timed calls per row (default 500)")
    args = ap.parse_args()
    if args.tokens < 50 or args.n < 1:
        ap.error("--tokens must be >= 50 and --n >= 1")

    tmp = Path(tempfile.mkdtemp(prefix="kvwire-tokbench-"))
    try:
        (tmp / "tokenizer.json").write_bytes(lzma.decompress((DATA / "tokenizer.json.xz").read_bytes()))
        shutil.copy(DATA / "tokenizer_config.json", tmp)
        tok = load_tokenizer(tmp)
        rng = random.Random(7)
        msgs = conversation(tok, args.tokens, rng)
        lasts = [prose(rng, rng.randint(20, 120)) + f" #{i}" for i in range(args.n + 20)]

        def chat(i: int) -> list[dict[str, Any]]:
            return msgs[:-1] + [{"role": "user", "content": lasts[i % len(lasts)]}]

        texts = [tok.render_chat(chat(i), tools=TOOLS) for i in range(64)]
        n_tokens = statistics.median(len(tok.encode(t)) for t in texts)
        print(f"chat: {len(msgs)} messages, 2 tools, ~{n_tokens:.0f} Qwen3 tokens "
              f"({statistics.median(len(t) for t in texts):.0f} chars); {args.n} calls a row")
        rows: list[tuple[str, tuple[float, float] | None]] = [
            ("kvwire encode_chat (render + encode)", timed(lambda i: tok.encode_chat(chat(i), tools=TOOLS), args.n)),
            ("  kvwire render_chat only", timed(lambda i: tok.render_chat(chat(i), tools=TOOLS), args.n)),
            ("  kvwire encode only, turns cached", timed(lambda i: tok.encode(texts[i % len(texts)]), args.n)),
            ("  kvwire encode only, cold (cache emptied)", timed(lambda i: (
                tok._segments.clear(), tok.encode(texts[i % len(texts)])), args.n)),
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
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'':52s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for name, r in rows:
        print(f"{name:52s} " + (f"{r[0]:8.3f} {r[1]:8.3f}" if r else f"{'-':>8s} {'-':>8s}"))


if __name__ == "__main__":
    main()
