"""Deprecated: old import paths only. The router's systems have rooms of their own now:
:mod:`kvwire.routing` (the routing core), :mod:`kvwire.proxy`, :mod:`kvwire.indexer` and
:mod:`kvwire.serve`; each old module forwards to its new one for one release.

Deprecated here too: ``from kvwire.router import RoutingPolicy`` (and ``Candidate``,
``Decision``, ``LoadTracker``, ``request_load``) keeps working for one release, with a
DeprecationWarning; import them from :mod:`kvwire.routing`. (Resolved on use, so importing
a module of this package warns about nothing.)"""

from typing import Any

_MOVED = {"Candidate": "kvwire.routing.policy", "Decision": "kvwire.routing.policy",
          "LoadTracker": "kvwire.routing.load", "RoutingPolicy": "kvwire.routing.policy",
          "request_load": "kvwire.routing.policy"}

__all__ = ["Candidate", "Decision", "LoadTracker", "RoutingPolicy", "request_load"]


def __getattr__(name: str) -> Any:
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'kvwire.router' has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(f"kvwire.router.{name} moved to kvwire.routing.{name}; the old name goes "
                  "in the next release", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)
