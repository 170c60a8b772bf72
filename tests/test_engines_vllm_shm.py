"""kvwire's shm MessageQueue inside vLLM 0.33 (the shm half of the plugin).

The vLLM-dependent checks run in one subprocess (tests/_vllm_shm_broadcast.py): importing
vLLM costs ~10 s CPU, so one driver imports it once and forks vLLM's 4-process broadcast
pattern; its own checks (signatures, install/uninstall) run while
the workers mostly sleep. The API-parity points that need no vLLM run here, in-process, on
real shared memory, with real threads and ZeroMQ sockets.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ports import free_port

from kvwire.shm import Handle, MessageQueue, QueueShutdownError, StatelessGroup
from kvwire.shm._common import set_local_shutdown_default

pytestmark = pytest.mark.timeout(240)

HERE = Path(__file__).parent
# The broadcast pattern (vLLM's test: 10,000 arrays per group); env to shorten local runs.
N = int(os.environ.get("KVWIRE_VLLM_SHM_N", "10000"))


def _missing() -> str | None:
    """Which wheel the vLLM tier lacks (found without importing: vLLM's import is slow)."""
    for mod, wheel in (("torch", "torch (CPU wheel)"), ("vllm", "vllm==0.33.0")):
        if importlib.util.find_spec(mod) is None:
            return (f"{wheel} is not installed: the vllm shm-swap tests need it "
                    f"(pip install --no-deps vllm==0.33.0 plus what shm_broadcast imports)")
    return None


needs_vllm = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


def _pair(**kw: Any) -> tuple[MessageQueue, MessageQueue]:
    w = MessageQueue(1, 1, **kw)
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    t = threading.Thread(target=r.wait_until_ready, args=(30,))
    t.start()
    w.wait_until_ready(timeout=30)
    t.join()
    return w, r


# ------------------------------------------------------------- the vLLM tier
@pytest.fixture(scope="module")
def vllm_run() -> dict[str, Any]:
    """Run the driver once for the module: vLLM's pattern, kvwire's queue swapped in."""
    env = dict(os.environ, KVWIRE_VLLM_SHM="1", PYTHONPATH=os.pathsep.join(
        [str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("KVWIRE_SHM_LOCAL_SHUTDOWN", None)
    proc = subprocess.run([sys.executable, str(HERE / "_vllm_shm_broadcast.py"), str(N), "180"],
                          capture_output=True, text=True, timeout=230, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"driver printed no result (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    out = json.loads(lines[-1])
    out["rc"] = proc.returncode
    out["stderr"] = proc.stderr[-4000:]
    return out


@needs_vllm
def test_vllm_broadcast_pattern_with_kvwire_queue(vllm_run: dict[str, Any]) -> None:
    """4 processes, gloo and vLLM's StatelessProcessGroup, writer rank 2, 40 KiB x 2
    chunks, N arrays with random sleeps: every reader gets every array, through kvwire."""
    out = vllm_run
    assert "error" not in out, out.get("error")
    assert out["rc"] == 0 and out["exitcodes"] == [0, 0, 0, 0], out["stderr"]
    assert out["parent_swapped"] is False  # the driver never switched: each worker did
    assert sorted(out["ranks"]) == ["0", "1", "2", "3"]
    for rank, r in out["ranks"].items():
        assert r["is_kvwire"] and r["class"] == "kvwire.shm.queue.MessageQueue", r
        assert r["via"] == "entry point", f"rank {rank}: the plugin switch was {r['via']}"
        for group in ("gloo", "stateless"):
            assert r[f"{group}_queue_is_kvwire"], (rank, group)
            assert r[f"{group}_count"] == N, (rank, group)
    print(f"\nvLLM pattern, kvwire queue: import {out['import_s']} s, run {out['run_s']} s; "
          f"gloo {out['ranks']['0']['gloo_s']} s, stateless {out['ranks']['0']['stateless_s']} s")


@needs_vllm
def test_vllm_cancellation_semantics(vllm_run: dict[str, Any]) -> None:
    """vLLM's cancel test: the writer's shutdown stays local (readers time out), a reader
    blocked in dequeue is cancelled by shutdown() from a thread ("cancelled")."""
    ranks = vllm_run["ranks"]
    assert ranks["2"]["writer_shutting_down"] is True
    for rank in ("0", "1", "3"):
        r = ranks[rank]
        assert r["timeout_after_writer_shutdown"] is True, r
        assert r["cancel_error"] == "QueueShutdownError", r  # a RuntimeError("... cancelled")
        assert r["cancelled_after_s"] < 10, r  # not its 30 s timeout
        assert r["still_cancelled"] and r["shutting_down"], r


@needs_vllm
def test_vllm_group_ranks_external_writer_and_single_reader(vllm_run: dict[str, Any]) -> None:
    """A group whose ranks are not the global ones: the external writer's handle is given
    to the writer rank only (vLLM's multi-node executor); single_reader's reader_rank is
    a global rank (GroupCoordinator's)."""
    ranks = vllm_run["ranks"]
    for rank in ("1", "2", "3"):
        assert ranks[rank]["external"] is True, ranks[rank]
    assert ranks["3"]["single_reader_handles"] == 3
    assert ranks["3"]["single_reader_got"] == [["from", 1], ["from", 2], ["from", 3]]
    assert ranks["1"]["single_reader_handles"] == ranks["2"]["single_reader_handles"] == 0


@needs_vllm
def test_vllm_api_signatures_and_handle_fields(vllm_run: dict[str, Any]) -> None:
    """Every parameter of vLLM 0.33's public MessageQueue methods exists in kvwire's at the
    same position; kvwire's Handle starts with vLLM's fields in vLLM's order; a vLLM handle
    given to kvwire names the missing switch."""
    p = vllm_run["parent"]
    assert "error" not in p, p.get("error")
    assert p["signature_gaps"] == []
    assert p["handle_fields_prefix"] is True
    assert "KVWIRE_VLLM_SHM=1" in (p["vllm_handle_error"] or "")


@needs_vllm
def test_install_swaps_everywhere_idempotent_and_uninstalls(vllm_run: dict[str, Any]) -> None:
    """install() in a process where a module bound vLLM's class at import (as vLLM's
    executors do; a module made of that import statement stands in): both names become
    kvwire's, one log line, a second call does nothing; uninstall() restores
    them and kvwire's default shutdown semantics."""
    p = vllm_run["parent"]
    assert p["module_swapped"] and p["executor_swapped"] and p["installed"]
    assert set(p["patched"]) >= {"vllm.distributed.device_communicators.shm_broadcast",
                                 "vllm._kvwire_test_executor"}
    assert p["second_install"] == []
    assert len(p["log_lines"]) == 1 and "kvwire.shm.MessageQueue" in p["log_lines"][0]
    assert p["local_shutdown_under_install"] is True
    assert p["restored"] and not p["installed_after_uninstall"]
    assert p["local_shutdown_after_uninstall"] is False


def test_install_without_vllm_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced fault: vLLM is installed here, so its absence is simulated the way Python
    marks a module as unimportable (None in sys.modules)."""
    from kvwire.plugins import vllm_shm

    monkeypatch.setitem(sys.modules, vllm_shm.SHM_MODULE, None)
    with pytest.raises(ImportError, match="shm_broadcast"):
        vllm_shm.install()
    assert not vllm_shm.installed()


# --------------------------------------------------------- parity, no vLLM
def test_enable_shm_tensor_arena_accepted_positionally_and_by_keyword() -> None:
    """vLLM's executor passes enable_shm_tensor_arena=; its 7th positional parameter."""
    import numpy as np

    for kw in ({"enable_shm_tensor_arena": True}, {}):
        args = (1, 1, None, 4096, 4, None) + ((True,) if not kw else ())
        w = MessageQueue(*args, **kw)
        assert w.enable_shm_tensor_arena is True
        w.close()
    w, r = _pair(max_chunk_bytes=16384, max_chunks=4, enable_shm_tensor_arena=True)
    x = np.arange(3000, dtype=np.int64)  # 24 KB: out-of-band, through two chunks
    w.enqueue(x, timeout=10)
    y = r.dequeue(timeout=10)
    assert np.array_equal(x, y) and y.flags.writeable  # vLLM's readers get writable arrays
    r.close()
    w.close()


def test_handle_has_vllm_fields_in_order() -> None:
    import dataclasses

    names = [f.name for f in dataclasses.fields(Handle)]
    assert names[:7] == ["local_reader_ranks", "buffer_handle", "local_subscribe_addr",
                         "local_notify_addr", "remote_subscribe_addr", "remote_addr_ipv6",
                         "tensor_arena_handle"]
    w = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
    h = w.export_handle()
    assert h.local_notify_addr is None and h.tensor_arena_handle is None
    w.close()


def test_create_from_handle_rejects_foreign_handle_clearly() -> None:
    with pytest.raises(TypeError, match="kvwire.shm.Handle"):
        MessageQueue.create_from_handle({"local_reader_ranks": [0]}, 0)  # type: ignore[arg-type]


def test_zero_and_negative_timeouts_raise_at_once() -> None:
    """vLLM's executor computes max(0.0, deadline - now): a 0 timeout must not block."""
    w, r = _pair(max_chunk_bytes=1024, max_chunks=2)
    for t in (0, 0.0, -1.0):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            r.dequeue(timeout=t)
        assert time.monotonic() - t0 < 5
    w.enqueue(1)
    w.enqueue(2)
    for t in (0, -1.0):  # the 2-chunk ring is full
        with pytest.raises(TimeoutError):
            w.enqueue(3, timeout=t)
    assert [r.dequeue(timeout=0), r.dequeue(timeout=0)] == [1, 2]
    r.close()
    w.close()


def test_local_shutdown_process_default_and_env_override(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """install() makes vLLM's semantics the default for new writers; the env var, when
    set, still decides."""
    monkeypatch.delenv("KVWIRE_SHM_LOCAL_SHUTDOWN", raising=False)
    prev = set_local_shutdown_default(True)
    try:
        w, r = _pair(max_chunk_bytes=1024, max_chunks=2)
        assert w.local_shutdown is True
        w.shutdown()
        with pytest.raises(TimeoutError):  # vLLM: the reader sees nothing
            r.dequeue(timeout=0.05)
        r.close()
        w.close()
        monkeypatch.setenv("KVWIRE_SHM_LOCAL_SHUTDOWN", "0")
        w, r = _pair(max_chunk_bytes=1024, max_chunks=2)
        assert w.local_shutdown is False
        w.shutdown()
        with pytest.raises(QueueShutdownError):
            r.dequeue(timeout=10)
        r.close()
        w.close()
    finally:
        set_local_shutdown_default(prev)
    monkeypatch.delenv("KVWIRE_SHM_LOCAL_SHUTDOWN")
    w = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
    assert w.local_shutdown is prev
    w.close()


def test_external_writer_handle_only_on_writer_rank() -> None:
    """vLLM passes the external writer's handle to group rank ``writer_rank`` only; the
    others pass None and must still join that queue (not build their own)."""
    world, writer_rank = 3, 1
    ext = MessageQueue(world, world, max_chunk_bytes=1024, max_chunks=4)
    port = free_port()
    got: dict[int, Any] = {}

    def member(rank: int) -> None:
        try:
            g = StatelessGroup("127.0.0.1", port, rank, world, timeout=60)
            mine = ext.export_handle() if rank == writer_rank else None
            mq = MessageQueue.create_from_process_group(g, 1024, 4, writer_rank=writer_rank,
                                                        external_writer_handle=mine,
                                                        blocking=False)
            mq.wait_until_ready(timeout=60)
            got[rank] = [mq.dequeue(timeout=30) for _ in range(3)]
            mq.close()
            g.close()
        except BaseException as e:  # reported below, with the rank
            got[rank] = e

    ts = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    ext.wait_until_ready(timeout=60)
    for i in range(3):
        ext.enqueue(i)
    for t in ts:
        t.join(60)
    ext.close()
    assert got == {r: [0, 1, 2] for r in range(world)}


@pytest.mark.parametrize("side", ["local", "remote"])
def test_cpu_tensors_travel_out_of_band(side: str) -> None:
    """vLLM's messages carry CPU tensors; with torch imported they go as raw buffers
    (torch's own pickling costs ~1 ms per tensor), and come out equal and writable."""
    torch = pytest.importorskip("torch", reason="torch is missing: the tensor path needs it")
    from kvwire.shm import tensors

    cases = [torch.randn(10), torch.arange(6).reshape(2, 3).t(), torch.tensor(3.5),
             torch.empty(0, 4), torch.randn(4, dtype=torch.bfloat16),
             torch.randn(3, dtype=torch.complex64).conj(), torch.randn(2, requires_grad=True),
             torch.zeros(100_000), {"a": torch.ones(3, dtype=torch.int8), "b": [1, 2]}]
    if side == "local":
        w, r = _pair(max_chunk_bytes=1 << 16, max_chunks=4)
    else:
        w = MessageQueue(1, 0, max_chunk_bytes=1 << 16, max_chunks=4, connect_ip="127.0.0.1")
        r = MessageQueue.create_from_handle(w.export_handle(), 0, trust_remote_pickle=True)
        t = threading.Thread(target=r.wait_until_ready, args=(30,))
        t.start()
        w.wait_until_ready(timeout=30)
        t.join()
    assert w._dumps is tensors.queue_dumps() and w._dumps is not __import__("pickle").dumps
    bufs: list[Any] = []
    w._dumps(torch.zeros(1000), 5, buffer_callback=bufs.append)
    assert len(bufs) == 1 and bufs[0].raw().nbytes == 4000  # out of band, not torch.save
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.extend(r.dequeue(timeout=30) for _ in cases))
    th.start()
    for c in cases:
        w.enqueue(c, timeout=30)
    th.join(60)
    assert len(out) == len(cases)
    for c, o in zip(cases, out, strict=True):
        if isinstance(c, dict):
            assert torch.equal(c["a"], o["a"]) and c["b"] == o["b"]
            continue
        assert o.dtype == c.dtype and o.shape == c.shape and o.requires_grad == c.requires_grad
        assert torch.equal(o.detach().resolve_conj(), c.detach().resolve_conj())
    out[0] += 1  # writable, as vLLM's readers get them
    r.close()
    w.close()


_DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32",
           "int64", "bool", "complex64"]


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(_DTYPES), shape=st.lists(st.integers(0, 5), max_size=4),
       seed=st.integers(0, 2**31 - 1), transpose=st.booleans(), step=st.integers(1, 2),
       mode=st.sampled_from(["copy", "own", "readonly"]))
def test_tensor_codec_round_trips(dtype: str, shape: list[int], seed: int, transpose: bool,
                                  step: int, mode: str) -> None:
    """Any dtype/shape/layout (0-dim, empty, transposed, strided slices) comes back equal
    from the tensor-aware dumps, whatever memory the reader's buffers live in."""
    torch = pytest.importorskip("torch", reason="torch is missing: the tensor path needs it")
    import pickle

    from kvwire.shm import tensors

    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 50).to(getattr(torch, dtype))
    if transpose and t.dim() >= 2:
        t = t.transpose(0, -1)
    if step > 1 and t.dim() >= 1:
        t = t[::step]
    bufs: list[Any] = []
    main = tensors.queue_dumps()(t, 5, buffer_callback=bufs.append)
    raw = [b.raw() for b in bufs]
    if mode == "copy":  # the ring's single chunk: bytearray copies
        frames: list[Any] = [bytearray(b) for b in raw]
    elif mode == "own":  # reassembled fragments: views of private memory
        frames = [memoryview(bytearray(b)) for b in raw]
    else:  # remote: read-only frames
        frames = [bytes(b) for b in raw]
    with warnings.catch_warnings():  # torch warns when it gets read-only memory
        warnings.simplefilter("error")
        back = pickle.loads(main, buffers=frames)
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back, t)
    if back.numel():
        back.view(-1)[0] = back.view(-1)[0]  # writable (torch warns on read-only memory)
