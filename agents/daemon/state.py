"""The agent's state directory: its node token and its command journal.

- ``node-token.json`` (mode 0600): the node token the control plane issued at the last
  registration, with the URL and host it belongs to.
- ``journal.jsonl``: append-only JSON lines, one per event of a command: ``started`` (before the
  backend is called), ``finished`` (the outcome, written before it is reported) and ``reported``
  (the control plane has it). A command redelivered after a crash or a lost report is found here
  and its recorded outcome is reported again instead of running it twice.
- ``agent.lock``: held (flock) while an agent runs, so two agents never share one journal.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

TOKEN_FILE = "node-token.json"
JOURNAL_FILE = "journal.jsonl"
LOCK_FILE = "agent.lock"
# The journal is rewritten at start-up once it holds this many lines, keeping the newest commands:
# the control plane never redelivers a command that old.
COMPACT_AT_LINES = 50_000
KEEP_COMMANDS = 10_000


class StateDirBusy(RuntimeError):
    """Another agent process holds this state directory."""


@dataclass(frozen=True)
class Outcome:
    """What the agent reports for one command: the report's path and body."""

    report_path: str
    body: dict[str, Any]

    @property
    def ok(self) -> bool:
        return bool(self.body.get("ok"))

    def to_json(self) -> dict[str, Any]:
        return {"report_path": self.report_path, "body": self.body}

    @classmethod
    def from_json(cls, data: Any) -> Outcome:
        if not isinstance(data, dict) or not isinstance(data.get("report_path"), str):
            raise ValueError("not an outcome")
        body = data.get("body")
        if not isinstance(body, dict):
            raise ValueError("not an outcome")
        return cls(report_path=data["report_path"], body=body)


@dataclass
class CommandRecord:
    command_id: str
    kind: str
    started: bool = False
    outcome: Outcome | None = None
    reported: bool = False
    # Started by an earlier agent process that stopped before the outcome was known.
    interrupted: bool = False


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable by its owner only."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """Finished commands and their outcomes, durable before they are reported. Thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._records: dict[str, CommandRecord] = {}
        self._closed = False
        lines = self._load()
        if lines >= COMPACT_AT_LINES:
            self._compact()
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def _load(self) -> int:
        if not self.path.exists():
            return 0
        lines = 0
        with open(self.path, encoding="utf-8", errors="replace") as source:
            for line in source:
                lines += 1
                try:
                    event = json.loads(line)
                    self._apply(event)
                except (ValueError, KeyError, TypeError):
                    # A line cut short by a crash mid-write: what it would have said never
                    # happened as far as the control plane knows.
                    log.warning("journal %s: skipping unreadable line %d", self.path, lines)
        for record in self._records.values():
            record.interrupted = record.started and record.outcome is None
        return lines

    def _apply(self, event: dict[str, Any]) -> None:
        command_id = event["command_id"]
        if not isinstance(command_id, str):
            raise TypeError("command_id")
        record = self._records.get(command_id)
        if record is None:
            record = self._records[command_id] = CommandRecord(command_id, str(event.get("kind", "")))
        else:
            # Keep insertion order = recency, for compaction.
            self._records[command_id] = self._records.pop(command_id)
        what = event["event"]
        if what == "started":
            record.started = True
        elif what == "finished":
            record.outcome = Outcome.from_json(event["outcome"])
        elif what == "reported":
            record.reported = True
        else:
            raise ValueError(what)

    @staticmethod
    def _events(record: CommandRecord) -> Iterator[dict[str, Any]]:
        base = {"command_id": record.command_id, "kind": record.kind}
        if record.started:
            yield {**base, "event": "started"}
        if record.outcome is not None:
            yield {**base, "event": "finished", "outcome": record.outcome.to_json()}
        if record.reported:
            yield {**base, "event": "reported"}

    def _compact(self) -> None:
        keep = list(self._records.values())[-KEEP_COMMANDS:]
        self._records = {r.command_id: r for r in keep}
        text = "".join(json.dumps(e, separators=(",", ":")) + "\n" for r in keep for e in self._events(r))
        _write_private(self.path, text)
        log.info("journal %s compacted to its %d newest commands", self.path, len(keep))

    def _append(self, event: dict[str, Any]) -> None:
        if self._closed:
            raise RuntimeError(f"journal {self.path} is closed")
        event = {**event, "at": time.time()}
        self._file.write(json.dumps(event, separators=(",", ":")) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def get(self, command_id: str) -> CommandRecord | None:
        with self._lock:
            return self._records.get(command_id)

    def start(self, command_id: str, kind: str) -> None:
        with self._lock:
            record = self._records.setdefault(command_id, CommandRecord(command_id, kind))
            record.started = True
            record.interrupted = False
            self._append({"event": "started", "command_id": command_id, "kind": kind})

    def finish(self, command_id: str, kind: str, outcome: Outcome) -> bool:
        """Record the outcome; False (and nothing written) when one is recorded already: the first
        outcome stands (e.g. the shutdown reported a step failed while the backend still ran it)."""
        with self._lock:
            record = self._records.setdefault(command_id, CommandRecord(command_id, kind))
            if record.outcome is not None or self._closed:
                return False
            self._append(
                {"event": "finished", "command_id": command_id, "kind": kind, "outcome": outcome.to_json()}
            )
            record.outcome = outcome
            record.interrupted = False
            return True

    def mark_reported(self, command_id: str) -> None:
        with self._lock:
            record = self._records.get(command_id)
            if record is None or record.reported or self._closed:
                return
            self._append({"event": "reported", "command_id": command_id, "kind": record.kind})
            record.reported = True

    def unreported(self) -> list[CommandRecord]:
        """Finished commands whose outcome the control plane may not have, oldest first."""
        with self._lock:
            return [r for r in self._records.values() if r.outcome is not None and not r.reported]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._file.close()


class StateDir:
    """The agent's directory; ``open()`` takes its lock and loads the journal."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_file: IO[str] | None = None
        self._journal: Journal | None = None

    def open(self) -> None:
        if not self.path.exists():
            self.path.mkdir(parents=True, mode=0o700)
        lock = open(self.path / LOCK_FILE, "a+", encoding="utf-8")  # noqa: SIM115 - held until close()
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            lock.close()
            raise StateDirBusy(f"another agent is running with state directory {self.path}") from exc
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        self._lock_file = lock
        self._journal = Journal(self.path / JOURNAL_FILE)

    @property
    def journal(self) -> Journal:
        if self._journal is None:
            raise RuntimeError("the state directory is not open")
        return self._journal

    def read_token(self, url: str, host: str) -> str:
        """The stored node token for this control plane and host ("" when there is none)."""
        try:
            data = json.loads((self.path / TOKEN_FILE).read_text())
        except (OSError, ValueError):
            return ""
        if not isinstance(data, dict) or data.get("url") != url or data.get("host") != host:
            return ""
        token = data.get("token")
        return token if isinstance(token, str) else ""

    def write_token(self, url: str, host: str, token: str) -> None:
        _write_private(self.path / TOKEN_FILE, json.dumps({"url": url, "host": host, "token": token}) + "\n")

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        if self._lock_file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None
