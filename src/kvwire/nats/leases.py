"""Per-engine leases in a JetStream key-value bucket: several bridges share the work.

``kvwire bridge --share``: each engine is followed by exactly one bridge at a time. A lease
is the key ``<engine>`` in bucket ``kvwire-leases`` (created with a TTL); it is taken with
a create (fails if the key exists), renewed by compare-and-set on its revision, released
by a delete on exit. A bridge that dies stops renewing: the server expires its keys after
the TTL and another bridge's next create succeeds. A bridge whose renewal fails (its
revision is stale: it was cut off longer than the TTL and someone else took over) stops
following that engine at once; for the short overlap Msg-Id dedupe keeps the subject exact.
"""

from __future__ import annotations

import logging
from typing import Any

from .subjects import DEFAULT_LEASE_BUCKET, check_token

__all__ = ["LeaseTable"]

log = logging.getLogger("kvwire.nats.leases")


class LeaseTable:
    """The leases one bridge (``owner``) holds; call :meth:`open` once connected."""

    def __init__(self, js: Any, owner: str, *, bucket: str = DEFAULT_LEASE_BUCKET,
                 ttl: float = 10.0) -> None:
        if not ttl > 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl!r}")
        self.js = js
        self.owner = owner
        self.bucket = check_token(bucket, "lease bucket")
        self.ttl = ttl
        self.kv: Any = None
        self.held: dict[str, int] = {}  # engine -> revision of our last write
        self.acquired = 0
        self.lost = 0

    async def open(self) -> None:
        """Bind to the bucket, creating it (file storage, TTL) if missing."""
        from nats.js.api import KeyValueConfig, StorageType
        from nats.js.errors import BucketNotFoundError, NotFoundError

        try:
            self.kv = await self.js.key_value(self.bucket)
        except (BucketNotFoundError, NotFoundError):
            pass
        else:  # the bucket's TTL rules (another bridge made it): renew in time for it
            ttl = (await self.kv.status()).ttl
            if ttl:
                self.ttl = min(self.ttl, ttl)
            return
        self.kv = await self.js.create_key_value(KeyValueConfig(
            bucket=self.bucket, ttl=self.ttl, history=1, storage=StorageType.FILE,
            description="kvwire bridge per-engine leases"))

    @property
    def presence_key(self) -> str:
        return f"bridges.{self.owner.rsplit(':', 1)[-1]}"

    async def heartbeat(self) -> int:
        """Say this bridge is alive (a key the TTL expires if it dies); the number of live
        bridges, so each can take its fair share of the engines."""
        from nats.js.errors import NoKeysError

        await self.kv.put(self.presence_key, self.owner.encode())
        try:
            keys = await self.kv.keys()
        except NoKeysError:
            keys = []
        return max(1, sum(1 for k in keys if k.startswith("bridges.")))

    async def try_acquire(self, engine: str) -> bool:
        """Take the lease of ``engine`` if nobody holds it (or renew it if we do)."""
        from nats.js.errors import KeyWrongLastSequenceError

        if engine in self.held:
            return await self.renew(engine)
        try:
            self.held[engine] = await self.kv.create(engine, self.owner.encode())
        except KeyWrongLastSequenceError:
            return False
        self.acquired += 1
        log.info("lease on %s taken by %s", engine, self.owner)
        return True

    async def renew(self, engine: str) -> bool:
        """Compare-and-set on our revision; False (and forgotten) if someone else has it."""
        from nats.js.errors import KeyWrongLastSequenceError, NotFoundError

        rev = self.held.get(engine)
        if rev is None:
            return False
        try:
            self.held[engine] = await self.kv.update(engine, self.owner.encode(), last=rev)
            return True
        except (KeyWrongLastSequenceError, NotFoundError):
            del self.held[engine]
            self.lost += 1
            log.warning("lease on %s lost by %s (expired or taken over)", engine, self.owner)
            return False

    async def release(self, engine: str) -> None:
        """Give the lease back (only if it is still ours)."""
        from nats.js.errors import Error as JsError

        rev = self.held.pop(engine, None)
        if rev is None or self.kv is None:
            return
        try:
            await self.kv.delete(engine, last=rev)
        except JsError as e:  # expired or taken meanwhile: nothing to give back
            log.info("lease on %s not released: %s", engine, e)

    async def release_all(self) -> None:
        for engine in list(self.held):
            await self.release(engine)
        try:
            await self.kv.delete(self.presence_key)
        except Exception:  # noqa: BLE001 - gone already: the TTL removes it anyway
            pass

    async def holder(self, engine: str) -> str | None:
        """Who holds the lease of ``engine`` now (None: free)."""
        from nats.js.errors import KeyDeletedError, KeyNotFoundError, NotFoundError

        try:
            entry = await self.kv.get(engine)
        except (KeyNotFoundError, KeyDeletedError, NotFoundError):
            return None
        return None if entry.value is None else entry.value.decode()
