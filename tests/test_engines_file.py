"""``kvwire serve --engines-file``: engines added and removed at run time outlive a restart.

The pure rule (:class:`EngineChanges`) against a model under hypothesis; the file's errors;
then real ``kvwire serve`` processes restarted on the same command line, one proxying to real
``kvwire engine`` processes, one answering the decision API (whose file write is made to fail
for real: its temporary file's path is taken by a directory)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.consume.engine_spec import EngineSpec
from kvwire.consume.stream import Batch
from kvwire.routing.core import RouterCore
from kvwire.serve.engines_file import EngineChanges, EnginesFile
from kvwire.wire.events import BlockStored, KVEventBatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_membership import AUTH, TOKEN  # noqa: E402
from test_proxy import (  # noqa: E402
    TIMEOUT,
    EngineProc,
    _chat,
    engine_procs,  # noqa: F401 (a fixture)
    serve_proc,  # noqa: F401 (a fixture)
    wait_for,
)

NAMES = ("a", "b", "c", "d")


def _text(name: str, port: int) -> str:
    return f"{name}=tcp://127.0.0.1:{port}"


# ------------------------------------------------------------------------- the pure rule

_ops = st.lists(st.tuples(st.sampled_from(("add", "remove")), st.sampled_from(NAMES),
                          st.integers(6000, 6003)), max_size=12)


@settings(max_examples=300, deadline=None)
@given(start=st.sets(st.sampled_from(NAMES)), ops=_ops)
def test_changes_laid_over_the_start_give_the_fleet_they_made(start: set[str],
                                                              ops: list) -> None:
    """Whatever adds and removes were made, in any order, the engines at the next start are
    the ones the changes left (an added engine as it was added last), and the removed
    names are withdrawn; the file gives back what was written."""
    given_specs = [EngineSpec.parse(_text(n, 5000)) for n in sorted(start)]
    fleet = {e.name: e for e in given_specs}
    changes = EngineChanges()
    for op, name, port in ops:
        if op == "add":
            changes = changes.add(name, _text(name, port))
            fleet[name] = EngineSpec.parse(_text(name, port))
        else:
            changes = changes.remove(name)
            fleet.pop(name, None)
    out = changes.over(given_specs, EngineSpec.parse)
    assert {e.name: e for e in out.engines} == fleet
    assert len(out.engines) == len(fleet)
    last = {name: op for op, name, _ in ops}
    assert out.withdrawn == {n for n, op in last.items() if op == "remove"}
    assert out.dropped == sorted(n for n in start if n in changes.removed)
    assert out.replaced == sorted(n for n in start if n in changes.added)


def test_engines_file_round_trip_and_errors(tmp_path: Path) -> None:
    f = EnginesFile(tmp_path / "engines.json")
    assert f.load() == EngineChanges()  # no file yet: no changes
    c = EngineChanges().add("b", _text("b", 6001)).remove("a")
    f.commit(c)
    assert EnginesFile(f.path).load() == c and f.changes == c
    assert json.loads(f.path.read_text()) == {"version": 1, "added": {"b": _text("b", 6001)},
                                              "removed": ["a"]}
    for raw, want in ((b"{", "engines.json"), (b'{"added": []}', "added"),
                      (b'{"extra": 1}', "extra"), (b'{"version": 2}', "version 2")):
        f.path.write_bytes(raw)
        with pytest.raises(ValueError, match=want):
            EnginesFile(f.path).load()
    with pytest.raises(ValueError, match=f"engines file {tmp_path}: .*Is a directory"):
        EnginesFile(tmp_path).load()  # unreadable: an error, not an empty set of changes
    with pytest.raises(ValueError, match=f"no directory {tmp_path / 'nowhere'} to write"):
        EnginesFile(tmp_path / "nowhere" / "engines.json").load()
    with pytest.raises(ValueError, match="engine 'b' added as 'c=tcp.*names 'c'"):
        EngineChanges(added={"b": _text("c", 1)}).over([], EngineSpec.parse)
    with pytest.raises(ValueError, match="engine 'b' added as 'b=nowhere'"):
        EngineChanges(added={"b": "b=nowhere"}).over([], EngineSpec.parse)


def test_a_withdrawn_engine_is_not_found_again_on_the_stream() -> None:
    """--nats without --nats-engine: a name removed before the restart stays out when its
    streams show up on JetStream again; others are found as before."""
    core = RouterCore([], nats=object(), discover=True, withdrawn={"gone"})

    def item(stream: str) -> Batch:
        return Batch(stream, 1, KVEventBatch(0.0, [BlockStored([7], None, list(range(16)),
                                                               16, None)], 0), 1)

    core.feed._apply([item("gone/dp0"), item("new/dp0")])
    assert [t.stream for t in core.targets] == ["new/dp0"]
    core.add_engine(EngineSpec.parse_named("gone"))  # added again: routed, no longer out
    assert [t.stream for t in core.targets] == ["new/dp0", "gone/dp0"]


def test_an_add_that_fails_after_the_write_is_taken_back(tmp_path: Path) -> None:
    """The change is written first; an add that then fails (here for real: the router's
    subscriber is closed, as while it stops) is written back out of the file, and the
    caller hears why (503), not a bare 500. A removal still takes the engine out."""
    from kvwire.serve.app import serve_in_thread

    core = RouterCore([EngineSpec.parse(_text("a", 5801))])
    core.start()
    kept = EnginesFile(tmp_path / "engines.json")
    server, thread, port = serve_in_thread(core, admin_token=TOKEN, engines_file=kept)
    try:
        core.close()
        r = httpx.post(f"http://127.0.0.1:{port}/engines", headers=AUTH,
                       json={"engine": _text("b", 5802)}, timeout=TIMEOUT)
        assert r.status_code == 503 and "stopping" in r.json()["error"], r.text
        assert EnginesFile(kept.path).load() == EngineChanges() == kept.changes
        assert [e.name for e in core.engines] == ["a"]
        # a removal then is made (no decision picks the engine) and kept
        r = httpx.delete(f"http://127.0.0.1:{port}/engines/a", headers=AUTH, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert core.engines == [] and EnginesFile(kept.path).load().removed == ["a"]
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)


class _SlowDisk(EnginesFile):
    """An engines file whose writes wait for ``go`` (standing in for a slow disk, which
    cannot be caused here for real); ``writing`` is set while one waits."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.go, self.writing = threading.Event(), threading.Event()

    def commit(self, changes: EngineChanges) -> None:
        self.writing.set()
        assert self.go.wait(TIMEOUT)
        super().commit(changes)


