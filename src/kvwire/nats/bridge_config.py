"""``kvwire bridge`` settings and the JetStream stream it writes to (kept apart from the
bridge's run loop in :mod:`kvwire.nats.bridge`, which re-exports them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..consume.stream import StreamConfig
from .subjects import (
    DEFAULT_LEASE_BUCKET,
    DEFAULT_PREFIX,
    DEFAULT_SNAPSHOT_BUCKET,
    DEFAULT_STREAM,
    check_token,
)

__all__ = ["BridgeConfig", "BridgeError", "ensure_stream"]


class BridgeError(RuntimeError):
    """Bad configuration or a JetStream refusal, said in words (the CLI exits 2 on it)."""


@dataclass
class BridgeConfig:
    """Where to write and how much history JetStream keeps (``None``: unlimited)."""

    nats: str | list[str] = "nats://127.0.0.1:4222"
    stream: str = DEFAULT_STREAM
    prefix: str = DEFAULT_PREFIX
    max_age: float | None = None  # seconds
    max_bytes: int | None = None
    max_msgs_per_subject: int | None = None
    duplicate_window: float = 120.0  # seconds; must not exceed max_age
    snapshot_interval: float = 30.0  # seconds; 0: no object-store snapshots
    snapshot_bucket: str = DEFAULT_SNAPSHOT_BUCKET
    share: bool = False
    lease_bucket: str = DEFAULT_LEASE_BUCKET
    lease_ttl: float = 10.0
    max_inflight: int = 4096
    ack_timeout: float = 5.0
    pack: int = 256  # guarded runs of up to this many batches (1: one message per batch)
    log_interval: float = 10.0  # seconds between one-line stat logs; 0: none
    skip_timeout: float = 10.0  # reference run check: longest wait to reach the subject's seq
    connect_timeout: float = 10.0  # first connection only; later ones are retried forever
    stream_config: StreamConfig = field(default_factory=StreamConfig)

    def check(self) -> None:
        """Raise :class:`BridgeError` naming the first bad setting."""
        def bad(what: str) -> BridgeError:
            return BridgeError(f"bad bridge config: {what}")

        if not self.stream or any(c in self.stream for c in " \t.*>/\\"):
            raise bad(f"stream name {self.stream!r} must be non-empty, without spaces, "
                      "'.', '*', '>', '/' or '\\'")
        try:
            for part in self.prefix.split("."):
                check_token(part, "subject prefix part")
            check_token(self.snapshot_bucket, "snapshot bucket")
            check_token(self.lease_bucket, "lease bucket")
        except ValueError as e:
            raise bad(str(e)) from None
        for name, v in (("max_age", self.max_age), ("max_bytes", self.max_bytes),
                        ("max_msgs_per_subject", self.max_msgs_per_subject)):
            if v is not None and not v > 0:
                raise bad(f"{name} must be > 0 (or unset for unlimited), got {v!r}")
        if not self.duplicate_window > 0:
            raise bad(f"duplicate_window must be > 0 seconds, got {self.duplicate_window!r}")
        if self.max_age is not None and self.duplicate_window > self.max_age:
            raise bad(f"duplicate_window ({self.duplicate_window:g}s) cannot exceed max_age "
                      f"({self.max_age:g}s): JetStream would refuse the stream")
        if self.max_bytes is not None and self.max_bytes < 1 << 20:
            raise bad(f"max_bytes {self.max_bytes} is below 1 MiB: not one snapshot chunk fits")
        if not self.snapshot_interval >= 0:
            raise bad(f"snapshot_interval must be >= 0, got {self.snapshot_interval!r}")
        for name, v in (("lease_ttl", self.lease_ttl), ("ack_timeout", self.ack_timeout),
                        ("skip_timeout", self.skip_timeout),
                        ("connect_timeout", self.connect_timeout)):
            if not v > 0:
                raise bad(f"{name} must be > 0 seconds, got {v!r}")
        if self.max_inflight < 1:
            raise bad(f"max_inflight must be >= 1, got {self.max_inflight}")
        if not isinstance(self.pack, int) or not 1 <= self.pack <= 4096:
            raise bad(f"pack must be an int from 1 to 4096, got {self.pack!r}")


async def ensure_stream(js: Any, cfg: BridgeConfig) -> Any:
    """Create the stream (file storage) or update its limits; BridgeError if it cannot."""
    from nats.js.api import DiscardPolicy, StorageType
    from nats.js.api import StreamConfig as JsStreamConfig
    from nats.js.errors import APIError, NotFoundError

    subject = f"{cfg.prefix}.>"
    limits: dict[str, Any] = {"duplicate_window": cfg.duplicate_window, "allow_direct": True,
                              "discard": DiscardPolicy.OLD}
    if cfg.max_age is not None:
        limits["max_age"] = cfg.max_age
    if cfg.max_bytes is not None:
        limits["max_bytes"] = cfg.max_bytes
    if cfg.max_msgs_per_subject is not None:
        limits["max_msgs_per_subject"] = cfg.max_msgs_per_subject
    try:
        try:
            info = await js.stream_info(cfg.stream)
        except NotFoundError:
            return await js.add_stream(JsStreamConfig(
                name=cfg.stream, subjects=[subject], storage=StorageType.FILE, **limits))
        have = info.config
        if subject not in (have.subjects or []):
            raise BridgeError(f"stream {cfg.stream} exists with subjects {have.subjects}, "
                              f"not {subject!r}: use another --stream or --prefix")
        if have.storage != StorageType.FILE:
            raise BridgeError(f"stream {cfg.stream} exists with {have.storage} storage; the "
                              "bridge needs file storage (delete it or use another --stream)")
        return await js.update_stream(dataclasses.replace(have, **limits))
    except APIError as e:
        raise BridgeError(f"JetStream refused stream {cfg.stream}: "
                          f"{e.description or e} (code {e.err_code})") from None
