"""Mooncake request traces: loading, replaying, and the token ids behind their hash ids.

A Mooncake trace is JSON lines: ``timestamp`` (ms), ``input_length``, ``output_length``,
``hash_ids`` (ids of the request's 512-token prefix blocks; equal ids mean equal prefixes up
to and including that block). The trace carries no tokens, so the simulator derives them:
block ``i``'s 512 token ids depend on ``hash_ids[i]`` only (a SHAKE-128 stream seeded by the
id), which is exactly what the ids mean, and lets the prefix index hash real tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
from array import array
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

try:  # optional (the sim extra brings it with matplotlib): 10x faster token arrays
    import numpy as _np
except ImportError:  # pragma: no cover - exercised where numpy is absent
    _np = None

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "Request",
    "TraceError",
    "block_tokens",
    "bundled_trace_path",
    "load_trace",
    "prompt_array",
    "prompt_tokens",
    "repeat_trace",
]

#: Tokens per Mooncake hash id.
MOONCAKE_BLOCK_TOKENS = 512
_SALT = b"kvwire-sim/v1:"


class TraceError(ValueError):
    """A trace line that is not a valid Mooncake request (the message names the line)."""


@dataclass(frozen=True, slots=True)
class Request:
    """One trace request; ``t`` in seconds since the trace start."""

    t: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def cacheable_tokens(self) -> int:
        """Prompt tokens named by hash ids (all of them in a well-formed trace)."""
        return min(self.input_length, len(self.hash_ids) * MOONCAKE_BLOCK_TOKENS)


def bundled_trace_path() -> Path:
    """The Mooncake synthetic trace shipped as package data (3,993 requests)."""
    return Path(str(resources.files("kvwire.sim") / "data" / "synthetic_trace.jsonl"))


def _int_field(obj: dict, key: str, where: str, minimum: int = 0) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TraceError(f"{where}: {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def parse_line(line: str, where: str) -> Request:
    """One JSON line -> Request; TraceError naming ``where`` and the field when invalid."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: 'timestamp' must be a number of ms >= 0, got {ts!r}")
    inp = _int_field(obj, "input_length", where, 0)
    out = _int_field(obj, "output_length", where, 0)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 48 for h in ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers in [0, 2**48)")
    # Fewer ids than input_length needs is accepted: only the prefix the ids name is
    # cacheable (Request.cacheable_tokens); the rest is always prefilled.
    return Request(ts / 1000.0, inp, out, tuple(ids))


def load_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """Read a Mooncake JSONL trace (blank lines skipped), sorted by timestamp (stable).

    Raises TraceError naming the file and line of the first bad record, or if it is empty."""
    path = Path(path)
    reqs: list[Request] = []
    try:
        fh = path.open(encoding="utf-8")
    except OSError as e:
        raise TraceError(f"{path}: cannot open trace ({e.strerror})") from None
    with fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            reqs.append(parse_line(line, f"{path}:{n}"))
            if limit is not None and len(reqs) >= limit:
                break
    if not reqs:
        raise TraceError(f"{path}: no requests in trace")
    reqs.sort(key=lambda r: r.t)
    return reqs


def repeat_trace(reqs: list[Request], times: int) -> list[Request]:
    """The trace played ``times`` times back to back: each copy shifted in time by the
    trace's span (plus its mean gap) and its hash ids offset past every id used before, so
    copies share no prefixes with each other (a longer trace with the same statistics)."""
    if times < 1:
        raise ValueError(f"times must be >= 1, got {times}")
    if times == 1:
        return list(reqs)
    t0, t1 = reqs[0].t, reqs[-1].t
    span = (t1 - t0) + ((t1 - t0) / max(1, len(reqs) - 1))
    id_span = 1 + max((max(r.hash_ids) for r in reqs if r.hash_ids), default=0)
    out: list[Request] = []
    for k in range(times):
        dt, dh = k * span, k * id_span
        out.extend(
            Request(r.t + dt, r.input_length, r.output_length, tuple(h + dh for h in r.hash_ids))
            for r in reqs
        )
    return out


def block_tokens(hash_id: int) -> bytes:
    """The 512 token ids (uint16, native order) of Mooncake block ``hash_id``, as bytes."""
    return hashlib.shake_128(_SALT + hash_id.to_bytes(8, "little")).digest(
        2 * MOONCAKE_BLOCK_TOKENS
    )


def prompt_tokens(req: Request, n_tokens: int | None = None) -> list[int]:
    """The first ``n_tokens`` (default: all cacheable) token ids of a request."""
    n = req.cacheable_tokens if n_tokens is None else n_tokens
    nb = -(-n // MOONCAKE_BLOCK_TOKENS)
    arr = array("H", b"".join(block_tokens(h) for h in req.hash_ids[:nb]))
    return arr[:n].tolist()


def prompt_array(req: Request, n_tokens: int) -> array:
    """The first ``n_tokens`` token ids as ``array('q')``: the index converts an int64 array
    to bytes with one copy, where a list costs a Python int per token (about 8x slower)."""
    nb = -(-n_tokens // MOONCAKE_BLOCK_TOKENS)
    raw = b"".join(block_tokens(h) for h in req.hash_ids[:nb])
    out = array("q")
    if _np is not None:
        out.frombytes(_np.frombuffer(raw, dtype=_np.uint16)[:n_tokens].astype(_np.int64).tobytes())
    else:
        out.extend(iter(array("H", raw)[:n_tokens]))
    return out
