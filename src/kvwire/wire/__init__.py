"""What is on the wire: event types (:mod:`.event_types`) and their dialects (:mod:`.events`,
:mod:`.rfc1527`), ZeroMQ frames
(:mod:`.frames`), endpoints (:mod:`.endpoint`), CurveZMQ (:mod:`.curve`), and the frame layout
of the transport and of kvwire's control extension (:mod:`.protocol`).

This package re-exports nothing: the names a user needs (``KVEventBatch``, ``BlockStored``,
``decode_batch``, ``encode_batch``, ...) are at the top level (``from kvwire import ...``);
protocol internals stay in the module that defines them (``kvwire.wire.protocol.MAGIC``)."""
