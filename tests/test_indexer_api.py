"""The RFC #1403 indexer API (kvwire.indexer.indexer) over real HTTP (``kvwire serve``'s app on
a loopback port) fed by real ZmqEventPublishers registered at run time: both peers'
spellings and answer shapes, unregistering, the registrations file across a restart of a
real ``kvwire serve`` process, the cases Dynamo's indexer gets wrong (docs/indexer-api.md),
and bad input answered 4xx and counted."""

from __future__ import annotations

import contextlib
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("httptools")
httpx = pytest.importorskip("httpx")

from waiting import wait_for  # noqa: E402
from xxhash import xxh3_64_intdigest  # noqa: E402

from kvwire.consume.stream import StreamConfig  # noqa: E402
from kvwire.publish.publisher import ZmqEventPublisher  # noqa: E402
from kvwire.routing.core import RouterCore  # noqa: E402
from kvwire.serve.app import serve_in_thread  # noqa: E402
from kvwire.wire.events import (  # noqa: E402
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    Rfc1527Fields,
)
from kvwire.wire.rfc1527 import (  # noqa: E402
    standard_block_hashes,
    standard_local_hashes,
    standard_seed,
)

BS = 16
SERVE = [sys.executable, "-m", "kvwire", "serve"]


def tokens(seed: int, blocks: int, bs: int = BS) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(blocks * bs)]


def stored(toks: list[int], first_hash: Any, medium: str = "GPU", bs: int = BS,
           parent: Any = None, **kw: Any) -> KVEventBatch:
    n = len(toks) // bs
    hs = (list(range(first_hash, first_hash + n)) if isinstance(first_hash, int)
          else first_hash)
    return KVEventBatch(time.time(), [BlockStored(hs, parent, toks, bs, kw.pop("lora_id", None),
                                                 medium, **kw)], 0)



def signed(xs: list[int]) -> list[int]:
    return [x - (1 << 64) if x >= 1 << 63 else x for x in xs]


class Service:
    """``kvwire serve``'s app (no routing engines) over a RouterCore, on a loopback port."""

    def __init__(self, http: httpx.Client, core: RouterCore, where: Any) -> None:
        self.http, self.core, self.where = http, core, where
        self.pubs: dict[str, ZmqEventPublisher] = {}

    def publisher(self, name: str, **kw: Any) -> ZmqEventPublisher:
        p = self.pubs[name] = ZmqEventPublisher(
            endpoint=f"ipc://{self.where}/{name}.live",
            replay_endpoint=f"ipc://{self.where}/{name}.replay", heartbeat_interval=0.2, **kw)
        return p

    def register(self, name: str, **body: Any) -> httpx.Response:
        p = self.pubs[name]
        body.setdefault("modelname" if "model_name" not in body else "x", "m")
        body.pop("x", None)
        body.setdefault("block_size", BS)
        r = self.http.post("/register", json={"endpoint": p.endpoint,
                                               "replay_endpoint": p.replay_endpoint,
                                               "type": "vLLM", **body})
        assert r.status_code in (200, 201), r.text
        return r

    def query(self, path: str = "/query", status: int = 200, **body: Any) -> Any:
        r = self.http.post(path, json=body)
        assert r.status_code == status, r.text
        return r.json()

    def held(self, inst: str, toks: list[int], want: int, **q: Any) -> dict:
        """Wait until instance ``inst`` answers ``want`` tokens for ``toks`` (Mooncake)."""
        q.setdefault("model", "m")
        q.setdefault("block_size", BS)
        tenant = q.get("tenant_id", "default")

        def got() -> dict | None:
            row = self.query(token_ids=toks, **q)[tenant].get(inst)
            return row if row is not None and row["longest_matched"] == want else None

        return wait_for(got, f"{inst} holding {want} tokens")


@contextlib.contextmanager
def service(tmp_path) -> Iterator[Service]:
    core = RouterCore([], stream_config=StreamConfig(dead_after=2.0))
    core.start()
    server, thread, port = serve_in_thread(core)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
    svc = Service(http, core, tmp_path)
    try:
        yield svc
    finally:
        http.close()
        server.should_exit = True
        thread.join(10)
        core.close()
        for p in svc.pubs.values():
            p.shutdown(timeout=1)


