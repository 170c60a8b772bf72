"""Cache-aware routing: the pure policy (:mod:`.policy`) and the HTTP service (:mod:`.service`,
needs the ``serve`` extra; imported lazily so the policy stays dependency-free)."""

from .policy import Candidate, Decision, LoadTracker, RoutingPolicy, request_load

__all__ = ["Candidate", "Decision", "LoadTracker", "RoutingPolicy", "request_load"]
