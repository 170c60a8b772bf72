"""The proxy's settings (``kvwire serve``'s proxy flags), apart from the classes that read
them so that each imports it without importing the others."""

from __future__ import annotations

from dataclasses import dataclass

from ..routing.pairs import FALLBACK

__all__ = ["ProxyConfig"]


@dataclass
class ProxyConfig:
    """``serve``'s proxy flags."""

    retries: int = 2
    cooloff: float = 5.0
    probe_interval: float = 1.0
    #: seconds an engine's /health may take: a loaded engine answers late, and one failed
    #: probe marks it down for the cool-off (until 2026-11-30: max(probe_interval, 0.5))
    probe_timeout: float = 5.0
    connect_timeout: float = 2.0
    first_byte_timeout: float = 60.0
    stall_timeout: float = 300.0
    max_body: int = 32 << 20
    #: stored responses whose engine is remembered (proxy/responses.py)
    response_ids: int = 100_000
    #: requests being answered at once; more are refused with 429 (0: no limit)
    max_in_flight: int = 4096
    #: workers encoding long new prompt text off the event loop (0: on the loop)
    tokenize_threads: int = 2
    #: long prompts being encoded off the loop at once, waiting included; more: 429
    tokenize_queue: int = 16
    #: prefill/decode pairs: the engines' protocol, ``vllm`` or ``sglang`` (None: vllm,
    #: and pairs only when an engine has a role other than both)
    pd_protocol: str | None = None
    #: a prefill that failed on every prefill engine tried: ``local`` (prefill on the
    #: decode engine) or ``fail`` (502)
    pd_fallback: str = "local"

    def __post_init__(self) -> None:
        if self.pd_protocol not in (None, "vllm", "sglang"):
            raise ValueError(f"pd_protocol must be vllm or sglang, got {self.pd_protocol!r}")
        if self.pd_fallback not in FALLBACK:
            raise ValueError(f"pd_fallback must be local or fail, got {self.pd_fallback!r}")