@pytest.fixture
def svc(tmp_path) -> Iterator[Service]:
    with service(tmp_path) as s:
        yield s


# --------------------------------------------------------------------------- the API


def test_register_query_per_medium_and_rank_then_unregister(svc: Service) -> None:
    """One instance, two DP ranks (Mooncake spelling), registered while the service runs:
    answers per medium and per rank in tokens, in both shapes, by tokens and by hashes;
    unregistering a rank drops its blocks, and then the instance."""
    svc.publisher("r0")
    svc.publisher("r1")
    r = svc.register("r0", instance_id="node", dp_rank=0, tenant_id="t")
    assert r.json() == {"status": "registered successfully", "instance_id": "node",
                        "replaced": False}
    svc.register("r1", instance_id="node", dp_rank=1, tenant_id="t")
    toks = tokens(1, 4)
    svc.pubs["r0"].publish(stored(toks[: 2 * BS], 10))  # rank 0: 2 blocks on GPU
    svc.pubs["r1"].publish(stored(toks, 20, "CPU"))  # rank 1: all 4 blocks on CPU
    svc.pubs["r1"].publish(stored(toks[:BS], 30))  # ... and its first one on GPU too
    want = {"longest_matched": 64, "GPU": 32, "CPU": 64, "DISK": 0, "DP": {"0": 32, "1": 64}}
    q = {"model": "m", "tenant_id": "t", "block_size": BS}
    wait_for(lambda: svc.query(token_ids=toks, **q)["t"]["node"] == want,
             "all three batches applied")  # (two streams: applied in any order)
    assert svc.query(token_ids=toks + [1, 2, 3], **q)["t"]["node"] == want  # partial block
    # Dynamo's shape, chosen by its spelling (model_name); scores: GPU tokens per rank
    dyn = svc.query(model_name="m", token_ids=toks, tenant_id="t")
    # (as Dynamo's indexer: cpu = GPU or CPU, disk = any medium, dp = GPU per rank)
    assert dyn == {"scores": {"node": {"0": 32, "1": 16}}, "frequencies": [],
                   "instances": {"node": {"longest_matched": 64, "gpu": 32, "dp":
                                          {"0": 32, "1": 16}, "cpu": 64, "disk": 64}}}
    # ... or by ?shape=
    assert "scores" in svc.query("/query?shape=dynamo", model="m", token_ids=toks,
                                 tenant_id="t")
    assert "t" in svc.query("/query?shape=mooncake", model_name="m", token_ids=toks,
                            tenant_id="t")
    # by hash: Mooncake's sequence hashes (and the older block_hash), Dynamo's signed locals
    seq = standard_block_hashes(toks, BS)
    for field in ("seq_hashes", "block_hash"):
        out = svc.query("/query_by_hash", model="m", tenant_id="t", block_size=BS,
                        **{field: seq[:3]})
        assert out["t"]["node"]["longest_matched"] == 48, out
    out = svc.query("/query_by_hash", model_name="m", tenant_id="t",
                    block_hashes=signed(standard_local_hashes(toks, BS)))
    assert out["instances"]["node"]["longest_matched"] == 64
    # a hash query in another block size is not this instance's
    out = svc.query("/query_by_hash", model="m", tenant_id="t", block_size=32, seq_hashes=seq)
    assert out["t"]["node"]["longest_matched"] == 0
    # instance_id omitted: every instance of the tenant; another tenant: nothing
    assert svc.query(model="m", token_ids=toks, tenant_id="other") == {"other": {}}

    dump = svc.http.get("/dump").json()
    assert {r["dp_rank"] if "dp_rank" in r else 0 for r in dump["registrations"]} == {0, 1}
    s1 = dump["streams"]["node|t|1"]
    assert s1["block_size"] == BS and sorted(s1["blocks"]["CPU"]) == sorted(seq)
    assert s1["blocks"]["GPU"] == seq[:1]

    r = svc.http.post("/unregister", json={"instance_id": "node", "tenant_id": "t",
                                           "dp_rank": 1, "modelname": "m"})
    assert r.json() == {"status": "unregistered successfully",
                        "removed_instances": ["node|t|1"]}
    wait_for(lambda: "node|t|1" not in svc.core.index.streams(), "rank 1 dropped")
    row = svc.query(model="m", token_ids=toks, tenant_id="t")["t"]["node"]
    assert row["DP"] == {"0": 32} and row["CPU"] == 0
    svc.pubs["r1"].publish(stored(tokens(2, 2), 40))  # no longer followed: not indexed
    time.sleep(0.3)  # (nothing to wait for: a block that must NOT arrive)
    assert "node|t|1" not in svc.core.index.streams()
    r = svc.http.post("/unregister", json={"instance_id": "node", "tenant_id": "t"})
    assert r.json()["removed_instances"] == ["node|t|0"]
    assert svc.query(model="m", token_ids=toks, tenant_id="t") == {"t": {}}
    assert svc.http.get("/registrations").json() == []


