"""RLinf node groups on a real cluster: a label names node ranks, never a hardware type, and each
component lands on the nodes of its group (node rank = host-name order, docs/job-spec.md)."""

from __future__ import annotations

import pytest
from django.test import Client

from cluster.models import Device, Node, NodeStatus
from common.audit import Actor
from jobs.admission import admit_pending
from jobs.models import Job, JobState
from tests.factories import make_cluster, make_user

pytestmark = pytest.mark.django_db

# Labels that look like hardware (h800) on a cluster of H100 nodes: RLinf reads them as names.
CONFIG = """
cluster:
  num_nodes: 3
  component_placement:
    actor:
      node_group: h800
      placement: 0-15
    rollout:
      node_group: gen
      placement: 0-7
  node_groups:
    - label: h800
      node_ranks: 1-2
    - label: gen
      node_ranks: 0
runner:
  max_steps: 5
  experiment_name: node-groups
rollout:
  model_dir: /models/Qwen2.5-1.5B/
actor:
  model:
    tensor_model_parallel_size: 1
"""


def submit_yaml(text: str) -> tuple[int, dict[str, object]]:
    client = Client()
    client.force_login(make_user("alice"))
    response = client.post("/api/v1/jobs/", text, content_type="application/yaml")
    return response.status_code, response.json()


def nodes_of(job: Job, group: str) -> set[str]:
    return set(
        Device.objects.filter(worker__group__job=job, worker__group__name=group).values_list(
            "node__name", flat=True
        )
    )


def test_a_node_group_labelled_like_hardware_runs_on_the_node_ranks_of_its_group() -> None:
    make_cluster({"node-0": ("H100", 8), "node-1": ("H100", 8), "node-2": ("H100", 8)})
    status, body = submit_yaml(CONFIG)
    # It was refused with "rank 0 is H100, not h800": the label had become a hardware affinity.
    assert status == 201, body
    job = Job.objects.get(pk=body["id"])
    assert job.state == JobState.ADMITTED
    assert nodes_of(job, "actor") == {"node-1", "node-2"}
    assert nodes_of(job, "rollout") == {"node-0"}
    assert job.groups.get(name="actor").hardware == []


def test_node_ranks_do_not_shift_while_a_node_is_lost() -> None:
    make_cluster({"node-0": ("H100", 8), "node-1": ("H100", 8), "node-2": ("H100", 8)})
    Node.objects.filter(name="node-0").update(status=NodeStatus.LOST)
    status, body = submit_yaml(CONFIG)
    assert status == 201, body
    job = Job.objects.get(pk=body["id"])
    # The rollout's group is node rank 0, which is lost: it waits rather than move to node-1.
    assert job.state == JobState.PENDING
    assert "rank 0 (node-0/gpu0) is not free" in job.state_detail
    Node.objects.filter(name="node-0").update(status=NodeStatus.READY)
    admit_pending(actor=Actor.scheduler())
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED
    assert (nodes_of(job, "actor"), nodes_of(job, "rollout")) == ({"node-1", "node-2"}, {"node-0"})
