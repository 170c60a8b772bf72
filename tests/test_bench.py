"""The benchmarks' own logic, in seconds (the benchmarks take minutes: `make bench` runs them):
bench/tokenizer.py's long-prompt table on a small prompt, and the chats bench/routing.py
builds from the trace. Both run in a child process: the bench folder on ``sys.path`` would
shadow modules (events, index, proxy...) in this one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_tokenizer_long_rows() -> None:
    """Every tokenizer and prompt shape gets its cold, warm-extend and library rows; the
    warm-extend calls add about ``--extend`` of the prompt, and the library's row counts the
    same new tokens."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "tokenizer.py"), "--quick",
                        "--long-only", "--long-tokens", "1000", "--long-n", "3", "--cold-n",
                        "2", "--extend", "0.1"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    found = [(m[0].strip(), m[1].split()) for m in re.findall(r"^(.{50}) (\s*\d.*)$",
                                                              r.stdout, re.M)]
    names = [n for n, _ in found]
    for kind in ("qwen3", "builtin"):
        for shape in ("text", "chat"):
            cold = names.index(f"{kind} {shape}, cold (new tokenizer, new prompt)")
            warm = names.index(f"{kind} {shape}, warm-extend (seen + new part)")
            assert names[warm + 1] == "library, the new part alone", r.stdout
            (_, c), (_, w), (_, lib) = found[cold], found[warm], found[warm + 1]
            calls, tokens, new = (float(v) for v in w[:3])
            assert calls == 3 and 0.05 <= new / tokens <= 0.2, w
            assert lib[1] == lib[2] == w[2] and float(c[1]) >= 1000, r.stdout
            assert all(float(v) >= 0 for v in w[3:]), w
    assert len(re.findall(r"^  \w+ +\w+ warm: .* (MET|MISSED); \d+% seen", r.stdout, re.M)) == 4, \
        r.stdout


ROUTING_CHECK = r"""
import os, re, shutil, sys
sys.path.insert(0, os.path.join(sys.argv[1], "bench"))
import routing
from kvwire.sim.trace import bundled_trace_path, load_trace
from kvwire.tokenize import load_tokenizer


def lcp(a, b):  # length of the common prefix, by slices (C speed)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


reqs = load_trace(bundled_trace_path(), limit=80)
qwen = routing.vendored_qwen3()
try:
    for tok in (load_tokenizer(None), load_tokenizer(qwen)):
        chats = routing.ChatBuilder(tok)
        msgs = [chats.messages(r, i) for i, r in enumerate(reqs)]
        for m, r in zip(msgs, reqs):
            assert m[0]["role"] == "system" and m[-1]["role"] == "user"
            assert len(m) == -(-r.cacheable_tokens // 512) + 1
            assert all(len(tok.encode(b["content"])) == 512 for b in m[:r.cacheable_tokens // 512][:3])
        texts = [tok.render_chat(m) for m in msgs]
        # where message k starts in chat i's text (both templates open each with im_start;
        # rendering the first k alone would not do: Qwen3's renders a last assistant turn
        # with a thinking block)
        starts = [[m.start() for m in re.finditer(re.escape("<|im_start|>"), t)] for t in texts]
        assert all(len(st) == len(m) + 1 for st, m in zip(starts, msgs))

        def head(i, k):  # length of chat i's first k messages, rendered
            return starts[i][k]

        shared_pairs = apart = 0
        for i in range(len(reqs)):
            for j in range(i):
                a, b = reqs[i].hash_ids, reqs[j].hash_ids
                k = 0
                while k < min(len(a), len(b)) and a[k] == b[k]:
                    k += 1
                if k * 512 > min(reqs[i].cacheable_tokens, reqs[j].cacheable_tokens):
                    continue  # a shared block is the last, partial one of a request
                shared = lcp(texts[i], texts[j])
                if k:
                    assert shared >= head(i, k), (tok.name, i, j, k)
                    shared_pairs += 1
                if k < len(msgs[i]) - 1 and k < len(msgs[j]) - 1:  # block k differs
                    assert shared < head(i, k + 1), (tok.name, i, j, k)
                    apart += 1
        assert shared_pairs > 0 and apart > 0, (shared_pairs, apart)
        print(tok.name, "pairs", shared_pairs, apart)
finally:
    shutil.rmtree(qwen, ignore_errors=True)
"""


def test_routing_chats_share_the_trace_prefixes() -> None:
    """bench/routing.py's chats (builtin and Qwen3): a system prompt, a message a trace
    block of exactly 512 tokens, a last user turn; two requests sharing their first k blocks
    share the rendered text of their first k messages, and no more than one message beyond."""
    r = subprocess.run([sys.executable, "-c", ROUTING_CHECK, str(ROOT)], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0 and "pairs" in r.stdout, r.stderr[-3000:]