def test_dynamo_spelling_register_and_reregister(svc: Service) -> None:
    """Dynamo's body (integer id, model_name): 201 {"status": "ok"}; registering the same
    key again with another endpoint replaces the stream (an engine back on a new port)."""
    svc.publisher("a")
    p2 = svc.publisher("a2")
    r = svc.register("a", instance_id=100, model_name="m")
    assert (r.status_code, r.json()) == (201, {"status": "ok"})
    toks = tokens(3, 2)
    svc.pubs["a"].publish(stored(toks, 1))
    out = wait_for(lambda: svc.query(model_name="m", token_ids=toks)["scores"],
                   "instance 100 scored")
    assert out == {"100": {"0": 32}}
    r = svc.http.post("/register", json={"instance_id": 100, "model_name": "m",
                                         "endpoint": p2.endpoint, "block_size": BS,
                                         "replay_endpoint": p2.replay_endpoint})
    assert r.status_code == 201
    wait_for(lambda: not svc.query(model_name="m", token_ids=toks)["scores"],
             "the old stream's blocks dropped")
    p2.publish(stored(toks[:BS], 5))
    wait_for(lambda: svc.query(model_name="m", token_ids=toks)["scores"] == {"100": {"0": 16}},
             "the new stream indexed")
    regs = svc.http.get("/registrations").json()
    assert [(r["instance_id"], r["endpoint"], r["stream"]) for r in regs] == [
        (100, p2.endpoint, "100|default|0")]
    wait_for(lambda: svc.http.get("/registrations").json()[0]["alive"], "alive shown")
    health = svc.http.get("/indexer/health").json()
    assert health["registered"] == 1 and health["stream_errors"] == 0, health


def test_a_mooncake_registration_follows_a_run_from_seq_1_exactly(svc: Service) -> None:
    """Mooncake Store's publisher numbers its run from 1. Registered as ``type: Mooncake``
    its whole run (the 69 vendored batches, by replay: published before the registration)
    is an exact start; the same publisher registered as vLLM is a late start (seq 0 would be
    missing), as it must be for an engine's stream."""
    import json
    import threading
    from pathlib import Path

    from mooncake_like import MooncakeLike

    doc = json.loads((Path(__file__).parent / "data" / "rfc1527_mooncake.json").read_text())
    moon = MooncakeLike(doc["messages"])
    moon.publish_all()
    stop = threading.Event()
    server = threading.Thread(target=moon.serve, args=(stop,), daemon=True)
    server.start()
    try:
        for inst, kind in (("moon", "Mooncake"), ("as-vllm", "vLLM")):
            r = svc.http.post("/register", json={
                "endpoint": moon.endpoint, "replay_endpoint": moon.replay_endpoint,
                "type": kind, "modelname": "m", "block_size": BS, "instance_id": inst})
            assert r.status_code == 200, r.text

        def followed() -> dict | None:
            st = {k.split("|")[0]: v.stream for k, v in svc.core.sub_stats.items()}
            done = all(k in st and st[k].batches == 69 for k in ("moon", "as-vllm"))
            # (a stalled consumer, on a loaded box, confirms its tail before it reads exact)
            return st if done and st["moon"].state != "unconfirmed" else None

        st = wait_for(followed, "both registrations holding the 69 batches, moon's tail confirmed")
        assert st["moon"].exact and st["moon"].lost == 0, st["moon"]
        assert not st["as-vllm"].exact, st["as-vllm"]
    finally:
        stop.set()
        server.join()
        moon.close()


