"""The whole control plane (daphne, the Celery worker and beat) stopped in the middle of a
migration and started again: the migration resumes from the database and commits, with the
agents' outcomes of the step in hand delivered from their journals, nothing run twice."""

from __future__ import annotations

import pytest

from scheduler.core.migration import StepKind
from scheduler.models import Migration, MigrationState, StepState
from tests.e2e.helpers import (
    FINISHED_MIGRATION_STATES,
    allocation,
    journal_events,
    math_spec,
    ownership_is_consistent,
    submit,
    wait_agents_agree,
    wait_migration_finished,
    wait_running,
)
from tests.services import wait_until
from tests.stack import LiveStack, NodeAgent

NODES = ("node-a", "node-b")


@pytest.mark.django_db(transaction=True)
def test_a_control_plane_restarted_mid_migration_resumes_it_from_the_database(live_stack: LiveStack) -> None:
    # A slower simulation: the migration's steps take long enough to stop everything in between.
    agents = [live_stack.start_agent(name, gpus=4, speed=5) for name in NODES]
    for agent in agents:
        agent.wait_registered()
    job = submit(live_stack, math_spec("restart", policy="static-disaggregated"))
    wait_running(live_stack, job)
    before = allocation(job)

    status, body = live_stack.api(
        "POST", f"/api/v1/jobs/{job.pk}/migrate/", {"donor": "rollout", "recipient": "actor", "workers": 2}
    )
    assert status == 202, body
    migration = Migration.objects.get(migration_id=body["migration_id"])
    step = migration.steps.get(kind=StepKind.TRANSFER_STATE.value, is_rollback=False)

    def command_ids() -> dict[str, NodeAgent]:
        return {f"{step.step_id}@{node}#{step.attempts}": live_stack.agent(node) for node in step.nodes}

    def step_in_the_agents_hands() -> bool:
        # Queued is not enough: the agents must have taken the step before everything stops.
        step.refresh_from_db()
        return step.state == StepState.RUNNING and all(
            any(e["command_id"] == command_id and e["event"] == "started" for e in journal_events(agent))
            for command_id, agent in command_ids().items()
        )

    assert wait_until(step_in_the_agents_hands, timeout_s=60, interval_s=0.05), live_stack.logs()
    live_stack.stop_control_plane()
    migration.refresh_from_db()
    assert migration.state not in FINISHED_MIGRATION_STATES, "the migration finished before the stop"

    # With nobody to report to, the agents finish the step and keep its outcome in their journals.
    started = command_ids()

    def outcomes_journaled() -> bool:
        return all(
            any(e["command_id"] == command_id and e["event"] == "finished" for e in journal_events(agent))
            for command_id, agent in started.items()
        )

    assert wait_until(outcomes_journaled, timeout_s=60), live_stack.logs()
    assert all(agent.running() for agent in agents)

    live_stack.start_control_plane()
    migration = wait_migration_finished(live_stack, migration)
    assert migration.state == MigrationState.COMMITTED, migration.error
    step.refresh_from_db()
    assert step.state == StepState.DONE and step.attempts == 1
    moved = set(migration.device_uids)
    after = allocation(job)
    assert after["actor"] == before["actor"] | moved
    assert after["rollout"] == before["rollout"] - moved
    assert ownership_is_consistent(job) == []
    for agent in agents:
        starts = [e["command_id"] for e in journal_events(agent) if e["event"] == "started"]
        assert len(starts) == len(set(starts)), starts
    wait_agents_agree(live_stack, NODES)
