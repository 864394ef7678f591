"""The ``sim`` execution backend: a simulated GPU host running RL workers in wall-clock time.

Each node agent with ``--backend sim`` drives one ``SimBackend``. It simulates the host's GPUs with
the core simulator's performance model (``scheduler/core/sim``), ``speed`` virtual seconds per wall
second, so workers produce realistic utilisation, queues, in-flight requests, tokens and progress,
and migration steps take their modelled time. A background thread keeps the simulation current;
``telemetry()`` returns what happened since the previous call. The model lives in ``host.py``
(virtual time only, deterministic; migration steps in ``steps.py``); this module maps wall time
onto it, serialises access, and injects faults (``faults.py``).

Agents of one job coordinate through the control plane only: they report their part of each
iteration in the heartbeat (``telemetry().jobs``) and learn the global picture from the heartbeat
reply (``observe_control``), both shaped by ``agents.services.progress``. See docs/sim-backend.md.

This module must not import Django: agents run on GPU hosts with a slim install.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from agents.backends.base import DeviceInfo, DeviceReading, StepFailed, Telemetry, WorkerReading
from agents.backends.faults import (
    CRASH_EXIT_CODE,
    SIM_FAULTS_ENV,
    Fault,
    FaultMode,
    FaultPlan,
    faults_from_env,
    parse_faults,
)
from agents.backends.once import OncePerKey
from agents.backends.sim.host import SimHost
from agents.backends.sim.model import SpecProblem
from agents.backends.sim.state import HostError, JobView
from agents.backends.sim.steps import HostSteps, StepPlan
from agents.backends.step_payload import StepContext, parse_step

log = logging.getLogger(__name__)

DEFAULT_SPEED = 10.0
DEFAULT_SAMPLE_INTERVAL_S = 0.5  # wall seconds between two telemetry samples of a worker
SPEC_WAIT_S = 15.0  # how long a step for a job unknown here waits for its spec in a heartbeat reply
WAIT_TOLERANCE_S = 1e-6  # below the resolution of an epoch timestamp in a float


class SimClock(Protocol):
    """Where the backend reads the time and waits; tests pass a ``ManualClock``."""

    def now(self) -> float: ...

    def sleep(self, seconds: float, interrupt: threading.Event) -> bool:
        """Wait ``seconds``; True when ``interrupt`` was set (the backend is closing)."""
        ...


class WallClock:
    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float, interrupt: threading.Event) -> bool:
        return interrupt.wait(max(0.0, seconds))


class ManualClock:
    """A clock that moves only when told to (``advance``) or when the backend waits (``sleep``
    moves it by the time waited): the simulation then runs deterministically in one thread."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._t = start
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._t

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._t += seconds

    def sleep(self, seconds: float, interrupt: threading.Event) -> bool:
        if interrupt.is_set():
            return True
        self.advance(max(0.0, seconds))
        return interrupt.is_set()


