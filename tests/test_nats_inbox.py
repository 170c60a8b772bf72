"""``kvwire.nats.inbox``: subscriptions handled in nats-py's read loop, and the guarded
writer that uses them for its PubAcks (with its direct socket writes), on a real
nats-server; the version gate of nats-py's internals (kvwire.nats.client_internals), and
the writer's tests again on nats-py's public API only (``nats_api``)."""

from __future__ import annotations

import asyncio
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

nats = pytest.importorskip("nats")

from nats_api import nats_api_fixture  # noqa: E402, F401 - the nats_api fixture
from waiting import until  # noqa: E402

from kvwire.index.cache import BlockCache  # noqa: E402
from kvwire.nats import client_internals as CI  # noqa: E402
from kvwire.nats.bridge_config import BridgeConfig, ensure_stream  # noqa: E402
from kvwire.nats.inbox import inline_supported, subscribe_inline  # noqa: E402
from kvwire.nats.subjects import H_FIRST_SEQ, H_SEQ  # noqa: E402
from kvwire.nats.writer import JsWriter  # noqa: E402
from kvwire.wire import events as E  # noqa: E402


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_inline_callback_runs_in_the_read_loop_in_order_with_headers(nats_server: Any) -> None:
    async def main() -> None:
        nc = await nats.connect(nats_server.url)
        pub = await nats.connect(nats_server.url)
        try:
            assert inline_supported(nc)
            got: list[tuple[str, bytes, Any, bool]] = []
            plain: list[bytes] = []
            probes_seen: list[bool] = []
            plain_probes: list[bytes] = []

            def cb(m: Any) -> None:
                if m.data != b"probe":
                    got.append((m.subject, m.data, m.headers,
                                asyncio.current_task() is nc._reading_task))
                else:
                    probes_seen.append(asyncio.current_task() is nc._reading_task)

            async def plain_cb(m: Any) -> None:
                (plain if m.data != b"probe" else plain_probes).append(m.data)

            sub = await subscribe_inline(nc, "t.inline.*", cb)
            await nc.subscribe("t.plain", cb=plain_cb)  # nats-py's own path, same client
            await nc.flush()
            # Probes until both deliver: on a loaded box nats-server 2.15 was seen dropping
            # a fresh connection's first publishes to subscriptions it had confirmed.
            for _ in range(200):
                await pub.publish("t.inline.probe", b"probe")
                await pub.publish("t.plain", b"probe")
                await pub.flush()
                await asyncio.sleep(0.05)
                if probes_seen and plain_probes:
                    break
            for i in range(50):
                await pub.publish(f"t.inline.{i}", b"%d" % i, headers={"K": str(i)})
                await pub.publish("t.plain", b"p%d" % i)
            await pub.flush()
            await until(lambda: len(got) >= 50 and len(plain) >= 50,
                        lambda: f"messages: {len(got)} inline, {len(plain)} plain; "
                                f"reader {nc.stats} {nc.is_connected}; writer {pub.stats}")
            assert [g[1] for g in got] == [b"%d" % i for i in range(50)]
            assert [g[0] for g in got] == [f"t.inline.{i}" for i in range(50)]
            assert all(g[2] == {"K": str(i)} for i, g in enumerate(got))
            assert all(g[3] for g in got), "the callback ran outside nats-py's read loop"
            assert plain == [b"p%d" % i for i in range(50)]

            # no responders: a status message reaches the callback with its status header
            await nc.publish("t.nobody", b"", reply="t.inline.status")
            await nc.flush()
            await until(lambda: len(got) == 51, "the no-responders status")
            assert got[-1][0] == "t.inline.status" and got[-1][2]["Status"] == "503", got[-1]

            await sub.unsubscribe()
            await nc.flush()
            n = len(got)
            await pub.publish("t.inline.x", b"late")
            await pub.publish("t.plain", b"after")
            await pub.flush()
            await until(lambda: len(plain) == 51, "the plain subscription")
            assert len(got) == n, "a callback after unsubscribe"
        finally:
            await nc.close()
            await pub.close()

    run(main())


