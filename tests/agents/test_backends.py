"""Execution backends: nodes register the backends their agent runs, and a job is placed only on
nodes that run its backend (a ray job never lands on simulated hosts)."""

from __future__ import annotations

import pytest
from django.test import Client

from cluster.models import Device, Node
from common.models import AuditEvent
from jobs.models import Job, JobReason, JobState, Worker
from tests.agents.conftest import Agent, devices, register
from tests.agents.test_register import post_register
from tests.factories import make_user, ray_spec, spec, submit

pytestmark = pytest.mark.django_db


def nodes_of(job: Job) -> set[str]:
    return set(Device.objects.filter(worker__group__job=job).values_list("node__name", flat=True))


def launches(agent: Agent) -> list[int]:
    return [c["payload"]["job"] for c in agent.fetch().json()["commands"] if c["kind"] == "launch_workers"]


def test_registration_records_the_backends_the_agent_runs(client: Client, bootstrap: str) -> None:
    _, body = register(client, bootstrap, "ray-a", backend="ray", backends=["ray"])
    assert body["node"]["backend"] == "ray" and body["node"]["backends"] == ["ray"]
    assert Node.objects.get(name="ray-a").backends == ["ray"]
    assert AuditEvent.objects.get(verb="node.register").payload["backends"] == ["ray"]
    # An agent that names only its backend (protocol 1 before `backends`) offers that one.
    _, body = register(client, bootstrap, "sim-a")
    assert body["node"]["backends"] == ["sim"] and Node.objects.get(name="sim-a").backends == ["sim"]


def test_an_agent_registering_again_with_another_backend_updates_the_node(
    client: Client, bootstrap: str
) -> None:
    register(client, bootstrap, "node-a")
    _, body = register(client, bootstrap, "node-a", backend="ray", backends=["ray"])
    node = Node.objects.get(name="node-a")
    assert (node.backend, node.backends) == ("ray", ["ray"]) and body["node"]["backends"] == ["ray"]
    changed = AuditEvent.objects.get(verb="node.backends_changed")
    assert changed.actor == "agent:node-a" and changed.object_id == str(node.pk)
    assert changed.payload == {"from": ["sim"], "to": ["ray"]}
    # The same backends again change nothing worth an audit row of their own.
    register(client, bootstrap, "node-a", backend="ray", backends=["ray"])
    assert AuditEvent.objects.filter(verb="node.backends_changed").count() == 1


@pytest.mark.parametrize(
    ("extra", "path"),
    [
        ({"backends": "ray"}, "backends"),
        ({"backends": []}, "backends"),
        ({"backends": ["sim", "k8s"]}, "backends[1]"),
        ({"backends": ["sim", "sim"]}, "backends[1]"),
        ({"backend": "sim", "backends": ["ray"]}, "backends"),
    ],
)
def test_bad_backends_are_refused_by_field(
    client: Client, bootstrap: str, extra: dict[str, object], path: str
) -> None:
    response = post_register(client, bootstrap, {"host": "node-a", "devices": devices(2), **extra})
    assert response.status_code == 400  # type: ignore[attr-defined]
    fields = response.json()["error"]["fields"]  # type: ignore[attr-defined]
    assert [f["path"] for f in fields] == [path], fields
    assert not Node.objects.exists()


def test_a_ray_job_waits_for_a_ray_node_and_never_runs_on_sim_hosts(client: Client, bootstrap: str) -> None:
    sim = {host: register(client, bootstrap, host, gpus=4)[0] for host in ("sim-a", "sim-b")}
    owner = make_user("alice")
    job = submit(owner, ray_spec("ray-job", rollout=1, actor=2))

    # Eight free simulated GPUs, but none runs ray: the job waits and says why.
    assert (job.state, job.state_reason) == (JobState.PENDING, JobReason.WAITING_FOR_DEVICES)
    assert job.state_detail == (
        "waiting for a node whose agent runs the 'ray' backend: no ready node offers it (ready nodes run sim)"
    )
    assert not Worker.objects.filter(group__job=job).exists()
    assert all(launches(agent) == [] for agent in sim.values())
    # The operator sees the reason on the job.
    operator = Client()
    operator.force_login(owner)
    shown = operator.get(f"/api/v1/jobs/{job.pk}/").json()
    assert (shown["state"], shown["state_detail"]) == ("pending", job.state_detail)

    # A node whose agent runs ray registers: the job is admitted there, and only there.
    ray_agent, _ = register(client, bootstrap, "ray-a", gpus=4, backend="ray", backends=["ray"])
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED
    assert nodes_of(job) == {"ray-a"}
    assert launches(ray_agent) == [job.pk]
    assert all(launches(agent) == [] for agent in sim.values())


def test_a_sim_job_is_not_placed_on_a_ray_only_node(client: Client, bootstrap: str) -> None:
    register(client, bootstrap, "ray-a", gpus=4, backend="ray", backends=["ray"])
    job = submit(make_user("alice"), spec("sim-job", rollout=2, actor=2))
    assert job.state == JobState.PENDING
    assert "the 'sim' backend" in job.state_detail and "ready nodes run ray" in job.state_detail

    register(client, bootstrap, "sim-a", gpus=4)
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED and nodes_of(job) == {"sim-a"}


def test_a_job_waiting_for_its_backend_does_not_hold_back_jobs_of_another(
    client: Client, bootstrap: str
) -> None:
    register(client, bootstrap, "sim-a", gpus=4)
    owner = make_user("alice")
    ray_job = submit(owner, ray_spec("ray-first", rollout=1, actor=2, priority=10))
    sim_job = submit(owner, spec("sim-later", rollout=2, actor=2))
    assert ray_job.state == JobState.PENDING
    assert sim_job.state == JobState.ADMITTED and nodes_of(sim_job) == {"sim-a"}
    # Jobs of the waiting job's own backend keep its priority order behind it.
    small_ray = submit(owner, ray_spec("ray-small", rollout=1, actor=1))
    # Room for the small one (3 GPUs), not the first (4): the small one still waits behind it.
    register(client, bootstrap, "ray-a", gpus=3, backend="ray", backends=["ray"])
    ray_job.refresh_from_db()
    small_ray.refresh_from_db()
    assert (ray_job.state, small_ray.state) == (JobState.PENDING, JobState.PENDING)
    assert ray_job.state_detail.startswith("waiting for devices: ")
    assert ray_job.state_detail.endswith("(on the nodes running the 'ray' backend)")


def test_a_job_no_cluster_of_this_shape_could_hold_is_still_refused(client: Client, bootstrap: str) -> None:
    register(client, bootstrap, "sim-a", gpus=4)
    response = Client()
    response.force_login(make_user("alice"))
    refused = response.post(
        "/api/v1/jobs/", ray_spec("huge-ray", rollout=100, actor=2), content_type="application/json"
    )
    assert refused.status_code == 422
    assert [f["path"] for f in refused.json()["error"]["fields"]] == ["components.rollout"]
    assert not Job.objects.exists()
