"""kvwire's one error for a refused request, below every room that raises it: the routing
core (no HTTP of its own) raises it as ``RouteError``, the indexer, the proxy and the engine
as an HTTP answer; the server renders it in kvwire's shape or OpenAI's."""

from __future__ import annotations

import msgspec

__all__ = ["HttpError"]

_enc = msgspec.json.Encoder()

class HttpError(ValueError):
    """A request refused: its HTTP ``status``, a ``message`` naming what was wrong, and two
    renderings. :meth:`kvwire` (``{"error": message, "reason": reason}``, ``reason`` being
    the label of the bad-request counters) for kvwire's own routes; :meth:`openai` (OpenAI's
    and vLLM's ``{"error": {"message", "type", "param", "code"}}``) for ``/v1`` and the
    engine. ``headers``: extra response headers (``retry-after``)."""

    def __init__(self, status: int, message: str, reason: str = "", *,
                 type: str | None = None, param: str | None = None,
                 headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.type = type
        self.param = param
        self.headers = headers

    def kvwire(self) -> bytes:
        return _enc.encode({"error": self.message, "reason": self.reason})

    def openai(self) -> bytes:
        return _enc.encode({"error": {"message": self.message,
                                      "type": self.type or "BadRequestError",
                                      "param": self.param, "code": self.status}})

    # (the ApiError interface the engine's code used)
    def body(self) -> bytes:
        return self.openai()
