"""Which pip extra each command needs, checked before the command starts: without it the
command prints one line naming the extra and exits 2, never a traceback.

``pip install kvwire`` (the core) runs every command's core job: ``listen``, ``keys``,
``engine``, ``fleet``, ``index``, ``sim`` (its table), ``demo --sim`` and ``--late-join``.
The rest needs an extra, as :data:`NEEDS` says. ``EXTRA_MODULES`` is what kvwire imports
from each extra; tests/test_install.py checks it against pyproject.toml's extras and runs
every command in a fresh venv per extra.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["EXTRA_MODULES", "NEEDS", "Need", "extra_for_module", "install_hint", "missing",
           "needs_text"]

#: The top-level modules kvwire imports from each extra (a subset of its distributions:
#: what is there when the extra is installed).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "serve": ("prometheus_client", "tokenizers"),
    "epp": ("hpack", "envoy", "google", "prometheus_client", "tokenizers"),
    "nats": ("nats",),
    "sim": ("matplotlib",),
    "tokenize": ("tokenizers",),
    "metrics": ("prometheus_client",),
}


class Need(NamedTuple):
    """A command needs ``extra`` when ``applies(args)``; ``when`` says when, for --help
    (None: always)."""

    extra: str
    when: str | None = None
    applies: Callable[[argparse.Namespace], bool] = lambda args: True


def _tokenizer_dir(args: argparse.Namespace) -> bool:
    if getattr(args, "tokenizer", None) not in (None, "engine", "builtin"):
        return True
    flags = getattr(args, "engine_flags", None) or []  # kvwire fleet passes engine flags on
    return any(f == "--tokenizer" or f.startswith("--tokenizer=") for f in flags)


#: Per command, the extras it needs (a command not named needs only the core).
NEEDS: dict[str, tuple[Need, ...]] = {
    "serve": (Need("serve"), Need("nats", "--nats", lambda a: a.nats is not None)),
    "epp": (Need("epp", "the picker (not --envoy-config)", lambda a: not a.envoy_config),
            Need("nats", "--nats", lambda a: a.nats is not None)),
    "bridge": (Need("nats"),),
    "demo": (Need("serve", "the HTTP fleet story (the default; not --sim or --late-join)",
                  lambda a: not (a.sim or a.late_join)),),
    "listen": (Need("nats", "a nats:// endpoint",
                    lambda a: any(e.startswith("nats://") for e in a.endpoint)),
               Need("metrics", "--metrics", lambda a: a.metrics is not None)),
    "sim": (Need("sim", "--report (the PNG)", lambda a: a.report is not None),),
    "engine": (Need("tokenize", "--tokenizer DIR", _tokenizer_dir),),
    "fleet": (Need("tokenize", "--tokenizer DIR", _tokenizer_dir),),
}


def install_hint(extras: list[str]) -> str:
    return f"pip install 'kvwire[{','.join(extras)}]'"


def needs_text(command: str) -> str | None:
    """What ``kvwire COMMAND --help`` says about installing, or None (the core suffices)."""
    parts = []
    for n in NEEDS.get(command, ()):
        parts.append(f"{install_hint([n.extra])}" + (f" for {n.when}" if n.when else ""))
    return "install: " + "; ".join(parts) if parts else None


def _absent(extra: str) -> str | None:
    for mod in EXTRA_MODULES[extra]:
        if importlib.util.find_spec(mod) is None:
            return mod
    return None


def missing(command: str, args: argparse.Namespace) -> str | None:
    """One line if ``args`` need an extra that is not installed, else None."""
    lacking: list[tuple[str, str]] = []
    for n in NEEDS.get(command, ()):
        if n.applies(args) and n.extra not in (e for e, _ in lacking):
            mod = _absent(n.extra)
            if mod is not None:
                lacking.append((n.extra, mod))
    if not lacking:
        return None
    return _line(command, [e for e, _ in lacking], [m for _, m in lacking])


def extra_for_module(command: str, module: str) -> str | None:
    """The extra that brings ``module`` (top-level name), the command's own first."""
    own = [n.extra for n in NEEDS.get(command, ())]
    for extra in [*own, *EXTRA_MODULES]:
        if module in EXTRA_MODULES.get(extra, ()):
            return extra
    return None


def _line(command: str, extras: list[str], modules: list[str]) -> str:
    which = " and ".join(f"'{e}'" for e in extras)
    plural = "extras" if len(extras) > 1 else "extra"
    return (f"kvwire {command}: needs the {which} {plural} (no module "
            f"{', '.join(repr(m) for m in modules)}): {install_hint(extras)}")


def module_line(command: str, module: str) -> str | None:
    """The one line for a ModuleNotFoundError of ``module`` raised while running, or None
    when no extra brings it (a broken install: the traceback is the honest answer)."""
    extra = extra_for_module(command, module)
    return None if extra is None else _line(command, [extra], [module])