def test_changes_are_written_off_the_loop_one_at_a_time(tmp_path: Path) -> None:
    """While a change's write waits on the disk the router still answers (the write is not
    on the event loop); concurrent adds of one name are made one at a time: one 201, the
    rest 409, and the file names the engine that is routed to (a second writer could
    otherwise write back the state before the first's add)."""
    from kvwire.serve.app import serve_in_thread

    core = RouterCore([EngineSpec.parse(_text("a", 5801))])
    core.start()
    kept = _SlowDisk(tmp_path / "engines.json")
    server, thread, port = serve_in_thread(core, admin_token=TOKEN, engines_file=kept)
    base = f"http://127.0.0.1:{port}"

    async def adds() -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as c:
            async def add() -> int:
                r = await c.post("/engines", headers=AUTH, json={"engine": _text("b", 5802)})
                return r.status_code

            tasks = [asyncio.create_task(add()) for _ in range(6)]
            assert await asyncio.to_thread(kept.writing.wait, TIMEOUT)
            r = await c.get("/engines")  # answered while the write waits
            assert r.status_code == 200 and set(r.json()) == {"a"}
            kept.go.set()
            return sorted(await asyncio.gather(*tasks))

    try:
        assert asyncio.run(adds()) == [201] + [409] * 5
        assert [e.name for e in core.engines] == ["a", "b"]
        assert EnginesFile(kept.path).load().added == {"b": _text("b", 5802)}
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        core.close()


# -------------------------------------------------------------------- real processes


def _restart(p: subprocess.Popen) -> None:
    p.terminate()
    assert p.wait(TIMEOUT) == 0


