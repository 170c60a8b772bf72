"""Names that moved to ``kvwire.routing`` keep working at their old places for one release:
the same objects, with a DeprecationWarning naming the new place; and nothing of kvwire
imports through the old places itself."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import kvwire.routing as routing
from kvwire.routing import core, load, policy


def _fresh(name: str):
    """Import ``name`` again (a module warns when it is first imported)."""
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_router_policy_is_the_routing_policy_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="kvwire.routing.policy"):
        old = _fresh("kvwire.router.policy")
    for name in old.__all__:
        new = getattr(load if name == "LoadTracker" else policy, name)
        assert getattr(old, name) is new, name


def test_router_service_is_the_routing_core_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="kvwire.routing.core"):
        old = _fresh("kvwire.router.service")
    for name in old.__all__:
        assert getattr(old, name) is getattr(core, name), name


@pytest.mark.parametrize("name", ["RoutingPolicy", "Candidate", "Decision", "LoadTracker",
                                  "request_load"])
def test_the_router_package_names_warn_and_are_the_same(name: str) -> None:
    import kvwire.router

    with pytest.warns(DeprecationWarning, match=f"kvwire.routing.{name}"):
        old = getattr(kvwire.router, name)
    assert old is getattr(routing, name)
    with pytest.raises(AttributeError):
        kvwire.router.NoSuchName  # noqa: B018


def test_importing_a_router_module_warns_about_nothing() -> None:
    """Importing the proxy, the indexer, the app (and kvwire's whole API) goes through no
    deprecated name."""
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "import kvwire, kvwire.proxy.proxy, kvwire.serve.app, kvwire.indexer.indexer\n"
            "import kvwire.cli.serve, kvwire.cli.index, kvwire.sim.fleet, kvwire.sim.routers\n"
            "import kvwire.nats.load_channel\n"
            "kvwire.RoutingPolicy\n"
            "import sys\n"
            "bad = [m for m in ('kvwire.router.policy', 'kvwire.router.service') "
            "if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr


def test_the_new_names_import_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from kvwire.routing import RoutingPolicy  # noqa: F401
        from kvwire.routing.core import RouterCore  # noqa: F401


def test_the_indexer_holds_a_feed_not_a_router(tmp_path) -> None:
    """``kvwire index`` follows its registrations with a Feed of its own (no router with no
    engines); beside a router (``kvwire serve``) it holds the router's feed: one index, one
    lock, and the router's engines' streams are not registrable."""
    from kvwire.consume.engine_spec import EngineSpec
    from kvwire.consume.subscriber import StreamSpec
    from kvwire.indexer.indexer import Indexer
    from kvwire.routing.feed import Feed

    ix = Indexer.standalone(on_loop=True)
    try:
        assert type(ix.feed) is Feed and not ix.feed.owned
    finally:
        ix.close()
    assert ix.feed.closed
    router = core.RouterCore([EngineSpec("e0", "ipc:///nonexistent/e0")])
    ix = Indexer(router, tmp_path / "regs.json")
    assert ix.feed is router.feed and ix.feed.index is router.index
    assert ix.feed.lock is router.lock
    with pytest.raises(ValueError, match="already followed"):
        ix.feed.add_stream(StreamSpec("e0/dp0", "ipc:///nonexistent/x"))


def test_routing_imports_no_http_no_asyncio_and_nothing_above_it() -> None:
    """kvwire.routing is the routing without its faces: none of its modules imports
    asyncio, an HTTP or NATS library, or a kvwire module above it (router/, the proxy, the
    indexer, serve, cli, nats)."""
    import ast
    from pathlib import Path

    banned = {"asyncio", "http", "httptools", "httpx", "fastapi", "uvicorn", "nats", "h11"}
    above = ("router", "proxy", "indexer", "serve", "cli", "nats", "http1", "sim")
    for path in sorted(Path(routing.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [(0, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.level, node.module or "")]
            else:
                continue
            for level, name in names:
                top = name.split(".")[0]
                if level == 0:
                    assert top not in banned, (path.name, name)
                    assert not (top == "kvwire" and name.split(".")[1:2] and
                                name.split(".")[1] in above), (path.name, name)
                elif level == 2:  # from ..X: a sibling of routing
                    assert top not in above, (path.name, name)