class SimBackend:
    """One simulated host. Thread-safe: the daemon may call it from several threads."""

    name = "sim"

    def __init__(
        self,
        host: str,
        *,
        gpus: int = 8,
        hardware: str = "H100",
        speed: float = DEFAULT_SPEED,
        seed: int = 0,
        faults: str | Iterable[str] | None = None,
        sample_interval_s: float = DEFAULT_SAMPLE_INTERVAL_S,
        clock: SimClock | None = None,
        background: bool | None = None,
        exit_process: Callable[[int], Any] = os._exit,
        spec_wait_s: float = SPEC_WAIT_S,
        trace_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """``faults``: fault specs (``"fail:switch,crash:barrier@2"``); None reads DYNARL_SIM_FAULTS.
        ``background``: run the thread that keeps the simulation current (default: with a wall
        clock yes, with a ManualClock no). ``trace_dir``: the directory job traces
        (``workload.trace``) are read from, the agent's ``--trace-dir``; None reads none."""
        # Options may arrive as text (flags, environment).
        gpus, speed, seed, sample_interval_s = int(gpus), float(speed), int(seed), float(sample_interval_s)
        if speed <= 0:
            raise ValueError("speed must be above 0")
        if sample_interval_s <= 0:
            raise ValueError("sample_interval_s must be above 0")
        self.host = host
        self.speed = float(speed)
        self.seed = seed
        self.gpus = gpus
        self._clock: SimClock = clock or WallClock()
        self._wall0 = self._clock.now()
        self._sim = SimHost(
            host,
            gpus=gpus,
            hardware=hardware,
            seed=seed,
            sample_every_s=sample_interval_s * self.speed,
            trace_dir=trace_dir,
        )
        self._steps = HostSteps(self._sim)
        self.hardware = self._sim.hardware
        self.faults = FaultPlan(faults_from_env(SIM_FAULTS_ENV) if faults is None else parse_faults(faults))
        self._exit = exit_process
        self._spec_wait_s = spec_wait_s
        self._lock = threading.RLock()
        self._views_changed = threading.Condition(self._lock)
        self._closing = threading.Event()
        self._once = OncePerKey()  # each (step, attempt) carried out once, by the first node asking
        run_thread = isinstance(self._clock, WallClock) if background is None else background
        self._thread: threading.Thread | None = None
        if run_thread:
            self._thread = threading.Thread(target=self._run, name=f"sim-{host}", daemon=True)
            self._thread.start()

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SimBackend:
        """From the agent's configuration: ``host`` (required), ``gpus``, ``hardware``, ``speed``,
        ``seed``, ``faults``, ``sample_interval_s``, ``trace_dir``."""
        known = {"host", "gpus", "hardware", "speed", "seed", "faults", "sample_interval_s", "trace_dir"}
        if unknown := sorted(set(config) - known):
            raise ValueError(f"unknown sim backend settings: {', '.join(unknown)}")
        if not config.get("host"):
            raise ValueError("the sim backend needs a host name")
        return cls(
            str(config["host"]),
            gpus=int(config.get("gpus", 8)),
            hardware=str(config.get("hardware", "H100")),
            speed=float(config.get("speed", DEFAULT_SPEED)),
            seed=int(config.get("seed", 0)),
            faults=config.get("faults"),
            sample_interval_s=float(config.get("sample_interval_s", DEFAULT_SAMPLE_INTERVAL_S)),
            trace_dir=None if config.get("trace_dir") is None else str(config["trace_dir"]),
        )

    # -- time ------------------------------------------------------------------------------------

    def virtual_now(self) -> float:
        """Virtual seconds since the backend started, as of the clock's current time."""
        return (self._clock.now() - self._wall0) * self.speed

    def _wall_of(self, virtual: float) -> float:
        return self._wall0 + virtual / self.speed

    def sync(self) -> None:
        """Bring the simulation up to the current time."""
        with self._lock:
            self._sim.advance_to(self.virtual_now())

    def _run(self) -> None:
        interval = min(0.2, self._sim.sample_every_s / self.speed / 2)
        while not self._closing.wait(interval):
            try:
                self.sync()
            except Exception:  # the simulation must never kill the agent's heartbeat
                log.exception("sim backend %s: advancing the simulation failed", self.host)

    def _wait_virtual(self, seconds: float) -> None:
        """Let ``seconds`` of virtual time pass; StepFailed when the backend closes meanwhile."""
        with self._lock:
            # From the simulation's present, which a previous step may have carried past the clock's.
            target = max(self._sim.now, self.virtual_now()) + max(0.0, seconds)
        while True:
            remaining = (target - self.virtual_now()) / self.speed
            if remaining <= WAIT_TOLERANCE_S:
                break
            if self._clock.sleep(remaining, self._closing):
                raise StepFailed(f"{self.host}: interrupted, the agent is shutting down")
        with self._lock:
            # The step ends at its modelled time even when the clock's resolution stops just short.
            self._sim.advance_to(max(target, self.virtual_now()))

    # -- ExecutionBackend ---------------------------------------------------------------------

    def inventory(self) -> Sequence[DeviceInfo]:
        return [
            DeviceInfo(index=d.index, hardware=d.hardware.name, memory_gb=d.hardware.hbm_gb)
            for d in self._sim.devices
        ]

    def launch_workers(self, job: Mapping[str, Any], workers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """``job``: the launch payload (``{"job": id, "spec": {...}, ...}``). Starts each worker on
        its devices; returns ``{"ok": all started, "workers": {name: {"ok", "error"}}}`` once the
        workers run (their modelled start time). Idempotent by worker name."""
        self._inject("launch_workers")
        job_id = job.get("job", job.get("id"))
        if isinstance(job_id, bool) or not isinstance(job_id, int):
            raise StepFailed("the launch payload has no integer 'job'")
        outcomes: dict[str, dict[str, Any]] = {}
        ready_at = 0.0
        with self._lock:
            self._sim.advance_to(self.virtual_now())
            try:
                host_job = self._sim.ensure_job(job_id, job.get("spec"))
            except (HostError, SpecProblem) as exc:
                host_job = None
                problem = str(exc)
            for entry in workers:
                name = str(entry.get("worker", ""))
                if host_job is None:
                    outcomes[name] = {"ok": False, "error": problem}
                    continue
                try:
                    devices = entry.get("devices", [])
                    indices = [int(d["index"]) for d in devices]
                    # Devices a colocated placement time-shares with other workers of the job.
                    shared = [
                        int(d["index"]) for d in devices if isinstance(d, Mapping) and d.get("shared") is True
                    ]
                    worker = self._sim.add_worker(
                        host_job, name, str(entry.get("group", "")), indices, member=True, shared=shared
                    )
                except (HostError, SpecProblem, KeyError, TypeError, ValueError) as exc:
                    outcomes[name] = {"ok": False, "error": str(exc)}
                    continue
                outcomes[name] = {"ok": True, "error": ""}
                ready_at = max(ready_at, worker.ready_at)
            wait = max(0.0, ready_at - self._sim.now)
        self._wait_virtual(wait)
        with self._lock:
            for name, outcome in outcomes.items():
                started = self._sim.workers.get(name)
                if outcome["ok"] and (started is None or not started.alive):
                    outcomes[name] = {"ok": False, "error": f"worker {name} did not start"}
        return {"ok": all(o["ok"] for o in outcomes.values()), "workers": outcomes}

    def stop_workers(
        self, job_id: int, worker_names: Sequence[str], *, redo_from_iteration: int | None = None
    ) -> dict[str, Any]:
        """Stop workers by name (names are cluster-wide; ``job_id`` only labels the call, 0 when
        the caller does not know it). Their unfinished work ends with them; with
        ``redo_from_iteration`` (the job is placed anew) so does this host's progress from it."""
        self._inject("stop_workers")
        with self._lock:
            self._sim.advance_to(self.virtual_now())
            stopped = {}
            for name in worker_names:
                self._sim.remove_worker(name, rehome=False)
                stopped[name] = {"ok": True, "error": ""}
            if redo_from_iteration is not None:
                self._sim.redo_from(job_id, redo_from_iteration)
        return {"ok": True, "workers": stopped}

    def execute_step(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        ctx = parse_step(payload)
        return self._once.run((ctx.step_id, ctx.attempt), lambda: self._execute(ctx), failures=(StepFailed,))

    def telemetry(self) -> Telemetry:
        with self._lock:
            self._sim.advance_to(self.virtual_now())
            devices = [
                DeviceReading(index=index, utilisation=utilisation, memory_used_gb=memory, source="simulated")
                for index, utilisation, memory in self._sim.telemetry.device_readings()
            ]
            workers = [
                WorkerReading(
                    worker=s.worker,
                    at=round(self._wall_of(s.at), 6),
                    utilisation=s.utilisation,
                    queue_length=s.queue_length,
                    in_flight=s.in_flight,
                    tokens=s.tokens,
                    progress=s.progress,
                    turn=None if s.turn is None else s.turn.value,
                )
                for s in self._sim.telemetry.drain()
            ]
            return Telemetry(devices=devices, workers=workers, jobs=self._sim.telemetry.progress_entries())

    def observe_control(self, reply: Mapping[str, Any]) -> None:
        """The heartbeat reply, or just its ``jobs`` section
        (``agents.services.progress.reply_for``). The registration reply works too: its ``jobs``
        (job id -> spec) are kept for later launches."""
        section = reply.get("jobs", reply) if isinstance(reply, Mapping) else {}
        if not isinstance(section, Mapping):
            return
        views: dict[int, JobView] = {}
        specs: dict[int, Mapping[str, Any]] = {}
        for key, data in section.items():
            if not str(key).isdigit() or not isinstance(data, Mapping):
                continue
            if "components" in data and "iteration" not in data:
                specs[int(key)] = data  # the registration reply maps job ids to their specs
                continue
            try:
                views[int(key)] = JobView.from_json(data)
            except (TypeError, ValueError, AttributeError):
                log.warning("sim backend %s: ignoring a malformed view of job %s", self.host, key)
        with self._views_changed:
            self._sim.advance_to(self.virtual_now())
            self._sim.specs.update(specs)
            if views or not specs:
                self._sim.observe(views)
            self._views_changed.notify_all()

    def running_workers(self) -> Sequence[str]:
        """Workers alive on this host that the control plane knows. Workers a migration started
        count from their switch on: until then the control plane lists none of them, and
        reconciling against its list must not stop them mid-migration."""
        with self._lock:
            return sorted(
                name
                for name, worker in self._sim.workers.items()
                if worker.alive and (worker.member or not worker.joining)
            )

    def close(self) -> None:
        self._closing.set()
        with self._views_changed:
            self._views_changed.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # -- inspection (tests, the docs' examples) -------------------------------------------------

    def members(self, job_id: int, group: str) -> list[str]:
        """This host's workers that belong to ``group``'s membership now."""
        with self._lock:
            return sorted(
                w.name
                for w in self._sim.workers.values()
                if w.job_id == job_id and w.group == group and w.member
            )

    def worker_state(self, name: str) -> str | None:
        with self._lock:
            worker = self._sim.workers.get(name)
            return worker.state.value if worker is not None else None

    @property
    def simulation(self) -> SimHost:
        """The underlying simulation (read it under ``lock`` only)."""
        return self._sim

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    # -- steps ------------------------------------------------------------------------------------

    def _inject(self, kind: str) -> Fault | None:
        fault = self.faults.next_for(kind)
        if fault is None:
            return None
        if fault.mode is FaultMode.FAIL:
            raise StepFailed(f"{self.host}: injected fault {fault}")
        if fault.mode is FaultMode.HANG:
            log.warning("sim backend %s: injected fault %s, hanging until closed", self.host, fault)
            self._closing.wait()
            raise StepFailed(f"{self.host}: injected fault {fault}, interrupted by shutdown")
        return fault  # a crash happens mid-step, once the step has begun

    def _execute(self, ctx: StepContext) -> dict[str, Any]:
        fault = self._inject(ctx.kind)
        self._await_job(ctx)
        with self._lock:
            self._sim.advance_to(self.virtual_now())
            try:
                plan: StepPlan = self._steps.begin(ctx)
            except (HostError, SpecProblem) as exc:
                raise StepFailed(f"{self.host}: {ctx.kind}: {exc}") from exc
        if fault is not None and fault.mode is FaultMode.CRASH:
            self._wait_virtual(plan.duration_s / 2)
            log.error("sim backend %s: injected fault %s, exiting with %s", self.host, fault, CRASH_EXIT_CODE)
            logging.shutdown()
            self._exit(CRASH_EXIT_CODE)
            raise StepFailed(f"{self.host}: injected fault {fault}")  # only reached if exit returned
        self._wait_virtual(plan.duration_s)
        with self._lock:
            self._sim.advance_to(self.virtual_now())
            try:
                return plan.finish()
            except (HostError, SpecProblem) as exc:
                raise StepFailed(f"{self.host}: {ctx.kind}: {exc}") from exc

    def _await_job(self, ctx: StepContext) -> None:
        """A step that starts workers of a job this host has never run needs the job's spec,
        which the next heartbeat reply carries; wait for it (bounded)."""
        if ctx.kind != "start_workers":
            return
        if ctx.spec is not None:
            with self._lock:
                try:
                    self._sim.ensure_job(ctx.job_id, ctx.spec)
                except SpecProblem as exc:
                    raise StepFailed(f"{self.host}: {exc}") from exc
            return
        deadline = time.monotonic() + self._spec_wait_s
        with self._views_changed:
            while not self._sim.knows_job(ctx.job_id):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closing.is_set():
                    raise StepFailed(f"{self.host}: job {ctx.job_id} is unknown here and no spec arrived")
                self._views_changed.wait(timeout=min(remaining, 0.5))
            view = self._sim.pending_views.get(ctx.job_id)
            self._sim.ensure_job(ctx.job_id, view.spec if view is not None else None)
