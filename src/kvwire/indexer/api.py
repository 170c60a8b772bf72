"""The pure part of the RFC #1403 indexer API: request bodies in both peers' spellings,
registrations and their file, query scopes and the two answer shapes. No sockets, no index:
:mod:`kvwire.indexer.indexer` holds these and does the I/O.

Spellings (docs/indexer-api.md): Mooncake's Conductor sends ``modelname`` / ``model``,
``tenant_id``, ``additionalsalt`` / ``cache_salt``, string instance ids, ``seq_hashes`` (older
clients ``block_hash``); Dynamo's indexer ``model_name``, integer instance ids and, for
``/query_by_hash``, ``block_hashes``: *local* block hashes as signed 64-bit ints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs

import msgspec

from ..http1 import HttpError
from ..index.keys import TokenId
from ..state_file import write_atomically
from ..wire.rfc1527 import standard_sequence_hashes

__all__ = [
    "MEDIA", "BadRequest", "add_rank", "QueryBody", "QueryByHashBody", "RegisterBody", "Registration",
    "RegistrationFile", "Scope", "UnregisterBody", "decode", "empty_answer", "new_row",
    "pick_shape",
    "seq_from_local", "shape_answer",
]

#: The media of an answer, as the RFC spells them (kvwire's index tiers of the same names).
MEDIA = ("GPU", "CPU", "DISK")
#: Engine types /register accepts (case-insensitive), as the RFC spells them.
TYPES = {"vllm": "vLLM", "sglang": "SGLang", "mooncake": "Mooncake"}
DEFAULT_TENANT = "default"

Name = Annotated[str, msgspec.Meta(max_length=256)]
Endpoint = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
BlockSize = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
InstanceId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | Annotated[
    int, msgspec.Meta(ge=0)]
#: (msgspec bounds stop at int64: the hash lists' ranges are checked in ``check``)
_U64_END = 1 << 64


#: A request the indexer refuses, ``BadRequest(status, message, reason)``: kvwire's one HTTP
#: error (``reason`` labels the counter).
BadRequest = HttpError


def decode(body: bytes, tp: type) -> Any:
    """``body`` as ``tp``; 400 for malformed JSON, 422 naming the field otherwise."""
    try:
        out = msgspec.json.decode(body, type=tp)
    except msgspec.ValidationError as e:
        raise BadRequest(422, f"invalid request body: {e}", "wrong_type") from None
    except msgspec.DecodeError as e:
        raise BadRequest(400, f"malformed JSON body: {e}", "malformed_json") from None
    check = getattr(out, "check", None)
    if check is not None:
        check()
    return out


def _one(what: str, *vals: Any) -> Any:
    """The value given under one of a field's spellings (two different ones: refused)."""
    got = [v for v in vals if v is not None]
    if len(set(map(str, got))) > 1:
        raise BadRequest(422, f"{what} given twice with different values: {got}",
                         "conflicting_fields")
    return got[0] if got else None


class Registration(msgspec.Struct, frozen=True, omit_defaults=True):
    """One followed stream: an engine's DP rank, keyed ``(tenant, instance, dp_rank)``."""

    endpoint: str
    type: str
    model: str
    instance_id: str | int
    tenant: str = DEFAULT_TENANT
    dp_rank: int = 0
    block_size: int | None = None
    replay_endpoint: str | None = None
    lora_name: str | None = None
    salt: str | None = None
    topic: str = ""

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.tenant, str(self.instance_id), self.dp_rank)

    @property
    def stream(self) -> str:
        return self.stream_name(*self.key)

    @staticmethod
    def stream_name(tenant: str, instance: str, dp_rank: int) -> str:
        """The subscriber / index stream name: Mooncake's ``instance|tenant|dp_rank``."""
        return f"{instance}|{tenant}|{dp_rank}"


class RegisterBody(msgspec.Struct):
    """``POST /register`` in either spelling (unknown fields ignored: peers add some)."""

    endpoint: Endpoint
    instance_id: InstanceId
    type: Name | None = None
    replay_endpoint: Endpoint | None = None
    modelname: Name | None = None
    model_name: Name | None = None
    model: Name | None = None
    lora_name: Name | None = None
    tenant_id: Name | None = None
    block_size: BlockSize | None = None
    dp_rank: Rank | None = None
    additionalsalt: Name | None = None
    salt: Name | None = None
    topic: Name = ""

    def dynamo_spelling(self) -> bool:
        return self.model_name is not None or isinstance(self.instance_id, int)

    def registration(self) -> Registration:
        model = _one("model name (modelname / model_name / model)", self.modelname,
                     self.model_name, self.model)
        if model is None:
            raise BadRequest(422, "modelname (Mooncake) or model_name (Dynamo) is required",
                             "missing_model")
        kind = TYPES.get((self.type or "vLLM").lower())
        if kind is None:
            raise BadRequest(422, f"type must be one of vLLM, SGLang, Mooncake; got "
                             f"{self.type!r}", "bad_type")
        return Registration(
            self.endpoint, kind, model, self.instance_id,
            self.tenant_id or DEFAULT_TENANT, self.dp_rank or 0, self.block_size,
            self.replay_endpoint, self.lora_name or None,
            _one("salt (additionalsalt / salt)", self.additionalsalt, self.salt) or None,
            self.topic)


