"""vLLM's shm broadcast pattern with kvwire's queue swapped in by the plugin switch.

Run by tests/test_engines_vllm_shm.py as ``python tests/_vllm_shm_broadcast.py N``.
The driver imports vLLM once (its import costs ~10 s CPU) and forks 4 workers (as
vLLM's own test harness does); the driver itself never swaps anything. Each worker
turns the swap on through vLLM's plugin loader with ``KVWIRE_VLLM_SHM=1``, then, as
vLLM's tests/distributed/test_shm_broadcast.py does (written from its description):

* over a gloo group and over vLLM's ``StatelessProcessGroup`` (both at once, a thread
  each; vLLM's test runs them one after the other): a queue from
  ``MessageQueue.create_from_process_group(pg, 40 KiB, 2 chunks, writer_rank=2)``,
  N random int64 arrays (1..10,000 elements, ~40 KB on average: about half of them
  span two chunks) broadcast with random sleeps of up to 1 ms on both sides, every
  reader checking each array;
* cancellation: the writer shuts down (vLLM's semantics: readers see nothing, a
  ``dequeue(timeout=0.01)`` times out); a reader blocked in ``dequeue`` is cancelled by
  ``shutdown()`` from another thread (``RuntimeError`` matching "cancelled") and
  ``shutting_down`` is set.

Prints one JSON line: per-rank results, or the first failure.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import sys
import threading
import time
import traceback
from typing import Any

from ports import free_port

WORLD = 4
WRITER = 2
CHUNK = 40 * 1024
NCHUNKS = 2
# Benchmark mode (not used by the tests): "kvwire" or "vllm" (no swap: vLLM's own queue);
# no sleeps, and only the broadcast phase.
BENCH = os.environ.get("KVWIRE_VLLM_SHM_BENCH", "")


def arrays(n: int, seed: int) -> Any:
    """The same n arrays in every process, made lazily (10,000 of them are ~400 MB)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for size in rng.integers(1, 10_000, n):
        yield rng.integers(1, 100, size, dtype=np.int64)


def switch_on() -> str:
    """Turn the swap on as a vLLM process does: through the general plugins."""
    from importlib.metadata import entry_points

    import vllm.plugins

    if any(ep.value.startswith("kvwire.") for ep in entry_points(group="vllm.general_plugins")):
        vllm.plugins.load_general_plugins()
        return "entry point"
    try:  # the plugin is not registered in this install: call its hook directly
        from kvwire.plugins.vllm import register
    except ImportError:
        from kvwire.plugins.vllm_shm import install

        install()
        return "install() (no kvwire.plugins.vllm plugin)"
    register()
    return "register() (entry point not registered)"


def broadcast(mq: Any, rank: int, n: int, seed: int) -> int:
    import numpy as np

    rnd = random.Random(seed * 31 + rank)
    count = 0
    for x in arrays(n, seed):
        if rank == WRITER:
            mq.broadcast_object(x)
        else:
            y = mq.broadcast_object(None)
            if not np.array_equal(x, y):
                raise AssertionError(f"rank {rank}: message {count} differs")
        count += 1
        if not BENCH:
            time.sleep(rnd.random() / 1000)
    return count


