"""Which engine holds which stored response (OpenAI's Responses API, as vLLM serves it).

vLLM keeps a response it produced (``store``) in that server's memory: a later
``POST /v1/responses`` with ``previous_response_id`` continues the conversation only
there, and ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``,
``GET /v1/responses/{id}/input_items`` and ``DELETE /v1/responses/{id}`` find the response
only there. Routed by load, most of them would reach an engine that answers 404. So the
proxy learns each response's id from the answer that created it (the first
``"id": "resp_..."`` of the body or stream: the response object's own id, which both
vLLM and OpenAI write before its items) and sends what names the id to that engine. The
table is bounded (least recently used forgotten first); an id it does not know (the
proxy restarted, or forgot it) is looked for on each engine in turn, and the one that
does not answer 404 is remembered.

No I/O here: the proxy (router/forward.py) feeds it what it reads and asks it where to go.
"""

from __future__ import annotations

import re
from collections import OrderedDict

__all__ = ["PREFIX", "RESPONSE_ID", "SCAN_LIMIT", "ResponseOwners", "addressed"]

PREFIX = b"/v1/responses/"
#: A response object's id as it appears in an answer (the first one is the response's own).
RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"\\]{1,256})"')
#: How far into an answer the id is looked for (it comes in the first event or field).
SCAN_LIMIT = 64 << 10
#: What may follow ``/v1/responses/{id}``.
_SUFFIXES = (b"", b"/cancel", b"/input_items")


def addressed(path: bytes) -> str | None:
    """The response id of ``/v1/responses/{id}``, ``.../cancel`` or ``.../input_items``;
    None for any other path (``""`` for a path under ``/v1/responses/`` of another form)."""
    if not path.startswith(PREFIX):
        return None
    rest = path[len(PREFIX):]
    rid, slash, tail = rest.partition(b"/")
    if not rid or (b"/" + tail if slash else b"") not in _SUFFIXES:
        return ""
    try:
        return rid.decode("ascii")
    except UnicodeDecodeError:
        return ""


class ResponseOwners:
    """Response id -> the engine that produced it, at most ``capacity`` ids (least
    recently used forgotten first)."""

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._owner: OrderedDict[str, str] = OrderedDict()
        self.learned = 0
        self.forgotten = 0  # pushed out by the bound

    def __len__(self) -> int:
        return len(self._owner)

    def get(self, rid: str) -> str | None:
        engine = self._owner.get(rid)
        if engine is not None:
            self._owner.move_to_end(rid)
        return engine

    def learn(self, rid: str, engine: str) -> None:
        if not self.capacity:
            return
        if self._owner.get(rid) != engine:
            self.learned += 1
        self._owner[rid] = engine
        self._owner.move_to_end(rid)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
            self.forgotten += 1

    def learn_from(self, data: bytes, engine: str) -> bool:
        """Learn the id of the response in ``data`` (an answer's start); True if found."""
        m = RESPONSE_ID.search(data, 0, SCAN_LIMIT)
        if m is None:
            return False
        self.learn(m.group(1).decode("ascii", "replace"), engine)
        return True

    def forget(self, rid: str) -> None:
        self._owner.pop(rid, None)