class UnregisterBody(msgspec.Struct):
    """``POST /unregister``: removes ``(instance, tenant, dp_rank)``, or every DP rank of
    the instance when ``dp_rank`` is left out (Dynamo's)."""

    instance_id: InstanceId
    tenant_id: Name | None = None
    dp_rank: Rank | None = None
    model_name: Name | None = None
    modelname: Name | None = None

    def dynamo_spelling(self) -> bool:
        return self.model_name is not None or isinstance(self.instance_id, int)

    def tenant(self) -> str:
        return self.tenant_id or DEFAULT_TENANT


class Scope(msgspec.Struct, frozen=True):
    """Which registrations a query asks, and the LoRA / salt its keys are made with."""

    model: str
    tenant: str
    instance: str | None
    lora_name: str | None
    cache_salt: str | None

    def covers(self, r: Registration) -> bool:
        """In scope: same tenant and model, the instance asked (or any), and the same
        instance salt: an instance registered with a salt is asked only by queries with
        that ``cache_salt``; one without by any (its blocks' own salts then decide)."""
        return (r.tenant == self.tenant and r.model == self.model
                and (self.instance is None or str(r.instance_id) == self.instance)
                and (r.salt is None or r.salt == self.cache_salt))


class _QueryCommon(msgspec.Struct):
    model: Name | None = None
    model_name: Name | None = None
    lora_name: Name | None = None
    tenant_id: Name | None = None
    instance_id: InstanceId | None = None
    block_size: BlockSize | None = None
    cache_salt: Name | None = None
    salt: Name | None = None

    def dynamo_spelling(self) -> bool:
        return self.model_name is not None

    def scope(self) -> Scope:
        model = _one("model (model / model_name)", self.model, self.model_name)
        if model is None:
            raise BadRequest(422, "model (Mooncake) or model_name (Dynamo) is required",
                             "missing_model")
        return Scope(model, self.tenant_id or DEFAULT_TENANT,
                     None if self.instance_id is None else str(self.instance_id),
                     self.lora_name or None,
                     _one("cache salt (cache_salt / salt)", self.cache_salt, self.salt) or None)


class QueryBody(_QueryCommon):
    """``POST /query``: token ids; ``block_size`` is accepted and not needed (each
    instance's prompt blocks are cut at its own block size)."""

    token_ids: list[TokenId] = []

    def check(self) -> None:
        if not self.token_ids:
            raise BadRequest(422, "token_ids is missing or empty", "empty_tokens")


class QueryByHashBody(_QueryCommon):
    """``POST /query_by_hash``: ``seq_hashes`` (Mooncake; ``block_hash`` from older clients)
    are rolling sequence hashes; ``block_hashes`` (Dynamo) are local block hashes, signed or
    not. Exactly one of them."""

    seq_hashes: list[int] | None = None
    block_hash: list[int] | None = None
    block_hashes: list[int] | None = None

    def check(self) -> None:
        given = [n for n in ("seq_hashes", "block_hash", "block_hashes")
                 if getattr(self, n) is not None]
        if len(given) != 1:
            raise BadRequest(422, "give exactly one of seq_hashes (sequence hashes), "
                             "block_hash (older spelling) or block_hashes (Dynamo: local "
                             f"block hashes); got {given or 'none'}", "hashes")
        hs = getattr(self, given[0])
        if not hs:
            raise BadRequest(422, f"{given[0]} is empty", "empty_hashes")
        low = -(1 << 63) if given[0] == "block_hashes" else 0
        for i, h in enumerate(hs):
            if not low <= h < _U64_END:
                raise BadRequest(422, f"{given[0]}[{i}] = {h} is not a 64-bit hash "
                                 f"({'signed or unsigned' if low else 'unsigned'})",
                                 "hash_range")

    def hashes(self) -> tuple[list[int], list[int]]:
        """``(sequence hashes, local hashes)``: one of them is empty."""
        if self.block_hashes is not None:
            return [], [h & 0xFFFF_FFFF_FFFF_FFFF for h in self.block_hashes]
        return list(self.seq_hashes if self.seq_hashes is not None else self.block_hash
                    or []), []


