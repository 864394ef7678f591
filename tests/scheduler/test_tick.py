"""The scheduling tick on real PostgreSQL and Redis: claims, decisions, snapshots, durations."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from django.db import connection
from django.test import TestCase, override_settings

from cluster.models import Node
from common import redis as common_redis
from jobs.models import Job, JobState, Worker
from scheduler import telemetry
from scheduler.core.decisions import Decision, Reason
from scheduler.models import HypergraphSnapshot, Migration, MigrationState, SchedulingDecision, Tick
from scheduler.services import tick
from tests.factories import make_cluster, make_user, mark_running, ray_spec, spec, submit
from tests.scheduler.test_gpu_migrations import deliver_all


@pytest.fixture(autouse=True)
def _clean_window(settings: object) -> Iterator[None]:
    yield
    common_redis.shared_client().flushdb()


def report(job: Job, utilisation: dict[str, float], tokens: dict[str, int], *, seconds: int = 12) -> None:
    """Every worker reports once a second for ``seconds``: what their agents would send."""
    now = time.time()
    for node in Node.objects.all():
        workers = Worker.objects.filter(group__job=job, devices__node=node).select_related("group").distinct()
        samples = [
            {
                "worker": w.name,
                "at": now - seconds + k + 1,
                "utilisation": utilisation[w.group.name],
                "tokens": tokens[w.group.name],
                "queue_length": 0,
                "in_flight": 4 if utilisation[w.group.name] > 0.5 else 0,
            }
            for w in workers
            for k in range(seconds)
        ]
        # The live window is written when the ingest commits; in a test transaction, run that now.
        with TestCase.captureOnCommitCallbacks(execute=True):
            telemetry.ingest_report(node, {"sent_at": now, "devices": [], "workers": samples}, now=now)


def idle_rollout_busy_trainer_job(policy: str = "dynarl") -> Job:
    make_cluster({"node-a": ("H100", 4), "node-b": ("H100", 4)})
    owner = make_user("alice")
    data = spec(rollout=6, actor=2, policy=policy)
    data["policy"]["params"] = (
        {"sustain_s": 0.0, "cooldown_s": 0.0, "min_gain_ratio": 0.0}
        if policy == "dynarl"
        else {"cooldown_s": 0.0}
    )
    job = mark_running(submit(owner, data))
    report(job, {"rollout": 0.02, "actor": 1.0}, {"rollout": 5, "actor": 800})
    return job


@pytest.mark.django_db
@override_settings(SIGNAL_WINDOW_S=10.0)
def test_tick_moves_idle_rollout_gpus_to_the_busy_trainer() -> None:
    job = idle_rollout_busy_trainer_job()
    result = tick.run_tick(job.pk)
    assert result is not None and result.outcome == "decided", result and result.outcome
    decision = SchedulingDecision.objects.get(job=job)
    assert (decision.donor, decision.recipient) == ("rollout", "actor")
    assert decision.candidates, "the candidates weighed are recorded"
    assert decision.inputs["rollout"]["low_utilisation_fraction"] == 1.0
    migration = Migration.objects.get(job=job)
    assert migration.decision_id == decision.pk
    assert result.duration_ms > 0 and result.policy_ms > 0
    assert HypergraphSnapshot.objects.filter(job=job).exists()
    job.refresh_from_db()
    assert job.tokens_per_s > 0


@pytest.mark.django_db
def test_tick_skips_jobs_that_are_not_running_and_duplicate_beats() -> None:
    make_cluster({"node-a": ("H100", 8)})
    job = submit(make_user("bob"))
    assert job.state == JobState.ADMITTED
    assert tick.run_tick(job.pk) is None
    mark_running(job)
    assert tick.run_tick(job.pk) is not None
    assert tick.run_tick(job.pk) is None  # the same beat delivered twice
    assert Tick.objects.filter(job=job).count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_ticks_make_one_decision() -> None:
    job = idle_rollout_busy_trainer_job()
    barrier = threading.Barrier(2)
    results: list[object] = []

    def worker() -> None:
        barrier.wait()
        try:
            results.append(tick.run_tick(job.pk))
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert Tick.objects.filter(job=job).count() == 1
    assert SchedulingDecision.objects.filter(job=job).count() == 1
    assert Migration.objects.filter(job=job).count() == 1
    assert sum(r is not None for r in results) == 1


@pytest.mark.django_db
@override_settings(SIGNAL_WINDOW_S=10.0)
def test_loans_go_home_when_the_iteration_ends_even_if_a_migration_held_the_boundary() -> None:
    # BiDiRL returns every loan at the boundary whatever the signals (dynarl weighs each return
    # live, tests/scheduler_core/test_policies_dynarl.py): what is tested here is the hook.
    job = idle_rollout_busy_trainer_job("bidirectional")
    assert tick.run_tick(job.pk) is not None
    lent = SchedulingDecision.objects.get(job=job)
    assert (lent.donor, lent.recipient) == ("rollout", "actor")
    # The iteration moves on while the loan's migration is still in flight...
    Job.objects.filter(pk=job.pk).update(iteration=1, last_tick_at=None)
    in_flight = tick.run_tick(job.pk)
    assert in_flight is not None and in_flight.outcome == "migration_in_flight"
    deliver_all()
    assert Migration.objects.get(job=job).state == MigrationState.COMMITTED
    # ...and the first tick that may decide again sends the borrowed GPUs home.
    Job.objects.filter(pk=job.pk).update(last_tick_at=None)
    result = tick.run_tick(job.pk)
    assert result is not None and result.outcome == "decided"
    back = SchedulingDecision.objects.filter(job=job).latest("pk")
    assert back.reason == Reason.RETURN_BORROWED
    assert (back.donor, back.recipient) == ("actor", "rollout")
    assert sorted(back.device_uids) == sorted(lent.device_uids)
    assert "iteration 1 ended" in back.detail
    job.refresh_from_db()
    assert job.policy_state["queued"] == []


@pytest.mark.django_db
@override_settings(SIGNAL_WINDOW_S=10.0)
def test_a_return_the_planner_refuses_is_said_and_owed_again_in_the_policys_state() -> None:
    job = idle_rollout_busy_trainer_job()
    actor_gpus = sorted(
        Worker.objects.filter(group__job=job, group__name="actor").values_list("devices__uid", flat=True)
    )
    # A queued return of every GPU the trainer holds: it still fits the job (the trainer holds
    # them), but the planner does not leave a group without a worker.
    back = Decision(
        policy="dynarl",
        reason=Reason.RETURN_BORROWED,
        detail="iteration 0 ended: actor returns 2 borrowed GPUs to rollout",
        donor="actor",
        recipient="rollout",
        device_ids=tuple(actor_gpus),
        donor_strategy=None,
        recipient_strategy=None,
        at=time.time(),
    )
    job.policy_state = {"queued": [back.to_json()]}
    job.save(update_fields=["policy_state"])
    result = tick.run_tick(job.pk)
    assert result is not None and result.outcome == "no_change", result and result.outcome
    refused = SchedulingDecision.objects.get(job=job)
    assert "[not carried out: donor actor cannot run with 0 workers" in refused.detail, refused.detail
    assert not Migration.objects.filter(job=job).exists()
    # The policy was told: the return is not awaited, and the trainer owes the GPUs again.
    job.refresh_from_db()
    state = job.policy_state["policy"]
    assert all(m["device_ids"] != actor_gpus for m in state["pending"])
    assert [(loan["lender"], loan["borrower"], sorted(loan["device_ids"])) for loan in state["loans"]] == [
        ("rollout", "actor", actor_gpus)
    ]


@pytest.mark.django_db
@override_settings(SIGNAL_WINDOW_S=10.0)
def test_a_job_grows_only_into_free_devices_of_nodes_that_run_its_backend() -> None:
    make_cluster({"node-a": ("H100", 4), "node-b": ("H100", 4)})
    Node.objects.filter(name="node-a").update(backend="ray", backends=["ray"])
    data = ray_spec(rollout=1, actor=2)
    data["policy"]["params"] = {"sustain_s": 0.0, "cooldown_s": 0.0, "min_gain_ratio": 0.0}
    job = mark_running(submit(make_user("alice"), data))
    busy = ({"rollout": 0.9, "actor": 1.0, "reward": 0.1}, {"rollout": 5, "actor": 800, "reward": 0})
    report(job, *busy)

    # The trainer is the bottleneck and node-b's four GPUs are free, but node-b runs sim hosts.
    result = tick.run_tick(job.pk)
    assert result is not None and result.outcome == "no_change", result and result.outcome
    assert not SchedulingDecision.objects.filter(job=job).exists()
    # Its row says why: the one move it could weigh breaks a worker limit.
    assert (
        result.note
        == "best of 1 moves weighed, reward to actor (1 GPU): reward would drop to 0 workers, under its minimum 1"
    )

    make_cluster({"node-c": ("H100", 4)})
    Node.objects.filter(name="node-c").update(backend="ray", backends=["ray"])
    Job.objects.filter(pk=job.pk).update(last_tick_at=None)
    report(job, *busy)
    result = tick.run_tick(job.pk)
    assert result is not None and result.outcome == "decided", result and result.outcome
    grown = SchedulingDecision.objects.get(job=job)
    assert grown.reason == Reason.GROW_INTO_FREE_DEVICES
    assert {uid.split("/")[0] for uid in grown.device_uids} == {"node-c"}
