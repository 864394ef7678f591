"""What the end-to-end tests share: job specs, waiting on the live stack, and the checks that the
database and the agents agree on who runs where."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from django.utils import timezone

from cluster.models import Device, DeviceStatus
from jobs.models import Job, Worker, WorkerState
from scheduler.models import Migration, MigrationState
from tests.ray_cluster import NAMESPACE, LocalRayCluster
from tests.services import wait_until
from tests.stack import DEFAULT_SIM_SPEED, LiveStack, NodeAgent

LIVE_WORKER_STATES = (WorkerState.STARTING, WorkerState.RUNNING)
FINISHED_MIGRATION_STATES = (MigrationState.COMMITTED, MigrationState.ROLLED_BACK, MigrationState.FAILED)


def math_spec(
    name: str,
    *,
    policy: str = "dynarl",
    iterations: int = 1000,
    prompts: int = 64,
    samples: int = 4,
    max_new_tokens: int = 2048,
    rollout: int = 6,
    actor: int = 2,
    policy_params: dict[str, Any] | None = None,
    actor_valid_dp: tuple[int, ...] = (2, 4, 6),
) -> dict[str, Any]:
    """A math RL job on a 1.5B model for 8 GPUs: ``rollout`` engines and an ``actor`` gang of one
    of the ``actor_valid_dp`` sizes (by default it may grow to 4 or 6 ranks)."""
    return {
        "name": name,
        "backend": "sim",
        "model": {"name": "qwen2.5-1.5b", "params_b": 1.5},
        "workload": {
            "kind": "math",
            "iterations": iterations,
            "prompts_per_iteration": prompts,
            "samples_per_prompt": samples,
            "max_new_tokens": max_new_tokens,
        },
        "components": [
            {"name": "rollout", "kind": "rollout", "workers": rollout, "min_workers": 2},
            {
                "name": "actor",
                "kind": "actor",
                "workers": actor,
                "min_workers": 2,
                "parallelism": {"tp": 1, "valid_dp": list(actor_valid_dp)},
                "depends_on": ["rollout"],
            },
        ],
        "policy": {"name": policy, "params": policy_params or {}},
    }


def start_cluster(
    stack: LiveStack,
    nodes: Iterable[str] = ("node-a", "node-b"),
    gpus: int = 4,
    speed: float = DEFAULT_SIM_SPEED,
) -> None:
    """Sim hosts of ``gpus`` each, ``speed`` virtual seconds per wall second."""
    agents = [stack.start_agent(name, gpus=gpus, speed=speed) for name in nodes]
    for agent in agents:
        agent.wait_registered()


def submit(stack: LiveStack, spec: dict[str, Any]) -> Job:
    status, body = stack.api("POST", "/api/v1/jobs/", spec)
    assert status == 201, body
    return Job.objects.get(pk=body["id"])


def wait_running(stack: LiveStack, job: Job, timeout_s: float = 90) -> None:
    """Until the job runs and every one of its workers runs (the agents launched them)."""

    def running() -> bool:
        job.refresh_from_db()
        workers = Worker.objects.filter(group__job=job)
        return job.state == "running" and workers.exists() and not workers.exclude(state="running").exists()

    assert wait_until(running, timeout_s=timeout_s), (
        f"job {job.pk} is {job.state} ({job.state_reason}: {job.state_detail})\n{stack.logs()}"
    )


def wait_migration_finished(stack: LiveStack, migration: Migration, timeout_s: float = 120) -> Migration:
    def finished() -> bool:
        migration.refresh_from_db()
        return migration.state in FINISHED_MIGRATION_STATES

    assert wait_until(finished, timeout_s=timeout_s), (
        f"migration {migration.migration_id} still {migration.state}: "
        f"{list(migration.steps.order_by('index').values_list('kind', 'state', 'nodes'))}\n{stack.logs()}"
    )
    return migration


def wait_released(stack: LiveStack, job: Job) -> None:
    """Every worker of ``job`` stopped (the agents confirmed) and every device free."""

    def released() -> bool:
        return (
            not Worker.objects.filter(group__job=job).exclude(state=WorkerState.STOPPED).exists()
            and not Device.objects.exclude(status=DeviceStatus.FREE, worker__isnull=True).exists()
        )

    assert wait_until(released, timeout_s=60), (
        f"{list(Worker.objects.filter(group__job=job).values_list('name', 'state'))} "
        f"{list(Device.objects.values_list('uid', 'status', 'worker__name'))}\n{stack.logs()}"
    )


def live_workers(job: Job, group: str | None = None) -> set[str]:
    workers = Worker.objects.filter(group__job=job, state__in=LIVE_WORKER_STATES)
    if group is not None:
        workers = workers.filter(group__name=group)
    return set(workers.values_list("name", flat=True))


def allocation(job: Job) -> dict[str, set[str]]:
    """group -> the device uids its live workers own, from the database."""
    owned: dict[str, set[str]] = {}
    for uid, group in Device.objects.filter(
        worker__group__job=job, worker__state__in=LIVE_WORKER_STATES
    ).values_list("uid", "worker__group__name"):
        owned.setdefault(group, set()).add(uid)
    return owned


def ownership_is_consistent(job: Job) -> list[str]:
    """Problems with the database's view: a live worker without devices, a device owned by a
    worker that is not live. Empty when consistent."""
    problems = []
    for worker in Worker.objects.filter(group__job=job, state__in=LIVE_WORKER_STATES):
        if not worker.devices.exists():
            problems.append(f"live worker {worker.name} owns no device")
    for uid, name, state in Device.objects.filter(worker__group__job=job).values_list(
        "uid", "worker__name", "worker__state"
    ):
        if state not in LIVE_WORKER_STATES:
            problems.append(f"{uid} is owned by {name}, which is {state}")
    return problems


def agents_disagree(nodes: Iterable[str], since: Any) -> list[str]:
    """Where what the agents report differs from the database: every device must carry a worker
    on its agent (memory in use, from the agent's heartbeat) exactly when the database gives it to
    a live worker. Only readings newer than ``since`` count."""
    problems = []
    for device in Device.objects.filter(node__name__in=list(nodes)).select_related("worker"):
        if device.reported_at is None or device.reported_at <= since:
            problems.append(f"{device.uid}: no reading since {since:%H:%M:%S.%f}")
            continue
        owned = device.worker is not None and device.worker.state in LIVE_WORKER_STATES
        busy = device.memory_used_gb > 0
        if owned != busy:
            owner = device.worker.name if device.worker else "nobody"
            problems.append(
                f"{device.uid}: database says {owner}, agent reports {device.memory_used_gb} GB in use"
            )
    return problems


def wait_agents_agree(stack: LiveStack, nodes: Iterable[str], timeout_s: float = 60) -> None:
    """Until every agent's devices match the database (readings taken after this call began)."""
    nodes = list(nodes)
    since = timezone.now()
    assert wait_until(lambda: not agents_disagree(nodes, since), timeout_s=timeout_s), (
        f"{agents_disagree(nodes, since)}\n{stack.logs()}"
    )


def journal_events(agent: NodeAgent) -> list[dict[str, Any]]:
    """The agent's step journal, over every process of it. The agent may be appending while this
    reads: a torn last line is skipped (it is read whole next time)."""
    path = Path(agent.state_dir) / "journal.jsonl"
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


# The configuration tests/runtime/rl/test_loop.py shows learning (its seeds rise by 0.26 to 0.48
# over 20 iterations; the same job without learning moves by at most 0.04): the runtime's default
# model and task, 16 problems trained over every iteration, 8 samples each, a KL term to the
# reference. Sampling seeds are per sample, so which engine serves a sample changes nothing.
REAL_JOB_ITERATIONS = 16


def real_job(name: str, **workload: Any) -> dict[str, Any]:
    return {
        "name": name,
        "backend": "ray",
        "model": {"name": "tiny-gpt", "params_b": 0.0001},
        "workload": {
            "iterations": REAL_JOB_ITERATIONS,
            "prompts_per_iteration": 16,
            "samples_per_prompt": 8,
            "max_new_tokens": 40,
            **workload,
        },
        "runtime": {"dataset_size": 16, "kl_coef": 0.02},
        "components": [
            {"name": "rollout", "kind": "rollout", "workers": 2},
            {"name": "reference", "kind": "inference", "workers": 1},
            {"name": "reward", "kind": "reward", "workers": 1},
            {
                "name": "actor",
                "kind": "actor",
                "workers": 2,
                "depends_on": ["rollout", "reward", "reference"],
            },
        ],
        "policy": {"name": "static-disaggregated"},
    }


def moving_real_job(
    name: str, iterations: int, rollout: int, reward: int = 2, **workload: Any
) -> dict[str, Any]:
    """The real job laid out for the trainer to grow from one rank to four by GPUs of its rollout
    (``rollout`` engines, down to one) and of its ``reward`` workers (down to one)."""
    spec = real_job(name, iterations=iterations, **workload)
    spec["components"] = [
        {"name": "rollout", "kind": "rollout", "workers": rollout, "min_workers": 1},
        {"name": "reference", "kind": "inference", "workers": 1},
        {"name": "reward", "kind": "reward", "workers": reward, "min_workers": 1},
        {
            "name": "actor",
            "kind": "actor",
            "workers": 1,
            "max_workers": 4,
            "parallelism": {"valid_dp": [1, 2, 4]},
            "depends_on": ["rollout", "reward", "reference"],
        },
    ]
    return spec


def start_ray_agents(stack: LiveStack, cluster: LocalRayCluster, checkpoints: Path) -> None:
    agents = [
        stack.start_ray_agent(node, address=cluster.address, namespace=NAMESPACE, checkpoint_dir=checkpoints)
        for node in cluster.nodes
    ]
    for agent in agents:
        agent.wait_registered()


def start_moving_real_job(
    stack: LiveStack, cluster: LocalRayCluster, checkpoints: Path, name: str, iterations: int, rollout: int
) -> Job:
    """The Ray agents started and ``moving_real_job`` submitted, waited until it trained once."""
    start_ray_agents(stack, cluster, checkpoints)
    job = submit(stack, moving_real_job(name, iterations, rollout))
    wait_running(stack, job, timeout_s=180)
    assert wait_until(lambda: job.iteration_results.exists(), timeout_s=300), stack.logs()
    return job
