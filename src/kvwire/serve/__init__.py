"""The `kvwire serve` application: its routes (decision API, engines at run time, health,
metrics), its status page, and the object graph that ties proxy, indexer and routing core."""
