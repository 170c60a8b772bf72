"""Imports only go down. Every module of src/kvwire sits in a room (the ``ROOMS`` table
below, lowest first); a module may import its own room or a lower one, never a higher one
or a sibling on the same floor, and no import cycle may exist, between rooms or between the
files of one room. The source is read (ast), nothing is imported.

What counts as an import: every ``import`` / ``from ... import`` of a kvwire module, at
module level and inside functions alike. A function's import runs the first time the
function does, so it is the same dependency, only later: an upward or circular one there
fails as it would at the top of the file (most cycles this test was written against ran
through such imports). Importing ``kvwire.a.b`` also runs the package ``kvwire.a``'s
``__init__``, so it counts as importing that package too. What does not count: imports
under ``if TYPE_CHECKING:`` (never run), the top-level package ``kvwire`` (its
``__version__`` is for everyone; its names are looked up lazily from a table of strings, and
it has no import of its own at module level, checked below), and ``DEPRECATED`` modules:
old paths left for one release, which only point at the new one and which no kvwire
module may import.

Private names stay in their module: a module may not import another module's ``_name``,
nor touch an attribute ``obj._name`` that it does not itself define (as a function, class,
class attribute, slot or assignment). Such a reach is a class split over files sharing
private state, or one part using another's insides instead of a public method; the few
modules that do so today are listed in ``PRIVATE_REACH`` until they are mended.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvwire"

#: The rooms, lowest first; rooms on one floor may not import each other. A module belongs
#: to the room of its longest listed prefix (``kvwire.`` left out).
ROOMS: list[dict[str, list[str]]] = [
    # Leaves anyone may use (the three floors below wire).
    # kvwire's one error for a refused request (the routing core raises it too).
    # and the atomic write of a state file (the indexer's, the engines file).
    {"errors": ["errors"], "state_file": ["state_file"],
     "moved": ["_moved"]},  # _moved: the DEPRECATED paths' helper
    # The one HTTP/1.1 server and client; HTTP/2 for gRPC (the frame codec, the pure
    # connection machine, the gRPC server the endpoint picker serves Envoy on); tokenizers
    # and chat templates.
    {"http1": ["http1"], "h2": ["h2"], "tokenize": ["tokenize"]},
    # Prometheus exposition (and listen --metrics' exporter, on the one server).
    {"metrics": ["metrics"]},
    # What is on the wire: event types, dialect codecs, frames, endpoints, CurveZMQ.
    {"wire": ["wire"]},
    # The pure stream machine and the subscriber; one-to-many IPC in shared memory (it uses
    # the wire's frame helpers and nothing else).
    {"consume": ["consume"], "shm": ["shm"]},
    # The prefix index and the block cache (the publisher keeps its snapshot in one).
    {"index": ["index"]},
    # The engine side's publisher.
    {"publish": ["publish"]},
    # kvwire's streams on NATS JetStream (a source for the subscriber, a bridge from
    # publishers); the model engine and the `kvwire engine` server (it publishes); the
    # vLLM / SGLang plugins (they publish, and put the shm queue in vLLM).
    {"nats": ["nats"], "engine": ["engine"], "plugins": ["engines", "plugins"]},
    # Routing without HTTP or asyncio: policy, load, the feed of an index, the core.
    {"routing": ["routing"]},
    # What answers HTTP on top of it: the OpenAI proxy, the RFC #1403 indexer.
    {"proxy": ["proxy"], "indexer": ["indexer"],
     # Replica load sharing's NATS I/O: the pure half is routing.sharing, below it.
     "load_channel": ["nats.load_channel"]},
    # The endpoint picker behind Envoy (ext_proc over gRPC): Envoy connects, kvwire only
    # decides, and it decides as the proxy does, so it stands on the proxy: the proxy's
    # engine health (fleet, prober), its tokenization and the routing core's reservation
    # lifecycle, reused rather than copied (a sibling of the proxy could not import them).
    {"epp": ["epp"]},
    # router/: old import paths only, forwarding to routing/, proxy/, indexer/ and serve/
    # for one release.
    {"router": ["router"]},
    # The `kvwire serve` application; beside it, engines without a GPU: the late-join demo
    # and the fleet simulator (it runs the router's policy and load sharing against the
    # model engine).
    {"serve": ["serve"], "sim": ["sim"]},
    # The command line.
    {"cli": ["cli", "__main__"]},
]

#: Old import paths kept for one release: modules that only resolve names at their new
#: path (kvwire/_moved.py), so they import nothing up; no kvwire module may import them.
DEPRECATED = {"kvwire.router.app", "kvwire.router.indexer", "kvwire.router.proxy",
              "kvwire.router.proxy_state", "kvwire.router.status_feed",
              "kvwire.router.status_series", "kvwire.router.upstream", "kvwire.router.load_share",
              "kvwire.consume.cache", "kvwire.engines", "kvwire.engines.sglang",
              "kvwire.engines.vllm", "kvwire.engines.vllm_shm", "kvwire.router.cache_aware"}

#: Cycles that exist today and must go: each a sorted tuple of the modules of one strongly
#: connected component. This must become empty; the test fails when a cycle listed here is
#: gone (take it off the list) as well as when one not listed appears. Empty now (the
#: proxy's files have no cycle even counting imports for annotations: checked below).
KNOWN_CYCLES: set[tuple[str, ...]] = set()

#: Modules that reach into another module's private names today, each a seam still to
#: mend (nothing else may join them): the stream machine split over three files by
#: inheritance, the shm queue's sides, the index's walk and state, the simulator's routers,
#: the engine model's requests, and the plugins, NATS internals and argparse they subclass
#: or drive (other projects' private names). The proxy (proxy/) has none: its handler,
#: relay, prober and metrics use the fleet's public methods.
PRIVATE_REACH = {
    "kvwire", "kvwire.cli.main", "kvwire.consume.delivery", "kvwire.consume.recovery",
    "kvwire.consume.stream", "kvwire.engine.model", "kvwire.index.prefix",
    "kvwire.index.walk", "kvwire.nats.client_internals", "kvwire.nats.link",
    "kvwire.plugins.sglang", "kvwire.plugins.vllm", "kvwire.publish.publisher",
    "kvwire.shm.queue", "kvwire.shm.reader", "kvwire.shm.remote_reader", "kvwire.shm.writer",
    "kvwire.sim.fleet"}


def _modules() -> tuple[dict[str, Path], set[str]]:
    """Every Python module of kvwire by dotted name, and the C extensions' names."""
    mods: dict[str, Path] = {}
    exts: set[str] = set()
    for p in sorted(SRC.rglob("*.py")):
        parts = ["kvwire", *p.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = p
    for p in SRC.rglob("*.c"):
        exts.add(".".join(["kvwire", *p.relative_to(SRC).with_suffix("").parts]))
    return mods, exts


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, type_checking: bool = False,
             ) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Each import statement that runs (and, with ``type_checking``, those under ``if
    TYPE_CHECKING:`` too), and whether it is inside a function."""
    out: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def walk(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if (isinstance(child, ast.If) and _is_type_checking(child.test)
                    and not type_checking):
                for s in child.orelse:
                    walk_one(s, lazy)
                continue
            walk_one(child, lazy)

    def walk_one(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append((node, lazy))
        walk(node, lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                             ast.Lambda)))

    walk(tree, False)
    return out


def import_graph(type_checking: bool = False) -> dict[tuple[str, str], bool]:
    """(importer, imported) -> True when every such import is inside a function."""
    mods, exts = _modules()
    edges: dict[tuple[str, str], bool] = {}
    problems = []
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node, lazy in _imports(ast.parse(path.read_text(), str(path)), type_checking):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
                    base_name = ".".join(base + ([node.module] if node.module else []))
                else:
                    base_name = node.module or ""
                for a in node.names:
                    sub = f"{base_name}.{a.name}"
                    targets.append(sub if sub in mods or sub in exts else base_name)
            for t in targets:
                if t != "kvwire" and not t.startswith("kvwire."):
                    continue
                if t in exts:
                    continue  # a C accelerator: imports nothing of kvwire
                if t not in mods:
                    problems.append(f"{name} imports {t}, which is not a kvwire module")
                    continue
                # importing a.b.c runs the packages a.b and a first (not the importer's own)
                chain = t.split(".")
                for i in range(2, len(chain) + 1):
                    dep = ".".join(chain[:i])
                    if dep == name or name.startswith(dep + "."):
                        continue
                    edges[(name, dep)] = edges.get((name, dep), True) and lazy
    assert not problems, "\n".join(problems)
    return edges


def room_of(module: str) -> str:
    rel = module.removeprefix("kvwire.")
    best, best_len = None, -1
    for floor in ROOMS:
        for room, prefixes in floor.items():
            for p in prefixes:
                if (rel == p or rel.startswith(p + ".")) and len(p) > best_len:
                    best, best_len = room, len(p)
    assert best is not None, f"{module} is in no room: add it to ROOMS in tests/test_layers.py"
    return best


def floor_of(room: str) -> int:
    return next(i for i, floor in enumerate(ROOMS) if room in floor)


def _counted(edges: dict[tuple[str, str], bool]) -> dict[tuple[str, str], bool]:
    return {(a, b): lazy for (a, b), lazy in edges.items()
            if a != "kvwire" and b != "kvwire" and a not in DEPRECATED}


def upward_imports(edges: dict[tuple[str, str], bool]) -> list[str]:
    bad = []
    for (a, b), lazy in sorted(_counted(edges).items()):
        ra, rb = room_of(a), room_of(b)
        if ra != rb and floor_of(rb) >= floor_of(ra):
            how = "sibling" if floor_of(rb) == floor_of(ra) else "higher"
            bad.append(f"{a} ({ra}) imports {b} ({rb}, a {how} room)"
                       f"{' inside a function' if lazy else ''}")
    return bad


def cycles(edges: dict[tuple[str, str], bool]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, list[str]] = defaultdict(list)
    for a, b in _counted(edges):
        graph[a].append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: set[tuple[str, ...]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on.add(v)
            succ = graph[v]
            if i < len(succ):
                work.append((v, i + 1))
                w = succ[i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.add(tuple(sorted(comp)))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return found


def test_every_module_has_a_room() -> None:
    mods, _ = _modules()
    for m in mods:
        if m != "kvwire":
            room_of(m)


def test_imports_only_go_down() -> None:
    bad = upward_imports(import_graph())
    assert not bad, "imports that go up (see ROOMS in tests/test_layers.py):\n" + "\n".join(bad)


def test_no_import_cycles_but_the_known_ones() -> None:
    found = cycles(import_graph())
    new = found - KNOWN_CYCLES
    gone = KNOWN_CYCLES - found
    assert not new, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in sorted(new))
    assert not gone, ("cycles in KNOWN_CYCLES no longer exist; remove them from the list:\n"
                      + "\n".join(" <-> ".join(c) for c in sorted(gone)))


def test_the_top_level_package_imports_nothing_at_module_level() -> None:
    """``kvwire`` is exempt above because every module imports it (as a package) and its
    names load lazily; that holds only while it imports no kvwire module when loaded."""
    tree = ast.parse((SRC / "__init__.py").read_text())
    eager = [ast.unparse(n) for n, lazy in _imports(tree) if not lazy and (
        any(a.name.startswith("kvwire") for a in n.names) if isinstance(n, ast.Import)
        else n.level > 0 or (n.module or "").startswith("kvwire"))]
    assert not eager, eager


def test_nothing_imports_a_deprecated_path() -> None:
    users = sorted(f"{a} -> {b}" for a, b in import_graph() if b in DEPRECATED)
    assert not users, users


def test_deprecated_lists_every_old_path() -> None:
    """A module that only forwards to a new path (``__getattr__ = moved(...)`` and nothing
    but imports besides) is in DEPRECATED, and everything in DEPRECATED is one."""
    mods, _ = _modules()
    shims = set()
    for name, path in mods.items():
        body = [n for n in ast.parse(path.read_text()).body
                if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        forwards = [n for n in body if isinstance(n, ast.Assign)
                    and isinstance(n.value, ast.Call) and getattr(n.value.func, "id", "") == "moved"]
        if forwards and all(isinstance(n, (ast.Import, ast.ImportFrom)) or n in forwards
                            for n in body):
            shims.add(name)
    assert shims == DEPRECATED


def test_the_checker_sees_an_upward_import_a_cycle_and_a_type_checking_one() -> None:
    """The rules above on a made-up tree: the checker can fail."""
    edges = {("kvwire.wire.events", "kvwire.consume.stream"): True,
             ("kvwire.consume.stream", "kvwire.wire.events"): False}
    assert upward_imports(edges) == [
        "kvwire.wire.events (wire) imports kvwire.consume.stream (consume, a higher room) "
        "inside a function"]
    assert cycles(edges) == {("kvwire.consume.stream", "kvwire.wire.events")}
    assert upward_imports({("kvwire.consume.stream", "kvwire.shm.queue"): False}), "sibling"
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvwire import x\n"
           "def f():\n    import kvwire.y\n")
    found = [(ast.unparse(n), lazy) for n, lazy in _imports(ast.parse(src))]
    assert found == [("from typing import TYPE_CHECKING", False), ("import kvwire.y", True)]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_names(tree: ast.Module) -> set[str]:
    """Every name a module defines: functions, classes, assigned names and attributes,
    class attributes, slots."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets):
            out.update(c.value for c in ast.walk(n.value)
                       if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return out


def private_reaches(name: str, source: str, submodules: set[str] = frozenset(),
                    is_pkg: bool = False) -> list[str]:
    """Where module ``name`` (its ``source``) reaches into another module's private names:
    ``from M import _x`` (unless ``M._x`` is a module: ``submodules``), or ``obj._x`` for an
    ``_x`` the module does not define itself."""
    tree = ast.parse(source)
    own = _own_names(tree)
    bad = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in own:
            bad.append(f"{name}:{n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith(
                "kvwire")):
            for a in n.names:
                if not _private(a.name):
                    continue
                if n.level:
                    parts = name.split(".")
                    base = ".".join(parts[: len(parts) - n.level + is_pkg]
                                    + ([n.module] if n.module else []))
                else:
                    base = n.module or ""
                if f"{base}.{a.name}" not in submodules:
                    bad.append(f"{name}:{n.lineno}: from {base} import {a.name}")
    return sorted(bad)