# --------------------------------------------------------------------------- Dynamo's gaps


def test_cases_dynamos_indexer_gets_wrong(svc: Service) -> None:
    """Each case of docs/indexer-api.md "Where kvwire answers differently", over real
    sockets: kvwire answers right where Dynamo's standalone indexer does not."""
    for n in ("a", "b", "salted", "lora", "wide", "moon", "w8"):
        # (SGLang's dialect carries cache_salt; vLLM's puts it in extra_keys)
        svc.publisher(n, dialect={"moon": "rfc1527", "salted": "sglang"}.get(n, "vllm"))
    svc.register("a", instance_id="a")
    svc.register("b", instance_id="b")
    svc.register("salted", instance_id="salted")
    svc.register("lora", instance_id="lora")
    svc.register("wide", instance_id="wide")  # registered 16, publishes 32-token blocks
    svc.register("moon", instance_id="moon", type="Mooncake")
    svc.register("w8", instance_id="w8", additionalsalt="w8a8")
    toks = tokens(5, 4)
    # 1. the same prefix under different engine hashes on two instances, then each goes on
    #    with a child of its own hash: both instances hold all of it (Dynamo drops b's child)
    svc.pubs["a"].publish(stored(toks[: 2 * BS], 100))
    svc.pubs["b"].publish(stored(toks[: 2 * BS], 900))
    svc.pubs["a"].publish(stored(toks[2 * BS :], 102, parent=101))
    svc.pubs["b"].publish(stored(toks[2 * BS :], 902, parent=901))
    svc.held("a", toks, 64)
    svc.held("b", toks, 64)
    # 2. blocks stored with a cache salt are not matched by a query without it
    svc.pubs["salted"].publish(stored(toks, 1, cache_salt="tenant-x"))
    svc.held("salted", toks, 64, cache_salt="tenant-x")
    assert svc.query(model="m", token_ids=toks, block_size=BS)["default"]["salted"][
        "longest_matched"] == 0
    # 3. blocks stored under a LoRA id alone are that adapter's, not the base model's
    svc.pubs["lora"].publish(stored(toks, 1, lora_id=7))
    svc.held("lora", toks, 64, lora_name="7")
    assert svc.query(model="m", token_ids=toks)["default"]["lora"]["longest_matched"] == 0
    # 4. 32-byte block hashes: decoded and indexed, and removed by the same bytes
    big = [bytes([i]) * 32 for i in range(4)]
    svc.pubs["a"].publish(stored(tokens(6, 4), big))
    svc.held("a", tokens(6, 4), 64)
    svc.pubs["a"].publish(KVEventBatch(time.time(), [BlockRemoved(big[2:], "GPU")], 0))
    svc.held("a", tokens(6, 4), 32)
    # 5. a block size other than registered: answered in the events' block size
    wide = tokens(7, 2, 32)
    svc.pubs["wide"].publish(stored(wide, 1, bs=32))
    svc.held("wide", wide + wide[:BS], 64)  # 80 tokens: two complete 32-token blocks
    text = svc.http.get("/metrics").text
    assert re.search(r'kvwire_indexer_events_total\{what="block_size_mismatch"\} 1', text)
    # 6. RFC #1527 blocks announced by standard sequence hashes only (no tokens, block size
    #    nil on the wire): matched at the registered block size by a prompt hashed here
    seq = standard_block_hashes(toks, BS)
    ev = BlockStored(seq[:3], None, [], 0, None, "GPU",
                     rfc1527=Rfc1527Fields(base_block_idx=0))
    svc.pubs["moon"].publish(KVEventBatch(time.time(), [ev], 0))
    svc.held("moon", toks, 48)
    # 7. an instance registered with a salt answers only queries carrying that cache_salt
    svc.pubs["w8"].publish(stored(toks, 1))
    svc.held("w8", toks, 64, cache_salt="w8a8")
    assert "w8" not in svc.query(model="m", token_ids=toks)["default"]


