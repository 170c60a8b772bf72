"""How long one engine step takes, and how long moving KV blocks between engines takes:
linear cost models with every constant a parameter.

``step = base + prefill_token x prefill tokens + decode_seq x decoding sequences
+ context_token x context tokens of the batch``. The defaults describe Llama-3.1-8B in
BF16 on one H100 SXM (docs/sim.md says where each number comes from and how it was derived).
``transfer = blocks x block_size x bytes_per_token / bandwidth + latency``: a disaggregated
decode engine pulling a prompt's KV from a prefill engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["StepCost", "TransferCost"]


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


@dataclass(frozen=True, slots=True)
class TransferCost:
    """Seconds to move KV blocks between two engines. Defaults: Llama-3.1-8B's KV in BF16
    (32 layers x 8 KV heads x 128 dims x K and V x 2 bytes = 131,072 bytes a token) over a
    400 Gb/s NIC (50 GB/s), plus 1 ms to set a transfer up."""

    bytes_per_token: int = 131_072
    bandwidth_Bps: float = 50e9
    latency_s: float = 1e-3

    def __post_init__(self) -> None:
        b = self.bytes_per_token
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"bytes_per_token must be an integer >= 1, got {b!r}")
        bw = self.bandwidth_Bps
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not math.isfinite(bw) \
                or bw <= 0:
            raise ValueError(f"bandwidth_Bps must be a finite number > 0, got {bw!r}")
        lat = self.latency_s
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) \
                or not math.isfinite(lat) or lat < 0:
            raise ValueError(f"latency_s must be a finite number >= 0, got {lat!r}")

    def bytes(self, blocks: int, block_size: int) -> int:
        """Bytes moved for ``blocks`` whole blocks (a partial last block moves whole)."""
        return blocks * block_size * self.bytes_per_token

    def time(self, blocks: int, block_size: int) -> float:
        """Seconds to move ``blocks`` blocks; nothing to move takes no time."""
        if blocks <= 0:
            return 0.0
        return blocks * block_size * self.bytes_per_token / self.bandwidth_Bps + self.latency_s
