"""Carrying out the control plane's commands through the backend, and reporting them.

A command is reported until the control plane has it, retrying with backoff through outages.

Each command runs at most once per agent state directory: ``started`` is journaled before the
backend is called and the outcome is journaled before it is reported, so a command delivered again
(after a crash, a lost report or a re-registration) is answered from the journal with the outcome
it had. A migration step that an earlier agent process started but never finished is reported
failed rather than run again: what it did is unknown, and a failed step makes the control plane
roll the migration back. A backend whose steps outlive the agent (``resumes_interrupted_steps``:
the Ray backend, whose job driver runs each step once per attempt and keeps its outcome) has such
a step carried out again instead: it finishes it or answers what it did, so a step that took
effect before the agent died (a switch past the point of no return) is reported as done, not
rolled back over. Launch and stop commands are idempotent by worker name, so those are simply
carried out again.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agents.backends.base import ExecutionBackend, StepFailed, steps_outlive_agent
from agents.backends.faults import CRASH_EXIT_CODE, Fault, FaultMode, FaultPlan
from agents.daemon.client import ApiError, Backoff, GaveUp, quote_id, retrying
from agents.daemon.session import AgentSession, RegistrationRefused
from agents.daemon.state import Journal, Outcome

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 10_000  # what the control plane keeps of an error message
REPORT_TIMEOUT_S = 10.0
INTERRUPTED_STEP = (
    "the agent stopped while carrying this step out; what it did is unknown, so it is reported "
    "failed for the control plane to roll back"
)

RESUMED_STEP = (
    "an earlier agent process started this step and stopped; the backend runs each step once and "
    "keeps its outcome beyond the agent, so it is carried out again, which finishes it or answers "
    "what it did"
)


def command_report_path(command_id: str) -> str:
    return f"/api/v1/agent/commands/{quote_id(command_id)}/report"


def step_report_path(step_id: str) -> str:
    return f"/api/v1/agent/steps/{quote_id(step_id)}/report"


def _json_safe(value: Any) -> Any:
    """What a backend returned, as JSON (anything JSON cannot hold becomes its repr)."""
    return json.loads(json.dumps(value, default=repr))


def _worker_names(workers: Sequence[Any]) -> list[str]:
    return [str(w["worker"]) if isinstance(w, Mapping) else str(w) for w in workers]


def workers_outcome(result: Any, names: Sequence[str]) -> dict[str, Any]:
    """The report of a launch or stop. A backend may say per worker how it went, as
    ``result["workers"] = {name: {"ok": bool, "error": str}}``; the rest of ``result`` is kept."""
    result = _json_safe(result) if isinstance(result, Mapping) else {}
    per_worker = result.pop("workers", None)
    workers: dict[str, dict[str, Any]] = {}
    if isinstance(per_worker, Mapping):
        for name in names:
            said = per_worker.get(name)
            if isinstance(said, Mapping):
                workers[name] = {"ok": bool(said.get("ok", True)), "error": str(said.get("error", ""))}
    failed = [f"{name}: {w['error'] or 'failed'}" for name, w in workers.items() if not w["ok"]]
    body: dict[str, Any] = {"ok": not failed, "error": "; ".join(failed)[:MAX_ERROR_CHARS], "result": result}
    if workers:
        body["workers"] = workers
    return body


def failure(message: str, **extra: Any) -> dict[str, Any]:
    return {"ok": False, "error": message[:MAX_ERROR_CHARS], "result": {}, **extra}


@dataclass
class InHand:
    command_id: str
    kind: str
    report_path: str
    attempt: Any  # a migration step's attempt, reported with its outcome
    started: bool = False  # the backend was called


ORDERED_KINDS = ("launch_workers", "stop_workers")


class CommandRunner:
    """Runs each command in its own thread, so a step that hangs in the backend does not keep
    the node from carrying out the compensations the control plane sends once it gives up on the
    step. A job's launch and stop commands run one at a time, in the order they arrived (a stop
    must not overtake the launch of the same workers). Migration steps need no ordering here: the
    control plane dispatches a migration's next step only once the previous one is over.
    """

    def __init__(
        self,
        session: AgentSession,
        backend: ExecutionBackend,
        journal: Journal,
        backoff: Backoff,
        on_fatal: Callable[[BaseException], None],
        faults: FaultPlan | None = None,
        exit: Callable[[int], Any] = os._exit,
    ) -> None:
        self.session = session
        self.faults = faults or FaultPlan(())
        self.exit = exit  # how an injected crash ends the process
        self.backend = backend
        self.journal = journal
        self.backoff = backoff
        self.on_fatal = on_fatal
        # Set at shutdown once the grace period is over: reports still retrying stop (the
        # journal keeps the outcome; the next agent process reports it).
        self.give_up = threading.Event()
        self.worker_jobs: dict[str, int] = {}  # worker name -> job id, for reconciliation
        self._busy = threading.Condition()
        self._in_hand: dict[str, InHand] = {}
        self._queues: dict[str, deque[str]] = {}  # per job: its launch/stop commands in order
        self._accepting = True

    # --- what each command does -------------------------------------------------------------------

    def _run_backend(self, kind: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """The report body for one command, from the backend; never raises."""
        try:
            if kind == "launch_workers":
                workers = [w for w in payload.get("workers", []) if isinstance(w, Mapping)]
                job_id = payload.get("job")
                for worker in workers:
                    if isinstance(job_id, int):
                        self.worker_jobs[str(worker["worker"])] = job_id
                return workers_outcome(self.backend.launch_workers(payload, workers), _worker_names(workers))
            if kind == "stop_workers":
                names = _worker_names(payload.get("workers", []))
                job_id = payload.get("job")
                redo = payload.get("redo_from_iteration")
                result = self.backend.stop_workers(
                    job_id if isinstance(job_id, int) else 0,
                    names,
                    redo_from_iteration=redo
                    if isinstance(redo, int) and not isinstance(redo, bool)
                    else None,
                )
                body = workers_outcome(result, names)
                if body["ok"]:
                    for name in names:
                        self.worker_jobs.pop(name, None)
                return body
            if kind == "migration_step":
                fault = self._injected_fault(payload)
                result = self.backend.execute_step(payload)
                if fault is not None:  # a crash: after the step's effects, before its outcome
                    log.error("injected fault %s: the agent exits with %s", fault, CRASH_EXIT_CODE)
                    self.exit(CRASH_EXIT_CODE)
                return {
                    "ok": True,
                    "error": "",
                    "result": _json_safe(result) if isinstance(result, Mapping) else {},
                    "attempt": payload.get("attempt"),
                }
            return failure(f"this agent does not know command kind {kind!r}")
        except StepFailed as exc:
            log.warning("%s failed: %s", kind, exc)
            return failure(str(exc) or "the backend could not carry it out", **self._attempt(kind, payload))
        except Exception as exc:
            log.exception("the backend raised while carrying out %s", kind)
            return failure(f"{type(exc).__name__}: {exc}", **self._attempt(kind, payload))

    def _injected_fault(self, payload: Mapping[str, Any]) -> Fault | None:
        """The drill's fault for this step (``--faults``): a failure or a hang happens here,
        before the backend is called; a crash is returned for the caller to carry out."""
        step = payload.get("step")
        fault = self.faults.next_for(str(step.get("kind", "")) if isinstance(step, Mapping) else "")
        if fault is None:
            return None
        if fault.mode is FaultMode.FAIL:
            raise StepFailed(f"injected fault {fault}")
        if fault.mode is FaultMode.HANG:
            log.warning("injected fault %s: the step hangs until the agent stops", fault)
            self.give_up.wait()
            raise StepFailed(f"injected fault {fault}, interrupted by the agent stopping")
        return fault

    @staticmethod
    def _attempt(kind: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        return {"attempt": payload.get("attempt")} if kind == "migration_step" else {}

    @staticmethod
    def _report_path(command_id: str, kind: str, payload: Mapping[str, Any]) -> str:
        step = payload.get("step")
        if kind == "migration_step" and isinstance(step, Mapping) and isinstance(step.get("step_id"), str):
            return step_report_path(step["step_id"])
        return command_report_path(command_id)

    # --- reporting ----------------------------------------------------------------------------------

    def report(
        self,
        command_id: str,
        outcome: Outcome,
        *,
        give_up: threading.Event | None = None,
        deadline: float | None = None,
    ) -> bool:
        """Report until the control plane has it (or a 4xx says it never will). False when
        retrying stopped first: the journal keeps the outcome for the next agent process."""
        try:
            reply = retrying(
                lambda: self.session.call(
                    "POST", outcome.report_path, body=outcome.body, timeout_s=REPORT_TIMEOUT_S
                ),
                backoff=self.backoff,
                describe=f"report of {command_id}",
                give_up=give_up,
                deadline=deadline,
            )
        except GaveUp as exc:
            log.warning("%s not delivered; the journal keeps it for the next agent start", exc)
            return False
        except ApiError as exc:
            # Asking again would get the same answer (the command or step is gone, or not ours).
            log.error("the control plane refused the report of %s: %s", command_id, exc)
            self.journal.mark_reported(command_id)
            return False
        self.journal.mark_reported(command_id)
        state = reply.get("state") if isinstance(reply, Mapping) else None
        repeated = isinstance(reply, Mapping) and reply.get("repeated")
        log.info(
            "reported %s: %s (control plane: %s%s)",
            command_id,
            "ok" if outcome.ok else "failed",
            state,
            ", already known" if repeated else "",
        )
        return True

    def report_unreported(self, give_up: threading.Event) -> None:
        """At start: outcomes an earlier agent process journaled but may not have delivered."""
        for record in self.journal.unreported():
            if record.outcome is not None:
                log.info("reporting %s again: journaled by an earlier agent process", record.command_id)
                self.report(record.command_id, record.outcome, give_up=give_up)

    # --- taking commands ----------------------------------------------------------------------------

    def submit(self, command: Mapping[str, Any]) -> None:
        """Take one fetched command; it runs in its own thread. A command already in hand (a
        redelivery while it runs) is not started again."""
        command_id = str(command.get("command_id", ""))
        kind = str(command.get("kind", ""))
        raw_payload = command.get("payload")
        payload: Mapping[str, Any] = raw_payload if isinstance(raw_payload, Mapping) else {}
        if not command_id:
            log.error("ignoring a command without an id: %r", command)
            return
        queue_key = f"job {payload.get('job')}" if kind in ORDERED_KINDS else ""
        with self._busy:
            if not self._accepting:
                log.info("stopping: not starting %s %s", kind, command_id)
                return
            if command_id in self._in_hand:
                log.info("%s %s is in hand already; not starting it twice", kind, command_id)
                return
            in_hand = InHand(
                command_id, kind, self._report_path(command_id, kind, payload), payload.get("attempt")
            )
            self._in_hand[command_id] = in_hand
            if queue_key:
                self._queues.setdefault(queue_key, deque()).append(command_id)
        threading.Thread(
            target=self._handle,
            args=(in_hand, payload, queue_key),
            name=f"command {command_id}",
            daemon=True,
        ).start()

    def _my_turn(self, queue_key: str, command_id: str) -> bool:
        """Wait until the job's earlier launch/stop commands are done; False when stopping first."""
        with self._busy:
            queue = self._queues[queue_key]
            self._busy.wait_for(lambda: queue[0] == command_id or not self._accepting)
            return queue[0] == command_id and self._accepting

    def _handle(self, in_hand: InHand, payload: Mapping[str, Any], queue_key: str) -> None:
        try:
            if queue_key and not self._my_turn(queue_key, in_hand.command_id):
                log.info("stopping: not starting %s %s", in_hand.kind, in_hand.command_id)
                return
            self._carry_out(in_hand, payload)
        except RegistrationRefused as exc:
            self.on_fatal(exc)
        except Exception as exc:
            log.exception("carrying out %s failed", in_hand.command_id)
            self.on_fatal(exc)
        finally:
            with self._busy:
                del self._in_hand[in_hand.command_id]
                if queue_key:
                    queue = self._queues[queue_key]
                    queue.remove(in_hand.command_id)
                    if not queue:
                        del self._queues[queue_key]
                self._busy.notify_all()

    def _carry_out(self, in_hand: InHand, payload: Mapping[str, Any]) -> None:
        command_id, kind = in_hand.command_id, in_hand.kind
        record = self.journal.get(command_id)
        if record is not None and record.outcome is not None:
            log.info("%s %s was carried out already; reporting its journaled outcome", kind, command_id)
            self.report(command_id, record.outcome, give_up=self.give_up)
            return
        if (
            record is not None
            and record.interrupted
            and kind == "migration_step"
            and not steps_outlive_agent(self.backend)
        ):
            log.warning("%s %s: %s", kind, command_id, INTERRUPTED_STEP)
            outcome = Outcome(in_hand.report_path, failure(INTERRUPTED_STEP, attempt=in_hand.attempt))
            if self.journal.finish(command_id, kind, outcome):
                self.report(command_id, outcome, give_up=self.give_up)
            return
        with self._busy:
            if not self._accepting:
                log.info("stopping: not starting %s %s", kind, command_id)
                return
            in_hand.started = True
        if record is not None and record.interrupted:
            log.warning("%s %s: %s", kind, command_id, RESUMED_STEP)
        log.info("carrying out %s %s", kind, command_id)
        self.journal.start(command_id, kind)
        outcome = Outcome(in_hand.report_path, self._run_backend(kind, payload))
        if self.journal.finish(command_id, kind, outcome):
            self.report(command_id, outcome, give_up=self.give_up)
        else:
            log.warning(
                "%s %s finished, but an outcome was journaled for it already (it stands)", kind, command_id
            )

    # --- shutdown -------------------------------------------------------------------------------------

    def stop_accepting(self) -> None:
        """From now on no command starts (those the backend is running carry on)."""
        with self._busy:
            self._accepting = False
            self._busy.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no command is in hand (carried out and reported); False on timeout."""
        with self._busy:
            return self._busy.wait_for(lambda: not self._in_hand, timeout=max(0.0, timeout_s))

    def in_hand(self) -> list[InHand]:
        with self._busy:
            return list(self._in_hand.values())

    def abandon(self, reason: str, *, deadline: float) -> None:
        """Shutdown cannot wait any longer. A migration step the backend is still running is
        reported failed (the control plane rolls back); a launch or stop is left to be delivered
        again to the next agent process, which carries it out (they are idempotent)."""
        for in_hand in self.in_hand():
            if not in_hand.started:
                continue
            if in_hand.kind != "migration_step":
                log.warning("leaving %s %s unreported: %s", in_hand.kind, in_hand.command_id, reason)
                continue
            outcome = Outcome(in_hand.report_path, failure(reason, attempt=in_hand.attempt))
            if self.journal.finish(in_hand.command_id, in_hand.kind, outcome):
                log.warning("reporting %s failed: %s", in_hand.command_id, reason)
                self.report(in_hand.command_id, outcome, deadline=deadline)
