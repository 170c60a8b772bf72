"""``kvwire index``: the lean HTTP face of the indexer API, and its workers' one index.

* the C-parsed ``/query`` token ids (``Indexer._query``) answer byte for byte as msgspec's
  path (``c_token_ids = False``) does, for any body (hypothesis), bad ones included;
* the C parser itself on long arrays (its 64-byte block path): every id it returns is the
  JSON's, it never takes a text JSON rejects (``01``, ``,,``, ...), and it takes every
  compact or ", "-spaced array of in-range ids;
* ``kvwire index --workers 2`` (real processes, a real publisher): a ``/register`` answered
  on one connection is seen by every later connection, whichever worker takes it (40 fresh
  connections: the parent hands them to both workers in turn); likewise ``/unregister``; the query
  string reaches the indexer (``?shape=``); pipelined keep-alive requests are answered in
  order; a worker that dies takes the service down (exit 1), never half of it.
"""

from __future__ import annotations

import array
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from engine_helpers import TIMEOUT
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from waiting import wait_for  # noqa: E402

from kvwire.indexer.indexer import Indexer
from kvwire.publish.publisher import ZmqEventPublisher
from kvwire.wire.events import BlockStored, KVEventBatch

_wait = functools.partial(wait_for, timeout=TIMEOUT, interval=0.02)

ROOT = Path(__file__).resolve().parent.parent
BS = 16
PROMPT = list(range(1000, 1000 + 6 * BS))



#: the fixture's publishers: (instance, dp_rank, registered extra fields, blocks held, medium)
_FLEET = [("e1", 0, {}, 6, "GPU"), ("e1", 1, {}, 3, "CPU"), ("e2", 0, {"additionalsalt": "x"}, 2,
          "GPU"), ("e3", 0, {"block_size": 2 * BS}, 4, "GPU")]  # e3: registered size differs


@pytest.fixture(scope="module")
def indexed():
    """An in-process Indexer following real publishers (_FLEET) of model "m", tenant "t",
    each holding a prefix of PROMPT: two DP ranks of one instance on different media, an
    instance registered with a salt, one registered with another block size than it uses."""
    where = tempfile.mkdtemp(prefix="kvw-ih-")
    pubs = []
    ix = Indexer.standalone()
    try:
        for i, (inst, rank, extra, n, medium) in enumerate(_FLEET):
            live, replay = f"ipc://{where}/{i}.l", f"ipc://{where}/{i}.r"
            pubs.append(ZmqEventPublisher(endpoint=live, replay_endpoint=replay,
                                          heartbeat_interval=0.2))
            st_, out = ix.handle("POST", "/register", json.dumps({
                "endpoint": live, "replay_endpoint": replay, "type": "vLLM", "modelname": "m",
                "tenant_id": "t", "instance_id": inst, "block_size": BS, "dp_rank": rank,
                **extra}).encode())
            assert st_ == 200, out
            pubs[-1].publish(KVEventBatch(time.time(), [BlockStored(
                list(range(1, n + 1)), None, PROMPT[:n * BS], BS, None, medium)], 0))
        for inst, rank, extra, n, _medium in _FLEET:
            q = json.dumps({"token_ids": PROMPT, "model": "m", "tenant_id": "t",
                            "instance_id": inst, **({"cache_salt": "x"} if extra.get(
                                "additionalsalt") else {})}).encode()
            _wait(lambda q=q, n=n, rank=rank: (b'"%d":%d' % (rank, n * BS))
                  in ix.handle("POST", "/query", q)[1], f"{inst} rank {rank}'s blocks")
        yield ix
    finally:
        for p in pubs:
            p.shutdown(timeout=1)
        ix.close()


_TOKENS = st.one_of(
    st.lists(st.sampled_from(PROMPT[:40]) | st.integers(0, 2**32 - 1), max_size=120),
    st.just(PROMPT), st.just(PROMPT[:50]), st.just(PROMPT), st.just(PROMPT + [5] * 40),
    st.lists(st.integers(-3, 2**33), max_size=5))  # out of range: the strict path names it
_FIELDS = st.dictionaries(
    st.sampled_from(["model", "model_name", "tenant_id", "instance_id", "lora_name",
                     "cache_salt", "salt", "block_size", "extra"]),
    st.sampled_from(["m", "t", "e1", "e2", "e3", 16, 0, None, "x", 3.5, [1]]), max_size=2)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=_TOKENS, fields=_FIELDS, first=st.booleans(), spaces=st.booleans(),
       dup=st.sampled_from([False, False, False, True]),
       junk=st.one_of(st.just(""), st.sampled_from(["]", "}", ",", "x"])),
       inst=st.sampled_from([None, "e1", "e2", "e3"]), salt=st.sampled_from([None, "x"]))
