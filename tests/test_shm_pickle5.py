"""The C pickle subset codec (src/kvwire/shm/_pickle5.c, reached through kvwire.shm._ring's
dumps_fast / loads_fast), and the C ring's layout constants against layout.py.

* random plain-typed objects: the C encoder's bytes are valid pickle (pickle.loads gives
  the object back) and the C decoder reads both its own and pickle's output;
* random and damaged bytes never crash the decoder: it returns an object or SLOW (then
  pickle.loads decides), never a segfault or a stray Python error;
* every constant the C ring was compiled with equals layout.py's.
"""

from __future__ import annotations

import math
import pickle
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.shm import _native
from kvwire.shm._native import NATIVE, REASON

try:  # the module itself, even when KVWIRE_SHM_PURE=1 keeps MessageQueue off it
    from kvwire.shm import _ring as ring
except ImportError:  # not built here
    ring = None

pytestmark = pytest.mark.skipif(ring is None, reason=f"kvwire.shm._ring is not built: {REASON}")


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b))
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


_scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
            | st.text(max_size=300) | st.binary(max_size=300))
_keys = st.none() | st.booleans() | st.integers() | st.text(max_size=20) | st.binary(max_size=8)
_values = st.recursive(
    _scalars,
    lambda inner: (st.lists(inner, max_size=6) | st.lists(inner, max_size=6).map(tuple)
                   | st.dictionaries(_keys, inner, max_size=5)),
    max_leaves=25)


@settings(max_examples=400, deadline=None)
@given(_values)
def test_codec_agrees_with_pickle(obj) -> None:
    fast = ring.dumps_fast(obj)  # None: an int beyond 64 bits
    if fast is not None:
        assert _same(pickle.loads(fast), obj)  # valid pickle: a pure reader loads it
        assert _same(ring.loads_fast(fast), obj)
    std = pickle.dumps(obj, protocol=5)
    got = ring.loads_fast(std)  # pickle's own output for these types, memo included
    if got is not ring.SLOW:
        assert _same(got, pickle.loads(std))


@settings(max_examples=200, deadline=None)
@given(_values, st.integers(min_value=0, max_value=600))
def test_encoder_gives_up_cleanly_when_the_chunk_is_too_small(obj, cap: int) -> None:
    fast = ring.dumps_fast(obj, cap)
    if fast is not None:  # fitted: complete and exact, never cut short
        assert len(fast) <= cap
        assert _same(pickle.loads(fast), obj)


def test_codec_leaves_sharing_recursion_and_other_types_to_pickle() -> None:
    x = [1]
    assert ring.dumps_fast((x, x)) is None  # shared list: pickle's memo keeps the identity
    loop: list = []
    loop.append(loop)
    assert ring.dumps_fast(loop) is None
    for other in ({1, 2}, 1j, bytearray(b"x"), np.int64(3), "\ud800", 2**64, True.__class__):
        assert ring.dumps_fast(other) is None
    a, b = ring.loads_fast(pickle.dumps((x, x), 5))  # memo GETs keep the sharing
    assert a is b
    back = ring.loads_fast(pickle.dumps(loop, 5))
    assert back[0] is back
    assert ring.loads_fast(pickle.dumps({1, 2}, 5)) is ring.SLOW


def _decode(data: bytes) -> None:
    """Never crashes; any object it returns is the one pickle.loads would build."""
    got = ring.loads_fast(data)
    if got is ring.SLOW:
        return
    try:
        want = pickle.loads(data)
    except Exception:  # pickle refuses bytes the subset decoder accepted: report them
        pytest.fail(f"loads_fast accepted what pickle.loads refuses: {data!r}")
    assert _same(got, want), data


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_decoder_survives_random_bytes(data: bytes) -> None:
    ring.loads_fast(data)  # SLOW or an object; a crash kills the test process
    ring.loads_fast(b"\x80\x05" + data)  # past the protocol header, into the opcodes


@settings(max_examples=300, deadline=None)
@given(_values, st.randoms(use_true_random=False))
def test_decoder_survives_damaged_pickles(obj, rng: random.Random) -> None:
    for data in (ring.dumps_fast(obj), pickle.dumps(obj, 5)):
        if data is None:
            continue
        ring.loads_fast(data[: rng.randrange(len(data) + 1)])  # truncated
        q = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            q[rng.randrange(len(q))] = rng.randrange(256)
        ring.loads_fast(bytes(q))  # flipped bytes


def test_decoder_results_match_pickle_on_truncations() -> None:
    for obj in [("step", 42, [1, 2, 3]), {"k": [1.5, None, "x" * 300, b"y" * 70000]}]:
        for data in (ring.dumps_fast(obj), pickle.dumps(obj, 5)):
            for k in range(0, len(data), max(1, len(data) // 200)):
                _decode(data[:k])


def test_layout_constants_equal_layout_py() -> None:
    """The C ring hard-codes the shared-memory layout; a stale or edited build must not
    read another layout. (_native.py also refuses a mismatching build at import.)"""
    c = ring.LAYOUT
    want = _native._expected_layout()
    assert c == want
    assert NATIVE or REASON  # when it matches, only the env (or nothing) turns C off
