"""An agent killed at each step of a p2p migration (the trainer growing onto a rollout engine's
GPUs): the job ends on its old workers or fully on the new ones, the audit trail shows a rollback,
the restarted agent registers again and no command runs twice. The hosts of the moved GPUs are
killed with it, so every agent the migration touches restarts mid-migration."""

from __future__ import annotations

from collections import Counter

import pytest

from cluster.models import Device
from common.models import AuditEvent
from jobs.models import Worker
from scheduler.core.migration import StepKind
from scheduler.models import Migration, MigrationState, MigrationStep
from tests.e2e.helpers import (
    allocation,
    journal_events,
    live_workers,
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
# The trainer's side of a rollout -> actor move, in plan order. The switch is its point of no
# return: a failure up to it rolls the side back, one after it is retried until it goes through.
P2P_STEPS = (
    StepKind.RESERVE_DEVICES,
    StepKind.START_WORKERS,
    StepKind.TRANSFER_STATE,
    StepKind.REBUILD_GROUPS,
    StepKind.BARRIER,
    StepKind.SWITCH,
    StepKind.DESTROY_OLD,
)
INTERRUPTED = "the agent stopped while carrying this step out"


def journal_starts(agent: NodeAgent) -> Counter[str]:
    """How often each command was started by the backend, over every process of this agent."""
    return Counter(e["command_id"] for e in journal_events(agent) if e["event"] == "started")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", [k.value for k in P2P_STEPS])
def test_an_agent_killed_at_a_p2p_step_leaves_the_job_whole(live_stack: LiveStack, kind: str) -> None:
    # Every agent dies the first time it executes a step of this kind.
    agents = [live_stack.start_agent(name, gpus=4, faults=f"crash:{kind}@1") for name in NODES]
    for agent in agents:
        agent.wait_registered()
    job = submit(live_stack, math_spec("crash", policy="static-disaggregated"))
    wait_running(live_stack, job)
    old_actor = live_workers(job, "actor")
    old_allocation = allocation(job)
    assert len(old_actor) == 2

    status, body = live_stack.api(
        "POST", f"/api/v1/jobs/{job.pk}/migrate/", {"donor": "rollout", "recipient": "actor", "workers": 2}
    )
    assert status == 202, body
    migration = Migration.objects.get(migration_id=body["migration_id"])
    moved = set(migration.device_uids)
    new_actor = set(migration.steps.get(kind=StepKind.START_WORKERS.value, is_rollback=False).worker_names)

    # Every agent the step runs on dies in it (each has the fault); then they start again.
    step = migration.steps.get(kind=kind, is_rollback=False)
    crashed = [live_stack.agent(name) for name in step.nodes]
    assert wait_until(lambda: not any(a.running() for a in crashed), timeout_s=90), live_stack.logs()
    assert [a.returncode for a in crashed] == [70] * len(crashed), live_stack.logs()
    # The hosts of the moved GPUs go down too (SIGKILL), so a restart also meets the new workers.
    hosts = set(Device.objects.filter(uid__in=moved).values_list("node__name", flat=True))
    killed = [live_stack.agent(name) for name in sorted(hosts - set(step.nodes))]
    for agent in killed:
        agent.kill()
    for agent in crashed + killed:
        agent.start()
    for agent in crashed + killed:
        agent.wait_registered()

    migration = wait_migration_finished(live_stack, migration)
    job.refresh_from_db()
    actor_now = live_workers(job, "actor")
    owned = allocation(job)
    if kind == StepKind.DESTROY_OLD:
        # Past the switch: the trainer's side goes through, the interrupted step retried.
        assert migration.state == MigrationState.COMMITTED, migration.error
        assert actor_now == old_actor | new_actor
        assert owned["actor"] == old_allocation["actor"] | moved
        assert migration.steps.get(kind=kind, is_rollback=False).attempts >= 2
    else:
        assert migration.state == MigrationState.ROLLED_BACK, migration.error
        # The trainer keeps exactly its old gang on its old devices; the new ranks are gone.
        assert actor_now == old_actor
        assert owned["actor"] == old_allocation["actor"]
        assert not Worker.objects.filter(name__in=new_actor).exists()
        assert migration.steps.filter(is_rollback=True).exists()
        verbs = set(
            AuditEvent.objects.filter(
                object_type=Migration._meta.label_lower, object_id=str(migration.pk)
            ).values_list("verb", flat=True)
        )
        assert {"migration.plan", "migration.rollback"} <= verbs, verbs
        assert "migration.commit" not in verbs
    # Never both, never neither: every live worker owns devices, every owned device a live worker.
    assert ownership_is_consistent(job) == []
    assert actor_now and live_workers(job, "rollout")

    # The step in hand when the agent died was reported failed by the restarted agent (the first
    # such report fails the step; later ones change nothing), not run again; no command ran twice
    # on any agent.
    step.refresh_from_db()
    first = step.result["attempts"]["1"]
    assert first, step.result
    assert all(INTERRUPTED in outcome["error"] for outcome in first.values()), first
    for agent in agents:
        repeated = {c: n for c, n in journal_starts(agent).items() if n > 1}
        assert repeated == {}, repeated
    for row in MigrationStep.objects.filter(migration=migration):
        for attempt, outcomes in row.result.get("attempts", {}).items():
            assert set(outcomes) <= set(row.nodes), (row.step_id, attempt, outcomes)

    # The agents run what the database says, device by device.
    wait_agents_agree(live_stack, NODES)