def test_no_module_reaches_into_another_modules_private_names() -> None:
    mods, exts = _modules()
    subs = set(mods) | exts
    found: dict[str, list[str]] = {}
    for name, path in mods.items():
        bad = private_reaches(name, path.read_text(), subs, path.name == "__init__.py")
        if bad:
            found[name] = bad
    new = {m: b for m, b in found.items() if m not in PRIVATE_REACH}
    assert not new, ("private names used outside their module (add a public method):\n"
                     + "\n".join(x for b in new.values() for x in b))
    assert not [m for m in found if m.startswith("kvwire.proxy")]


def test_the_proxy_flows_one_way_even_in_annotations() -> None:
    """proxy/ is one owner per concern with a request flowing one way (facade -> handler
    -> tokens, relay -> fleet -> metrics): no cycle among its files even counting imports
    under TYPE_CHECKING (a class that needs another's type for its annotations only is
    still one half of a knot)."""
    found = cycles(import_graph(type_checking=True))
    assert not [c for c in found if any(m.startswith("kvwire.proxy") for m in c)], found


def test_the_checker_sees_a_private_reach() -> None:
    """The rule on made-up modules: the checker can fail, and what a module defines
    itself (its own private attributes, a private submodule) passes."""
    src = ("from .proxy import _Link, Proxy\nfrom . import _native\n"
           "class Relay:\n    __slots__ = ('_n',)\n"
           "    def f(self, proxy, other):\n        self._n = other._n\n"
           "        return proxy._check(self._lock), _native._ring\n")
    got = private_reaches("kvwire.proxy.relay", src, {"kvwire.proxy._native"})
    assert got == ["kvwire.proxy.relay:1: from kvwire.proxy.proxy import _Link",
                   "kvwire.proxy.relay:7: _native._ring",  # (a module's private name too)
                   "kvwire.proxy.relay:7: proxy._check",
                   "kvwire.proxy.relay:7: self._lock"], got


if __name__ == "__main__":  # the room graph, for whoever edits ROOMS
    g = import_graph()
    by_rooms: dict[tuple[str, str], list[str]] = defaultdict(list)
    for (a, b), lazy in sorted(_counted(g).items()):
        if room_of(a) != room_of(b):
            by_rooms[(room_of(a), room_of(b))].append(f"{a} -> {b}{' (lazy)' if lazy else ''}")
    for (ra, rb), ex in sorted(by_rooms.items()):
        print(f"{ra:>9} -> {rb:<9} {len(ex):3}  e.g. {ex[0]}")
    print(*upward_imports(g), sep="\n")
    print(*(" <-> ".join(c) for c in sorted(cycles(g))), sep="\n", file=sys.stderr)
