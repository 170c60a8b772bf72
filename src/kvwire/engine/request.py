"""A request as the engine model sees it, and the content hash that names its blocks.

A block's identity covers its parent's identity, its tokens, the LoRA adapter, and (on the
first block, so every later block inherits it through the chain) the cache salt: two
requests share a cached block exactly when their prompts agree up to the end of that block
under the same adapter and salt. The hash is BLAKE2b (64 bits), stable across processes, so
a run is the same for a seed whatever ``PYTHONHASHSEED`` is.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["EngineRequest", "block_hashes", "extend_hashes"]

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
#: a remote-prefill request holding its blocks while its prompt's KV is pulled
TRANSFERRING = "transferring"


def _extra(lora_id: int | None, cache_salt: str | None, first: bool) -> bytes:
    salt = cache_salt if first else None
    if lora_id is None and salt is None:
        return b""
    return repr((lora_id, salt)).encode()


def extend_hashes(hashes: list[int], tokens: Sequence[int], block_size: int,
                  lora_id: int | None = None, cache_salt: str | None = None) -> list[int]:
    """Append the hashes of the full blocks of ``tokens`` not yet in ``hashes``."""
    n = len(tokens) // block_size
    i = len(hashes)
    if i >= n:
        return hashes
    part = tokens[i * block_size:n * block_size]
    raw = (part if isinstance(part, array) and part.typecode == "q" else array("q", part)).tobytes()
    step = 8 * block_size
    rest = _extra(lora_id, None, False)
    parent = hashes[-1] if hashes else 0
    for j in range(n - i):
        extra = rest if i + j else _extra(lora_id, cache_salt, True)
        d = hashlib.blake2b(parent.to_bytes(8, "little") + extra + raw[j * step:(j + 1) * step],
                            digest_size=8).digest()
        parent = int.from_bytes(d, "little")
        hashes.append(parent)
    return hashes


def block_hashes(tokens: Sequence[int], block_size: int, lora_id: int | None = None,
                 cache_salt: str | None = None) -> list[int]:
    """The hashes of every full block of ``tokens`` (unsigned 64-bit, chained)."""
    return extend_hashes([], tokens, block_size, lora_id, cache_salt)


@dataclass(eq=False)
class EngineRequest:
    """One generation request: a prompt of token ids and ``max_tokens`` to generate.

    The fields after ``cache_salt`` are the engine's bookkeeping (read them, do not set
    them). Generated token ids come from a generator seeded by the engine's seed and the
    request id, so a run is reproducible and output blocks are cached like any others."""

    rid: str
    prompt: Sequence[int]
    max_tokens: int
    lora_id: int | None = None
    cache_salt: str | None = None
    #: the token ids to generate (at least ``max_tokens``); None: random ids from the seed
    output: Sequence[int] | None = None
    #: prefill side of a disaggregated pair: compute the prompt, sample one token, finish,
    #: and hold the blocks under a lease for the decode engine to pull (vLLM's
    #: ``do_remote_decode``)
    remote_decode: bool = False
    #: decode side: the prompt's KV comes from a remote engine (vLLM's ``do_remote_prefill``)
    remote_prefill: bool = False

    status: str = WAITING
    arrival: float = 0.0
    tokens: array = field(default_factory=lambda: array("q"))  # prompt + generated so far
    hashes: list[int] = field(default_factory=list)  # of tokens' full blocks
    blocks: list[int] = field(default_factory=list)  # physical blocks held
    num_computed: int = 0  # tokens whose KV is computed (or taken from the cache)
    num_cached_blocks: int = 0  # leading held blocks that carry their hash
    num_output: int = 0
    #: tokens found in the prefix cache at the first admission (vLLM's ``cached_tokens``)
    cached_tokens: int = -1
    #: tokens found in the prefix cache at its latest admission (after a preemption too)
    hit_tokens: int = 0
    preemptions: int = 0
    first_token_t: float | None = None
    last_token_t: float = 0.0
    finish_t: float | None = None
    #: a remote-prefill request's pull: the first block index and how many blocks (set when
    #: it enters TRANSFERRING; the last prompt token is always computed locally)
    pull_from: int = 0
    pull_blocks: int = 0
    #: whether the pull is still to be decided (a remote-prefill request before its first
    #: admission); False after it pulled, failed or chose a local prefill
    pull_pending: bool = False
    #: the request ended without output: its transfer failed under ``load_failure="fail"``
    failed: bool = False
    _out: array = field(default_factory=lambda: array("q"), repr=False)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def _start(self, block_size: int, seed: int) -> None:
        if not self.tokens:
            self.tokens = array("q", self.prompt)
            extend_hashes(self.hashes, self.tokens, block_size, self.lora_id, self.cache_salt)
            if self.output is not None:
                if len(self.output) < self.max_tokens:
                    raise ValueError(f"request {self.rid!r}: output has {len(self.output)} "
                                     f"tokens, fewer than max_tokens ({self.max_tokens})")
                self._out = array("q", self.output[:self.max_tokens])
                return
            raw = random.Random(f"{seed}/{self.rid}").randbytes(4 * self.max_tokens)
            self._out = array("q", array("I", raw))  # ids below 2**32

    def _append_output(self, n: int, block_size: int) -> None:
        k = self.num_output
        self.tokens.extend(self._out[k:k + n])
        self.num_output = k + n
        if len(self.tokens) // block_size > len(self.hashes):
            extend_hashes(self.hashes, self.tokens, block_size, self.lora_id, self.cache_salt)
