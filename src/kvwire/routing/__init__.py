"""Routing by cache, without HTTP or asyncio: the pure policy (:mod:`.policy`), the load it
weighs (:mod:`.load`), the subscriber that feeds a prefix index (:mod:`.feed`), the router
built on them (:mod:`.core`) and the pure half of replica load sharing (:mod:`.sharing`).

Importing this package loads only the pure policy and load (no ZeroMQ, no subscriber)."""

from .load import LoadTracker
from .policy import POLICIES, Candidate, Decision, RoutingPolicy, make_policy, request_load

__all__ = ["POLICIES", "Candidate", "Decision", "LoadTracker", "RoutingPolicy", "make_policy",
           "request_load"]
