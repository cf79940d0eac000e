"""Fault injection for the controller: crash after a step, stale reads, lost events, conflicts.

Off by default. Turned on by ``--fault`` flags or the ``NEONVM_FAULTS`` environment
variable, e.g.::

    NEONVM_FAULTS="crash_after=commit"                  # os._exit(137) after the 1st commit
    NEONVM_FAULTS="crash_after=ungate@2"                # ... after the 2nd ungate
    NEONVM_FAULTS="stale_reads=0.3,drop_watch_events=0.2,conflict=0.2,seed=7"

Knobs:

* ``crash_after=<step>[@n]``: end the process with ``os._exit(137)`` (what SIGKILL looks
  like to a supervisor) right after the n-th successful ``<step>`` (default the first).
  Steps: ``plan``, ``create``, ``commit``, ``ungate``, ``cleanup`` (a pod deleted),
  ``restart``, ``drop_plan``, ``sync``, ``add_finalizer``, ``finalize``.
* ``stale_reads=p``: with probability p the cache answers with an older version of the
  VM or of its pod list than it holds.
* ``drop_watch_events=p``: with probability p a watch event is ignored entirely.
* ``conflict=p``: with probability p another writer bumps the VM's resourceVersion just
  before a status or finalizer write, so the write gets 409.
* ``seed=n``: seed of the random choices (default: random).
* ``crash_record=path``: when the crash fires, first write a JSON record of it to
  ``path`` (``{"fault": "crash_after", "step": ..., "occurrence": ..., "vm": ...,
  "exit_code": 137, "pid": ...}``), so a supervisor learns that the crash fault fired
  from a file, not from the log. It enables nothing by itself.

This module is the faults' vocabulary (the knobs, their parsing, the seeded
:class:`Faults` that rolls the dice, the crash record); it imports nothing of the
controller. Where the faults act is :mod:`neonvm.controller.fault_wiring`: wrappers put
around the production parts at the composition root, only when a knob is on.

The random source is per :class:`Faults` instance (seeded), never global; one instance
is shared by all the wrappers of a process.
"""

from __future__ import annotations

import json
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from neonvm.controller.actions import performed_actions

STEPS = tuple(action.step for action in performed_actions())
"""Every step ``crash_after`` may name: each performed action's own ``step``."""

ENV_VAR = "NEONVM_FAULTS"
CRASH_EXIT_CODE = 137


class FaultConfigError(ValueError):
    """A fault specification that cannot be parsed; the message names the bad part."""


@dataclass(frozen=True)
class FaultConfig:
    """Parsed fault knobs (all off by default)."""

    crash_after: str | None = None
    crash_occurrence: int = 1
    stale_reads: float = 0.0
    drop_watch_events: float = 0.0
    conflict: float = 0.0
    seed: int | None = None
    crash_record: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.crash_after or self.stale_reads or self.drop_watch_events
                    or self.conflict)

    @classmethod
    def parse(cls, specs: str | list[str] | tuple[str, ...] | None) -> FaultConfig:
        """Parse ``"k=v,k=v"`` (or several such strings); empty or None means no faults."""
        if specs is None:
            return cls()
        parts: list[str] = []
        for spec in [specs] if isinstance(specs, str) else list(specs):
            parts += [p.strip() for p in spec.replace(";", ",").split(",") if p.strip()]
        values: dict[str, object] = {}
        for part in parts:
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not sep:
                raise FaultConfigError(f"fault {part!r}: expected key=value")
            if key == "crash_after":
                step, _, nth = value.partition("@")
                if step not in STEPS:
                    raise FaultConfigError(
                        f"crash_after={value}: step must be one of {', '.join(STEPS)}")
                values["crash_after"] = step
                values["crash_occurrence"] = _positive_int(nth or "1", part)
            elif key in ("stale_reads", "drop_watch_events", "conflict"):
                values[key] = _probability(value, part)
            elif key == "seed":
                values["seed"] = _positive_int(value, part, allow_zero=True)
            elif key == "crash_record":
                if not value:
                    raise FaultConfigError(f"fault {part!r}: expected a file path")
                values["crash_record"] = value
            else:
                raise FaultConfigError(
                    f"unknown fault {key!r} (known: crash_after, stale_reads, "
                    f"drop_watch_events, conflict, seed, crash_record)")
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, extra: list[str] | tuple[str, ...] = ()) -> FaultConfig:
        """``$NEONVM_FAULTS`` plus any ``--fault`` values (flags win on the same key)."""
        return cls.parse([os.environ.get(ENV_VAR, ""), *extra])


def _probability(value: str, part: str) -> float:
    try:
        p = float(value)
    except ValueError:
        raise FaultConfigError(f"fault {part!r}: {value!r} is not a number") from None
    if not 0.0 <= p < 1.0:
        raise FaultConfigError(f"fault {part!r}: probability must be in [0, 1)")
    return p


def _positive_int(value: str, part: str, allow_zero: bool = False) -> int:
    try:
        n = int(value)
    except ValueError:
        raise FaultConfigError(f"fault {part!r}: {value!r} is not an integer") from None
    if n < (0 if allow_zero else 1):
        raise FaultConfigError(f"fault {part!r}: must be {'>= 0' if allow_zero else '>= 1'}")
    return n


@dataclass
class Faults:
    """The live fault injector of one controller process (thread-safe)."""

    config: FaultConfig = field(default_factory=FaultConfig)
    exit: Callable[[int], object] = os._exit
    """How to die; tests of this module pass a recorder instead of ``os._exit``."""

    def __post_init__(self) -> None:
        self._rng = random.Random(self.config.seed)
        self._lock = threading.Lock()
        self._occurrences: dict[str, int] = {}

    def _roll(self, p: float) -> bool:
        if p <= 0.0:
            return False
        with self._lock:
            return self._rng.random() < p

    def after(self, step: str, vm: str = "") -> None:
        """Called right after ``step`` succeeded; crashes here when configured to."""
        if self.config.crash_after != step:
            return
        with self._lock:
            n = self._occurrences.get(step, 0) + 1
            self._occurrences[step] = n
        if n == self.config.crash_occurrence:
            logger.bind(vm=vm, step=step).error(
                "fault injection: crashing right after {step} (exit {code})",
                step=step, code=CRASH_EXIT_CODE)
            if self.config.crash_record:
                try:
                    write_crash_record(Path(self.config.crash_record), {
                        "fault": "crash_after", "step": step, "occurrence": n, "vm": vm,
                        "exit_code": CRASH_EXIT_CODE, "pid": os.getpid()})
                except OSError as exc:  # the crash happens all the same
                    logger.error("fault injection: no crash record written: {err}", err=exc)
            self.exit(CRASH_EXIT_CODE)

    def serve_stale(self) -> bool:
        """Should this cache read answer with an older version?"""
        return self._roll(self.config.stale_reads)

    def drop_event(self) -> bool:
        """Should this watch event be ignored?"""
        return self._roll(self.config.drop_watch_events)

    def inject_conflict(self) -> bool:
        """Should another writer bump the object's resourceVersion before this write?"""
        return self._roll(self.config.conflict)

    def pick(self, n: int) -> int:
        """A seeded index in ``range(n)`` (which stale version to serve)."""
        with self._lock:
            return self._rng.randrange(n)


def write_crash_record(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` as JSON to ``path`` whole or not at all (a temporary file renamed
    into place), so a reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_crash_record(path: Path) -> dict[str, Any] | None:
    """The record :func:`write_crash_record` left at ``path``; None if there is none."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
