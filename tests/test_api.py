"""The top-level API: ``from kvwire import Subscriber, ...`` works for every name of
``kvwire.__all__``, costs nothing until used (``import kvwire`` loads neither pyzmq nor
msgspec nor any kvwire submodule), names the same objects as the deep paths, and type
checkers see the same names as the run time does."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvwire

INIT = Path(kvwire.__file__)
# The public names users rely on, spelled out here so that dropping one from kvwire fails.
PROMISED = {
    "ZmqEventPublisher", "KVEventBatch", "BlockStored", "BlockRemoved", "AllBlocksCleared",
    "Subscriber", "StreamSpec", "Batch", "Reset", "Snapshot", "BlockCache", "PrefixIndex",
    "RoutingPolicy", "MessageQueue", "decode_batch", "encode_batch",
}


def _fresh(code: str) -> dict:
    """Runs ``code`` in a new interpreter; it prints one JSON value, which is returned."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       check=True)
    return json.loads(r.stdout)


def test_import_kvwire_loads_no_submodule_and_no_heavy_dependency() -> None:
    loaded = _fresh("import sys, json, kvwire; print(json.dumps(sorted(sys.modules)))")
    ours = [m for m in loaded if m == "kvwire" or m.startswith("kvwire.")]
    heavy = [m for m in loaded if m.split(".")[0] in ("zmq", "msgspec", "xxhash", "typing")]
    assert ours == ["kvwire"] and heavy == [], (ours, heavy)


def test_a_name_loads_only_what_it_needs() -> None:
    # the policy is pure Python: using it must not drag in ZeroMQ or the subscriber
    loaded = _fresh("import sys, json, kvwire; kvwire.RoutingPolicy; "
                    "print(json.dumps(sorted(sys.modules)))")
    assert "kvwire.routing.policy" in loaded
    assert not [m for m in loaded if m.split(".")[0] == "zmq" or m.startswith("kvwire.consume")]


def test_star_import_and_dir_give_every_name_of_all() -> None:
    got = _fresh("import json\nfrom kvwire import *\n"
                 "print(json.dumps(sorted(k for k in dir() if not k.startswith('_') or "
                 "k == '__version__')))")
    assert set(kvwire.__all__) <= set(got)
    # dir() lists them before any was used (tab completion in a fresh REPL)
    listed = _fresh("import json, kvwire; print(json.dumps(dir(kvwire)))")
    assert set(kvwire.__all__) <= set(listed)


def test_every_name_of_all_resolves_to_its_deep_path() -> None:
    assert PROMISED <= set(kvwire.__all__)
    assert set(kvwire.__all__) == set(kvwire._API) | {"__version__", "native_status"}
    for name, module in kvwire._API.items():
        deep = getattr(importlib.import_module(module), name)
        assert getattr(kvwire, name) is deep, name
    # the deep paths people already use keep working
    from kvwire.consume.subscriber import Subscriber
    from kvwire.publish.publisher import ZmqEventPublisher
    from kvwire.wire.events import decode_batch

    assert (Subscriber, ZmqEventPublisher, decode_batch) == (
        kvwire.Subscriber, kvwire.ZmqEventPublisher, kvwire.decode_batch)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Subscribr'"):
        kvwire.Subscribr  # noqa: B018
    with pytest.raises(ImportError):
        exec("from kvwire import Subscribr", {})
    assert not hasattr(kvwire, "MAGIC")


def test_type_checkers_see_the_same_names() -> None:
    tree = ast.parse(INIT.read_text())
    checked: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom) and imp.module.startswith("kvwire"):
                    checked.update({a.name: imp.module for a in imp.names})
    assert checked == kvwire._API


def test_wire_package_does_not_reexport_protocol_internals() -> None:
    import kvwire.wire
    from kvwire.wire import protocol

    for name in ("MAGIC", "OP_INFO", "OP_SNAPSHOT", "END_SEQ", "pack_seq", "parse_request"):
        assert hasattr(protocol, name)
        assert name not in vars(kvwire.wire), name