class _Bare:
    """A client with nats-py's public API only (as a nats-py without those internals would
    be): the real one's ``subscribe``, nothing private."""

    def __init__(self, nc: Any) -> None:
        self.subscribe = nc.subscribe


@pytest.mark.parametrize("how", ["no internals", "forced public"])
def test_without_the_internals_it_falls_back_to_nats_py_s_dispatch(
        nats_server: Any, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    async def main() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            got: list[bool] = []

            def cb(m: Any) -> None:
                got.append(asyncio.current_task() is nc._reading_task)

            if how == "no internals":
                client: Any = _Bare(nc)
            else:
                monkeypatch.setenv(CI.FORCE_PUBLIC, "1")
                client = nc
            assert not inline_supported(client)
            await subscribe_inline(client, "t.fb", cb)
            await nc.publish("t.fb", b"x")
            await nc.flush()
            await until(lambda: got, "the message")
            assert got == [False]  # delivered by the subscription's own task
            assert nc._process_msg.__self__ is nc  # nats-py's reader left as it was
        finally:
            await nc.close()

    run(main())


def test_the_internals_are_gated_by_nats_py_s_version(
        nats_server: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """Only the tested nats-py versions (the pin in pyproject.toml) get the internals; any
    other says so once, as a warning, and gets the public API. (Another nats-py cannot be
    installed next to this one: the version string is patched, the client is real.)"""
    assert CI.version_tested("2.16.0") and CI.version_tested("2.16.7")
    for v in ("2.15.9", "2.17.0", "3.0.0", "2", "dev"):
        assert not CI.version_tested(v), v
    import nats.aio.client as client_mod

    lo, hi = CI.TESTED
    assert CI.version_tested(client_mod.__version__), (client_mod.__version__, CI.TESTED)
    with open(Path(__file__).resolve().parents[1] / "pyproject.toml") as f:
        pins = [ln for ln in f if '"nats-py' in ln]
    assert pins and all(f"nats-py>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}" in ln for ln in pins), pins

    async def main() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            monkeypatch.delenv(CI.FORCE_PUBLIC, raising=False)
            assert CI.internals(nc) is not None
            monkeypatch.setattr(client_mod, "__version__", "9.0.0")
            monkeypatch.setattr(CI, "_warned", set())
            with pytest.warns(RuntimeWarning, match="nats-py 9.0.0 is outside"):
                assert CI.internals(nc) is None
            assert "nats-py 9.0.0 is outside" in caplog.text
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert CI.internals(nc) is None  # said once
            assert not inline_supported(nc)
            w = JsWriter(nc, None, "X")
            assert w.fast is None  # the writer's public-API path
        finally:
            await nc.close()

    run(main())


async def _writer(url: str, **kw: Any) -> tuple[Any, Any, JsWriter]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    cfg = BridgeConfig(nats=url, stream="INBOXT", prefix="inboxt")
    await ensure_stream(js, cfg)
    w = JsWriter(nc, js, cfg.stream, ack_timeout=5.0, **kw)
    await w.start()
    public = os.environ.get(CI.FORCE_PUBLIC) == "1"
    assert (w.fast is None) == public and inline_supported(nc) != public
    return nc, js, w


def _batch(r: int, seq: int) -> E.KVEventBatch:
    return E.KVEventBatch(time.time(), [E.BlockStored([r * 1000 + seq], None, [1] * 16, 16,
                                                      None)], None)


async def _subject_seqs(js: Any, subject: str, last: int) -> list[int]:
    """The batch seqs stored on ``subject``, run by run, in stream order."""
    seqs: list[int] = []
    sub = await js.subscribe(subject, ordered_consumer=True)
    while not seqs or seqs[-1] < last:
        m = await sub.next_msg(timeout=10)
        first = int(m.headers.get(H_FIRST_SEQ) or m.headers[H_SEQ])
        seqs += range(first, int(m.headers[H_SEQ]) + 1)
    await sub.unsubscribe()
    return seqs


@pytest.mark.usefixtures("nats_api")
def test_guarded_writer_acks_in_the_read_loop_across_lanes_with_one_in_flight(
        nats_server: Any) -> None:
    """Three lanes share max_inflight=1 and are fed at once: what waits goes as runs, acks send the next run from the read loop, and every batch lands once, in
    order, with each lane's state the engine's."""

    async def main() -> None:
        nc, js, w = await _writer(nats_server.url, max_inflight=1, pack=8)
        try:
            lanes = [w.lane("e", r, f"inboxt.e.{r}") for r in range(3)]
            for ln in lanes:
                ln.expect = 0  # an empty subject
            truth = [BlockCache() for _ in lanes]

            async def feed(r: int) -> None:  # one task per lane (a lane's submits in order)
                ln = lanes[r]
                for seq in range(60):
                    b = _batch(r, seq)
                    truth[r].apply(b)
                    await w.submit(ln.batch_entry(3, seq, b, E.encode_batch(b)))

            await asyncio.gather(*(feed(r) for r in range(3)))
            await until(lambda: all(ln.last == (3, 59) and not ln.pending and not ln.held
                                    for ln in lanes), "every lane committed")
            assert w.stats.failed == 0 and w.stats.refused == 0, w.stats
            assert w.stats.runs > 0 and w.stats.sent < 180, w.stats  # waiting batches: runs
            for ln, t in zip(lanes, truth):
                assert ln.cache.as_dict() == t.as_dict()
            # every batch's lag (its ts -> the PubAck that covered it) was counted, once
            assert w.lag.n == w.lag_window.n == 180 and w.lag.ahead == 0
            assert 0 < w.lag.quantile(0.5) <= w.lag.quantile(0.99) <= w.lag.max < 60
            for r in range(3):
                assert await _subject_seqs(js, f"inboxt.e.{r}", 59) == list(range(60))
        finally:
            await w.close()
            await nc.close()

    run(main())


def test_an_ack_sends_at_once_unless_nats_py_holds_bytes_ahead(nats_server: Any) -> None:
    """From the read loop, the next message goes straight to the socket only when nothing
    of nats-py's is queued ahead of it (else it could overtake them); then a task sends it
    through nats-py's queue, behind them."""

    async def main() -> None:
        nc, js, w = await _writer(nats_server.url, pack=8)
        try:
            ln = w.lane("e", 0, "inboxt.e.0")
            ln.expect = 0
            seq = 0

            def hold() -> None:
                nonlocal seq
                b = _batch(0, seq)
                ln.held.append(ln.batch_entry(3, seq, b, E.encode_batch(b)))
                seq += 1

            hold()
            await nc.flush()
            assert not nc._pending_data_size
            w._pump_now(ln)
            assert len(ln.pending) == 1 and not w._tasks  # written from here, at once
            await until(lambda: ln.last == (3, 0), "the first ack")

            hold()
            await nc.publish("inboxt.other", b"ahead")  # queued in nats-py, not yet flushed
            assert nc._pending_data_size > 0
            w._pump_now(ln)
            assert not ln.pending and len(w._tasks) == 1  # left to a task
            await until(lambda: ln.last == (3, 1), "the second ack")
            assert await _subject_seqs(js, "inboxt.e.0", 1) == [0, 1]
            assert w.stats.failed == 0, w.stats
        finally:
            await w.close()
            await nc.close()

    run(main())


@pytest.mark.usefixtures("nats_api")
def test_what_is_submitted_together_leaves_as_one_run(nats_server: Any) -> None:
    """``submit(pump=False)`` holds a burst until ``pump()`` (the bridge pumps after each
    read of its engines), so five batches cost one message and one round trip instead of
    the first batch's and then the rest's; a whole run (``pack``) goes without waiting,
    and a lane held back past ``4 * max_inflight`` still moves (no deadlock)."""

    async def main() -> None:
        nc, js, w = await _writer(nats_server.url, max_inflight=2, pack=4)
        try:
            ln = w.lane("e", 0, "inboxt.e.0")
            ln.expect = 0
            truth = BlockCache()
            seq = 0

            async def submit(n: int, pump: bool = False) -> None:
                nonlocal seq
                for _ in range(n):
                    b = _batch(0, seq)
                    truth.apply(b)
                    await w.submit(ln.batch_entry(3, seq, b, E.encode_batch(b)), pump=pump)
                    seq += 1

            await submit(3)
            assert w.stats.sent == 0 and len(ln.held) == 3 and not ln.pending
            await w.pump(ln)
            await until(lambda: ln.last == (3, 2), "the burst's ack")
            assert w.stats.sent == 1 and w.stats.runs == 1, w.stats  # one message, 3 batches

            await submit(4)  # a whole run goes at once, without pump()
            await until(lambda: ln.last == (3, 6), "the full run's ack")
            assert w.stats.sent == 2 and w.stats.runs == 2 and not ln.held, w.stats

            await submit(1, pump=True)  # the default: sent at once
            await until(lambda: ln.last == (3, 7), "the single batch's ack")
            assert w.stats.sent == 3, w.stats

            await asyncio.wait_for(submit(40), 10)
            await w.pump(ln)
            await until(lambda: ln.last == (3, 47) and not ln.held and not ln.pending,
                        "the long burst committed")
            assert w.stats.failed == 0 and w.stats.refused == 0, w.stats
            assert ln.cache.as_dict() == truth.as_dict()
            assert await _subject_seqs(js, "inboxt.e.0", 47) == list(range(48))
        finally:
            await w.close()
            await nc.close()

        # a run longer than 4 * max_inflight: the held lane reaches the bound with nothing
        # in flight, so submit must send on its own rather than wait for room forever
        nc, js, w = await _writer(nats_server.url, max_inflight=1, pack=16)
        try:
            ln = w.lane("e", 1, "inboxt.e.1")
            ln.expect = 0
            for s in range(10):
                b = _batch(1, s)
                await asyncio.wait_for(
                    w.submit(ln.batch_entry(3, s, b, E.encode_batch(b)), pump=False), 10)
            await w.pump(ln)
            await until(lambda: ln.last == (3, 9) and not ln.held, "the long run committed")
            assert await _subject_seqs(js, "inboxt.e.1", 9) == list(range(10))
        finally:
            await w.close()
            await nc.close()

    run(main())


@pytest.mark.usefixtures("nats_api")
def test_held_entries_whose_pump_never_comes_are_sent_by_the_watch(nats_server: Any) -> None:
    """A caller that held entries (``pump=False``) and then failed before ``pump()`` (a
    follower cancelled or crashed mid-read) leaves them neither stuck nor lost: the writer's
    watch sends them within a tick (the one mechanism: a follower does nothing on exit)."""

    async def main() -> None:
        nc, js, w = await _writer(nats_server.url, pack=8)
        try:
            ln = w.lane("e", 0, "inboxt.e.0")
            ln.expect = 0
            for seq in range(3):
                b = _batch(0, seq)
                await w.submit(ln.batch_entry(3, seq, b, E.encode_batch(b)), pump=False)
            assert w.stats.sent == 0 and len(ln.held) == 3
            await until(lambda: ln.last == (3, 2) and not ln.held, "the watch's send", 5.0)
            assert w.stats.late_pumps == 1 and w.stats.sent == 1, w.stats
            assert await _subject_seqs(js, "inboxt.e.0", 2) == [0, 1, 2]
            assert w.stats.failed == 0, w.stats
        finally:
            await w.close()
            await nc.close()

    run(main())
