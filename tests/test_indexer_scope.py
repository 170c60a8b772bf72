"""The indexer API's pure parts (kvwire.indexer.api) and its scoping, without sockets:
``Indexer.handle`` over a RouterCore whose subscriber never starts, its index fed the
deliveries directly. A hypothesis model checks every answer (tenant, model, instance,
instance salt, block salt, LoRA, block size, medium, DP rank) against a brute-force one."""

from __future__ import annotations

import json
import os
from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.consume.items import Batch
from kvwire.index.keys import chain_start
from kvwire.indexer.api import (
    BadRequest,
    RegisterBody,
    Registration,
    RegistrationFile,
    decode,
    seq_from_local,
)
from kvwire.indexer.indexer import Indexer
from kvwire.routing.core import RouterCore
from kvwire.wire.events import BlockStored, KVEventBatch
from kvwire.wire.rfc1527 import standard_block_hashes, standard_local_hashes, standard_seed

BASE = [(i * 7919 + 13) % 50_000 for i in range(128)]


def call(ix: Indexer, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    status, out = ix.handle(method, path, b"" if body is None else json.dumps(body).encode())
    return status, json.loads(out)


# --------------------------------------------------------------------------- pure parts


def test_both_spellings_give_one_registration() -> None:
    moon = decode(json.dumps({
        "endpoint": "tcp://1.1.1.1:5557", "replay_endpoint": "tcp://1.1.1.1:5558",
        "type": "vllm", "modelname": "deepseek", "lora_name": "sql-adapter",
        "tenant_id": "default", "instance_id": "vllm-prefill-node1", "block_size": 128,
        "dp_rank": 0, "additionalsalt": "w8a8"}).encode(), RegisterBody)
    assert not moon.dynamo_spelling()
    assert moon.registration() == Registration(
        "tcp://1.1.1.1:5557", "vLLM", "deepseek", "vllm-prefill-node1", "default", 0, 128,
        "tcp://1.1.1.1:5558", "sql-adapter", "w8a8")
    dyn = decode(b'{"instance_id": 100, "endpoint": "tcp://127.0.0.1:5557", '
                 b'"model_name": "default", "block_size": 16}', RegisterBody)
    assert dyn.dynamo_spelling()
    r = dyn.registration()
    assert (r.instance_id, r.model, r.type, r.tenant, r.dp_rank) == (100, "default", "vLLM",
                                                                      "default", 0)
    assert r.stream == "100|default|0"
    with pytest.raises(BadRequest, match="given twice with different values"):
        decode(b'{"endpoint": "ipc:///x", "instance_id": 1, "modelname": "a", '
               b'"model_name": "b"}', RegisterBody).registration()


def test_local_hashes_chain_into_sequence_hashes() -> None:
    toks = list(range(64))
    for seed in (standard_seed(), standard_seed("lora-a", "ns")):
        local = standard_local_hashes(toks, 16, seed)
        assert seq_from_local(local) == standard_block_hashes(toks, 16, seed)


def test_registrations_file_is_replaced_whole(tmp_path, monkeypatch) -> None:
    f = RegistrationFile(tmp_path / "r.json")
    assert f.load() == []
    a = Registration("ipc:///a", "vLLM", "m", "a")
    b = Registration("ipc:///b", "SGLang", "m", 7, "t", 1, 32, None, "l", "s")
    f.save([a, b])
    assert f.load() == [a, b] and not (tmp_path / "r.json.tmp").exists()
    # a crash between writing and renaming (forced: os.replace fails) leaves the old file
    monkeypatch.setattr(os, "replace", lambda *x: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError):
        f.save([a])
    assert f.load() == [a, b]
    (tmp_path / "r.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"registrations file .*r\.json"):
        f.load()


def test_indexer_reads_its_file_at_start(tmp_path) -> None:
    path = tmp_path / "regs.json"
    core = RouterCore([])
    ix = Indexer(core, path)
    assert call(ix, "POST", "/register", {"endpoint": "ipc:///tmp/kvwire-nowhere-a",
                                          "modelname": "m", "instance_id": "a"})[0] == 200
    again = Indexer(RouterCore([]), path)
    assert list(again.regs) == [("default", "a", 0)]
    assert [s.name for s in again.feed.specs] == ["a|default|0"]


# --------------------------------------------------------------------------- scoping model

REG = st.fixed_dictionaries({
    "tenant": st.sampled_from(["t1", "t2"]),
    "instance": st.sampled_from(["i1", "i2", "i3"]),
    "dp": st.integers(0, 1),
    "model": st.sampled_from(["m", "n"]),
    "salt": st.sampled_from([None, "s"]),
    "bs": st.sampled_from([16, 32]),
    # chains stored on the stream: (blocks from the prompt's start, medium, LoRA, salt)
    "chains": st.lists(st.tuples(st.integers(1, 4), st.sampled_from(["GPU", "CPU", "DISK"]),
                                 st.sampled_from([None, "L"]),
                                 st.sampled_from([None, "s", "x"])), max_size=4),
})
QUERY = st.fixed_dictionaries({
    "tenant": st.sampled_from(["t1", "t2", "t3"]),
    "instance": st.sampled_from([None, "i1", "i2", "nobody"]),
    "model": st.sampled_from(["m", "n"]),
    "lora": st.sampled_from([None, "L"]),
    "salt": st.sampled_from([None, "s", "x"]),
    "ntok": st.integers(0, 128),
})


def _model_answer(regs: list[dict], q: dict) -> dict:
    rows: dict[str, dict] = {}
    for r in regs:
        if (r["tenant"], r["model"]) != (q["tenant"], q["model"]):
            continue
        if q["instance"] is not None and r["instance"] != q["instance"]:
            continue
        if r["salt"] is not None and r["salt"] != q["salt"]:
            continue
        key_salt = None if r["salt"] is not None else q["salt"]
        bs = r["bs"]
        full = q["ntok"] // bs
        per = {"GPU": 0, "CPU": 0, "DISK": 0}
        for blocks, medium, lora, salt in r["chains"]:
            if lora == q["lora"] and salt == key_salt:
                per[medium] = max(per[medium], min(blocks, full))
        anyn = max(per.values())
        row = rows.setdefault(r["instance"], {"longest_matched": 0, "GPU": 0, "CPU": 0,
                                              "DISK": 0, "DP": {}, "cum": [0, 0, 0],
                                              "gpu_dp": {}})
        row["longest_matched"] = max(row["longest_matched"], anyn * bs)
        for m, n in per.items():
            row[m] = max(row[m], n * bs)
        for t in range(3):  # chains start at block 0: a union of media is their max
            row["cum"][t] = max(row["cum"][t], max(list(per.values())[: t + 1]) * bs)
        row["DP"][str(r["dp"])] = anyn * bs
        row["gpu_dp"][str(r["dp"])] = per["GPU"] * bs
    if not rows and q["instance"] is not None:
        rows[q["instance"]] = {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "DP": {},
                               "cum": [0, 0, 0], "gpu_dp": {}}
    return rows


def _mooncake(rows: dict, q: dict) -> dict:
    return {q["tenant"]: {i: {k: v for k, v in row.items() if k not in ("cum", "gpu_dp")}
                          for i, row in rows.items()}}


def _dynamo(rows: dict) -> dict:
    live = {i: row for i, row in rows.items() if row["longest_matched"]}
    return {"scores": {i: {r: n for r, n in row["gpu_dp"].items() if n}
                       for i, row in live.items() if any(row["gpu_dp"].values())},
            "frequencies": [],
            "instances": {i: {"longest_matched": row["longest_matched"], "gpu": row["GPU"],
                              "dp": row["gpu_dp"], "cpu": row["cum"][1],
                              "disk": row["cum"][2]} for i, row in live.items()}}


@settings(max_examples=150, deadline=None)
@given(st.lists(REG, max_size=6, unique_by=lambda r: (r["tenant"], r["instance"], r["dp"])),
       st.lists(QUERY, min_size=1, max_size=5))
def test_answers_match_a_brute_force_model(regs: list[dict], queries: list[dict]) -> None:
    ix = Indexer(RouterCore([]))  # never started: registrations only recorded
    for k, r in enumerate(regs):
        status, _ = call(ix, "POST", "/register", {
            "endpoint": f"ipc:///tmp/kvwire-nowhere-{k}", "modelname": r["model"],
            "tenant_id": r["tenant"], "instance_id": r["instance"], "dp_rank": r["dp"],
            "block_size": r["bs"], "additionalsalt": r["salt"]})
        assert status == 200
        stream = f"{r['instance']}|{r['tenant']}|{r['dp']}"
        events = []
        for c, (blocks, medium, lora, salt) in enumerate(r["chains"]):
            toks = BASE[: blocks * r["bs"]]
            hashes = [1000 * c + i for i in range(blocks)]  # engine hashes: ids only
            events.append(BlockStored(hashes, None, toks, r["bs"], None, medium, lora,
                                      cache_salt=salt))
        ix.feed.index.apply(Batch(stream, 0, KVEventBatch(0.0, events, 0)))
    for q in queries:
        body = {"model": q["model"], "tenant_id": q["tenant"], "token_ids": BASE[: q["ntok"]]}
        for name, key in (("instance_id", "instance"), ("lora_name", "lora"),
                          ("cache_salt", "salt")):
            if q[key] is not None:
                body[name] = q[key]
        status, out = call(ix, "POST", "/query", body)
        if not q["ntok"]:
            assert status == 422
            continue
        assert status == 200, out
        rows = _model_answer(regs, q)
        assert out == _mooncake(rows, q), (body, out)
        status, out = call(ix, "POST", "/query?shape=dynamo", body)
        assert out == _dynamo(rows), (body, out)


def test_a_file_that_cannot_be_written_changes_nothing(tmp_path) -> None:
    ix = Indexer(RouterCore([]), tmp_path / "no-such-dir" / "regs.json")
    status, out = call(ix, "POST", "/register", {"endpoint": "ipc:///tmp/kvwire-nowhere",
                                                 "modelname": "m", "instance_id": "a"})
    assert status == 507 and "could not be written" in out["error"], out
    assert ix.regs == {} and ix.feed.specs == [] and ix.counts["bad_file"] == 1


def test_medium_prefixes_alone_and_cumulative() -> None:
    """Blocks 0-3 of one chain on GPU, CPU, CPU, DISK: each medium alone holds a short
    prefix, "this medium or a better one" a longer one (Dynamo's cpu / disk)."""
    from kvwire.index import PrefixIndex, block_keys

    idx = PrefixIndex()
    toks = BASE[:64]
    keys = block_keys(toks, 16)
    events = [BlockStored([100 + i], None if i == 0 else 99 + i, toks[16 * i : 16 * i + 16],
                          16, None, medium)
              for i, medium in enumerate(["GPU", "CPU", "CPU", "DISK"])]
    idx.apply(Batch("s", 0, KVEventBatch(0.0, events, 0)))
    n, alone, cum = idx.tier_prefixes(keys, ["s", "unknown"], cumulative=True)["s"]
    assert (n, alone, cum) == (4, {"GPU": 1, "CPU": 0, "DISK": 0},
                               {"GPU": 1, "CPU": 3, "DISK": 4})
    assert idx.tier_prefixes(keys, ["s"])["s"] == (4, {"GPU": 1, "CPU": 0, "DISK": 0})
    assert idx.tier_prefixes(keys, ["unknown"]) == {}


_MEDIA = ["GPU", "CPU", "DISK"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.sets(st.sampled_from(range(3)), min_size=1), max_size=6),
                min_size=1, max_size=4))
