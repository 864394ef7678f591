"""A migration commits while an agent is down (its node lost past the trainer's switch, so the
move rolls forward without it); the agent comes back, registers again and reconciles its host to
what the database says."""

from __future__ import annotations

import pytest

from cluster.models import NodeStatus
from common.models import AuditEvent
from jobs.models import Worker, WorkerState
from scheduler.core.migration import StepKind
from scheduler.models import Migration, MigrationState
from tests.e2e.helpers import (
    allocation,
    live_workers,
    math_spec,
    ownership_is_consistent,
    submit,
    wait_agents_agree,
    wait_migration_finished,
    wait_running,
)
from tests.services import wait_until
from tests.stack import LiveStack

NODES = ("node-a", "node-b")


@pytest.fixture
def stack_settings() -> dict[str, str]:
    # A silent node is declared lost within seconds.
    return {"NODE_LOST_AFTER_S": "6", "NODE_LIVENESS_CHECK_S": "1"}


@pytest.mark.django_db(transaction=True)
def test_an_agent_down_while_a_migration_commits_reconciles_when_it_returns(live_stack: LiveStack) -> None:
    # The trainer's hosts die in the step after its switch (destroying the old process groups).
    agents = [live_stack.start_agent(name, gpus=4, faults="crash:destroy_old@1") for name in NODES]
    for agent in agents:
        agent.wait_registered()
    job = submit(live_stack, math_spec("reconcile", policy="static-disaggregated"))
    wait_running(live_stack, job)
    before = allocation(job)
    old_actor = live_workers(job, "actor")

    status, body = live_stack.api(
        "POST", f"/api/v1/jobs/{job.pk}/migrate/", {"donor": "rollout", "recipient": "actor", "workers": 2}
    )
    assert status == 202, body
    migration = Migration.objects.get(migration_id=body["migration_id"])
    destroy_old = migration.steps.get(kind=StepKind.DESTROY_OLD.value, is_rollback=False)
    down = [live_stack.agent(name) for name in destroy_old.nodes]
    up = [a for a in agents if a not in down]
    assert wait_until(lambda: not any(a.running() for a in down), timeout_s=90), live_stack.logs()

    # Lost, skipped, committed: the move goes through without the dead hosts.
    migration = wait_migration_finished(live_stack, migration, timeout_s=90)
    assert migration.state == MigrationState.COMMITTED, migration.error
    for agent in down:
        assert not agent.running()
        node = agent.node()
        assert node is not None and node.status == NodeStatus.LOST
    moved = set(migration.device_uids)
    new_actor = live_workers(job, "actor") - old_actor
    assert len(new_actor) == 2
    assert allocation(job)["actor"] == before["actor"] | moved
    assert allocation(job)["rollout"] == before["rollout"] - moved
    verbs = set(AuditEvent.objects.filter(job=job).values_list("verb", flat=True))
    assert {"migration.node_lost", "migration.commit"} <= verbs, verbs
    for agent in down:
        node = agent.node()
        assert node is not None
        assert AuditEvent.objects.filter(
            verb="node.lost", object_type="cluster.node", object_id=str(node.pk)
        ).exists()

    # Back: each registers again and runs exactly what the database gives its host.
    for agent in down:
        agent.start()
    for agent in down:
        agent.wait_registered()
    # The reconcile is logged as the agent comes back; its log may trail the registration.
    assert wait_until(
        lambda: "reconcile: launching" in "\n".join(agent.log_text() for agent in down), timeout_s=30
    ), "\n".join(agent.log_text() for agent in down)
    expected_there = set(
        Worker.objects.filter(
            group__job=job, state=WorkerState.RUNNING, devices__node__name__in=destroy_old.nodes
        ).values_list("name", flat=True)
    )
    assert expected_there
    assert ownership_is_consistent(job) == []
    wait_agents_agree(live_stack, NODES)
    assert all(a.running() for a in up + down)
