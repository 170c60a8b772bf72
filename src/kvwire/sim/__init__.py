"""Engines that run without a GPU: the late-join demo (:mod:`.demo`) and the fleet simulator
(:mod:`.trace`, :mod:`.engine`, :mod:`.fleet`, :mod:`.report`, :mod:`.fleet_demo`; see
docs/sim.md)."""
