"""The fault plan a drill arms: faults given at start hold for the process; a fault file is read
again before every step, each write arming its faults anew, and a bad one injects nothing."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from agents.backends.faults import FaultPlan, parse_faults


def write(path: Path, text: str) -> None:
    """Replace the file whole, as a drill does, so no step reads half of it."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    os.replace(partial, path)


def fired(plan: FaultPlan, *kinds: str) -> list[str]:
    return [str(fault) for kind in kinds if (fault := plan.next_for(kind)) is not None]


def test_faults_given_at_start_count_their_occurrences_over_the_process() -> None:
    plan = FaultPlan(parse_faults("crash:barrier@2,fail:switch"))
    assert fired(plan, "barrier", "switch", "barrier", "barrier", "switch") == [
        "fail:switch",
        "crash:barrier@2",
        "fail:switch",
    ]


def test_a_fault_file_arms_and_disarms_a_running_agent(tmp_path: Path) -> None:
    path = tmp_path / "faults"
    plan = FaultPlan((), file=path)
    assert fired(plan, "switch", "barrier") == []  # no file yet: nothing injected

    write(path, "# drill 1\ncrash:switch@1\n")
    assert fired(plan, "barrier", "switch", "switch") == ["crash:switch@1"]

    # Each write arms anew: the occurrence counts from the step after it, not from the start.
    write(path, "crash:switch@1, fail:drain\n")
    assert fired(plan, "drain", "switch", "switch", "drain") == ["fail:drain", "crash:switch@1", "fail:drain"]

    write(path, "")  # disarmed
    assert fired(plan, "switch", "drain") == []
    write(path, "crash:barrier@1")
    path.unlink()  # removed before any step read it: nothing armed
    assert fired(plan, "barrier") == []


def test_a_fault_file_that_cannot_be_parsed_injects_nothing_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "faults"
    write(path, "crash:switch@1\n")
    plan = FaultPlan(parse_faults("fail:drain@1"), file=path)
    write(path, "crash:swtich@1\n")
    with caplog.at_level(logging.ERROR):
        assert fired(plan, "switch", "drain") == ["fail:drain@1"]  # the start's faults still hold
    assert f"fault file {path} ignored" in caplog.text and "unknown step kind 'swtich'" in caplog.text
