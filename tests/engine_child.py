"""The engine child of tests/test_engines_vllm.py and tests/test_engines_sglang.py, one
script for both engines (run as ``python engine_child.py vllm|sglang DOCS_EXAMPLE``).

It loads kvwire's plugins the way the engine does: first with every switch off, saying
what of the engine changed (nothing should), then runs the docs example (switches on; it
sets the switch, loads the plugins again and creates ``pub``) and publishes on command.
It speaks JSON lines (tests/engine_helpers.py ``Child``): one object per phase, then one
per command read from stdin. Imports only the standard library and the engine, so that
the "off" phase sees the engine as a fresh engine process does.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import logging
import os
import sys
import threading
from importlib.metadata import entry_points
from typing import Any

faulthandler.dump_traceback_later(280, exit=True)  # a stuck child says where, then ends
TESTS = os.path.dirname(os.path.abspath(__file__))
# this script's folder (sys.path[0]) is off the path until the engine has been checked
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != TESTS]


def out(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def qualname(v: Any) -> str:
    return f"{getattr(v, '__module__', '?')}.{getattr(v, '__qualname__', v)}"


def ids(obj: Any) -> dict[str, int]:
    """The identity of every attribute: a replaced function or class shows as a change."""
    return {n: id(v) for n, v in vars(obj).items()}


class Keep(logging.Handler):
    """Keeps the messages of the engine's log (the plugin's "active" line goes there)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Engine:
    """What differs between the engines: their modules, plugin loader and log."""

    name = ""
    group = ""  # the entry-point group of the engine's general plugins
    k: Any  # the engine's kv_events module

    def fingerprint(self) -> dict[str, Any]:
        """What a plugin could change on load: the factory's registry, the attributes of the
        kv_events module and its classes, the environment and the threads."""
        k = self.k
        return {
            "registry": {n: qualname(v) for n, v in k.EventPublisherFactory._registry.items()},
            "kv_events": ids(k), "factory": ids(k.EventPublisherFactory),
            "zmq_publisher": ids(k.ZmqEventPublisher),
            "env": sorted(os.environ),
            "threads": sorted(t.name for t in threading.enumerate()),
        }

    def load_plugins(self) -> None:
        raise NotImplementedError

    def reload_plugins(self) -> None:
        """Let the docs example load the plugins again (the "off" phase changed nothing, so
        this process is as fresh as a new one; an engine loads its plugins once per process)."""
        raise NotImplementedError

    def on_extra(self, pub: Any) -> dict[str, Any]:
        return {}


class Vllm(Engine):
    name, group = "vllm", "vllm.general_plugins"

    def __init__(self) -> None:
        import vllm.config.kv_events as c
        import vllm.distributed.kv_events as k
        import vllm.plugins

        self.plugins, self.k, self.c = vllm.plugins, k, c

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "config": ids(self.c),
                "KVEventsConfig": ids(self.c.KVEventsConfig),
                "loggers": sorted(logging.Logger.manager.loggerDict)}

    def load_plugins(self) -> None:
        self.plugins.load_general_plugins()

    def reload_plugins(self) -> None:
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging

        configure_logging(LoggingConfig())  # what `vllm serve` does: vLLM's log handler
        self.plugins.plugins_loaded = False

    def on_extra(self, pub: Any) -> dict[str, Any]:
        return {"config": repr(pub.get_publisher_config())}


class Sglang(Engine):
    name, group = "sglang", "sglang.srt.plugins"

    def __init__(self) -> None:
        logging.basicConfig(level=logging.INFO)  # as SGLang's server configures its log
        import sglang.srt.disaggregation.kv_events as k
        import sglang.srt.plugins

        self.plugins, self.k = sglang.srt.plugins, k

    def load_plugins(self) -> None:
        self.plugins.load_plugins()

    def reload_plugins(self) -> None:
        self.plugins._plugins_loaded = False

    def on_extra(self, pub: Any) -> dict[str, Any]:
        return {"source": pub.describe_local_source(16)}


def main(name: str, doc: str) -> None:
    engine: Engine = {"vllm": Vllm, "sglang": Sglang}[name]()
    # Phase "off": every switch off. A run without kvwire is the state before the load.
    before, mods = engine.fingerprint(), set(sys.modules)
    engine.load_plugins()
    after = engine.fingerprint()
    new_loggers = set(after.pop("loggers", ())) - set(before.pop("loggers", ()))
    changed = sorted(n for n in before if before[n] != after[n])
    changed += [f"logger {n}" for n in sorted(new_loggers) if "kvwire" in n]
    out({"phase": "off", "changed": changed,
         "kvwire_modules": sorted(m for m in set(sys.modules) - mods if m.startswith("kvwire")),
         "entry_point": [e.value for e in entry_points(group=engine.group)
                         if e.name == "kvwire"]})

    # Phase "on": the docs example, as a process of the engine's server would run it.
    engine.reload_plugins()
    keep = Keep()
    logging.getLogger(name).addHandler(keep)
    ns = {"__name__": "__main__"}
    exec(doc, ns)  # sets the switch, loads the plugins, creates `pub`
    pub = ns["pub"]
    out({"phase": "on", "registry": qualname(engine.k.EventPublisherFactory._registry["zmq"]),
         "type": type(pub).__name__, "lines": keep.lines, **engine.on_extra(pub)})

    sys.path.insert(0, TESTS)
    batches = getattr(importlib.import_module(f"test_engines_{name}"), f"{name}_batches")
    n = 0
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "pub":
            for b in batches(engine.k, cmd["n"], seed=n):
                pub.publish(b)
            n += cmd["n"]
            out({"published": n})
        elif cmd["op"] == "quit":
            out({"report": repr(pub.shutdown())})
            break
    # Done: skip the engine's interpreter teardown (1-2.5 s of torch's; nothing checks it).
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
