"""tests/mutation.py (the mutation sweep of docs/testing.md) on a toy repository: a branch
no test reaches survives and is named; the others are killed; no scratch worktree is left."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mutation.py")

TOY = textwrap.dedent("""\
    def clamp(x, lo, hi):
        if x < lo:
            return lo
        if x > hi:
            return hi
        return x
""")
TOY_TEST = textwrap.dedent("""\
    from toy import clamp

    def test_low_and_inside():
        assert clamp(-1, 0, 10) == 0
        assert clamp(0, 0, 10) == 0
        assert clamp(5, 0, 10) == 5
""")


def _git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def test_the_sweep_names_what_no_test_reaches(tmp_path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "src" / "toy.py").write_text(TOY)
    (tmp_path / "tests" / "test_toy.py").write_text(TOY_TEST)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "toy")
    r = subprocess.run([sys.executable, TOOL, "src/toy.py", "--repo", str(tmp_path), "--",
                        "tests/test_toy.py"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    survived = [ln for ln in r.stdout.splitlines() if ln.startswith("survived")]
    where = {int(ln.split()[1].rsplit(":", 1)[1]) for ln in survived}
    # the untested upper branch survives; so does `x < lo` -> `x <= lo`, an equivalent
    # mutant (x == lo gives lo either way): the sweep names it, a reader dismisses it
    assert {4, 5} <= where <= {2, 4, 5}, r.stdout
    assert "src/toy.py:2  compare0" in r.stdout
    assert "src/toy.py:4  if false" in r.stdout or "src/toy.py:4  compare0" in r.stdout
    killed = int(r.stdout.rsplit("killed ", 1)[1].split(",")[0])
    assert killed >= 3, r.stdout  # the lower branch's mutants all fail the test
    assert _git(tmp_path, "worktree", "list").count("\n") == 1  # the scratch copy is gone
    assert (tmp_path / "src" / "toy.py").read_text() == TOY  # the repo itself untouched


def test_the_sweep_refuses_what_it_cannot_run(tmp_path) -> None:
    r = subprocess.run([sys.executable, TOOL, "src/nothing.py"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "usage" in r.stderr
    r = subprocess.run([sys.executable, TOOL, "src/nothing.py", "--", "tests/x.py"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "no file 'src/nothing.py'" in r.stderr
