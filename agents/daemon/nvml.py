"""Device readings from NVML where a GPU driver is present.

``pynvml`` (the ``nvidia-ml-py`` package, in the ``ray`` extra) is optional: without it, or when
``nvmlInit()`` fails (no driver, no GPU), :func:`open_nvml` returns None and the backend's own
device readings are sent. With it, per-device utilisation, memory and compute processes come from
the driver and override what the backend says about those devices.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agents.backends.base import DeviceReading

log = logging.getLogger(__name__)
GIB = float(1 << 30)


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    memory_used_gb: float

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "memory_used_gb": round(self.memory_used_gb, 3)}


@dataclass(frozen=True)
class NvmlReading:
    index: int
    utilisation: float  # 0..1, the driver's last sample period
    memory_used_gb: float  # GiB
    processes: tuple[GpuProcess, ...] = field(default_factory=tuple)


class Nvml:
    """An initialised NVML session; ``read()`` never raises (a failing device is left out)."""

    def __init__(self, module: Any) -> None:
        self._nvml = module
        self._lock = threading.Lock()
        self.device_count = int(module.nvmlDeviceGetCount())

    def _read_one(self, index: int) -> NvmlReading:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        rates = nvml.nvmlDeviceGetUtilizationRates(handle)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        processes = []
        try:
            running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except nvml.NVMLError:
            running = []
        for process in running:
            used = getattr(process, "usedGpuMemory", None)
            processes.append(GpuProcess(pid=int(process.pid), memory_used_gb=(used or 0) / GIB))
        return NvmlReading(
            index=index,
            utilisation=min(1.0, max(0.0, float(rates.gpu) / 100.0)),
            memory_used_gb=float(memory.used) / GIB,
            processes=tuple(processes),
        )

    def read(self, indices: Iterable[int]) -> dict[int, NvmlReading]:
        readings: dict[int, NvmlReading] = {}
        with self._lock:
            for index in indices:
                if not 0 <= index < self.device_count:
                    continue
                try:
                    readings[index] = self._read_one(index)
                except self._nvml.NVMLError as exc:
                    log.warning("NVML could not read device %d: %s", index, exc)
        return readings

    def close(self) -> None:
        with self._lock, contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()


def open_nvml() -> Nvml | None:
    """An NVML session, or None where the bindings or the driver are missing."""
    try:
        module = importlib.import_module("pynvml")
    except ImportError:
        log.info("NVML bindings (nvidia-ml-py) not installed; device readings come from the backend")
        return None
    try:
        module.nvmlInit()
        session = Nvml(module)
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: no usable driver
        log.info("NVML unavailable (%s); device readings come from the backend", exc)
        return None
    log.info("NVML: %d devices; device readings come from the driver", session.device_count)
    return session


def device_readings(
    registered: Sequence[int],
    backend: Sequence[DeviceReading],
    nvml: Mapping[int, NvmlReading],
) -> list[dict[str, Any]]:
    """The heartbeat's ``devices``: for each registered device, NVML's reading where there is one
    (with its processes), else the backend's; devices neither reads are left out."""
    from_backend = {reading.index: reading for reading in backend}
    devices = []
    for index in registered:
        driver = nvml.get(index)
        if driver is not None:
            devices.append(
                {
                    "index": index,
                    "utilisation": driver.utilisation,
                    "memory_used_gb": round(driver.memory_used_gb, 3),
                    "source": "nvml",
                    "processes": [p.to_json() for p in driver.processes],
                }
            )
        elif index in from_backend:
            devices.append(from_backend[index].to_json())
    return devices
