"""Deprecated: the routing core moved to :mod:`kvwire.routing.core`; this name keeps working
for one release."""

import warnings

from ..routing.core import EngineConflict, EngineSpec, Routed, RouteError, RouterCore

warnings.warn("kvwire.router.service moved to kvwire.routing.core; the old name goes in the "
              "next release", DeprecationWarning, stacklevel=2)

__all__ = ["EngineConflict", "EngineSpec", "RouteError", "Routed", "RouterCore"]
