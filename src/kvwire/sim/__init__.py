"""Engines that run without a GPU: the late-join demo (:mod:`.demo`) and the fleet simulator
(:mod:`.trace`, :mod:`.types`, :mod:`.fifo` and :mod:`.batched` (its two engine models),
:mod:`.routers`, :mod:`.baselines` (SGLang's ``cache_aware`` rebuilt), :mod:`.fleet`,
:mod:`.report`, :mod:`.fleet_demo`, :mod:`.floor`; the batched model runs
:mod:`kvwire.engine`; see docs/sim.md)."""
