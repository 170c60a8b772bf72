"""Routing a long prompt on its start (docs/decisions/0019-route-on-the-start.md): the
proxy's handler and the endpoint picker route a :class:`~.offload.Partial` the same way. A
start settles the route when no engine holds all of its full blocks (blocks match as a
chain: nothing after it can lengthen a match); until one does, the start grows. The rest,
tokenized while the request is served, then completes the route: the whole prompt predicted
on its engine and its reservation set to its true length."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..http1 import HttpError
from ..routing.core import RouterCore
from .offload import Partial
from .tokens import TOKENIZING_ERRORS

__all__ = ["route_on_start", "whole_ids"]


async def route_on_start(core: RouterCore, counts: Any, part: Partial, lora: str | None,
                         salt: str | None, usable: Callable[[str], bool],
                         up: Callable[[str], bool]) -> tuple[Any, Any]:
    """Route ``part`` as soon as a start settles where its cached prefix ends, growing the
    start until one does or it is the whole prompt; its rest, tokenized meanwhile,
    completes the route. Returns the route and the ids known (a retry takes the whole ids
    from the rest: :func:`whole_ids`). RouteError as :meth:`RouterCore.route_proxy` raises
    it, or 400 if more of the text cannot be tokenized. ``counts``: the fleet's
    (``routed_on_start``, ``rests_skipped``, ``start_rest_failures``)."""
    try:
        while not part.done:
            routed = core.route_proxy(part.ids, lora, salt, usable, up, total=part.tokens)
            if routed is not None:
                counts["routed_on_start"] += 1
                rest = part.routed()
                if rest is None:  # (the workers had as many rests as they take)
                    counts["rests_skipped"] += 1
                    return routed, part.ids

                def complete(t: asyncio.Task, routed: Any = routed) -> None:
                    if t.cancelled() or t.exception() is not None:
                        counts["start_rest_failures"] += 1
                    else:
                        core.complete(routed, t.result(), lora, salt)

                rest.add_done_callback(complete)
                return routed, part.ids
            try:
                await part.extend()
            except TOKENIZING_ERRORS as e:  # (as Tokens.prompt answers them)
                raise HttpError(400, f"cannot tokenize the request: {e}",
                                param="prompt") from None
    finally:
        part.release()
    return core.route_proxy(part.ids, lora, salt, usable, up), part.ids


async def whole_ids(part: Partial, known: Any) -> Any:
    """The whole ids of a prompt routed on its start, for a retry on another engine: its
    rest's, once done (the first engine failed: a retry is rare and waits), so the retry is
    weighed and reserved at its true length and predicted whole there; ``known`` if the rest
    was skipped or failed (counted where it ended)."""
    if part.rest is None:
        return known
    try:
        return await asyncio.shield(part.rest)  # (a client gone leaves the rest to finish)
    except Exception:  # noqa: BLE001 (a rest that failed is counted by its callback)
        return known
