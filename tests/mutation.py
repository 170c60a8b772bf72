"""Mutation sweep: does any test fail when one piece of a source file is changed?

    .venv/bin/python tests/mutation.py src/kvwire/routing/policy.py -- tests/test_balance.py
    make mutate SOURCE=src/kvwire/routing/policy.py TESTS="tests/test_balance.py tests/test_router.py"

Each mutant changes one AST node of SOURCE (a comparison flipped at its boundary or negated,
``+``/``-`` and ``*``/``/`` swapped, ``and``/``or`` swapped, a ``not`` dropped, a number or
a bool changed, a statement replaced by ``pass``, an ``if`` made false) and runs the tests
given after ``--`` with ``-x``. A mutant no test fails on is printed with its line: either
the tests miss a behaviour there, or the change is equivalent (a shortcut, a default, an
``__all__``); the sweep cannot tell which, a reader can. It works on a scratch ``git
worktree`` of HEAD (uncommitted changes are not in it), with the built C modules copied in,
the ``.venv`` linked in (for tests that start ``kvwire`` processes) and ``PYTHONPATH``
pointing at it, and removes it at the end. Exit 0 whatever survives: a
report, not a gate. docs/testing.md ("Mutation sweeps") says how to read one.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
       ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn,
       ast.NotIn: ast.In}
BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
       ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv}
STATEMENTS = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return, ast.Raise,
              ast.If)


def mutants(tree: ast.Module, lines: tuple[int, int] | None) -> Iterator[tuple[int, str, int]]:
    """(node index in ``ast.walk`` order, kind, line) of every mutant of ``tree``."""
    for i, n in enumerate(ast.walk(tree)):
        line = getattr(n, "lineno", None)
        if line is None or (lines and not lines[0] <= line <= lines[1]):
            continue
        if isinstance(n, ast.Compare):
            for j, op in enumerate(n.ops):
                if type(op) in CMP:
                    yield i, f"compare{j}", line
        elif isinstance(n, ast.BinOp) and type(n.op) in BIN:
            yield i, "arith", line
        elif isinstance(n, ast.BoolOp):
            yield i, "and/or", line
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            yield i, "drop not", line
        elif isinstance(n, ast.Constant) and type(n.value) in (int, float, bool):
            yield i, "constant", line
        elif isinstance(n, STATEMENTS) and not (
                isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)):  # docstrings
            yield i, "if false" if isinstance(n, ast.If) else "pass", line


def _replace(tree: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list) and any(v is old for v in value):
                value[next(k for k, v in enumerate(value) if v is old)] = new
                return


def mutate(tree: ast.Module, index: int, kind: str) -> str:
    """The source of ``tree`` with mutant ``(index, kind)`` applied."""
    t = copy.deepcopy(tree)
    n = list(ast.walk(t))[index]
    if kind.startswith("compare"):
        j = int(kind[7:])
        n.ops[j] = CMP[type(n.ops[j])]()
    elif kind == "arith":
        n.op = BIN[type(n.op)]()
    elif kind == "and/or":
        n.op = ast.Or() if isinstance(n.op, ast.And) else ast.And()
    elif kind == "drop not":
        _replace(t, n, n.operand)
    elif kind == "constant":
        v = n.value
        n.value = (not v if isinstance(v, bool) else v + 1 if v == 0
                   else type(v)(0) if abs(v) < 2 else v * 2)
    elif kind == "if false":
        n.test = ast.Constant(False)
    else:
        _replace(t, n, ast.Pass())
    return ast.unparse(ast.fix_missing_locations(t))


def _scratch(repo: str) -> str:
    """A detached worktree of ``repo``'s HEAD with its untracked built modules (``*.so``),
    and its ``.venv`` linked in, so tests that start ``.venv/bin/kvwire`` processes run
    the mutant too (``PYTHONPATH`` comes before the editable install's path)."""
    where = tempfile.mkdtemp(prefix="kvwire-mutation-")
    subprocess.run(["git", "-C", repo, "worktree", "add", "-q", "--detach", where, "HEAD"],
                   check=True)
    for root, _, files in os.walk(os.path.join(repo, "src")):
        for f in files:
            if f.endswith(".so"):
                src = os.path.join(root, f)
                dst = os.path.join(where, os.path.relpath(src, repo))
                if os.path.isdir(os.path.dirname(dst)):
                    shutil.copy2(src, dst)
    venv = os.path.join(repo, ".venv")
    if os.path.isdir(venv):
        os.symlink(venv, os.path.join(where, ".venv"))
    return where


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: mutation.py SOURCE [--lines A-B] [--repo DIR] -- TEST [TEST ...]",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="mutation.py")
    ap.add_argument("source", help="the file to mutate, relative to the repo")
    ap.add_argument("--lines", help="only lines A-B")
    ap.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds per mutant; one that runs longer (a loop) counts as killed")
    args = ap.parse_args(argv[:cut])
    tests = argv[cut + 1:]
    if not tests:
        print("mutation.py: name the tests to run after --", file=sys.stderr)
        return 2
    lines = None
    if args.lines:
        a, _, b = args.lines.partition("-")
        lines = (int(a), int(b or a))
    repo = os.path.abspath(args.repo)
    path = os.path.join(repo, args.source)
    if not os.path.isfile(path):
        print(f"mutation.py: no file {args.source!r} in {repo}", file=sys.stderr)
        return 2
    text = open(path).read()
    tree = ast.parse(text)
    base = ast.unparse(tree)
    todo = list(mutants(tree, lines))
    where = _scratch(repo)
    target = os.path.join(where, args.source)
    env = {**os.environ, "PYTHONPATH": os.path.join(where, "src")}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", *tests]
    print(f"{len(todo)} mutants of {args.source}; tests: {' '.join(tests)}", flush=True)
    t0, killed, survived = time.monotonic(), 0, 0
    try:
        first = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True)
        if first.returncode != 0:
            print("the tests fail before any mutation:\n" + first.stdout[-2000:], file=sys.stderr)
            return 1
        for index, kind, line in todo:
            src = mutate(tree, index, kind)
            if src == base:
                continue
            with open(target, "w") as f:
                f.write(src)
            try:
                r = subprocess.run(cmd, cwd=where, env=env, capture_output=True,
                                   timeout=args.timeout)
                failed = r.returncode != 0
            except subprocess.TimeoutExpired:
                failed = True
            if failed:
                killed += 1
            else:
                survived += 1
                code = text.splitlines()[line - 1].strip()
                print(f"survived  {args.source}:{line}  {kind:9s} {code[:90]}", flush=True)
    finally:
        subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", where],
                       capture_output=True)
        shutil.rmtree(where, ignore_errors=True)
    print(f"killed {killed}, survived {survived} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
