"""The state directory: a private node token, a journal that survives the process, and one agent
per directory."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from agents.daemon.state import JOURNAL_FILE, TOKEN_FILE, Journal, Outcome, StateDir, StateDirBusy

DONE = Outcome(
    "/api/v1/agent/commands/launch%3Aw0%3A1/report", {"ok": True, "error": "", "result": {"pids": [7]}}
)


def test_the_node_token_is_private_and_tied_to_url_and_host(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    state.open()
    try:
        state.write_token("http://cp:8000", "gpu-1", "dynarl_node_abc")
        assert stat.S_IMODE((tmp_path / "state" / TOKEN_FILE).stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
        assert state.read_token("http://cp:8000", "gpu-1") == "dynarl_node_abc"
        assert state.read_token("http://other:8000", "gpu-1") == ""
        assert state.read_token("http://cp:8000", "gpu-2") == ""
    finally:
        state.close()


def test_one_agent_per_state_directory(tmp_path: Path) -> None:
    first, second = StateDir(tmp_path), StateDir(tmp_path)
    first.open()
    try:
        with pytest.raises(StateDirBusy):
            second.open()
    finally:
        first.close()
    second.open()  # free again once the first let go
    second.close()


def test_the_journal_survives_the_process(tmp_path: Path) -> None:
    path = tmp_path / JOURNAL_FILE
    journal = Journal(path)
    journal.start("launch:w0:1", "launch_workers")
    assert journal.finish("launch:w0:1", "launch_workers", DONE)
    journal.start("m1:00:pause_workers@gpu-1#1", "migration_step")  # never finished: a crash
    journal.start("stop:w0:1:5", "stop_workers")
    journal.finish("stop:w0:1:5", "stop_workers", DONE)
    journal.mark_reported("stop:w0:1:5")
    journal.close()
    with open(path, "a") as out:
        out.write('{"event": "finished", "command_id": "cut-sh')  # a line cut short by a crash

    again = Journal(path)
    launch = again.get("launch:w0:1")
    assert launch is not None and launch.outcome == DONE and not launch.reported and not launch.interrupted
    step = again.get("m1:00:pause_workers@gpu-1#1")
    assert step is not None and step.interrupted and step.outcome is None
    assert [r.command_id for r in again.unreported()] == ["launch:w0:1"]
    assert again.get("cut-sh") is None
    again.close()


def test_the_first_outcome_stands(tmp_path: Path) -> None:
    journal = Journal(tmp_path / JOURNAL_FILE)
    failed = Outcome(DONE.report_path, {"ok": False, "error": "shutting down", "result": {}})
    assert journal.finish("c1", "migration_step", failed)
    assert not journal.finish("c1", "migration_step", DONE)
    journal.close()
    record = Journal(tmp_path / JOURNAL_FILE).get("c1")
    assert record is not None and record.outcome == failed
    events = [json.loads(line)["event"] for line in (tmp_path / JOURNAL_FILE).read_text().splitlines()]
    assert events == ["finished"]
