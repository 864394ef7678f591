"""RecordingBackend: the execution backend these tests run the agent daemon with.

It stands in for GPU work only: it runs nothing, records every call it gets (one JSON line per
call, with the agent process's pid) in the file named by its ``record`` option, and reports its
devices and launched workers idle. Options (``--backend-option key=value``):

- ``record``: the JSON-lines file the calls go to (required);
- ``gpus``, ``hardware``: the inventory it registers;
- ``hold_launch`` / ``hold_steps``: a file path; launch_workers / execute_step wait until that
  file exists (or the backend is closed), so a test can act while a command is in hand;
- ``offers``: the job backends it says it runs (default: its name, ``sim``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agents.backends.base import DeviceInfo, DeviceReading, StepFailed, Telemetry, WorkerReading


class RecordingBackend:
    # The control plane knows hosts as 'sim' or 'ray'; this one registers as a simulated host.
    name = "sim"
    offers: tuple[str, ...]  # set only when the option is given

    def __init__(
        self,
        *,
        host: str,
        record: str,
        gpus: int = 4,
        hardware: str = "H100",
        hold_launch: str = "",
        hold_steps: str = "",
        offers: Sequence[str] = (),
    ) -> None:
        if offers:
            self.offers = tuple(offers)
        self.host = host
        self.record_path = Path(record)
        self.gpus = gpus
        self.hardware = hardware
        self.hold_launch = Path(hold_launch) if hold_launch else None
        self.hold_steps = Path(hold_steps) if hold_steps else None
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self._workers: dict[str, int] = {}  # name -> job id

    def _record(self, call: str, **data: Any) -> None:
        line = json.dumps({"call": call, "pid": os.getpid(), "at": time.time(), **data}) + "\n"
        with self._lock, open(self.record_path, "a", encoding="utf-8") as out:
            out.write(line)

    def _hold(self, gate: Path | None) -> None:
        while gate is not None and not gate.exists():
            if self.closed.wait(0.05):
                raise StepFailed("the backend closed while the command was held")

    def inventory(self) -> Sequence[DeviceInfo]:
        return [DeviceInfo(index=i, hardware=self.hardware, memory_gb=80.0) for i in range(self.gpus)]

    def launch_workers(self, job: Mapping[str, Any], workers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        names = [str(w["worker"]) for w in workers]
        self._record(
            "launch_workers", job=job.get("job"), workers=names, spec_name=job.get("spec", {}).get("name")
        )
        self._hold(self.hold_launch)
        with self._lock:
            for name in names:
                self._workers[name] = int(job.get("job", 0))
        return {"launched": names}

    def stop_workers(
        self, job_id: int, worker_names: Sequence[str], *, redo_from_iteration: int | None = None
    ) -> dict[str, Any]:
        self._record("stop_workers", job=job_id, workers=list(worker_names), redo_from=redo_from_iteration)
        with self._lock:
            for name in worker_names:
                self._workers.pop(name, None)
        return {"stopped": list(worker_names)}

    def execute_step(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        step = payload["step"]
        self._record(
            "execute_step", step_id=step["step_id"], kind=step["kind"], attempt=payload.get("attempt")
        )
        self._hold(self.hold_steps)
        self._record("step_done", step_id=step["step_id"], attempt=payload.get("attempt"))
        return {"step": step["step_id"]}

    def telemetry(self) -> Telemetry:
        now = time.time()
        with self._lock:
            names = sorted(self._workers)
        self._record("telemetry", workers=names)
        return Telemetry(
            devices=[
                DeviceReading(index=i, utilisation=0.0, memory_used_gb=0.0, source="simulated")
                for i in range(self.gpus)
            ],
            workers=[WorkerReading(worker=name, at=now, utilisation=0.0) for name in names],
        )

    def observe_control(self, reply: Mapping[str, Any]) -> None:
        self._record(
            "observe_control", node_status=reply.get("node_status"), duplicate=reply.get("duplicate")
        )

    def running_workers(self) -> Sequence[str]:
        with self._lock:
            return sorted(self._workers)

    def close(self) -> None:
        self._record("close")
        self.closed.set()


def read_calls(path: Path, call: str | None = None) -> list[dict[str, Any]]:
    """The calls recorded so far (a line cut short by a killed agent is left out)."""
    if not path.exists():
        return []
    calls = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if call is None or entry["call"] == call:
            calls.append(entry)
    return calls
