"""Own block keys: chained 64-bit xxh3 digests of each full block's token ids.

Engine block hashes cannot be recomputed by a consumer (SHA-256 of pickles, signed
truncations, 32-byte digests, per-engine seeds), so the index hashes token ids itself, the
same way for events and for requests. Two schemes (docs/prefix-index.md, "Keys"):

* ``"standard"`` (the default): the RFC #1527 sequence hash as Dynamo computes it (tokens as
  little-endian u32, ``local = xxh3_64(block, S)``, ``key[0] = local[0]``, ``key[i] =
  xxh3_64(le64(key[i-1]) || le64(local[i]), 1337)``) with ``S`` =
  :func:`kvwire.wire.rfc1527.standard_seed` of the LoRA name and the cache salt (as the
  cache namespace); the chain's seed is always 1337, as Dynamo's: a publisher that
  announces blocks only by standard hashes is matched by the same prompt. Token ids must
  fit in u32.
* ``"kvwire"`` (the earlier one): ``key[i] = xxh3_64(int64 bytes of block i, seed=key[i-1])``,
  the first block's seed mixing the LoRA name and the cache salt / extra keys.

Either way two adapters or two tenants with the same tokens never share a key, and a
partial last block has no key (engines cache full blocks).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

import msgspec
from xxhash import xxh3_64_intdigest

from ..wire.rfc1527 import STANDARD_SEED, standard_seed

__all__ = [
    "NATIVE", "ROOT_SEED", "SCHEMES", "KeyMap", "Lanes", "TokenId", "add_bits", "bits64",
    "block_keys", "chain_start", "chain_tokens", "insert_new", "pred_add", "pred_expire",
    "root_seed", "scan_tokens", "standard_fold", "token_bytes",
]

#: The key schemes, the default first.
SCHEMES = ("standard", "kvwire")

#: A token id as a request carries one (the proxy's prompts, /route, the indexer API): a
#: vocabulary index, non-negative and below 2^32, as the standard scheme hashes it (uint32).
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]

#: Seed of the first block when there is neither a LoRA name nor a salt.
ROOT_SEED = 0
_TAG = b"kvwire-index\x00"


def _salt_bytes(salt: Any) -> bytes:
    if isinstance(salt, str):
        return b"s" + salt.encode("utf-8", "surrogatepass")
    if isinstance(salt, bytes | bytearray | memoryview):
        return b"b" + bytes(salt)
    try:  # extra keys: tuples / lists of plain values, encoded canonically
        return b"m" + msgspec.msgpack.encode(salt)
    except (TypeError, msgspec.EncodeError):
        return b"r" + repr(salt).encode()


def root_seed(lora_name: str | None = None, salt: Any = None) -> int:
    """Seed of a chain's first block: 0 for the plain case, else a digest of LoRA + salt."""
    if lora_name is None and salt is None:
        return ROOT_SEED
    parts = _TAG
    parts += b"-" if lora_name is None else b"l" + lora_name.encode("utf-8", "surrogatepass")
    parts += b"\x00"
    parts += b"-" if salt is None else _salt_bytes(salt)
    return xxh3_64_intdigest(parts)


def standard_fold(lora_name: str | None = None, salt: Any = None) -> int:
    """The standard scheme's seed ``S``: the LoRA name as Dynamo's ``lora_name``, the cache
    salt as its ``cache_namespace`` (a string as is; bytes as they are; extra keys or other
    values by their canonical encoding, as in the kvwire scheme)."""
    if salt is not None and not isinstance(salt, str | bytes):
        salt = bytes(salt) if isinstance(salt, bytearray | memoryview) else _salt_bytes(salt)
    return standard_seed(lora_name, salt)


def chain_start(scheme: str, lora_name: str | None = None,
                salt: Any = None) -> tuple[int | None, int | None]:
    """``(seed, fold)`` to start a prompt's chain with: ``chain_tokens(toks, bs, n, seed, 0,
    fold)``. kvwire: ``(root_seed, None)``; standard: ``(None, S)`` (no block before)."""
    if scheme == "standard":
        return None, standard_fold(lora_name, salt)
    if scheme == "kvwire":
        return root_seed(lora_name, salt), None
    raise ValueError(f"key_scheme must be one of {SCHEMES}, got {scheme!r}")


