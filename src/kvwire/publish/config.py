"""``--kv-events-config``: the JSON object engines already accept, validated strictly."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from ..wire.endpoint import EndpointError, check_endpoint
from ..wire.events import check_dialect

__all__ = ["KVEventsConfig"]


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """KV event settings, with the engines' field names and defaults (spec section 4).

    ``dialect``, ``heartbeat_interval`` and the ``curve_*`` key files are kvwire additions
    (see docs/operations.md); reference engines would reject them, kvwire reads them.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    dialect: str = "vllm"
    heartbeat_interval: float | None = 1.0
    curve_secret_key_file: str | None = None
    curve_authorized_keys_dir: str | None = None

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if value < 0 or (name != "hwm" and value == 0):
                raise ValueError(f"KVEventsConfig.{name} must be positive, got {value!r}")
        if self.buffer_steps > 10_000_000:
            raise ValueError(
                f"KVEventsConfig.buffer_steps must be at most 10000000, got {self.buffer_steps!r}"
            )
        if self.heartbeat_interval is not None and self.heartbeat_interval <= 0:
            raise ValueError(
                "KVEventsConfig.heartbeat_interval must be > 0 seconds or null, "
                f"got {self.heartbeat_interval!r}"
            )
        try:
            check_endpoint(self.endpoint, "KVEventsConfig.endpoint")
            if self.replay_endpoint is not None:
                check_endpoint(self.replay_endpoint, "KVEventsConfig.replay_endpoint")
            check_dialect(self.dialect)
        except EndpointError:
            raise
        except ValueError as e:
            raise ValueError(f"KVEventsConfig.dialect: {e}") from None

    @classmethod
    def from_cli(cls, cli_value: str) -> KVEventsConfig:
        """Parse the JSON text users pass to ``--kv-events-config``."""
        try:
            raw = json.loads(cli_value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not valid JSON ({e}): {cli_value!r}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Any) -> KVEventsConfig:
        """Validate a mapping; errors name the field and the offending value."""
        if not isinstance(raw, dict):
            raise ValueError(f"KV events config must be a JSON object, got {raw!r}")
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as e:
            msg = str(e)
            if msg.startswith("KVEventsConfig."):
                raise ValueError(msg) from None
            unknown = sorted(set(raw) - set(cls.__struct_fields__))
            if unknown:
                raise ValueError(
                    f"KVEventsConfig: unknown field {unknown[0]!r} = {raw[unknown[0]]!r} "
                    f"(known fields: {', '.join(cls.__struct_fields__)})"
                ) from None
            field = msg.rsplit("$.", 1)[-1].rstrip("`") if "$." in msg else None
            if field in raw:
                raise ValueError(
                    f"KVEventsConfig.{field}: invalid value {raw[field]!r} ({msg})"
                ) from None
            raise ValueError(f"KVEventsConfig: {msg}") from None