def test_query_by_hash_of_a_lora_salted_prompt_as_dynamo_hashes_it(svc: Service) -> None:
    """A LoRA + salted prompt (SGLang's dialect carries both): Dynamo's local hashes of it
    (the LoRA name and the namespace are in their seed) and the sequence hashes rolled over
    them as Dynamo rolls them (seed 1337 always) each find every block by hash."""
    svc.publisher("ls", dialect="sglang")
    svc.register("ls", instance_id="ls")
    toks = tokens(9, 4)
    svc.pubs["ls"].publish(stored(toks, 1, lora_name="sql", cache_salt="ns"))
    svc.held("ls", toks, 64, lora_name="sql", cache_salt="ns")
    local = standard_local_hashes(toks, BS, standard_seed("sql", "ns"))
    seq = [local[0]]
    for h in local[1:]:
        seq.append(xxh3_64_intdigest(struct.pack("<QQ", seq[-1], h), 1337))
    out = svc.query("/query_by_hash", model="m", lora_name="sql", cache_salt="ns",
                    block_size=BS, seq_hashes=seq)
    assert out["default"]["ls"]["longest_matched"] == 64, out
    out = svc.query("/query_by_hash", model_name="m", lora_name="sql", cache_salt="ns",
                    block_hashes=signed(local))
    assert out["instances"]["ls"]["longest_matched"] == 64, out


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("method", "path", "body", "status", "needle"), [
    ("POST", "/query", b"{", 400, "malformed JSON"),
    ("POST", "/query", b'{"model": "m", "token_ids": [1, "x"]}', 422, "$.token_ids[1]"),
    ("POST", "/query", b'{"token_ids": [1]}', 422, "model_name (Dynamo) is required"),
    ("POST", "/query", b'{"model": "m"}', 422, "token_ids is missing or empty"),
    ("POST", "/query", b'{"model": "m", "model_name": "n", "token_ids": [1]}', 422,
     "given twice"),
    ("POST", "/query?shape=xml", b'{"model": "m", "token_ids": [1]}', 400, "shape must be"),
    ("POST", "/query_by_hash", b'{"model": "m"}', 422, "give exactly one of seq_hashes"),
    ("POST", "/query_by_hash", b'{"model": "m", "seq_hashes": [-1]}', 422,
     "seq_hashes[0] = -1 is not a 64-bit hash"),
    ("POST", "/register", b'{"instance_id": "x", "modelname": "m"}', 422,
     "missing required field `endpoint`"),
    ("POST", "/register", b'{"endpoint": "tcp//x", "instance_id": "x", "modelname": "m"}',
     422, "is not a ZeroMQ endpoint"),
    ("POST", "/register", b'{"endpoint": "ipc:///tmp/x", "instance_id": "x", "modelname":'
     b' "m", "type": "TGI"}', 422, "type must be one of vLLM, SGLang, Mooncake"),
    ("POST", "/register", b'{"endpoint": "ipc:///tmp/x", "instance_id": "x", "modelname":'
     b' "m", "block_size": 0}', 422, "$.block_size"),
    ("POST", "/unregister", b'{"instance_id": "ghost"}', 404, "'ghost' of tenant 'default'"),
    ("GET", "/query", b"", 405, "/query takes POST"),
    ("POST", "/nope", b"{}", 404, None),
])
def test_bad_input_is_4xx_naming_it_and_counted(svc: Service, method: str, path: str,
                                               body: bytes, status: int,
                                               needle: str | None) -> None:
    r = svc.http.request(method, path, content=body)
    assert r.status_code == status, r.text
    if needle is not None:
        assert needle in r.json()["error"], r.json()
        reason = r.json()["reason"]
        assert re.search(rf'kvwire_indexer_events_total\{{what="bad_{reason}"\}} 1\.0',
                         svc.http.get("/metrics").text)
    assert svc.http.get("/health").json()["ok"]  # still serving (no engines: the API alone)