def test_fast_query_answers_as_the_indexer(indexed, tokens, fields, first, spaces, dup,
                                           junk, inst, salt) -> None:
    """Same status and bytes with the token ids parsed in C as with msgspec's path, for any
    /query body: token ids first (the C path) or not, given twice, other fields valid, wrong or missing, malformed tails."""
    base = {"model": "m", "tenant_id": "t", "instance_id": inst, "cache_salt": salt}
    fields = {**{k: v for k, v in base.items() if v is not None}, **fields}  # in scope
    # unless overridden
    body = {"token_ids": tokens, **fields} if first else {**fields, "token_ids": tokens}
    raw = json.dumps(body, separators=(", ", ": ") if spaces else (",", ":")).encode()
    if dup:  # a second token_ids member: the strict decode keeps the last one
        raw = raw[:-1] + b',"token_ids":[1000,1001]}'
    raw += junk.encode()
    if not indexed.c_token_ids:
        pytest.skip("the C token-id parser is not built (or KVWIRE_NO_NATIVE): nothing to compare")
    fast = indexed.handle("POST", "/query", raw)
    indexed.c_token_ids = False
    try:
        assert fast == indexed.handle("POST", "/query", raw)
    finally:
        indexed.c_token_ids = True


_ID = st.one_of(st.integers(0, 9), st.integers(10, 99_999), st.integers(0, 2**32 - 1),
                st.integers(10**7, 10**8 - 1), st.integers(10**8, 10**9 - 1),
                st.integers(2**32, 10**11))
_ODD = st.sampled_from(["01", "00", "", " ", "-1", "1.5", "1e3", "x", "007", '"7"',
                        "123456789012"])


@settings(max_examples=400, deadline=None)
@example(ids=[7] * 60, spaced="", odd=(20, "01"), tail="}")  # in the block path
@example(ids=[7] * 60, spaced="", odd=(20, ""), tail="}")
@given(ids=st.one_of(st.lists(_ID, max_size=20), st.lists(_ID, min_size=30, max_size=400)),
       spaced=st.sampled_from(["", " ", "", "\n"]),
       odd=st.one_of(st.none(), st.tuples(st.integers(0, 400), _ODD)),
       tail=st.sampled_from(["}", ',"model":"m"}', ', "block_size": 16}', "]", "}x", ""]))
def test_token_parser_takes_only_what_json_says(ids, spaced, odd, tail) -> None:
    from kvwire.routing.tokens import parse_route_body

    if parse_route_body is None:
        pytest.skip("the C token-id parser is not built (or KVWIRE_NO_NATIVE)")
    items = [str(i) for i in ids]
    if odd is not None:
        items.insert(odd[0] % (len(items) + 1), odd[1])
    body = ('{"token_ids":[' + ("," + spaced).join(items) + "]" + tail).encode()
    got = parse_route_body(body)
    try:
        want = json.loads(body)
    except ValueError:
        want = None
    if got is not None:  # taken: exactly the JSON's ids, all in range, the rest as JSON's
        assert want is not None, body
        assert array.array("q", got[0]).tolist() == want["token_ids"], body
        assert all(0 <= t < 2**32 for t in want["token_ids"])
        rest = {} if got[1] is None else json.loads(got[1])
        assert rest == {k: v for k, v in want.items() if k != "token_ids"}
    elif odd is None and tail in ("}", ',"model":"m"}', ', "block_size": 16}') \
            and all(i < 2**32 for i in ids) and spaced != "\n":
        raise AssertionError(f"a plain array was not taken: {body[:200]!r}")


# ----------------------------------------------------------------------------- workers


