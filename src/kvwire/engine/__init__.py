"""A model of an LLM engine, pure and I/O-free: a vLLM V1-like scheduler with continuous
batching and chunked prefill, a paged KV cache with prefix caching that produces vLLM's KV
events, and a step-time model (:mod:`.model`, :mod:`.kvcache`, :mod:`.request`,
:mod:`.timing`; see docs/sim.md). It imports nothing of kvwire but :mod:`kvwire.wire`.
"""

from .kvcache import PagedPrefixCache
from .model import EngineConfig, EngineModel, StepResult
from .request import EngineRequest, block_hashes
from .timing import StepCost

__all__ = ["EngineConfig", "EngineModel", "EngineRequest", "PagedPrefixCache", "StepCost",
           "StepResult", "block_hashes"]
