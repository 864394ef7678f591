"""Fault injection: make a migration step (or a launch or stop) of a given kind fail, hang or kill
the agent, to test that every failure ends in a whole job.

A fault is written ``<mode>:<kind>`` or ``<mode>:<kind>@<n>``:

- ``fail:switch`` -- every ``switch`` step raises ``StepFailed`` (nothing of it is applied);
- ``hang:transfer_state`` -- the step never returns until the agent stops;
- ``crash:barrier@2`` -- the second ``barrier`` step kills the agent process (``os._exit(70)``)
  after the step's effects and before its outcome is recorded: the control plane learns of it
  only from the restarted agent (which reports it interrupted, or carries it out again where the
  backend's steps outlive the agent).

``kind`` is a migration step kind (``scheduler.core.migration.StepKind``) or ``launch_workers`` /
``stop_workers``. Occurrences are counted per kind over one agent process; a replayed step (same
step id and attempt) is not a new occurrence. Two places read fault lists: the sim backend
(``DYNARL_SIM_FAULTS``; it crashes half-way through a step's modelled time, docs/sim-backend.md)
and the agent daemon for any backend (``--faults`` / ``DYNARL_AGENT_FAULTS``, migration steps).

The agent daemon also takes a fault file (``--faults-file`` / ``DYNARL_AGENT_FAULTS_FILE``): the
same list, one or more per line or comma-separated, read again before every step, so a drill arms
and disarms a running agent without restarting it. Each write of the file arms its faults anew:
their occurrences count from the first step after it. A missing or empty file injects nothing; a
file that cannot be parsed injects nothing either, and says so in the log.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from scheduler.core.migration import StepKind

SIM_FAULTS_ENV = "DYNARL_SIM_FAULTS"
AGENT_FAULTS_ENV = "DYNARL_AGENT_FAULTS"
AGENT_FAULTS_FILE_ENV = "DYNARL_AGENT_FAULTS_FILE"
CRASH_EXIT_CODE = 70
COMMAND_KINDS = ("launch_workers", "stop_workers")
FAULT_KINDS = frozenset({k.value for k in StepKind} | set(COMMAND_KINDS))

log = logging.getLogger(__name__)


class FaultMode(StrEnum):
    FAIL = "fail"
    HANG = "hang"
    CRASH = "crash"


class FaultSpecError(ValueError):
    """A fault specification that cannot be understood; the message quotes it."""


# What reading a fault file can raise: a bad fault, an unreadable file, or one that is not text.
FAULT_FILE_ERRORS = (FaultSpecError, OSError, UnicodeDecodeError)


@dataclass(frozen=True)
class Fault:
    mode: FaultMode
    kind: str
    occurrence: int | None = None  # None: every occurrence

    def __str__(self) -> str:
        suffix = f"@{self.occurrence}" if self.occurrence is not None else ""
        return f"{self.mode.value}:{self.kind}{suffix}"


def parse_fault(text: str) -> Fault:
    raw = text.strip()
    mode_text, sep, rest = raw.partition(":")
    if not sep:
        raise FaultSpecError(f"fault {raw!r}: expected <mode>:<kind>[@<n>]")
    try:
        mode = FaultMode(mode_text.strip())
    except ValueError:
        modes = ", ".join(m.value for m in FaultMode)
        raise FaultSpecError(f"fault {raw!r}: mode must be one of {modes}") from None
    kind, at, count = rest.strip().partition("@")
    if kind not in FAULT_KINDS:
        raise FaultSpecError(f"fault {raw!r}: unknown step kind {kind!r}")
    occurrence: int | None = None
    if at:
        if not count.isdigit() or int(count) < 1:
            raise FaultSpecError(f"fault {raw!r}: the occurrence after '@' must be an integer >= 1")
        occurrence = int(count)
    return Fault(mode=mode, kind=kind, occurrence=occurrence)


def parse_faults(spec: str | Iterable[str] | None) -> tuple[Fault, ...]:
    """``"fail:switch,crash:barrier@2"`` or a list of such items; empty items are ignored."""
    if spec is None:
        return ()
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    return tuple(parse_fault(item) for item in items if item.strip())


def read_fault_file(path: Path) -> tuple[Fault, ...]:
    """The faults listed in ``path`` (comma- or line-separated; ``#`` starts a comment); none if
    it does not exist."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return ()
    items = (item for line in text.splitlines() for item in line.partition("#")[0].split(","))
    return parse_faults(list(items))


def faults_from_env(variable: str, environ: Mapping[str, str] | None = None) -> tuple[Fault, ...]:
    env = os.environ if environ is None else environ
    return parse_faults(env.get(variable, ""))


class FaultPlan:
    """Decides, for each execution of a kind, which fault (if any) applies. Thread-safe.

    ``faults`` hold for the whole process; ``file``'s are read again before every decision and
    counted from the file's latest write (see the module's docstring)."""

    def __init__(self, faults: Iterable[Fault], *, file: Path | None = None) -> None:
        self.faults = tuple(faults)
        self.file = file
        self._seen: dict[str, int] = {}
        self._armed: tuple[Fault, ...] = ()  # the file's faults, as of its latest write
        self._armed_seen: dict[str, int] = {}
        self._file_version: tuple[int, int, int] | None = None  # (inode, mtime ns, size) read
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self.faults) or self.file is not None

    def next_for(self, kind: str) -> Fault | None:
        """Count one more execution of ``kind`` and return the fault it triggers."""
        with self._lock:
            self._reread_file()
            # Both lists count every execution, whichever fires.
            given = self._count(self.faults, self._seen, kind)
            armed = self._count(self._armed, self._armed_seen, kind)
            return given or armed

    @staticmethod
    def _count(faults: tuple[Fault, ...], seen: dict[str, int], kind: str) -> Fault | None:
        count = seen.get(kind, 0) + 1
        seen[kind] = count
        for fault in faults:
            if fault.kind == kind and (fault.occurrence is None or fault.occurrence == count):
                return fault
        return None

    def _reread_file(self) -> None:
        if self.file is None:
            return
        try:
            stat = self.file.stat()
        except FileNotFoundError:
            version = None
        else:
            version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if version == self._file_version:
            return
        self._file_version = version
        self._armed_seen = {}
        try:
            self._armed = read_fault_file(self.file)
        except FAULT_FILE_ERRORS as exc:
            self._armed = ()
            log.error("fault file %s ignored: %s", self.file, exc)
            return
        if self._armed:
            log.warning("fault drill armed from %s: %s", self.file, ", ".join(map(str, self._armed)))
        elif version is not None:
            log.warning("fault drill disarmed: %s lists no fault", self.file)