def test_a_restarted_proxy_routes_to_the_fleet_the_changes_made(
        tmp_path: Path, engine_procs: Callable[..., list[EngineProc]],  # noqa: F811
        serve_proc: Callable[..., tuple[subprocess.Popen, str]]) -> None:  # noqa: F811
    """`kvwire serve` in front of one `kvwire engine`; a second engine is added and the
    first removed at run time; restarted on the same command line, it routes to the
    second only (the proxy is built for it although the command line's engine is gone)."""
    first, second = engine_procs(2)
    path = tmp_path / "engines.json"
    args = ("--engine", f"e0={first.events},url={first.url}", "--tokenizer", "builtin",
            "--probe-interval", "0.1", "--admin-token", TOKEN, "--engines-file", str(path))
    p, url = serve_proc(*args)
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        r = c.post("/engines", headers=AUTH,
                   json={"engine": f"e1={second.events},url={second.url}"})
        assert r.status_code == 201, r.text
        assert c.delete("/engines/e0", headers=AUTH).status_code == 200
    assert json.loads(path.read_text()) == {
        "version": 1, "added": {"e1": f"e1={second.events},url={second.url}"},
        "removed": ["e0"]}
    _restart(p)
    p, url = serve_proc(*args)
    said = " ".join(p.said)  # type: ignore[attr-defined]
    assert f"engines file {path}: added e1; e0 left out" in said
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        assert set(c.get("/engines").json()) == {"e1"}
        wait_for(lambda: c.get("/health").status_code == 200, "router healthy")
        r = c.post("/v1/chat/completions", json=_chat("after the restart " * 20, "q"))
        assert r.status_code == 200 and r.headers["x-kvwire-engine"] == "e1", r.text
        # added back at run time: the file forgets its removal, the next start routes to it
        r = c.post("/engines", headers=AUTH,
                   json={"engine": f"e0={first.events},url={first.url}"})
        assert r.status_code == 201, r.text
    _restart(p)
    p, url = serve_proc(*args)
    assert "left out" not in " ".join(p.said)  # type: ignore[attr-defined]
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        assert set(c.get("/engines").json()) == {"e0", "e1"}


def test_a_change_that_cannot_be_written_is_not_made(
        tmp_path: Path,
        serve_proc: Callable[..., tuple[subprocess.Popen, str]]) -> None:  # noqa: F811
    """Decision API only. The file's write fails for real (a directory sits where its
    temporary file goes): 507 naming the file, the engines unchanged, the file as it was;
    once the write can succeed, the same change is made and kept. An unreadable file
    stops the start (exit 2, naming it)."""
    path = tmp_path / "engines.json"
    args = ("--engine", _text("a", 5801), "--admin-token", TOKEN, "--engines-file", str(path))
    p, url = serve_proc(*args)
    blocked = path.with_name(path.name + ".tmp")
    blocked.mkdir()
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        r = c.post("/engines", headers=AUTH, json={"engine": _text("b", 5802)})
        assert r.status_code == 507 and str(path) in r.json()["error"]
        assert "nothing changed" in r.json()["error"]
        r = c.delete("/engines/a", headers=AUTH)
        assert r.status_code == 507
        # what would be refused anyway is refused for its own reason, before any write
        assert c.post("/engines", headers=AUTH,
                      json={"engine": _text("a", 5809)}).status_code == 409
        assert c.delete("/engines/zz", headers=AUTH).status_code == 404
        assert set(c.get("/engines").json()) == {"a"} and not path.exists()
        blocked.rmdir()
        assert c.post("/engines", headers=AUTH,
                      json={"engine": _text("b", 5802)}).status_code == 201
        # refused changes leave the file alone: a name in use, an unknown name
        assert c.post("/engines", headers=AUTH,
                      json={"engine": _text("b", 5803)}).status_code == 409
        assert c.delete("/engines/zz", headers=AUTH).status_code == 404
        assert set(c.get("/engines").json()) == {"a", "b"}
    assert json.loads(path.read_text())["added"] == {"b": _text("b", 5802)}
    _restart(p)
    path.write_text('{"version": 1, "added": {"x": "x=nowhere"}}')
    bad = subprocess.run([sys.executable, "-m", "kvwire", "serve", *args, "--port", "0"],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert bad.returncode == 2
    assert f"engines file {path}: engine 'x' added as 'x=nowhere'" in bad.stderr
