"""The `kvwire serve` application: the object graph that ties routing core, proxy, indexer
and load sharing, built, started and closed in one place (:mod:`.build`); its routes
(decision API, engines at run time, health, metrics) and its status page."""
