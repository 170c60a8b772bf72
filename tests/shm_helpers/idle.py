"""The idle-reader worker of test_shm_wake, in a module that imports only kvwire.shm.

Its CPU share is the test's measurement, so the process must hold nothing but the reader:

* no numpy (workers.py imports it): numpy's OpenBLAS starts a worker thread at import
  that spin-waits with sched_yield for ~0.1 s (2**28 TSC cycles) before it sleeps. That
  spin overlapped the measured window and cost 7-21 ms of CPU (0.7-2.1% of the idle
  second) while the reader itself used < 0.1 ms;
* no multiprocessing.Queue: its feeder thread would still be pickling and writing the
  "ready" message inside the window. Reports go through a Pipe end, synchronously.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvwire.shm import MessageQueue


def wake_reader(handle: Any, n: int, conn: Any) -> None:
    """Report, per message, (wake latency ns, CPU s of the process, wall s) of its dequeue,
    then the thread count and the waiting thread's own CPU in the first (idle) one.

    No liveness timer: only the writer's wake-up can end the sleep, so a lost or late
    wake-up shows as a wait of seconds, not as a 100 ms timer tick that looks like noise.
    """
    q = MessageQueue.create_from_handle(handle, 0, liveness_interval=1e4)
    q.wait_until_ready(timeout=30)
    conn.send("ready")
    res = []
    threads = len(os.listdir("/proc/self/task"))
    own = 0.0
    for i in range(n):
        c0, t0, w0 = time.process_time(), time.thread_time(), time.monotonic()
        sent_ns = q.dequeue(timeout=30)
        now_ns = time.perf_counter_ns()
        res.append((now_ns - sent_ns, time.process_time() - c0, time.monotonic() - w0))
        if i == 0:
            own = time.thread_time() - t0
    conn.send((res, threads, own))
    q.close()
