"""The wheelhouse of tests/test_install.py: every wheel that kvwire's core and its extras
need, fetched from the package index once into ``.wheelhouse/`` (git-ignored), so that each
run's fresh venvs install offline (``pip install --no-index --find-links``).

``make test`` fills it before pytest runs (``python tests/wheelhouse.py``); the test fills
it itself when it is missing or stale (``STAMP`` records the build requirements and the
wheel's Requires-Dist it was fetched for: an edit of pyproject.toml's dependencies fetches
again). The only reason to skip the install test: pip cannot reach the index (:class:`Offline`).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELHOUSE = ROOT / ".wheelhouse"
STAMP = WHEELHOUSE / "STAMP"
#: The extras the install test gives a venv each (the core gets one too).
EXTRAS = ("serve", "sim", "nats", "tokenize", "epp")
PIP_TIMEOUT = 900.0  # a first download of ~70 MB on a slow link
class Offline(Exception):
    """pip could not reach the package index to fill the wheelhouse."""


def _pip(*args: str, offline: bool, timeout: float = PIP_TIMEOUT) -> None:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", KVWIRE_NO_NATIVE="1")
    if offline:  # the wheelhouse alone: no index, no pip.conf's extra links
        env["PIP_CONFIG_FILE"] = os.devnull
        args = ("--no-index", "--find-links", str(WHEELHOUSE), *args)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", *args],
                       capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        out = (r.stdout + r.stderr)[-4000:]
        if not offline and not _index_reachable(env):
            raise Offline(f"pip cannot reach the package index:\n{out}")
        raise RuntimeError(f"pip wheel {' '.join(args)} failed ({r.returncode}):\n{out}")


def _index_reachable(env: dict[str, str]) -> bool:
    """Whether pip can fetch one build requirement from the index, bypassing its cache: a
    failed fetch is then pip's own (a bad requirement), not the network's."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--no-cache-dir", "-d", tmp, build_requires()[0]],
                           capture_output=True, text=True, timeout=300, env=env)
    return r.returncode == 0


def build_requires() -> list[str]:
    """pyproject.toml's [build-system] requires (what building kvwire's wheel needs)."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r"\[build-system\][^\[]*?requires\s*=\s*\[([^\]]*)\]", text)
    assert m, "pyproject.toml has no [build-system] requires"
    return re.findall(r"\"([^\"]+)\"", m.group(1))


def requires_dist(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return sorted(line for line in lines if line.startswith("Requires-Dist:"))


def _key(lines: list[str]) -> str:
    tag = f"py{sys.version_info[0]}.{sys.version_info[1]} {sys.platform}"
    return hashlib.sha256("\n".join([tag, *lines]).encode()).hexdigest()[:16]


def _stamp() -> dict[str, str]:
    try:
        return dict(line.split("=", 1) for line in STAMP.read_text().split())
    except (OSError, ValueError):
        return {}


def _source(to: Path) -> Path:
    """What building the wheel reads, copied: the tree's build/ may hold compiled modules
    and files moved away since (setuptools would package them)."""
    to.mkdir(parents=True)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, to / name)
    shutil.copytree(ROOT / "src", to / "src", ignore=shutil.ignore_patterns(
        "__pycache__", "*.so", "*.egg-info", "*.pyc"))
    return to


def ensure(dist: Path) -> Path:
    """Fill the wheelhouse if it is missing or stale, build kvwire's wheel from this tree
    into ``dist`` offline from it, and return that wheel. The wheel is pure Python
    (KVWIRE_NO_NATIVE: the C accelerators are optional and change no dependency), which
    keeps the build to seconds. Raises :class:`Offline` if the index must be reached and
    cannot be."""
    WHEELHOUSE.mkdir(exist_ok=True)
    stamp = _stamp()
    build_key = _key(build_requires())
    if stamp.get("build") != build_key:
        _pip("-w", str(WHEELHOUSE), *build_requires(), offline=False)
        stamp = {"build": build_key}
        STAMP.write_text(f"build={build_key}\n")
    dist.mkdir(parents=True, exist_ok=True)
    _pip("--no-deps", "-w", str(dist), str(_source(dist / "src")), offline=True)
    wheel = next(dist.glob("kvwire-*.whl"))
    deps_key = _key(requires_dist(wheel))
    if stamp.get("deps") != deps_key:
        _pip("-w", str(WHEELHOUSE), f"{wheel}[{','.join(EXTRAS)}]", offline=False)
        for stale in WHEELHOUSE.glob("kvwire-*.whl"):  # the tree's own wheel: rebuilt per run
            stale.unlink()
        STAMP.write_text(f"build={build_key}\ndeps={deps_key}\n")
    return wheel


if __name__ == "__main__":
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as tmp:
            ensure(Path(tmp))
    except Offline as e:
        print(f"kvwire: WARNING: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"kvwire: wheelhouse ready: {WHEELHOUSE}")