def test_unknown_instances_and_tenants_are_answered(svc: Service) -> None:
    q = {"model": "m", "token_ids": tokens(1, 2)}
    assert svc.query(**q, tenant_id="nobody") == {"nobody": {}}
    assert svc.query(**q, instance_id="ghost") == {"default": {"ghost": {
        "longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "DP": {}}}}
    assert svc.query(model_name="m", token_ids=[1] * 32, instance_id=7) == {
        "scores": {}, "frequencies": [], "instances": {}}
    assert re.search(r'kvwire_indexer_events_total\{what="empty_scope"\} 3',
                     svc.http.get("/metrics").text)


# --------------------------------------------------------------------------- restart


def _url(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    return _url_said(proc, timeout)[0]


def _url_said(proc: subprocess.Popen, timeout: float = 60.0) -> tuple[str, str]:
    """The URL ``kvwire serve`` announces on stderr, and all it said up to there. Lines are
    read by a thread (a select() on the pipe misses a line already in the reader's buffer,
    as when two come in one read), which stops at the URL line."""
    got: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            got.append(line)
            if re.search(r"(http://\S+)/", line):
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    seen = "".join(got)
    m = re.search(r"(http://\S+)/", got[-1]) if got else None
    if m is None:
        raise AssertionError(f"kvwire serve did not announce its port: {seen}")
    return m.group(1), seen


def _serve(regs) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([*SERVE, "--registrations", str(regs), "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, _url(proc)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def test_registrations_file_survives_a_restart(tmp_path) -> None:
    """A real ``kvwire serve --registrations FILE`` (no --engine): streams registered over
    HTTP are followed again after a restart, their blocks rebuilt from the publishers'
    snapshots without being published again."""
    regs = tmp_path / "regs.json"
    pubs = [ZmqEventPublisher(endpoint=f"ipc://{tmp_path}/p{i}.live",
                              replay_endpoint=f"ipc://{tmp_path}/p{i}.replay",
                              heartbeat_interval=0.2) for i in range(2)]
    toks = tokens(9, 3)
    q = {"model": "m", "token_ids": toks}

    def answer(url: str) -> dict:
        r = httpx.post(url + "/query", json=q, timeout=5)
        assert r.status_code == 200, r.text
        return {k: v["longest_matched"] for k, v in r.json()["default"].items()}

    proc, url = _serve(regs)
    try:
        for i, p in enumerate(pubs):
            r = httpx.post(url + "/register", json={
                "endpoint": p.endpoint, "replay_endpoint": p.replay_endpoint, "type": "vLLM",
                "modelname": "m", "instance_id": f"e{i}", "block_size": BS, "dp_rank": 0})
            assert r.status_code == 200, r.text
            p.publish(stored(toks[: (i + 2) * BS], 1))
        wait_for(lambda: answer(url) == {"e0": 32, "e1": 48}, "both indexed")
        assert not (tmp_path / "regs.json.tmp").exists()
    finally:
        _stop(proc)
    proc, url = _serve(regs)
    try:
        assert len(httpx.get(url + "/registrations").json()) == 2
        wait_for(lambda: answer(url) == {"e0": 32, "e1": 48}, "rebuilt after the restart")
        r = httpx.post(url + "/unregister", json={"instance_id": "e0"})
        assert r.status_code == 200
    finally:
        _stop(proc)
    proc, url = _serve(regs)
    try:
        assert [r["instance_id"] for r in httpx.get(url + "/registrations").json()] == ["e1"]
    finally:
        _stop(proc)
        for p in pubs:
            p.shutdown(timeout=1)


def test_unreadable_registrations_file_refuses_to_start(tmp_path) -> None:
    regs = tmp_path / "regs.json"
    regs.write_text('{"version": 1, "registrations": [{"endpoint": 5}]}')
    r = subprocess.run([*SERVE, "--registrations", str(regs), "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"registrations file {regs}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_stream_the_subscriber_cannot_open_is_reported(svc: Service) -> None:
    """``tcp://*:PORT`` makes kvwire bind (a collector); a port already taken fails in the
    subscriber thread, after the answer: /indexer/health says so, the service goes on."""
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = svc.http.post("/register", json={"endpoint": f"tcp://*:{port}",
                                              "modelname": "m", "instance_id": "c"})
        assert r.status_code == 200, r.text
        health = wait_for(lambda: (h := svc.http.get("/indexer/health").json())[
            "stream_errors"] and h, "the failed bind reported")
    assert "c|default|0" in health["last_stream_error"], health
    assert svc.http.get("/registrations").json()[0]["alive"] is False
