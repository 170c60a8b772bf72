"""Deprecated: the routing policy moved to :mod:`kvwire.routing.policy` (and the load
tracker to :mod:`kvwire.routing.load`); this name keeps working for one release."""

import warnings

from ..routing.load import LoadTracker
from ..routing.policy import (
    POLICIES,
    Candidate,
    Decision,
    LeastLoadPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    RoutingPolicy,
    make_policy,
    request_load,
)

warnings.warn("kvwire.router.policy moved to kvwire.routing.policy (LoadTracker: "
              "kvwire.routing.load); the old name goes in the next release",
              DeprecationWarning, stacklevel=2)

__all__ = ["POLICIES", "Candidate", "Decision", "LeastLoadPolicy", "LoadTracker",
           "RandomPolicy", "RoundRobinPolicy", "RoutingPolicy", "make_policy", "request_load"]
