"""The shm suites once more, on the pure-Python hot path.

The rest of the suite runs with whatever path is active (the C one when
kvwire.shm._ring is built). KVWIRE_SHM_PURE is read once per process, at import, so the
pure-Python run is a separate pytest process with KVWIRE_SHM_PURE=1: the writer, the
in-process readers and every spawned reader/writer process all use the Python path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvwire.shm import NATIVE

HERE = Path(__file__).resolve().parent
# the cross-process correctness suites (ordering/integrity, random sizes across the chunk
# size and overflow, 1-3 readers, dead peers, wake-ups) and the in-process ones
SUITES = ["test_shm_procs.py", "test_shm_faults.py", "test_shm_wake.py", "test_shm_ring.py",
          "test_shm_queue.py", "test_shm_native.py", "test_shm_shutdown.py"]


@pytest.mark.skipif(os.environ.get("KVWIRE_SHM_PURE", "") == "1",
                    reason="this run already is the pure-Python one")
@pytest.mark.skipif(not NATIVE, reason="the C path is off here, so the whole suite already "
                    "ran on the pure-Python path")
@pytest.mark.timeout(600)
def test_shm_suites_on_the_pure_python_path() -> None:
    env = dict(os.environ, KVWIRE_SHM_PURE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
           *(str(HERE / s) for s in SUITES)]
    r = subprocess.run(cmd, cwd=HERE.parent, env=env, capture_output=True, text=True,
                       timeout=540)
    tail = "\n".join((r.stdout + r.stderr).splitlines()[-40:])
    assert r.returncode == 0, f"pure-Python run failed:\n{tail}"
    assert " passed" in tail and "failed" not in tail, tail
