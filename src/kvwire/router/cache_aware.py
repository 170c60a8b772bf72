"""Deprecated path: SGLang's ``cache_aware`` policy, the simulator's baseline, is
:mod:`kvwire.sim.baselines` now (the simulator is its only user); this name goes in the next
release."""

from .._moved import moved

__getattr__ = moved(__name__, "kvwire.sim.baselines", ["CacheAwareParams", "CacheAwarePolicy"])
