"""The consumer side: the pure stream state machine, the subscriber (sync + asyncio faces),
the block cache (kvwire.index.cache)."""
