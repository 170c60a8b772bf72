"""Benchmark kvwire's event path against the reference design, measured in the same run.

Reference engine step: one BlockStored of 4 blocks x 16 tokens plus one BlockRemoved of 4
hashes. Baseline: what the engines do today, a PUB thread fed by ``queue.Queue`` that
encodes each batch with msgspec and sends it, consumed by a strict msgspec decoder.

    .venv/bin/python bench/events.py            # full run (about a minute)
    .venv/bin/python bench/events.py --quick    # smaller counts
    .venv/bin/python bench/events.py --vs-vllm  # CPU per batch beside vLLM's own publisher

``--vs-vllm`` runs vLLM's installed ``ZmqEventPublisher`` (vllm.distributed.kv_events, fed
vLLM's own event classes) and kvwire's, alternating, 3 runs each of 50,000 reference steps
(``-n`` to change), after one untimed run, with the strict msgspec consumer for both and
room for every batch; it prints the medians of the publishing process's CPU per batch
(all threads: process CPU from getrusage, the breakdown from per-thread CPU).

Prints one table; every kvwire number sits next to its baseline.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import threading
import time
from typing import Any

import msgspec
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvwire.consume.stream import Batch, StreamConfig  # noqa: E402
from kvwire.consume.subscriber import StreamSpec, Subscriber  # noqa: E402
from kvwire.publish.publisher import ZmqEventPublisher  # noqa: E402
from kvwire.wire import events as E  # noqa: E402

TOPIC = "bench"


def reference_step(i: int) -> E.KVEventBatch:
    base = 4 * i
    return E.KVEventBatch(
        time.time(),
        [
            E.BlockStored(
                [base + 1, base + 2, base + 3, base + 4], base, list(range(i % 1000, i % 1000 + 64)),
                16, None, "GPU",
            ),
            E.BlockRemoved([base - 7, base - 6, base - 5, base - 4], "GPU"),
        ],
        0,
    )


def baseline_step(i: int) -> Any:
    """The same step as the engine's own (vLLM-shaped) structs, encoded as-is."""
    b = reference_step(i)
    s, r = b.events
    return (
        b.ts,
        [
            E._VllmStored(s.block_hashes, s.parent_block_hash, s.token_ids, s.block_size,
                          s.lora_id, s.medium, None),
            E._VllmRemoved(r.block_hashes, r.medium),
        ],
        0,
    )


def vllm_step(i: int) -> Any:
    """The same step as vLLM's own event classes (its installed kv_events module)."""
    from vllm.distributed import kv_events as V

    b = reference_step(i)
    s, r = b.events
    return V.KVEventBatch(
        ts=b.ts,
        events=[
            V.BlockStored(block_hashes=s.block_hashes, parent_block_hash=s.parent_block_hash,
                          token_ids=s.token_ids, block_size=s.block_size, lora_id=s.lora_id,
                          medium=s.medium, lora_name=None),
            V.BlockRemoved(block_hashes=r.block_hashes, medium=r.medium),
        ],
        data_parallel_rank=0,
    )


def vllm_publisher(max_queue: int) -> Any:
    """vLLM's own publisher as installed (tcp on loopback, like the others)."""
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm.distributed import kv_events as V

    pub = V.ZmqEventPublisher(0, endpoint="tcp://*:0", topic=TOPIC, max_queue_size=max_queue)
    pub.endpoint = pub._endpoint
    return pub


class BaselinePublisher:
    """The reference design: queue.Queue -> one thread -> msgspec encode -> PUB send."""

    def __init__(self, endpoint: str, hwm: int = 100_000, maxsize: int = 100_000) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, hwm)
        self.pub.bind(endpoint)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.q: queue.Queue = queue.Queue(maxsize)
        self.enc = msgspec.msgpack.Encoder()
        self.seq = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def publish(self, batch: Any) -> None:
        self.q.put(batch)

    def _run(self) -> None:
        topic = TOPIC.encode()
        while True:
            b = self.q.get()
            if b is None:
                break
            payload = self.enc.encode(b)
            self.pub.send_multipart((topic, self.seq.to_bytes(8, "big"), payload))
            self.seq += 1

    def shutdown(self) -> None:
        self.q.put(None)
        self.thread.join()
        self.pub.close(linger=1000)
        self.ctx.term()


