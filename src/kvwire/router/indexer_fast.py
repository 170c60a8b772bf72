"""``POST /query`` with its token ids parsed in C, in front of :meth:`Indexer.handle`.

A 2,048-token body decoded by msgspec into a list of Python ints costs about 40 us, more than
the rest of the answer; ``_tokens.c`` (the parser ``/route`` uses) reads the ids straight into
int64s in about a third of that, and the index hashes those without a Python int per token.
Everything else is the indexer's own code (:meth:`Indexer._answer`, ``shape_answer``), so the
answer is the same bytes. Any body the C parser does not take (ids not first, not plain
non-negative ints below 2**32), a query string, a body error of any kind: the request goes
to ``Indexer.handle`` unchanged, which answers or names the error exactly as without this.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

from ..index import block_keys
from .indexer import Indexer
from .indexer_api import BadRequest, QueryBody, pick_shape, shape_answer
from .tokens import parse_route_body

__all__ = ["fast_handle"]

_enc = msgspec.json.Encoder()
_rest = msgspec.json.Decoder(QueryBody)


def fast_handle(ix: Indexer) -> Any:
    """``handle(method, path, body)`` answering as ``ix.handle`` does, faster for /query."""
    slow = ix.handle
    if parse_route_body is None:  # not built: nothing to gain
        return slow
    index = ix.core.index

    def handle(method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if path != "/query" or method != "POST":
            return slow(method, path, body)
        fast = parse_route_body(body)
        if fast is None:
            return slow(method, path, body)
        packed, rest = fast
        if not packed or len(packed) > 8 * ix.max_tokens:
            return slow(method, path, body)
        try:
            req = _rest.decode(rest) if rest is not None else QueryBody()
            if req.token_ids:  # token_ids given twice: let the strict path say so
                return slow(method, path, body)
            scope = req.scope()
            shape = pick_shape(req.dynamo_spelling(), "")
        except (msgspec.DecodeError, BadRequest):
            return slow(method, path, body)
        toks = array("q")
        toks.frombytes(packed)
        scheme = index.key_scheme

        def keys_for(bs: int, salt: str | None) -> list[int]:
            return block_keys(toks, bs, scope.lora_name, salt, scheme)

        ix._count("query")
        try:
            return 200, _enc.encode(shape_answer(shape, scope, ix._answer(scope, keys_for, None)))
        except BadRequest as e:  # e.g. 503: the index stayed busy past the core's lock_timeout
            return ix._bad(e.status, str(e), e.reason)

    handle.close = ix.close  # type: ignore[attr-defined]  (a worker closes it at exit)
    return handle
