"""The heartbeat's buffer and device readings: bounded, ordered, clamped; NVML wins where present."""

from __future__ import annotations

import math
import sys

import pytest

from agents.backends.base import DeviceReading, Telemetry, WorkerReading
from agents.daemon.heartbeat import TelemetryBuffer, sample_json
from agents.daemon.nvml import GpuProcess, NvmlReading, device_readings, open_nvml


def readings(*ats: float) -> Telemetry:
    return Telemetry(workers=[WorkerReading(worker="w0", at=at, utilisation=0.5, tokens=10) for at in ats])


def test_the_buffer_keeps_the_newest_samples_when_full() -> None:
    buffer = TelemetryBuffer(max_samples=3)
    buffer.add(readings(1.0, 2.0, 3.0, 4.0, 5.0), [])
    assert [s["at"] for s in buffer.samples] == [3.0, 4.0, 5.0] and buffer.dropped == 2


def test_a_batch_that_did_not_arrive_goes_back_in_front() -> None:
    buffer = TelemetryBuffer(max_samples=100)
    buffer.add(readings(1.0, 2.0, 3.0), [{"index": 0, "utilisation": 0.1, "memory_used_gb": 1.0}])
    batch = buffer.take(2, now=10.0)
    assert [s["at"] for s in batch.samples] == [1.0, 2.0]
    buffer.add(readings(4.0), [{"index": 0, "utilisation": 0.9, "memory_used_gb": 2.0}])
    buffer.put_back(batch)
    assert [s["at"] for s in buffer.samples] == [1.0, 2.0, 3.0, 4.0]
    assert buffer.devices[0]["utilisation"] == 0.9  # the newer reading wins
    body = buffer.take(10, now=3.5).body(sent_at=3.5)
    assert [w["at"] for w in body["workers"]] == [1.0, 2.0, 3.0, 3.5]  # never after sent_at


def test_samples_older_than_the_control_plane_keeps_are_not_sent() -> None:
    buffer = TelemetryBuffer(max_samples=100)
    buffer.add(readings(0.0, 5000.0), [])
    assert [s["at"] for s in buffer.take(10, now=5000.0).samples] == [5000.0]


def test_out_of_range_readings_are_clamped_or_dropped() -> None:
    clamped = sample_json(WorkerReading(worker="w", at=1.0, utilisation=1.7, queue_length=-3, progress=-0.2))
    assert clamped is not None
    assert (clamped["utilisation"], clamped["queue_length"], clamped["progress"]) == (1.0, 0, 0.0)
    assert sample_json(WorkerReading(worker="w", at=1.0, utilisation=math.nan)) is None
    assert sample_json(WorkerReading(worker="", at=1.0, utilisation=0.5)) is None


def test_nvml_readings_override_the_backends() -> None:
    backend = [
        DeviceReading(0, 0.2, 3.0, "process_cpu"),
        DeviceReading(1, 0.4, 5.0, "process_cpu"),
        DeviceReading(7, 0.9, 1.0, "process_cpu"),
    ]
    driver = {
        1: NvmlReading(index=1, utilisation=0.95, memory_used_gb=70.0, processes=(GpuProcess(4242, 69.5),))
    }
    devices = device_readings([0, 1, 2], backend, driver)
    assert devices == [
        {"index": 0, "utilisation": 0.2, "memory_used_gb": 3.0, "source": "process_cpu"},
        {
            "index": 1,
            "utilisation": 0.95,
            "memory_used_gb": 70.0,
            "source": "nvml",
            "processes": [{"pid": 4242, "memory_used_gb": 69.5}],
        },
    ]  # device 2 read by neither, device 7 not registered: left out


def test_without_the_bindings_readings_come_from_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # what a slim install without nvidia-ml-py has
    assert open_nvml() is None


def test_nvml_reads_the_devices() -> None:
    session = open_nvml()
    if session is None:
        pytest.skip("no NVML here (nvidia-ml-py not installed or no driver)")
    try:
        read = session.read(range(session.device_count))
        assert set(read) == set(range(session.device_count))
        assert all(0.0 <= r.utilisation <= 1.0 and r.memory_used_gb >= 0.0 for r in read.values())
    finally:
        session.close()