# ------------------------------------------------------------------ subscriber process

_BaselineEvent = E._VllmStored | E._VllmRemoved | E._MapCleared


def subscriber_main(endpoint: str, kind: str, first_v: Any, n: int, ready: Any, out: Any) -> None:
    """Count and decode batches with seq >= ``first_v.value`` (set once warm-up is over)."""
    if kind == "kvwire":
        # kvwire's own consumer: the Subscriber behind `kvwire listen` (live-only here:
        # the reference pair has no replay either).
        sub = Subscriber([StreamSpec("bench", endpoint, TOPIC)],
                         config=StreamConfig(deliver_empty=False))

        # poll_many: the Subscriber's call for high rates (same items as poll(), in bulk).
        pending: list[Any] = []

        def receive() -> tuple[int, Any] | None:
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                if not pending:
                    pending.extend(reversed(sub.poll_many(1.0)))
                    continue
                item = pending.pop()
                if type(item) is Batch:
                    return item.seq, item.batch.events
            return None
    else:
        # The reference consumer loop: poll, recv_multipart, strict msgspec decode.
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        sub.connect(endpoint)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        decode = msgspec.msgpack.Decoder(tuple[float, list[_BaselineEvent], int | None]).decode

        def receive() -> tuple[int, Any] | None:
            if not poller.poll(5000):
                return None
            _, seq_b, payload = sub.recv_multipart()
            return int.from_bytes(seq_b, "big"), decode(payload)[1]

    got = 0
    t_first = t_last = 0.0
    events = 0
    first = last = 1 << 62
    while True:
        r = receive()
        if r is None:
            break
        seq, evs = r
        if seq < first:
            ready.set()  # warm-up traffic arrives: connected
            first = first_v.value
            last = first + n - 1
            if seq < first:
                continue
        events += len(evs)
        if got == 0:
            t_first = time.perf_counter()
        got += 1
        t_last = time.perf_counter()
        if seq >= last:
            break
    out.put((got, t_first, t_last, events))


