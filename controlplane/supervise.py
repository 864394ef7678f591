"""Process supervision for the run command: a crashed process is restarted, the rest keep running.

Each program runs in its own session (so its process group can be signalled whole), its output
goes to our stdout with honcho's name-prefixed format, and when it exits it is started again after
an exponential backoff (``Backoff``): 1 s, 2 s, 4 s, … capped at a minute, forever, the count
starting over once a run has lasted ``reset_after_s``. Every crash and restart is logged with the
program's name, how it ended (exit code or signal) and when the next attempt comes. SIGINT or
SIGTERM stops it all: SIGTERM to every group, SIGKILL to what is left after its stop timeout (a
second signal does not wait). The states are kept in a JSON status file, replaced atomically on
every change, which /healthz reads (``read_status``).

Why a loop of our own rather than a supervisor package (both were weighed):

- supervisord (``-n``, ``autorestart``): the delay between tries of a process that dies within
  ``startsecs`` grows by one second per try and ends in FATAL after ``startretries``; one that dies
  later is restarted at once, with no delay. Exponential, capped, never-ending restarts would need
  an event listener driving its XML-RPC with timers of our own — the same policy code, plus a
  generated config file, a second daemon and a socket; its RPC reports no attempt count either.
- circus: a fixed ``retry_in`` and a ``max_retry``, no exponential backoff; brings pyzmq and tornado.
- honcho (used before): stops everything when one child exits, by design; only its output
  ``Printer`` is kept.

This module is plain Python (no Django), so the run command can import it before the environment
the children need is set.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from honcho.colour import get_colours
from honcho.printer import Message, Printer

log = logging.getLogger("dynarl.supervise")

RUNNING = "running"
RESTARTING = "restarting"  # exited; waiting out the backoff before the next start
STOPPING = "stopping"
STOPPED = "stopped"


@dataclass(frozen=True)
class Backoff:
    """Delay before restart attempt n (1-based): initial_s * factor**(n-1), at most max_s."""

    initial_s: float = 1.0
    factor: float = 2.0
    max_s: float = 60.0
    reset_after_s: float = 60.0  # a run at least this long counts as healthy: the next crash is attempt 1

    def delay(self, attempt: int) -> float:
        return float(min(self.max_s, self.initial_s * self.factor ** max(0, attempt - 1)))


@dataclass
class _Program:
    name: str
    argv: list[str]
    colour: str
    proc: subprocess.Popen[bytes] | None = None
    state: str = STOPPED
    started_at: float = 0.0  # monotonic
    restarts: int = 0  # starts after the first
    attempt: int = 0  # consecutive crashes of runs shorter than reset_after_s
    last_exit: str | None = None
    next_start: float | None = None  # monotonic
    next_start_wall: float | None = None  # the same moment as a Unix time, for the status file


def describe_exit(returncode: int) -> str:
    """``exit code 1`` or ``killed by SIGKILL``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class Supervisor:
    programs: Mapping[str, str]  # name -> command line
    env: Mapping[str, str]
    cwd: str
    status_path: Path
    backoff: Backoff = field(default_factory=Backoff)
    stop_timeout_s: float = 40.0  # above the agents' 30 s shutdown grace
    stop_timeouts: Mapping[str, float] = field(default_factory=dict)  # per program, where it differs
    poll_s: float = 0.2
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        colours = get_colours()
        self._programs = {
            name: _Program(name, shlex.split(command), next(colours))
            for name, command in self.programs.items()
        }
        self._printer = Printer(sys.stdout)
        self._printer.width = max([len(name) for name in self._programs] + [6])
        self._print_lock = threading.Lock()
        self._stop = threading.Event()
        self._hurry = threading.Event()
        self._signal: int | None = None
        self._readers: list[threading.Thread] = []

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        """Start every program and keep them running until SIGINT/SIGTERM; 128 + the signal then."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for program in self._programs.values():
                self._spawn(program)
            self._write_status()
            while not self._stop.is_set():
                now = self.clock()
                for program in self._programs.values():
                    self._tend(program, now)
                self._stop.wait(self.poll_s)
        finally:
            try:
                self._shutdown()  # after a signal, or an error of our own: nothing is left running
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                with contextlib.suppress(FileNotFoundError):
                    self.status_path.unlink()
        return 128 + self._signal if self._signal is not None else 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stop.is_set():
            self._hurry.set()
            return
        self._signal = signum
        log.info("%s received: stopping every process", signal.Signals(signum).name)
        self._stop.set()

    def _tend(self, program: _Program, now: float) -> None:
        if program.state == RUNNING and program.proc is not None:
            returncode = program.proc.poll()
            if returncode is None:
                if program.attempt and now - program.started_at >= self.backoff.reset_after_s:
                    program.attempt = 0  # it has stayed up: the next crash starts the backoff over
                    self._write_status()
                return
            self._on_exit(program, describe_exit(returncode), now)
        elif program.state == RESTARTING and program.next_start is not None and now >= program.next_start:
            program.restarts += 1
            self._spawn(program)
            if program.state == RUNNING and program.proc is not None:
                log.warning(
                    "%s restarted (pid %d, restart %d, attempt %d)",
                    program.name,
                    program.proc.pid,
                    program.restarts,
                    program.attempt,
                )
            self._write_status()

    def _on_exit(self, program: _Program, how: str, now: float) -> None:
        uptime = now - program.started_at
        self._kill_group(program, signal.SIGKILL)  # what it left behind, e.g. a pool's children
        program.attempt = 1 if uptime >= self.backoff.reset_after_s else program.attempt + 1
        delay = self.backoff.delay(program.attempt)
        program.state = RESTARTING
        program.last_exit = how
        program.next_start = now + delay
        program.next_start_wall = time.time() + delay
        log.warning(
            "%s exited (%s) after %.1f s; restart attempt %d in %g s",
            program.name,
            how,
            uptime,
            program.attempt,
            delay,
        )
        self._write_status()

    def _spawn(self, program: _Program) -> None:
        now = self.clock()
        try:
            proc = subprocess.Popen(
                program.argv,
                env=dict(self.env),
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, out of reach of the terminal's Ctrl-C
            )
        except OSError as exc:
            program.proc = None
            program.started_at = now
            self._on_exit(program, f"failed to start: {exc}", now)
            return
        program.proc = proc
        program.state = RUNNING
        program.started_at = now
        program.next_start = program.next_start_wall = None
        reader = threading.Thread(
            target=self._relay,
            args=(program.name, program.colour, proc),
            name=f"relay-{program.name}",
            daemon=True,
        )
        reader.start()
        self._readers = [r for r in self._readers if r.is_alive()] + [reader]
        if program.restarts == 0:
            log.info("%s started (pid %d)", program.name, proc.pid)

    def _relay(self, name: str, colour: str, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            message = Message(type="line", data=line, time=datetime.datetime.now(), name=name, colour=colour)
            with self._print_lock:
                self._printer.write(message)
        proc.stdout.close()

    # --- stopping ------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        stopping = []
        for program in self._programs.values():
            if program.state == RUNNING and program.proc is not None:
                program.state = STOPPING
                self._kill_group(program, signal.SIGTERM)
                stopping.append(program)
            else:
                program.state = STOPPED  # between restarts: nothing runs
        self._write_status()
        began = self.clock()
        alive = list(stopping)
        while alive:
            now = self.clock()
            for program in list(alive):
                assert program.proc is not None
                if program.proc.poll() is not None:
                    alive.remove(program)
                elif self._hurry.is_set() or now - began >= self.stop_timeouts.get(
                    program.name, self.stop_timeout_s
                ):
                    why = "a second signal" if self._hurry.is_set() else "did not stop in time"
                    log.warning("%s %s: SIGKILL", program.name, why)
                    self._kill_group(program, signal.SIGKILL)
                    alive.remove(program)
            if alive:
                time.sleep(self.poll_s)
        for program in stopping:
            assert program.proc is not None
            self._kill_group(program, signal.SIGKILL)  # the group too: children it left behind
            program.proc.wait()
            program.state = STOPPED
            log.info("%s stopped (%s)", program.name, describe_exit(program.proc.returncode))
        for reader in self._readers:
            reader.join(5)  # the rest of their output; the groups are gone, so the pipes are closed
        self._write_status()

    @staticmethod
    def _kill_group(program: _Program, sig: int) -> None:
        if program.proc is None:
            return
        # The group id is the leader's pid (start_new_session), valid while any member lives.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(program.proc.pid, sig)

    # --- status --------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = time.time()
        processes = {}
        for program in self._programs.values():
            entry: dict[str, Any] = {
                "state": program.state,
                "pid": program.proc.pid if program.proc is not None and program.state != RESTARTING else None,
                "restarts": program.restarts,
                "attempt": program.attempt,
                "last_exit": program.last_exit,
            }
            if program.state == RESTARTING and program.next_start_wall is not None:
                entry["next_attempt_at"] = program.next_start_wall
                entry["next_attempt_in_s"] = round(max(0.0, program.next_start_wall - now), 1)
            processes[program.name] = entry
        return {"supervisor_pid": os.getpid(), "updated_at": now, "processes": processes}

    def _write_status(self) -> None:
        # Written whole to a temporary file, then renamed over the old one: a reader never sees half.
        tmp = self.status_path.with_name(f".{self.status_path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.status(), indent=1))
            os.replace(tmp, self.status_path)
        except OSError as exc:  # the states are for /healthz; supervising goes on without them
            log.warning("could not write %s: %s", self.status_path, exc)


def read_status(path: Path) -> dict[str, Any]:
    """The status file a running supervisor keeps; raises OSError/ValueError when there is none."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("processes"), dict):
        raise ValueError(f"{path} is not a supervisor status file")
    return data