def subgroup(sb: Any, rank: int) -> dict[str, Any]:
    """Group ranks differ from global ones: ranks 1..3 form a group (group ranks 0..2).

    * vLLM's multi-node executor pattern: global rank 0, outside the group, writes; only
      group rank 0 (``writer_rank``) is given the handle, the others pass None;
    * ``create_from_process_group_single_reader`` with ``reader_rank`` = global rank 3
      (group rank 2), as ``GroupCoordinator`` passes it.
    """
    import torch.distributed as dist

    sub = dist.new_group([1, 2, 3])
    out: dict[str, Any] = {}
    if rank == 0:
        ext = sb.MessageQueue(3, 3, max_chunk_bytes=CHUNK, max_chunks=NCHUNKS)
        dist.broadcast_object_list([ext.export_handle()], 0)
        ext.wait_until_ready(timeout=60)
        for i in range(5):
            ext.enqueue(("ext", i))
        dist.barrier()
        ext.close()
        dist.barrier()
        return out
    got = [None]
    dist.broadcast_object_list(got, 0)
    mine = got[0] if rank == 1 else None  # group rank 0 only
    mq = sb.MessageQueue.create_from_process_group(sub, CHUNK, NCHUNKS, writer_rank=0,
                                                    external_writer_handle=mine,
                                                    blocking=False)
    mq.wait_until_ready(timeout=60)
    out["external"] = [mq.dequeue(timeout=30) for _ in range(5)] == [("ext", i)
                                                                    for i in range(5)]
    mq.close()
    dist.barrier()
    w, handles = sb.MessageQueue.create_from_process_group_single_reader(sub, CHUNK, NCHUNKS,
                                                                         reader_rank=3)
    out["single_reader_handles"] = len(handles)
    readers = [sb.MessageQueue.create_from_handle(h, 0) for h in handles]
    w.wait_until_ready(timeout=60)
    for r in readers:
        r.wait_until_ready(timeout=60)
    w.enqueue(("from", rank))
    if readers:
        out["single_reader_got"] = [r.dequeue(timeout=30) for r in readers]
    dist.barrier(group=sub)
    for q in (w, *readers):
        q.close()
    dist.barrier()
    return out


