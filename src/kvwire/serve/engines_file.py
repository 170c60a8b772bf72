"""Engines added and removed at run time, kept across restarts (``kvwire serve
--engines-file FILE``).

The file holds the changes, not the whole fleet: the engines added (``POST /engines``, each
as the text it was given) and the names removed (``DELETE /engines/NAME``). At start they
are laid over the command line's engines, so an engine added to the command line later is
still routed to, while one removed at run time stays removed after a restart, until it is
added again. :class:`EngineChanges` is the pure part (no I/O); :class:`EnginesFile` reads and
writes it (:func:`~kvwire.state_file.write_atomically`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from ..consume.engine_spec import EngineSpec
from ..state_file import write_atomically

__all__ = ["EngineChanges", "EnginesFile", "Start"]


class EngineChanges(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What run-time changes did to the engines given at start; changed by returning a new
    value, so the old one is at hand if the new one cannot be saved."""

    version: int = 1
    #: engine name -> the text ``POST /engines`` was given (``--engine``'s syntax, or
    #: ``--nats-engine``'s under ``--nats``)
    added: dict[str, str] = {}
    #: names removed at run time, sorted (an engine of the command line, or one found on
    #: the JetStream stream: neither is routed to again until added)
    removed: list[str] = []

    def add(self, name: str, text: str) -> EngineChanges:
        """After ``POST /engines`` added ``name`` as ``text``."""
        return EngineChanges(self.version, {**self.added, name: text},
                             [n for n in self.removed if n != name])

    def remove(self, name: str) -> EngineChanges:
        """After ``DELETE /engines/NAME``."""
        added = {n: t for n, t in self.added.items() if n != name}
        return EngineChanges(self.version, added, sorted({*self.removed, name}))

    def over(self, start: Sequence[EngineSpec],
             parse: Callable[[str], EngineSpec]) -> Start:
        """The engines to route to: ``start`` (the command line's) less those removed or
        added again (an added one replaces the command line's of its name), then those
        added. ValueError naming the entry for an added text ``parse`` refuses."""
        specs = [e for e in start if e.name not in self.added and e.name not in self.removed]
        for name, text in self.added.items():
            try:
                spec = parse(text)
            except ValueError as e:
                raise ValueError(f"engine {name!r} added as {text!r}: {e}") from None
            if spec.name != name:
                raise ValueError(f"engine {name!r} added as {text!r}, which names {spec.name!r}")
            specs.append(spec)
        given = {e.name for e in start}
        return Start(specs, set(self.removed),
                     sorted(n for n in self.removed if n in given),
                     sorted(n for n in self.added if n in given))


@dataclass(frozen=True)
class Start:
    """:meth:`EngineChanges.over`'s answer."""

    engines: list[EngineSpec]
    #: removed at run time: not routed to, nor found again on a JetStream stream
    withdrawn: set[str]
    #: command-line engines left out (removed at run time), and replaced (added again)
    dropped: list[str]
    replaced: list[str]


class EnginesFile:
    """:class:`EngineChanges` in a JSON file, rewritten whole on every change."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.changes = EngineChanges()  # as last read or written

    def load(self) -> EngineChanges:
        """The saved changes (none if there is no file yet); a file that cannot be read or
        parsed is a ValueError naming it (the router refuses to start rather than route to
        an engine removed, or forget one added)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            if not self.path.parent.is_dir():  # (else every change would be refused, 507)
                raise ValueError(f"engines file {self.path}: no directory "
                                 f"{self.path.parent} to write it in") from None
            return EngineChanges()
        except OSError as e:
            raise ValueError(f"engines file {self.path}: {e}") from None
        try:
            changes = msgspec.json.decode(raw, type=EngineChanges)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ValueError(f"engines file {self.path}: {e}") from None
        if changes.version != 1:
            raise ValueError(f"engines file {self.path}: version {changes.version} is not "
                             "one this kvwire reads (1)")
        self.changes = changes
        return changes

    def commit(self, changes: EngineChanges) -> None:
        """Write ``changes`` and hold them as the current ones (OSError if the file cannot be
        written: the old file and :attr:`changes` stay)."""
        write_atomically(self.path, msgspec.json.format(msgspec.json.encode(changes)) + b"\n")
        self.changes = changes
