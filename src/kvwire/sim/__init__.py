"""Engines that run without a GPU: the late-join demo (:mod:`.demo`) and the fleet simulator
(:mod:`.trace`, :mod:`.engine`, :mod:`.batched`, :mod:`.fleet`, :mod:`.report`,
:mod:`.fleet_demo`, :mod:`.floor`; the batched engines are :mod:`kvwire.engine`; see
docs/sim.md)."""
