"""Reconciliation after registering: the backend ends up running what the control plane says this
node runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agents.daemon.loop import reconcile
from agents.daemon.session import ProtocolSettings, Registration
from tests.agent_daemon.recording import RecordingBackend, read_calls


def worker(name: str, job: int, state: str) -> dict[str, Any]:
    return {
        "worker": name,
        "job": job,
        "group": name.split("-")[1],
        "kind": "rollout",
        "state": state,
        "devices": [{"uid": f"gpu-1/gpu{name[-1]}", "index": int(name[-1]), "hardware": "H100"}],
        "tp": 1,
        "pp": 1,
    }


def test_extra_workers_stop_and_lost_running_workers_start_again(tmp_path: Path) -> None:
    record = tmp_path / "calls.jsonl"
    backend = RecordingBackend(host="gpu-1", record=str(record))
    backend.launch_workers({"job": 5, "spec": {}}, [worker("j5-rollout-w0", 5, "running")])
    backend.launch_workers({"job": 4, "spec": {}}, [worker("j4-rollout-w3", 4, "running")])  # its job ended
    registration = Registration(
        token="t",
        created=False,
        workers=[
            worker("j5-rollout-w0", 5, "running"),  # runs: kept
            worker("j5-rollout-w1", 5, "running"),  # died with the old agent: launched again
            worker("j6-rollout-w2", 6, "starting"),  # its launch command comes again: left alone
        ],
        jobs={"5": {"name": "math-small"}, "6": {"name": "agentic"}},
        settings=ProtocolSettings.from_reply({}, 1.0),
    )

    result = reconcile(backend, registration, {"j4-rollout-w3": 4})

    assert result.stopped == ["j4-rollout-w3"] and result.relaunched == ["j5-rollout-w1"]
    assert list(backend.running_workers()) == ["j5-rollout-w0", "j5-rollout-w1"]
    [stop] = read_calls(record, "stop_workers")
    assert (stop["job"], stop["workers"]) == (4, ["j4-rollout-w3"])
    relaunch = read_calls(record, "launch_workers")[-1]
    assert (relaunch["job"], relaunch["workers"], relaunch["spec_name"]) == (
        5,
        ["j5-rollout-w1"],
        "math-small",
    )


def test_nothing_to_do_when_the_backend_matches(tmp_path: Path) -> None:
    backend = RecordingBackend(host="gpu-1", record=str(tmp_path / "calls.jsonl"))
    backend.launch_workers({"job": 5, "spec": {}}, [worker("j5-rollout-w0", 5, "running")])
    registration = Registration(
        token="t",
        created=False,
        workers=[worker("j5-rollout-w0", 5, "running")],
        jobs={},
        settings=ProtocolSettings.from_reply({}, 1.0),
    )
    result = reconcile(backend, registration, {})
    assert result.stopped == [] and result.relaunched == []
    assert len(read_calls(tmp_path / "calls.jsonl", "launch_workers")) == 1