def _call(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """One request on a fresh connection (urllib does not reuse them)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _start(*flags: str) -> tuple[subprocess.Popen, int]:
    kv = subprocess.Popen(
        [sys.executable, "-m", "kvwire.cli.index", "--port", "0", "--workers", "2", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    line = kv.stderr.readline()
    m = re.search(r"http://127\.0\.0\.1:(\d+) \(2 workers", line)
    if not m:
        kv.kill()
        raise AssertionError(f"kvwire index did not start: {line}{kv.stderr.read()}")
    return kv, int(m.group(1))


def _stop(kv: subprocess.Popen) -> None:
    if kv.poll() is None:
        kv.send_signal(signal.SIGTERM)
        assert kv.wait(TIMEOUT) == 0


@pytest.fixture
def workers():
    kv, port = _start()
    try:
        yield kv, port
    finally:
        _stop(kv)


def test_registrations_reach_every_worker_before_the_answer(workers) -> None:
    kv, port = workers
    where = tempfile.mkdtemp(prefix="kvw-iw-")
    pub = ZmqEventPublisher(endpoint=f"ipc://{where}/l", replay_endpoint=f"ipc://{where}/r",
                            heartbeat_interval=0.2)
    try:
        reg = {"instance_id": 7, "endpoint": f"ipc://{where}/l",
               "replay_endpoint": f"ipc://{where}/r", "model_name": "m", "block_size": BS}
        assert _call(port, "POST", "/register", reg)[0] == 201
        for _ in range(40):  # fresh connections: both workers, each must know it already
            st_, regs = _call(port, "GET", "/registrations")
            assert st_ == 200 and [str(r["instance_id"]) for r in regs] == ["7"], regs
        pub.publish(KVEventBatch(time.time(), [BlockStored(
            list(range(1, 7)), None, PROMPT, BS, None, "GPU")], 0))
        q = {"token_ids": PROMPT, "model": "m", "block_size": BS}
        _wait(lambda: all(_call(port, "POST", "/query", q)[1] == {
            "default": {"7": {"longest_matched": 96, "GPU": 96, "CPU": 0, "DISK": 0,
                              "DP": {"0": 96}}}} for _ in range(10)),
              "every worker to hold the publisher's blocks")
        # the query string reaches the indexer: Dynamo's shape for a Mooncake-spelled body
        st_, dyn = _call(port, "POST", "/query?shape=dynamo", q)
        assert st_ == 200 and dyn["instances"]["7"]["longest_matched"] == 96, dyn
        # pipelined keep-alive requests on one connection: answered in order, those behind
        # a sequenced /unregister only after every worker applied it (so they see it)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            one = json.dumps(q).encode()
            unreg = json.dumps({"instance_id": 7, "model_name": "m"}).encode()
            s.sendall((b"POST /query HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
                       % (len(one), one)) + b"GET /nope HTTP/1.1\r\nhost: x\r\n\r\n"
                      + (b"POST /unregister HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n"
                         b"\r\n%s" % (len(unreg), unreg))
                      + b"GET /registrations HTTP/1.1\r\nhost: x\r\n\r\n")
            got = b""
            while got.count(b"HTTP/1.1 ") < 4 or not got.endswith(b"]"):
                chunk = s.recv(65536)
                assert chunk, got
                got += chunk
        assert re.findall(rb"HTTP/1.1 (\d+)", got) == [b"200", b"404", b"200", b"200"], got
        assert b'"longest_matched":96' in got and got.endswith(b"\r\n\r\n[]"), got
        for _ in range(40):
            assert _call(port, "GET", "/registrations") == (200, [])
            assert _call(port, "POST", "/query", q) == (200, {"default": {}})
    finally:
        pub.shutdown(timeout=1)


def test_a_dead_worker_stops_the_service(workers) -> None:
    kv, port = workers
    kids = subprocess.run(["pgrep", "-P", str(kv.pid), "-f", "spawn_main"],
                          capture_output=True, text=True).stdout.split()
    assert len(kids) == 2, kids
    os.kill(int(kids[0]), signal.SIGKILL)
    assert kv.wait(TIMEOUT) == 1
    assert "exited" in kv.stderr.read()


def test_registrations_file_with_workers(tmp_path) -> None:
    """Worker 0 writes the file, every worker reads it: after a restart, every connection
    finds the registration again (the stream is followed again by each worker)."""
    regs = tmp_path / "regs.json"
    reg = {"instance_id": 9, "endpoint": "ipc:///tmp/kvw-nowhere.live", "model_name": "m",
           "block_size": BS}
    kv, port = _start("--registrations", str(regs))
    try:
        assert _call(port, "POST", "/register", reg)[0] == 201
    finally:
        _stop(kv)
    assert [r["instance_id"] for r in json.loads(regs.read_text())["registrations"]] == [9]
    kv, port = _start("--registrations", str(regs))
    try:
        for _ in range(20):
            st_, got = _call(port, "GET", "/registrations")
            assert st_ == 200 and [str(r["instance_id"]) for r in got] == ["9"], got
    finally:
        _stop(kv)
