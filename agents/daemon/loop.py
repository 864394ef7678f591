"""The agent's life: start, register and reconcile, heartbeat and command threads, shutdown.

Threads: the main thread waits for a signal and runs the shutdown; ``heartbeat`` sends telemetry;
``commands`` long-polls and hands each command to a thread of its own (agents.daemon.commands).
SIGTERM or SIGINT: stop fetching, give the commands in hand up to the grace period to finish and be
reported (a migration step that cannot finish in time is reported failed, so the control plane
rolls it back), send the last heartbeat, close the backend, exit 0. A second signal cuts the grace
period short.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from agents.backends.base import ExecutionBackend, ReconcilingBackend, steps_outlive_agent
from agents.backends.faults import FaultPlan
from agents.daemon.client import ApiError, Backoff, ControlPlaneClient, GaveUp, retrying
from agents.daemon.commands import CommandRunner
from agents.daemon.config import AgentConfig
from agents.daemon.heartbeat import Heartbeater, TelemetryBuffer
from agents.daemon.nvml import Nvml, open_nvml
from agents.daemon.registry import BackendError, load_backend, offered_backends
from agents.daemon.session import AgentSession, Registration, RegistrationRefused, agent_version
from agents.daemon.state import StateDir, StateDirBusy

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_REFUSED = 3
COMMANDS_PATH = "/api/v1/agent/commands"
FINAL_HEARTBEAT_S = 5.0  # how long the last heartbeat may take at shutdown
ABANDON_REPORT_S = 10.0  # how long reporting a step failed at shutdown may take


@dataclass(frozen=True)
class ReconcileResult:
    stopped: list[str]
    relaunched: list[str]


def reconcile(
    backend: ExecutionBackend, registration: Registration, worker_jobs: Mapping[str, int]
) -> ReconcileResult:
    """Make the backend run what the control plane says this node runs.

    Workers the backend runs that the control plane does not list are stopped. Workers the control
    plane lists as running that the backend lacks (its state died with an earlier agent process)
    are launched again; workers still starting are left to their launch command, which the control
    plane delivers again to a newly registered agent.
    """
    if isinstance(backend, ReconcilingBackend):
        result = backend.reconcile(registration.workers, registration.jobs)
        return ReconcileResult(
            stopped=list(result.get("stopped", [])), relaunched=list(result.get("relaunched", []))
        )
    expected = {str(w.get("worker")): w for w in registration.workers}
    running = set(backend.running_workers())
    extra = sorted(running - set(expected))
    by_job: dict[int, list[str]] = defaultdict(list)
    for name in extra:
        # 0 when unknown: stop_workers goes by worker name; the job id only labels the call.
        by_job[worker_jobs.get(name, 0)].append(name)
    for job_id, names in by_job.items():
        log.info("reconcile: stopping %s (not this node's according to the control plane)", names)
        try:
            backend.stop_workers(job_id, names)
        except Exception:
            log.exception("reconcile: the backend could not stop %s", names)
    missing: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for name, worker in expected.items():
        if name not in running and worker.get("state") == "running" and isinstance(worker.get("job"), int):
            missing[worker["job"]].append(worker)
    relaunched = []
    for job_id, workers in missing.items():
        names = [str(w["worker"]) for w in workers]
        spec = registration.jobs.get(str(job_id), {})
        log.info("reconcile: launching %s again (the control plane has them running here)", names)
        try:
            backend.launch_workers({"job": job_id, "spec": spec, "workers": workers}, workers)
            relaunched += names
        except Exception:
            log.exception("reconcile: the backend could not launch %s", names)
    return ReconcileResult(stopped=extra, relaunched=relaunched)


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.stopping = threading.Event()  # first signal: stop fetching, wind down
        self.hurry = threading.Event()  # second signal: do not wait out the grace period
        self.fatal: BaseException | None = None
        self.backoff = Backoff(base_s=config.retry_base_s, max_s=config.retry_max_s)
        self.client = ControlPlaneClient(config.url, user_agent=f"dynarl-agent/{agent_version() or 'dev'}")
        self.state = StateDir(config.state_dir)

    # --- signals ----------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.stopping.is_set():
            log.warning("%s again: not waiting for the command in hand", name)
            self.hurry.set()
        else:
            log.info("%s: stopping", name)
        self.stopping.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _fail(self, exc: BaseException) -> None:
        if self.fatal is None:
            self.fatal = exc
        self.stopping.set()

    # --- start ------------------------------------------------------------------------------------

    def _first_registration(self, session: AgentSession) -> Registration | None:
        """Register at start; None when the stored node token has to do (see docs/agent-daemon.md)."""
        stored = session.token
        if not self.config.bootstrap_token:
            if stored:
                log.warning("no bootstrap token: using the node token from %s", self.config.state_dir)
                return None
            raise RegistrationRefused("no bootstrap token configured and no node token stored")
        try:
            return session.register()
        except RegistrationRefused as exc:
            if stored and isinstance(exc.__cause__, ApiError) and exc.__cause__.status == 401:
                log.warning("bootstrap token refused (%s); using the stored node token", exc)
                return None
            raise

    def _command_loop(self, session: AgentSession, runner: CommandRunner) -> None:
        try:
            while not self.stopping.is_set():
                wait = min(self.config.poll_wait_s, session.settings.long_poll_max_wait_s)
                fetch = functools.partial(
                    session.call, "GET", f"{COMMANDS_PATH}?wait={wait:g}", timeout_s=wait + 10.0
                )
                try:
                    reply = retrying(
                        fetch,
                        backoff=self.backoff,
                        describe="fetching commands",
                        give_up=self.stopping,
                    )
                except GaveUp:
                    return
                except ApiError as exc:
                    log.error("the control plane refused the command fetch: %s", exc)
                    self.stopping.wait(self.backoff.max_s)
                    continue
                commands = reply.get("commands", []) if isinstance(reply, Mapping) else []
                for command in commands:
                    if isinstance(command, Mapping):
                        # Once stopping, the runner refuses it: it is delivered again to the next
                        # agent process.
                        runner.submit(command)
        except RegistrationRefused as exc:
            log.error("the control plane no longer accepts this agent: %s", exc)
            self._fail(exc)
        except Exception as exc:
            log.exception("the command thread failed")
            self._fail(exc)

    def run(self) -> int:
        self.install_signal_handlers()
        try:
            self.state.open()
        except (StateDirBusy, OSError) as exc:
            log.error("%s", exc)
            return EXIT_REFUSED
        backend: ExecutionBackend | None = None
        nvml: Nvml | None = None
        try:
            try:
                backend = load_backend(
                    self.config.backend,
                    host=self.config.host,
                    options=self.config.backend_options,
                    trace_dir=self.config.trace_dir,
                )
                inventory = list(backend.inventory())
                offers = offered_backends(backend)
            except BackendError as exc:
                log.error("%s", exc)
                return EXIT_CONFIG
            nvml = open_nvml() if self.config.nvml else None
            return self._serve(backend, nvml, inventory, offers)
        finally:
            if backend is not None:
                try:
                    backend.close()
                except Exception:
                    log.exception("the backend failed to close")
            if nvml is not None:
                nvml.close()
            self.state.close()

    def _serve(
        self, backend: ExecutionBackend, nvml: Nvml | None, inventory: list[Any], offers: Sequence[str]
    ) -> int:
        session = AgentSession(
            self.config,
            self.client,
            self.state,
            inventory,
            backend_name=str(backend.name),
            backoff=self.backoff,
            stop=self.stopping,
            backends=offers,
            steps_outlive_agent=steps_outlive_agent(backend),
        )
        runner = CommandRunner(
            session,
            backend,
            self.state.journal,
            self.backoff,
            on_fatal=self._fail,
            faults=FaultPlan(self.config.faults, file=self.config.faults_file),
        )
        try:
            registration = self._first_registration(session)
        except GaveUp:
            log.info("stopped before the control plane answered")
            return EXIT_OK
        except RegistrationRefused as exc:
            log.error("registration refused: %s", exc)
            return EXIT_REFUSED
        if registration is not None:
            result = reconcile(backend, registration, runner.worker_jobs)
            log.info("reconciled: %d stopped, %d launched again", len(result.stopped), len(result.relaunched))

        recovered = threading.Event()
        heartbeater = Heartbeater(
            session,
            backend,
            nvml,
            [device.index for device in inventory],
            TelemetryBuffer(max_samples=self.config.max_buffered_samples),
            self.backoff,
            on_fatal=self._fail,
            on_recovered=recovered.set,
        )
        heartbeater.start()
        threading.Thread(
            target=self._reconcile_after_recovery,
            args=(recovered, session, backend, runner),
            name="reconcile",
            daemon=True,
        ).start()
        commands = threading.Thread(
            target=self._command_loop, args=(session, runner), name="commands", daemon=True
        )
        commands.start()
        # Outcomes an earlier process journaled go out beside the heartbeats: should the control
        # plane drop away again now, the node keeps heartbeating while the reports retry.
        threading.Thread(
            target=runner.report_unreported, args=(self.stopping,), name="journal", daemon=True
        ).start()
        log.info("agent %s running (backend %s, %s)", self.config.host, backend.name, self.config.url)

        self.stopping.wait()
        return self._shutdown(runner, heartbeater)

    def _reconcile_after_recovery(
        self,
        recovered: threading.Event,
        session: AgentSession,
        backend: ExecutionBackend,
        runner: CommandRunner,
    ) -> None:
        """When the control plane reports the node back from lost, register again and reconcile,
        as after a restart: meanwhile its migrations rolled back or went on without this node.
        Only with no command in hand, so a step being carried out is never undercut."""
        while not self.stopping.is_set():
            if not recovered.wait(0.5):
                continue
            while not self.stopping.is_set() and not runner.wait_idle(0.5):
                pass
            if self.stopping.is_set():
                return
            recovered.clear()
            try:
                registration = session.register()
            except GaveUp:
                return
            except RegistrationRefused as exc:
                log.error("registration refused after the node came back: %s", exc)
                self._fail(exc)
                return
            except Exception:
                log.exception("registering again after the node came back failed")
                continue
            result = reconcile(backend, registration, runner.worker_jobs)
            log.info(
                "reconciled after the node came back: %d stopped, %d launched again",
                len(result.stopped),
                len(result.relaunched),
            )

    def _shutdown(self, runner: CommandRunner, heartbeater: Heartbeater) -> int:
        grace_end = time.monotonic() + self.config.shutdown_grace_s
        runner.stop_accepting()
        in_hand = runner.in_hand()
        if in_hand:
            log.info(
                "waiting up to %gs for %s to finish",
                self.config.shutdown_grace_s,
                ", ".join(f"{h.kind} {h.command_id}" for h in in_hand),
            )
        while not runner.wait_idle(0.2):
            if self.hurry.is_set() or time.monotonic() >= grace_end:
                runner.give_up.set()
                runner.abandon(
                    f"the agent on {self.config.host} is shutting down and could not finish this "
                    f"within its {self.config.shutdown_grace_s:g}s grace period",
                    deadline=time.monotonic() + ABANDON_REPORT_S,
                )
                break
        heartbeater.stop_and_flush(deadline=time.monotonic() + FINAL_HEARTBEAT_S)
        if self.fatal is not None:
            return EXIT_REFUSED if isinstance(self.fatal, RegistrationRefused) else EXIT_ERROR
        log.info("stopped cleanly")
        return EXIT_OK


def run_agent(config: AgentConfig) -> int:
    return Agent(config).run()
