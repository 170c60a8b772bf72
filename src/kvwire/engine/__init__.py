"""A model of an LLM engine, pure and I/O-free: a vLLM V1-like scheduler with continuous
batching and chunked prefill, a paged KV cache with prefix caching that produces vLLM's KV
events, a step-time model, and the prefill and decode roles of disaggregated serving
(leases, pulls and their cost) (:mod:`.model`, :mod:`.kvcache`, :mod:`.request`,
:mod:`.timing`; see docs/sim.md). It imports nothing of kvwire but :mod:`kvwire.wire`.
"""

from .kvcache import PagedPrefixCache
from .model import ROLES, EngineConfig, EngineModel, Lease, StepResult
from .request import TRANSFERRING, EngineRequest, block_hashes
from .timing import StepCost, TransferCost

__all__ = ["ROLES", "TRANSFERRING", "EngineConfig", "EngineModel", "EngineRequest", "Lease",
           "PagedPrefixCache", "StepCost", "StepResult", "TransferCost", "block_hashes"]