def seq_from_local(local: list[int]) -> list[int]:
    """The standard rolling sequence hashes of local block hashes: a LoRA name or a cache
    namespace is already in the local hashes (their seed); the chain's seed is fixed."""
    return standard_sequence_hashes(local)


def pick_shape(dynamo_spelling: bool, qs: str) -> str:
    """``"dynamo"`` or ``"mooncake"``: ``?shape=`` if given, else the request's spelling."""
    if qs:
        want = parse_qs(qs).get("shape", [""])[-1]
        if want in ("dynamo", "mooncake"):
            return want
        if want:
            raise BadRequest(400, f"shape must be dynamo or mooncake, got {want!r}",
                             "bad_shape")
    return "dynamo" if dynamo_spelling else "mooncake"


def new_row() -> dict[str, Any]:
    """One instance's answer, all zeros: ``longest_matched``, each medium alone, ``DP`` (any
    medium per rank), and for Dynamo's shape ``_cumulative`` (each medium or a better one)
    and ``_gpu_dp`` (GPU per rank)."""
    return {"longest_matched": 0, **dict.fromkeys(MEDIA, 0), "DP": {},
            "_cumulative": dict.fromkeys(MEDIA, 0), "_gpu_dp": {}}


def add_rank(row: dict[str, Any], rank: int, bs: int, n: int, alone: dict[str, int],
             cum: dict[str, int]) -> None:
    """Fold one DP rank's prefixes (in blocks of ``bs`` tokens: ``n`` on any medium,
    ``alone`` / ``cum`` as ``PrefixIndex.tier_prefixes(..., cumulative=True)``) into an
    instance's :func:`new_row`, in tokens."""
    row["longest_matched"] = max(row["longest_matched"], n * bs)
    c = row["_cumulative"]
    for m in MEDIA:
        row[m] = max(row[m], alone.get(m, 0) * bs)
        c[m] = max(c[m], cum.get(m, 0) * bs)
    row["DP"][str(rank)] = n * bs
    row["_gpu_dp"][str(rank)] = alone.get("GPU", 0) * bs


def empty_answer(scope: Scope) -> dict[str, dict[str, Any]]:
    """An instance asked by id but not registered is answered with zeros, not an error."""
    return {} if scope.instance is None else {scope.instance: new_row()}


def shape_answer(shape: str, scope: Scope, rows: dict[str, dict[str, Any]]) -> Any:
    """Mooncake: ``{tenant: {instance: {longest_matched, GPU, CPU, DISK, DP}}}``, each
    medium alone, ``DP`` any medium per rank (every instance in scope, zeros included).
    Dynamo, as its indexer answers: ``{"scores": {instance: {dp: GPU tokens}},
    "frequencies": [], "instances": {instance: {longest_matched, gpu, cpu, disk, dp}}}`` with
    ``cpu`` = GPU or CPU, ``disk`` = any of the three, ``dp`` = GPU per rank (instances that
    match nothing left out)."""
    if shape == "mooncake":
        return {scope.tenant: {name: {k: v for k, v in row.items() if k[0] != "_"}
                               for name, row in rows.items()}}
    scores: dict[str, dict[str, int]] = {}
    inst: dict[str, dict[str, Any]] = {}
    for name, row in rows.items():
        if not row["longest_matched"]:
            continue
        gpu_dp = row["_gpu_dp"]
        # (rows built without add_rank: each medium alone, the best the row can say)
        cum = row.get("_cumulative") or {m: row[m] for m in MEDIA}
        inst[name] = {"longest_matched": row["longest_matched"], "gpu": row["GPU"],
                      "dp": gpu_dp, "cpu": cum["CPU"], "disk": cum["DISK"]}
        if any(gpu_dp.values()):
            scores[name] = {r: n for r, n in gpu_dp.items() if n}
    return {"scores": scores, "frequencies": [], "instances": inst}


class RegistrationFile:
    """Registrations kept in a JSON file, rewritten whole on every change
    (:func:`~kvwire.state_file.write_atomically`) and read at start."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> list[Registration]:
        """The saved registrations ([] if there is no file yet); a file that cannot be read
        is an error naming it (the service refuses to start rather than forget streams)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        try:
            doc = msgspec.json.decode(raw, type=_FileDoc)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ValueError(f"registrations file {self.path}: {e}") from None
        return doc.registrations

    def save(self, regs: list[Registration]) -> None:
        write_atomically(self.path, msgspec.json.format(
            msgspec.json.encode(_FileDoc(1, regs))) + b"\n")


class _FileDoc(msgspec.Struct):
    version: int
    registrations: list[Registration]
