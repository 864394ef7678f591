"""Heartbeats: the backend's telemetry, batched, at the control plane's interval.

Every interval the backend's telemetry (and NVML's device readings) go into a bounded buffer, and
the buffer goes out as one heartbeat (several when it holds more than ``CHUNK_SAMPLES``). While the
control plane is unreachable the buffer keeps growing, up to ``max_samples`` worker samples (the
oldest are dropped first), and sending backs off; when it answers again the backlog goes out.

Exactly once: the control plane treats a heartbeat whose ``sent_at`` is not newer than the last one
it accepted as a retransmission. A heartbeat that may have arrived (the connection broke after it
was sent) is therefore sent again unchanged, same ``sent_at``, until the control plane answers;
one that certainly did not arrive (refused connection, a 5xx) goes back into the buffer and leaves
in the next heartbeat, stamped afresh.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agents.backends.base import ExecutionBackend, Telemetry, WorkerReading
from agents.daemon.client import ApiError, Backoff, GaveUp, Unreachable
from agents.daemon.nvml import Nvml, device_readings
from agents.daemon.session import AgentSession, RegistrationRefused

log = logging.getLogger(__name__)
HEARTBEAT_PATH = "/api/v1/agent/heartbeat"
CHUNK_SAMPLES = 5_000
# The control plane drops samples older than an hour; sending them would only cost bandwidth.
MAX_SAMPLE_AGE_S = 3_600.0


def _unit(value: float) -> float:
    return min(1.0, max(0.0, value))


def sample_json(reading: WorkerReading) -> dict[str, Any] | None:
    """A worker reading as the protocol wants it, clamped into range; None when it is unusable.
    One bad reading from a backend must not get the whole heartbeat refused."""
    numbers = (
        reading.at,
        reading.utilisation,
        *(() if reading.progress is None else (reading.progress,)),
        *(() if reading.waiting is None else (reading.waiting,)),
    )
    if not reading.worker or not all(math.isfinite(n) for n in numbers):
        return None
    data = reading.to_json()
    data["utilisation"] = _unit(reading.utilisation)
    for key in ("queue_length", "in_flight", "tokens"):
        data[key] = max(0, int(data[key]))
    if reading.progress is not None:
        data["progress"] = _unit(reading.progress)
    if reading.waiting is not None:
        data["waiting"] = _unit(reading.waiting)
    return data


@dataclass
class Batch:
    samples: list[dict[str, Any]]
    devices: dict[int, dict[str, Any]]
    jobs: dict[str, dict[str, Any]]

    def body(self, sent_at: float) -> dict[str, Any]:
        body: dict[str, Any] = {
            "sent_at": sent_at,
            "devices": [self.devices[i] for i in sorted(self.devices)],
            # A sample cannot be stamped later than its heartbeat.
            "workers": [{**s, "at": min(s["at"], sent_at)} for s in self.samples],
        }
        if self.jobs:
            body["jobs"] = list(self.jobs.values())
        return body


def _job_key(entry: Mapping[str, Any]) -> str:
    return str(entry.get("job", id(entry)))


@dataclass
class TelemetryBuffer:
    """Telemetry not yet delivered. Worker samples are kept in order (bounded); devices and job
    progress keep only their latest values, as the control plane does."""

    max_samples: int
    samples: deque[dict[str, Any]] = field(default_factory=deque)
    devices: dict[int, dict[str, Any]] = field(default_factory=dict)
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    dropped: int = 0

    def add(self, telemetry: Telemetry, devices: Sequence[Mapping[str, Any]]) -> None:
        for reading in telemetry.workers:
            sample = sample_json(reading)
            if sample is None:
                log.warning("dropping an unusable reading of worker %r from the backend", reading.worker)
                continue
            self.samples.append(sample)
        overflow = len(self.samples) - self.max_samples
        if overflow > 0:
            for _ in range(overflow):
                self.samples.popleft()
            self.dropped += overflow
            log.warning(
                "telemetry buffer full: dropped the %d oldest worker samples (%d so far)",
                overflow,
                self.dropped,
            )
        for device in devices:
            self.devices[int(device["index"])] = dict(device)
        for entry in telemetry.jobs:
            if isinstance(entry, Mapping):
                self.jobs[_job_key(entry)] = dict(entry)

    def take(self, limit: int, now: float) -> Batch:
        """The oldest ``limit`` samples and the latest device and job values, out of the buffer."""
        oldest = now - MAX_SAMPLE_AGE_S
        while self.samples and self.samples[0]["at"] < oldest:
            self.samples.popleft()
            self.dropped += 1
        samples = [self.samples.popleft() for _ in range(min(limit, len(self.samples)))]
        batch = Batch(samples=samples, devices=self.devices, jobs=self.jobs)
        self.devices, self.jobs = {}, {}
        return batch

    def put_back(self, batch: Batch) -> None:
        """A batch that certainly did not arrive: back in front, unless newer values replaced it."""
        self.samples.extendleft(reversed(batch.samples))
        self.devices = {**batch.devices, **self.devices}
        self.jobs = {**batch.jobs, **self.jobs}

    def __len__(self) -> int:
        return len(self.samples)


class Heartbeater:
    """The heartbeat thread: collect every interval, send when the backoff allows."""

    def __init__(
        self,
        session: AgentSession,
        backend: ExecutionBackend,
        nvml: Nvml | None,
        registered: Sequence[int],
        buffer: TelemetryBuffer,
        backoff: Backoff,
        on_fatal: Callable[[BaseException], None],
        on_recovered: Callable[[], None] | None = None,
    ) -> None:
        self.session = session
        # The control plane had given this node up for lost: what it runs may no longer be what
        # the control plane expects (its migrations went on without it).
        self.on_recovered = on_recovered
        self.backend = backend
        self.nvml = nvml
        self.registered = list(registered)
        self.buffer = buffer
        self.backoff = backoff
        self.on_fatal = on_fatal
        self.stop = threading.Event()
        self.in_doubt: dict[str, Any] | None = None  # sent, answer lost: must go again unchanged
        self.last_sent_at = 0.0
        self.node_status = ""
        self.last_rejected: list[Any] = []
        self._send_lock = threading.Lock()  # one sender at a time (the thread, then the final flush)
        self._buffer_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # --- collecting -------------------------------------------------------------------------------

    def collect(self) -> None:
        try:
            telemetry = self.backend.telemetry()
        except Exception:
            log.exception("the backend failed to give its telemetry")
            telemetry = Telemetry()
        readings = self.nvml.read(self.registered) if self.nvml is not None else {}
        devices = device_readings(self.registered, telemetry.devices, readings)
        with self._buffer_lock:
            self.buffer.add(telemetry, devices)

    def buffered(self) -> int:
        with self._buffer_lock:
            return len(self.buffer)

    # --- sending ------------------------------------------------------------------------------------

    def _stamp(self) -> float:
        # Strictly increasing, or the control plane would take it for a retransmission.
        self.last_sent_at = max(time.time(), self.last_sent_at + 1e-3)
        return self.last_sent_at

    def _post(self, body: dict[str, Any]) -> None:
        reply = self.session.call("POST", HEARTBEAT_PATH, body=body, timeout_s=10.0)
        if not isinstance(reply, dict):
            return
        status = str(reply.get("node_status", ""))
        if status != self.node_status:
            log.info("control plane: node %s is %s", self.session.config.host, status)
            self.node_status = status
        if reply.get("recovered") is True and self.on_recovered is not None:
            log.warning("the control plane had marked node %s lost; reconciling", self.session.config.host)
            self.on_recovered()
        rejected = reply.get("rejected") or []
        if rejected != self.last_rejected:
            # Usual for a moment after a worker stops or moves; said once, not every beat.
            if rejected:
                log.info("the control plane rejects part of the heartbeats: %s", rejected[:5])
            self.last_rejected = rejected
        try:
            self.backend.observe_control(reply)
        except Exception:
            log.exception("the backend failed to take the heartbeat reply")

    def _deliver(self, body: dict[str, Any]) -> tuple[str, str]:
        """Post one heartbeat: ("sent", ""), ("dropped", why) when refused as bad (never retried),
        ("lost", why) when it certainly did not arrive, ("in_doubt", why) when it may have."""
        try:
            self._post(body)
        except Unreachable as exc:
            return ("in_doubt" if exc.maybe_delivered else "lost"), str(exc)
        except GaveUp as exc:  # stopping while registering again after a 401
            return "lost", str(exc)
        except ApiError as exc:
            if exc.retryable:
                return "lost", str(exc)  # a 5xx: the control plane rolled back what it had started
            log.error("the control plane refused a heartbeat (%s); dropping it", exc)
            return "dropped", str(exc)
        return "sent", ""

    def send_pending(self, lock_timeout_s: float = -1) -> bool:
        """Send what is buffered (at least one heartbeat, for liveness); False when the control
        plane could not be reached and the rest waits for the next try."""
        if not self._send_lock.acquire(timeout=lock_timeout_s):
            return False
        try:
            if self.in_doubt is not None:
                outcome, why = self._deliver(self.in_doubt)
                if outcome in ("lost", "in_doubt"):
                    log.warning("heartbeat retransmission failed (%s); %d samples wait", why, self.buffered())
                    return False
                self.in_doubt = None
            first = True
            while first or self.buffered():
                first = False
                sent_at = self._stamp()
                with self._buffer_lock:
                    batch = self.buffer.take(CHUNK_SAMPLES, sent_at)
                body = batch.body(sent_at)
                outcome, why = self._deliver(body)
                if outcome == "in_doubt":
                    self.in_doubt = body
                elif outcome == "lost":
                    with self._buffer_lock:
                        self.buffer.put_back(batch)
                if outcome in ("in_doubt", "lost"):
                    waiting = self.buffered() + (len(batch.samples) if outcome == "in_doubt" else 0)
                    log.warning("heartbeat failed (%s); %d worker samples wait", why, waiting)
                    return False
            return True
        finally:
            self._send_lock.release()

    def _run(self) -> None:
        failures = 0
        next_send = time.monotonic()
        try:
            while not self.stop.is_set():
                interval = self.session.settings.heartbeat_interval_s
                self.collect()
                if time.monotonic() >= next_send:
                    if self.send_pending():
                        failures = 0
                        next_send = time.monotonic()
                    else:
                        # Back off, but never past a fraction of the time after which the control
                        # plane calls the node lost: when it is back, it should hear from us soon.
                        cap = max(interval, min(self.backoff.max_s, self.session.settings.lost_after_s / 4))
                        next_send = time.monotonic() + min(cap, self.backoff.delay(failures))
                        failures += 1
                self.stop.wait(interval)
        except RegistrationRefused as exc:
            self.on_fatal(exc)
        except Exception as exc:
            log.exception("the heartbeat thread failed")
            self.on_fatal(exc)

    def stop_and_flush(self, deadline: float) -> bool:
        """Stop the thread, then send the last telemetry, trying until ``deadline`` (monotonic).
        Returns whether everything was delivered."""
        self.stop.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self.collect()
        failures = 0
        while True:
            try:
                if self.send_pending(lock_timeout_s=max(0.0, deadline - time.monotonic())):
                    return True
            except RegistrationRefused as exc:
                log.error("final heartbeat not sent: %s", exc)
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("final heartbeat not delivered; %d worker samples lost", self.buffered())
                return False
            time.sleep(min(remaining, self.backoff.delay(failures)))
            failures += 1