# ------------------------------------------------------------------ measurements


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def zmq_io_cpu() -> float:
    """CPU seconds of this process's ZeroMQ I/O threads (named ZMQbg/IO/*)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("ZMQbg/IO"):
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            continue
    return total


def pct(values: list[int], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))] / 1000.0


def bench_decode(n: int) -> dict[str, float]:
    payload = E.encode_batch(reference_step(7))
    strict = msgspec.msgpack.Decoder(tuple[float, list[_BaselineEvent], int | None])
    dec = E.BatchDecoder()
    legacy = E.encode_batch(reference_step(7), "vllm-legacy")
    out = {}
    for name, fn, p in (
        ("strict", strict.decode, payload),
        ("kvwire", dec.decode, payload),
        ("kvwire_legacy", dec.decode, legacy),
    ):
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                fn(p)
            best = min(best, (time.perf_counter() - t) / n)
        out[name] = best * 1e6
    return out


def run_pair(
    kind: str, n: int, warm: int, max_queue: int = 100_000, pace: float | None = None,
    consumer: str | None = None,
) -> dict[str, float]:
    """Publish ``warm`` + ``n`` reference steps as fast as the caller can (or at ``pace``
    batches/s, spinning between calls like an engine loop); measure. ``consumer`` (default:
    the publisher's own pair) is "baseline" (strict msgspec loop) or "kvwire" (Subscriber)."""
    if kind == "kvwire":
        pub = ZmqEventPublisher(
            endpoint="tcp://*:0", topic=TOPIC, heartbeat_interval=None,
            max_queue_size=max_queue, buffer_steps=10_000,
        )
        make = reference_step
    elif kind == "vllm":
        pub = vllm_publisher(max_queue)
        make = vllm_step
    else:
        pub = BaselinePublisher("tcp://127.0.0.1:0", maxsize=max_queue)
        make = baseline_step
    endpoint = pub.endpoint
    # Built before the subscriber starts: building 200k steps takes seconds on a small
    # machine, longer than the subscriber's idle timeout.
    batches = [make(k) for k in range(n)]
    ctx = mp.get_context("spawn")
    ready, out, first = ctx.Event(), ctx.Queue(), ctx.Value("q", 1 << 62)
    proc = ctx.Process(target=subscriber_main,
                       args=(endpoint, consumer or ("baseline" if kind == "vllm" else kind),
                             first, n, ready, out))
    proc.start()
    # Warm up until the subscriber receives (slow joiner), then measure.
    i = 0
    deadline = time.monotonic() + 30
    while not ready.is_set() and time.monotonic() < deadline:
        pub.publish(make(i))
        i += 1
        ready.wait(0.005)
    for _ in range(warm):
        pub.publish(make(i))
        i += 1
    time.sleep(0.2)
    first.value = i
    lat = [0] * n
    clock = time.perf_counter_ns
    publish = pub.publish
    c0, m0, z0 = cpu_now(), time.thread_time(), zmq_io_cpu()
    t0 = time.perf_counter()
    gap = 0 if pace is None else int(1e9 / pace)
    next_t = clock()
    for i in range(n):
        if gap:
            next_t += gap
            while clock() < next_t:
                pass
        a = clock()
        publish(batches[i])
        lat[i] = clock() - a
    t_pub = time.perf_counter() - t0
    caller = time.thread_time() - m0
    if kind == "kvwire":
        # Wait until the sender drained the queue, then stop measuring CPU.
        deadline = time.monotonic() + 60
        while pub.stats().queue_depth and time.monotonic() < deadline:
            time.sleep(0.0005)
        cpu, io = cpu_now() - c0, zmq_io_cpu() - z0
        st = pub.stats()
        dropped = st.dropped
        pub.shutdown(timeout=5)
    else:
        q = pub.q if kind == "baseline" else pub._event_queue
        deadline = time.monotonic() + 60
        while q.qsize() and time.monotonic() < deadline:
            time.sleep(0.0005)
        cpu, io = cpu_now() - c0, zmq_io_cpu() - z0
        dropped = 0
        pub.shutdown()
    got, t_first, t_last, _ = out.get(timeout=60)
    proc.join(10)
    return {
        "publish_median_us": statistics.median(lat) / 1000.0,
        "publish_p99_us": pct(lat, 0.99),
        "publish_max_us": max(lat) / 1000.0,
        "caller_batches_s": n / t_pub,
        "cpu_us_per_batch": cpu / n * 1e6,
        # kvwire never encodes a batch it dropped (the queue was full): per delivered batch
        # is the fair figure when some were dropped.
        "cpu_us_per_delivered": cpu / got * 1e6 if got else float("nan"),
        "cpu_caller_us": caller / n * 1e6,
        "cpu_zmq_io_us": io / n * 1e6,
        "cpu_sender_us": (cpu - caller - io) / n * 1e6,
        "delivered": got,
        "dropped": dropped,
        "e2e_batches_s": (got - 1) / (t_last - t_first) if got > 1 and t_last > t_first else 0.0,
    }


def run_paced(kind: str, rate: float, n: int) -> dict[str, float]:
    """publish() latency at an engine-like pace (one batch every 1/rate s), subscriber live."""
    res = run_pair(kind, n, 200, pace=rate)
    return {"p50": res["publish_median_us"], "p99": res["publish_p99_us"]}


def run_full_queue(kind: str, n: int) -> dict[str, float]:
    """publish() latency while the queue is full: tiny queue, nobody draining fast enough."""
    if kind == "kvwire":
        pub = ZmqEventPublisher(endpoint="tcp://*:0", topic=TOPIC, heartbeat_interval=None,
                                max_queue_size=64, buffer_steps=1000)
        make = reference_step
    else:
        pub = BaselinePublisher("tcp://127.0.0.1:0", maxsize=64)
        make = baseline_step
    batches = [make(i) for i in range(n)]
    lat = [0] * n
    clock = time.perf_counter_ns
    publish = pub.publish
    for i in range(n):
        a = clock()
        publish(batches[i])
        lat[i] = clock() - a
    full = pub.stats().dropped if kind == "kvwire" else 0
    if kind == "kvwire":
        pub.shutdown(timeout=5)
    else:
        pub.shutdown()
    return {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "max": max(lat) / 1000.0, "dropped": full}


def vs_vllm(n: int) -> None:
    """CPU per batch beside vLLM's installed publisher: 3 alternating runs, medians."""
    import vllm

    print(f"kvwire bench/events.py --vs-vllm  (n={n}, cores={os.cpu_count()}, vllm "
          f"{vllm.__version__}, msgspec {msgspec.__version__}, pyzmq {zmq.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')})\n")
    runs: dict[str, list[dict[str, float]]] = {"vllm": [], "kvwire": []}
    # One untimed run first: the first run in a fresh process pays for growing its heap
    # (the engine thread's cost about 4x on a small machine), whichever kind it is.
    run_pair("vllm", n, 200, max_queue=2 * n, consumer="baseline")
    for _ in range(3):
        for kind in ("vllm", "kvwire"):
            runs[kind].append(run_pair(kind, n, 200, max_queue=2 * n, consumer="baseline"))
    keys = (("cpu_us_per_batch", "publisher CPU per batch, all threads (us)"),
            ("cpu_caller_us", "  of which engine thread (us)"),
            ("cpu_sender_us", "  of which sender thread (us)"),
            ("cpu_zmq_io_us", "  of which ZeroMQ I/O thread (us)"))
    w = max(len(label) for _, label in keys)
    print(f"{'metric':<{w}}  {'vllm':>8}  {'kvwire':>8}  {'ratio':>7}   kvwire runs")
    for key, label in keys:
        v = statistics.median(r[key] for r in runs["vllm"])
        k = statistics.median(r[key] for r in runs["kvwire"])
        each = " ".join(f"{r[key]:.2f}" for r in runs["kvwire"])
        print(f"{label:<{w}}  {v:>8.2f}  {k:>8.2f}  {k / v:>6.2f}x   {each}")
    print(f"\nvllm runs: {' '.join(f'{r[keys[0][0]]:.2f}' for r in runs['vllm'])}; delivered "
          f"vllm {[r['delivered'] for r in runs['vllm']]}, kvwire "
          f"{[r['delivered'] for r in runs['kvwire']]} of {n}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--vs-vllm", action="store_true",
                    help="only CPU per batch beside vLLM's installed publisher")
    ap.add_argument("-n", type=int, default=None, help="batches per e2e run")
    args = ap.parse_args()
    if args.vs_vllm:
        vs_vllm(args.n or 50_000)
        return
    n = args.n or (30_000 if args.quick else 200_000)
    warm = 200
    print(f"kvwire bench/events.py  (n={n}, cores={os.cpu_count()}, python {sys.version.split()[0]}, "
          f"msgspec {msgspec.__version__}, pyzmq {zmq.__version__})\n")

    d = bench_decode(20_000 if args.quick else 100_000)
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "kvwire": []}
    for _ in range(1 if args.quick else 3):
        for kind in ("baseline", "kvwire"):
            runs[kind].append(run_pair(kind, n, warm))
    # The tight loop outruns kvwire's sender, which then drops (replayably) rather than
    # block; with room for every batch nothing is dropped and all of them arrive.
    roomy = run_pair("kvwire", n, warm, max_queue=2 * n)

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    same_consumer = {
        "baseline": {"baseline": med("baseline", "e2e_batches_s"),
                     "kvwire": run_pair("kvwire", n, warm, 2 * n, consumer="baseline")
                     ["e2e_batches_s"]},
        "kvwire": {"baseline": run_pair("baseline", n, warm, consumer="kvwire")["e2e_batches_s"],
                   "kvwire": roomy["e2e_batches_s"]},
    }
    full = {k: run_full_queue(k, 20_000 if args.quick else 100_000) for k in ("baseline", "kvwire")}
    paced = {k: run_paced(k, 10_000, 10_000 if args.quick else 50_000)
             for k in ("baseline", "kvwire")}

    rows = [
        ("decode reference step (us)", d["strict"], d["kvwire"], d["kvwire"] / d["strict"],
         "kvwire/strict"),
        ("decode legacy positional (us)", d["strict"], d["kvwire_legacy"],
         d["kvwire_legacy"] / d["strict"], "kvwire/strict"),
    ]
    for key, label in (
        ("publish_median_us", "publish() median (us)"),
        ("publish_p99_us", "publish() p99 (us)"),
        ("cpu_us_per_delivered", "publisher CPU per delivered batch (us, all threads)"),
        ("e2e_batches_s", "end-to-end batches/s (each publisher's own consumer)"),
        ("caller_batches_s", "caller-side publish rate (batches/s)"),
    ):
        b, k = med("baseline", key), med("kvwire", key)
        rows.append((label, b, k, k / b if b else float("nan"), "kvwire/baseline"))
    # Nothing dropped (room for every batch): every batch was encoded and sent by both, so
    # CPU per batch compares like with like.
    base = {key: med("baseline", key) for key in runs["baseline"][0]}
    for key, label in (
        ("cpu_us_per_batch", "publisher CPU per batch, nothing dropped (us)"),
        ("cpu_caller_us", "  of which engine thread (us)"),
        ("cpu_sender_us", "  of which sender thread (us)"),
        ("cpu_zmq_io_us", "  of which ZeroMQ I/O thread (us)"),
    ):
        b, k = base[key], roomy[key]
        rows.append((label, b, k, k / b if b else float("nan"), "kvwire/baseline"))
    # Only the publisher changes: the same consumer reads both (nothing dropped).
    for consumer, label in (("baseline", "strict msgspec loop"), ("kvwire", "kvwire Subscriber")):
        b, k = same_consumer[consumer]["baseline"], same_consumer[consumer]["kvwire"]
        rows.append((f"end-to-end batches/s, {label} for both", b, k, k / b if b else
                     float("nan"), "kvwire/baseline"))
    rows.append(("publish() median at 10k batches/s (us)", paced["baseline"]["p50"],
                 paced["kvwire"]["p50"], paced["kvwire"]["p50"] / paced["baseline"]["p50"],
                 "kvwire/baseline"))
    rows.append(("publish() p99 at 10k batches/s (us)", paced["baseline"]["p99"],
                 paced["kvwire"]["p99"], paced["kvwire"]["p99"] / paced["baseline"]["p99"],
                 "kvwire/baseline"))
    rows.append(("publish() p99, queue full (us)", full["baseline"]["p99"], full["kvwire"]["p99"],
                 full["kvwire"]["p99"] / full["baseline"]["p99"], "kvwire/baseline"))
    rows.append(("publish() max, queue full (us)", full["baseline"]["max"], full["kvwire"]["max"],
                 full["kvwire"]["max"] / full["baseline"]["max"], "kvwire/baseline"))

    w = max(len(r[0]) for r in rows)
    print(f"{'metric':<{w}}  {'baseline':>12}  {'kvwire':>12}  {'ratio':>7}")
    print("-" * (w + 38))
    for label, b, k, ratio, what in rows:
        print(f"{label:<{w}}  {b:>12.2f}  {k:>12.2f}  {ratio:>6.2f}x  ({what})")
    print()
    dl = [r["delivered"] for r in runs["kvwire"]]
    dr = [r["dropped"] for r in runs["kvwire"]]
    print(f"kvwire runs: delivered {dl} of {n}, dropped (queue full, replayable) {dr}; "
          f"queue-full run dropped {full['kvwire']['dropped']} of the flood (counted, replayable)")
    print(f"kvwire run with max_queue_size=2n: delivered {roomy['delivered']} of {n}, "
          f"dropped {roomy['dropped']} (its CPU rows above; its e2e is the Subscriber-for-both "
          "row)")
    print(f"baseline runs: delivered {[r['delivered'] for r in runs['baseline']]} of {n}")
    print("\ntargets: CPU/batch <= 0.6x baseline; publish() p99 <= 10 us (also queue full); "
          "e2e >= 1.5x baseline")


if __name__ == "__main__":
    main()
