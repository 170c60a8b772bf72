"""How long one engine step takes: a linear cost model with every constant a parameter.

``step = base + prefill_token x prefill tokens + decode_seq x decoding sequences
+ context_token x context tokens of the batch``. The defaults describe Llama-3.1-8B in
BF16 on one H100 SXM (docs/sim.md says where each number comes from and how it was derived).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["StepCost"]


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds per step: a fixed part (reading the weights once), per prefill token
    (compute-bound), per decoding sequence (sampling and per-sequence overhead), and
    optionally per context token in the batch (reading the KV cache in attention)."""

    base_s: float = 5.0e-3
    prefill_token_s: float = 5.0e-5
    decode_seq_s: float = 3.0e-5
    context_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("base_s", "prefill_token_s", "decode_seq_s", "context_token_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.base_s <= 0:
            raise ValueError(f"base_s must be > 0 (every step takes time), got {self.base_s!r}")

    def step_time(self, prefill_tokens: int, decode_seqs: int, context_tokens: int = 0) -> float:
        return (self.base_s + self.prefill_token_s * prefill_tokens
                + self.decode_seq_s * decode_seqs + self.context_token_s * context_tokens)