def cancellation(sb: Any, rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    mq = sb.MessageQueue.create_from_process_group(dist.group.WORLD, CHUNK, NCHUNKS, WRITER)
    out: dict[str, Any] = {}
    if rank == WRITER:
        mq.shutdown()  # vLLM's semantics under the swap: stays in this process
        out["writer_shutting_down"] = mq.shutting_down
    dist.barrier()
    if rank != WRITER:
        try:
            mq.dequeue(timeout=0.01)
            raise AssertionError("dequeue returned after the writer's shutdown")
        except TimeoutError:
            out["timeout_after_writer_shutdown"] = True
        go = threading.Event()

        def cancel() -> None:
            go.wait()
            time.sleep(0.2)  # let the reader reach its futex sleep (either phase must work)
            mq.shutdown()

        th = threading.Thread(target=cancel)
        th.start()
        go.set()
        t0 = time.monotonic()
        try:
            mq.dequeue(timeout=30)
            raise AssertionError("dequeue returned a message nobody sent")
        except RuntimeError as e:
            if "cancelled" not in str(e):
                raise
            out["cancelled_after_s"] = round(time.monotonic() - t0, 3)
            out["cancel_error"] = type(e).__name__
        th.join()
        try:  # a cancelled reader stays cancelled
            mq.dequeue(timeout=1)
            raise AssertionError("dequeue after cancel returned")
        except RuntimeError as e:
            out["still_cancelled"] = "cancelled" in str(e)
        out["shutting_down"] = mq.shutting_down
    dist.barrier()
    mq.close()
    return out


def worker(rank: int, port: int, port2: int, n: int, results: Any) -> None:
    try:
        import torch.distributed as dist
        import vllm.distributed.device_communicators.shm_broadcast as sb
        from vllm.distributed.utils import StatelessProcessGroup

        import kvwire.shm

        via = "none (benchmark of vLLM's queue)" if BENCH == "vllm" else switch_on()
        res: dict[str, Any] = {"rank": rank, "via": via, "pid": os.getpid(),
                               "class": f"{sb.MessageQueue.__module__}.{sb.MessageQueue.__qualname__}",
                               "is_kvwire": sb.MessageQueue is kvwire.shm.MessageQueue}
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD)
        stateless = StatelessProcessGroup.create(host="127.0.0.1", port=port2, rank=rank,
                                                 world_size=WORLD)
        groups = (("gloo", dist.group.WORLD), ("stateless", stateless))
        queues, seeds = {}, {}
        for name, pg in groups:  # collectives, in the main thread
            mq = queues[name] = sb.MessageQueue.create_from_process_group(pg, CHUNK, NCHUNKS,
                                                                           WRITER)
            res[f"{name}_queue_is_kvwire"] = isinstance(mq, kvwire.shm.MessageQueue)
            res[f"{name}_native"] = getattr(mq, "native", None)
            seed = [random.randint(0, 1000) if rank == WRITER else None]
            dist.broadcast_object_list(seed, WRITER)
            seeds[name] = seed[0]
        stateless.barrier()
        dist.barrier()
        # Both groups' runs at once, one thread each (vLLM runs them one after the other):
        # the random sleeps then overlap, which halves the wall time on a loaded box.
        errors: list[str] = []

        def run(name: str) -> None:
            try:
                t0 = time.monotonic()
                res[f"{name}_count"] = broadcast(queues[name], rank, n, seeds[name])
                res[f"{name}_s"] = round(time.monotonic() - t0, 2)
            except BaseException:
                errors.append(f"{name}: {traceback.format_exc()}")

        threads = [threading.Thread(target=run, args=(name,)) for name, _ in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise AssertionError("\n".join(errors))
        stateless.barrier()
        dist.barrier()
        if BENCH:
            results.put(res)
            return
        for mq in queues.values():
            mq.close()
        res.update(subgroup(sb, rank))
        res.update(cancellation(sb, rank))
        dist.destroy_process_group()
        results.put(res)
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
        raise


def signature_gaps(vllm_cls: Any, kv_cls: Any) -> list[str]:
    """Every parameter of vLLM's public methods must exist in kvwire's, at the same
    position (positional callers) and with the same default."""
    import inspect

    from kvwire.shm.writer import WriterQueue

    gaps = []
    names = ["__init__", "export_handle", "create_from_handle", "wait_until_ready",
             "shutdown", "acquire_write", "acquire_read", "enqueue", "dequeue",
             "broadcast_object", "create_from_process_group",
             "create_from_process_group_single_reader"]
    for name in names:
        theirs = inspect.signature(getattr(vllm_cls, name))
        ours = inspect.signature(getattr(WriterQueue if name == "__init__" else kv_cls, name))
        op = list(ours.parameters.values())
        for i, p in enumerate(theirs.parameters.values()):
            q = ours.parameters.get(p.name)
            if q is None:
                gaps.append(f"{name}: no parameter {p.name}")
            elif p.kind is not p.KEYWORD_ONLY and (i >= len(op) or op[i].name != p.name):
                gaps.append(f"{name}: {p.name} is not at position {i}")
            elif (p.default is not p.empty and q.default != p.default
                  and (name, p.name) != ("__init__", "max_chunk_bytes")):  # docs/shm.md
                gaps.append(f"{name}: {p.name} defaults to {q.default!r}, vLLM {p.default!r}")
    for attr in ("shutting_down",):
        if not hasattr(kv_cls, attr):
            gaps.append(f"no attribute {attr}")
    return gaps


def parent_checks(sb: Any) -> dict[str, Any]:
    """install() in a process where a module already bound the name at import.

    vLLM's executors do ``from ...shm_broadcast import MessageQueue`` at import; importing
    one costs ~7 s CPU more, which here would slow the workers, so a module made of that
    same import statement stands in for it (registered under a ``vllm.`` name).
    """
    import dataclasses
    import logging
    import types

    mpe = types.ModuleType("vllm._kvwire_test_executor")
    exec("from vllm.distributed.device_communicators.shm_broadcast import MessageQueue",
         mpe.__dict__)
    sys.modules[mpe.__name__] = mpe

    import kvwire.shm
    from kvwire.plugins import vllm_shm

    original = sb.MessageQueue
    res: dict[str, Any] = {"signature_gaps": signature_gaps(original, kvwire.shm.MessageQueue)}
    theirs = [f.name for f in dataclasses.fields(sb.Handle)]
    ours = [f.name for f in dataclasses.fields(kvwire.shm.Handle)]
    res["handle_fields_prefix"] = ours[:len(theirs)] == theirs
    # a kvwire reader given a handle of vLLM's own queue: a clear error, not a hang
    vq = original(1, 1, max_chunk_bytes=1024, max_chunks=2)
    try:
        kvwire.shm.MessageQueue.create_from_handle(vq.export_handle(), 0)
        res["vllm_handle_error"] = None
    except TypeError as e:
        res["vllm_handle_error"] = str(e)
    records: list[logging.LogRecord] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    lg = logging.getLogger("vllm.kvwire.shm")
    lg.addHandler(Grab())
    lg.setLevel(logging.INFO)
    first = vllm_shm.install()
    second = vllm_shm.install()
    res["patched"] = first
    res["second_install"] = second
    res["log_lines"] = [r.getMessage() for r in records]
    res["executor_swapped"] = mpe.MessageQueue is kvwire.shm.MessageQueue
    res["module_swapped"] = sb.MessageQueue is kvwire.shm.MessageQueue
    res["installed"] = vllm_shm.installed()
    w = sb.MessageQueue(1, 1, None, 1024, 2, None, False)  # vLLM's positional order
    res["local_shutdown_under_install"] = w.local_shutdown
    w.close()
    vllm_shm.uninstall()
    res["restored"] = mpe.MessageQueue is original and sb.MessageQueue is original
    res["installed_after_uninstall"] = vllm_shm.installed()
    w = kvwire.shm.MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
    res["local_shutdown_after_uninstall"] = w.local_shutdown
    w.close()
    return res


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    budget = float(sys.argv[2]) if len(sys.argv) > 2 else 120.0
    os.environ["KVWIRE_VLLM_SHM"] = "1"
    os.environ.pop("KVWIRE_SHM_LOCAL_SHUTDOWN", None)
    t0 = time.monotonic()
    import torch.distributed  # noqa: F401  (imported once, before the fork)
    import vllm.distributed.device_communicators.shm_broadcast as sb
    import vllm.distributed.utils  # noqa: F401
    import vllm.plugins  # noqa: F401

    import kvwire.shm

    import_s = time.monotonic() - t0
    parent_swapped = sb.MessageQueue is kvwire.shm.MessageQueue
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port, port2 = free_port(), free_port()
    procs = [ctx.Process(target=worker, args=(r, port, port2, n, results)) for r in range(WORLD)]
    t1 = time.monotonic()
    for p in procs:
        p.start()
    out: dict[str, Any] = {"import_s": round(import_s, 2), "parent_swapped": parent_swapped,
                           "ranks": {}}
    try:  # while the workers run (they mostly sleep): the driver's own checks
        out["parent"] = parent_checks(sb)
    except BaseException:
        out["parent"] = {"error": traceback.format_exc()}
    deadline = t1 + budget
    try:
        while len(out["ranks"]) < WORLD:
            left = deadline - time.monotonic()
            if left <= 0:
                out["error"] = f"timed out after {budget:.0f}s; got ranks {sorted(out['ranks'])}"
                break
            try:
                r = results.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty: check that nobody died
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead and len(out["ranks"]) < WORLD:
                    out.setdefault("error", f"a worker exited with {dead}")
                continue
            out["ranks"][r["rank"]] = r
            if "error" in r:
                out["error"] = f"rank {r['rank']}: {r['error']}"
                break
    finally:
        for p in procs:
            p.join(10 if "error" not in out else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    out["run_s"] = round(time.monotonic() - t1, 2)
    out["exitcodes"] = [p.exitcode for p in procs]
    print(json.dumps(out, sort_keys=True))
    return 0 if "error" not in out and all(c == 0 for c in out["exitcodes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