def _std_u32(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error:
        raise ValueError(
            "token ids must fit in an unsigned 32-bit integer (standard scheme)") from None


def py_chain_std(token_ids: Sequence[int], block_size: int, n: int, prev: int | None,
                 fold: int, start: int = 0) -> Iterable[int]:
    """The standard scheme's keys of blocks ``start..n-1``, one at a time (``prev``: the key
    of block ``start - 1``, None when there is none). ``fold`` seeds the local hashes only;
    the chain is seeded by 1337 (a LoRA or a salt reaches the keys through the locals)."""
    step = block_size * 4
    mv = memoryview(_std_u32(list(token_ids[start * block_size : n * block_size])))
    k = prev
    pack = _QQ.pack
    for off in range(0, (n - start) * step if n > start else 0, step):
        local = xxh3_64_intdigest(mv[off : off + step], fold)
        k = local if k is None else xxh3_64_intdigest(pack(k, local), STANDARD_SEED)
        yield k


_QQ = struct.Struct("<QQ")


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as native int64 bytes, converted once for the whole sequence (an int64
    buffer such as ``array('q')`` or a numpy int64 array is copied as is)."""
    if not isinstance(token_ids, list | tuple):
        try:
            mv = memoryview(token_ids)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if mv.itemsize == 8 and mv.ndim == 1 and mv.format.lstrip("<=@") in ("q", "l"):
                return mv.tobytes()
    try:
        return struct.pack(f"{len(token_ids)}q", *token_ids)
    except struct.error as e:
        if "format requires" in str(e) or "out of range" in str(e):
            raise ValueError("token ids must fit in a signed 64-bit integer") from None
        raise ValueError("token ids must be a sequence of integers") from None


def py_chain_tokens(token_ids: Sequence[int], block_size: int, n: int, seed: int | None,
                    start: int = 0, fold: int | None = None) -> list[int]:
    """Keys of blocks ``start..n-1`` of ``token_ids``, chained from ``seed`` (the key of block
    ``start - 1``, or the root seed); the pure-Python twin of the C ``chain_tokens``. With
    ``fold``: the standard scheme, ``fold`` the local hashes' seed (``seed`` None: no block
    before)."""
    if block_size <= 0 or n < 0 or start < 0:
        raise ValueError("block_size must be positive, n and start >= 0")
    if n > len(token_ids) // block_size:
        raise ValueError("fewer token ids than n blocks of block_size")
    if fold is not None:
        return list(py_chain_std(token_ids, block_size, n, seed, fold, start))
    assert seed is not None
    step = block_size * 8
    mv = memoryview(token_bytes(token_ids[start * block_size : n * block_size]))
    out: list[int] = []
    append = out.append
    k = seed
    for off in range(0, (n - start) * step if n > start else 0, step):
        k = xxh3_64_intdigest(mv[off : off + step], k)
        append(k)
    return out


def py_add_bits(masks: dict[int, int], keys: list[int], setb: int, keep: int,
                tb: int, lanes: Any = None) -> list[int]:
    """Set ``setb`` (and clear what ``keep`` does not keep) in ``masks`` for every key, except
    keys whose mask already has ``tb``: those are returned (the pure twin of the C one)."""
    dups = []
    get = masks.get
    for k in keys:
        v = get(k)
        if v is None:
            masks[k] = setb
        elif v & tb:
            dups.append(k)
        else:
            masks[k] = (v | setb) & keep
    return dups


def _shift(shards: tuple) -> int:
    return 64 - (len(shards).bit_length() - 1)


def py_pred_add(keys: Iterable[int], expiry: tuple[dict, ...], masks: tuple[dict, ...],
                exp: float, bit: int) -> None:
    """Predict ``keys`` for the stream of slot ``bit`` until ``exp``: ``expiry[k] = exp``,
    ``masks[k] |= bit``, each map a tuple of 2**b dicts holding ``k`` in the one at
    ``k >> (64 - b)`` (the pure twin of the C one)."""
    se, sm = _shift(expiry), _shift(masks)
    for k in keys:
        expiry[k >> se][k] = exp
        d = masks[k >> sm]
        d[k] = d.get(k, 0) | bit


def py_pred_expire(keys: Iterable[int], expiry: tuple[dict, ...], masks: tuple[dict, ...],
                   now: float, bit: int) -> None:
    """Drop the predictions of ``keys`` whose expiry is ``<= now`` (one predicted again since
    stays), clearing ``bit`` from their masks (the pure twin of the C one)."""
    se, sm = _shift(expiry), _shift(masks)
    for k in keys:
        d = expiry[k >> se]
        e = d.get(k)
        if e is not None and e <= now:
            del d[k]
            m = masks[k >> sm]
            v = m.get(k, 0) & ~bit
            if v:
                m[k] = v
            else:
                m.pop(k, None)


def py_insert_new(d: dict, hashes: list, keys: list) -> int:
    """``d[hashes[i]] = keys[i]`` in order while ``hashes[i]`` is new to ``d``; stops at the
    first one already there (or repeated) and returns how many it inserted (the pure twin)."""
    for i, (h, k) in enumerate(zip(hashes, keys)):
        before = len(d)
        d.setdefault(h, k)
        if len(d) == before:
            return i
    return len(hashes)


NATIVE = False
#: Why the C path is not used (empty when it is).
REASON = ""
chain_tokens = py_chain_tokens
add_bits = py_add_bits
insert_new = py_insert_new
pred_add = py_pred_add
pred_expire = py_pred_expire
scan_tokens = None  # C only: PrefixIndex walks in Python without it
Lanes = None  # C only: the scan's uint64 mirror of the masks' lanes 0/1
bits64 = None  # C only: set bits of a 64-bit mask as a list
#: A stream's engine hash -> own key map: the C table (17 bytes a slot, see _keys.c) or a
#: dict (about 100 bytes an entry with its two ints); both behave alike for these keys.
KeyMap: Any = dict
if os.environ.get("KVWIRE_NO_NATIVE"):
    REASON = "KVWIRE_NO_NATIVE set"
else:
    try:
        from ._keys import (  # type: ignore[no-redef]  # noqa: F811
            KeyMap,
            Lanes,
            add_bits,
            bits64,
            chain_tokens,
            insert_new,
            pred_add,
            pred_expire,
            scan_tokens,
        )

        NATIVE = True
    except ImportError as e:  # not built (no compiler / no libxxhash): same keys, slower
        REASON = f"not built ({e})"


def block_keys(
    token_ids: Sequence[int], block_size: int, lora_name: str | None = None, salt: Any = None,
    scheme: str = "standard",
) -> list[int]:
    """Chained own keys of every full ``block_size``-token block of ``token_ids``.

    ``salt`` is the cache salt (a string) or extra keys (any msgpack-able value) of the
    request; the same value must be given for the events' blocks to match. ``scheme``:
    ``"standard"`` (RFC #1527 sequence hashes) or ``"kvwire"``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size!r}")
    seed, fold = chain_start(scheme, lora_name, salt)
    return chain_tokens(token_ids, block_size, len(token_ids) // block_size, seed, 0, fold)
