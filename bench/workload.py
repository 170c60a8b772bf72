"""The churn batch the subscriber and NATS benches both publish (one definition, so their
numbers stay comparable): 4 blocks stored, 4 older ones removed, 64 token ids."""

from __future__ import annotations

import time

from kvwire.wire import events as E


def step(i: int) -> E.KVEventBatch:
    base = 4 * i
    return E.KVEventBatch(
        time.time(),
        [E.BlockStored([base + 1, base + 2, base + 3, base + 4], base,
                       list(range(i % 1000, i % 1000 + 64)), 16, None, "GPU"),
         E.BlockRemoved([base - 7, base - 6, base - 5, base - 4], "GPU")],
        0,
    )