def test_medium_prefixes_against_brute_force(streams: list[list[set[int]]]) -> None:
    """Streams holding a prefix of one chain, each block on one or more media:
    ``tier_prefixes`` (which skips keys that change no stream's lane) answers as counting
    the leading blocks on each medium, on each medium or a better one, on any (cumulative
    or not); in C
    (``_tiers.c``) and in Python, and the C walk that hashes the prompt as it goes
    (``walk_tokens``, both key schemes) as the walk over the prompt's keys."""
    from kvwire.index import PrefixIndex, block_keys

    def lead(blocks: list[set[int]], tiers: set[int]) -> int:
        n = 0
        while n < len(blocks) and blocks[n] & tiers:
            n += 1
        return n

    toks = BASE[:96]
    names = [f"s{s}" for s in range(len(streams))]
    for scheme in ("standard", "kvwire"):
        idx = PrefixIndex(key_scheme=scheme)
        keys = block_keys(toks, 16, scheme=scheme) + [12345]  # one more key nobody holds
        for s, blocks in enumerate(streams):
            events, prev = [], None
            for i, media in enumerate(blocks):
                first = None
                for t in sorted(media):
                    h = 1000 * (t + 1) + i
                    events.append(BlockStored([h], prev, toks[16 * i : 16 * i + 16], 16,
                                              None, _MEDIA[t]))
                    first = first or h
                prev = first
            if events:
                idx.apply(Batch(f"s{s}", 0, KVEventBatch(0.0, events, 0)))
        walk = idx.walk
        walks = [True, False] if walk.c_walk else [False]
        for c_walk in walks:
            walk.c_walk = c_walk
            try:
                got = idx.tier_prefixes(keys, names, cumulative=True)
                plain = idx.tier_prefixes(keys, names)
            finally:
                walk.c_walk = walks[0]
            for s, blocks in enumerate(streams):
                if not blocks:
                    continue
                want = (lead(blocks, {0, 1, 2}),
                        {m: lead(blocks, {t}) for t, m in enumerate(_MEDIA)},
                        {m: lead(blocks, set(range(t + 1))) for t, m in enumerate(_MEDIA)})
                assert got[f"s{s}"] == want, (scheme, c_walk, s, blocks)
                assert plain[f"s{s}"] == want[:2], (scheme, c_walk, s, blocks)
        if walk.c_walk:
            known = [n for n in names if n in walk.streams]
            seed, fold = chain_start(scheme)
            flat = walk.walk_tokens(array("q", toks), 16, len(toks) // 16, seed, fold,
                                    [walk.streams[n].slot for n in known])
            assert walk.unflatten(flat, known, True) == walk.tier_prefixes(
                keys, known, cumulative=True), scheme
