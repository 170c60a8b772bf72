"""Helpers for tests that run ``kvwire listen`` as a real process (tests/test_cli.py,
tests/test_rfc1527.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

KVWIRE = [sys.executable, "-m", "kvwire"]


def sigint_default() -> None:
    """For ``preexec_fn``: the child takes SIGINT as a terminal's Ctrl-C. A suite started in
    the background by a shell without job control inherits SIGINT *ignored*, and Python keeps
    an inherited SIG_IGN, so a child would never see the SIGINT a test sends it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_listen(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [*KVWIRE, "listen", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, preexec_fn=sigint_default,
    )


def listen_while_publishing(
    pub: Any, make_batch: Callable[[int], Any], *args: str
) -> tuple[subprocess.Popen, str, str]:
    """Start ``kvwire listen *args`` and publish ``make_batch(0)``, ``make_batch(1)``, ...
    on ``pub`` every 0.05 s until it exits (60 s at most); then its output, the process
    killed and ``pub`` shut down whatever happened. The caller checks the return code."""
    proc = start_listen(*args)
    try:
        deadline = time.monotonic() + 60
        i = 0
        while proc.poll() is None and time.monotonic() < deadline:
            pub.publish(make_batch(i))
            i += 1
            time.sleep(0.05)
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
        pub.shutdown(timeout=1)
    return proc, out, err
