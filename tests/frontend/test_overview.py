"""The cluster overview in a real browser: the nodes and GPUs of running sim agents, a job's GPUs
coloured by component, totals by job, and a lost node flagged as it happens."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import Page, expect

from cluster.models import Device, DeviceStatus, Node, NodeStatus
from tests.factories import spec
from tests.frontend.conftest import screenshot
from tests.services import wait_until
from tests.stack import LiveStack

pytestmark = pytest.mark.django_db(transaction=True)

LONG_RUNNING = {"kind": "math", "iterations": 500, "prompts_per_iteration": 64, "samples_per_prompt": 4}


@pytest.fixture
def stack_settings() -> dict[str, str]:
    # A silent agent is declared lost within seconds, so the test can watch the page flag it.
    return {"NODE_LOST_AFTER_S": "4", "NODE_LIVENESS_CHECK_S": "1"}


def submit_running_job(live_stack: LiveStack, name: str, **components: int) -> dict[str, Any]:
    # A static policy, so the GPUs the page shows stay where admission put them.
    body = spec(name, workload=LONG_RUNNING, policy="static-disaggregated", **components)
    status, job = live_stack.api("POST", "/api/v1/jobs/", body)
    assert status == 201, job
    assert wait_until(
        lambda: Device.objects.filter(worker__group__job_id=job["id"]).count() == sum(components.values()),
        timeout_s=60,
    ), live_stack.logs()[-4000:]
    return job


def test_overview_shows_nodes_gpus_and_a_jobs_components(
    live_stack: LiveStack, login: Any, users: dict[str, tuple[str, str]]
) -> None:
    live_stack.start_agent("gpu-a", gpus=8, hardware="H100").wait_registered()
    live_stack.start_agent("gpu-b", gpus=4, hardware="H20", seed=1).wait_registered()
    job = submit_running_job(live_stack, "overview-job", rollout=4, actor=2)

    page: Page = login("viewer")
    page.goto("/")
    rows = page.locator(".node-row")
    expect(rows).to_have_count(2)
    expect(page.locator('.node-row[data-node="gpu-a"] .gpu')).to_have_count(8)
    expect(page.locator('.node-row[data-node="gpu-b"] .gpu')).to_have_count(4)
    expect(page.locator('.node-row[data-node="gpu-b"] .meta').first).to_contain_text("H20")

    # Every GPU the job holds is drawn in its colour, named by its component; the rest are free.
    owned = Device.objects.filter(worker__group__job_id=job["id"]).select_related("worker__group")
    held = {d.uid: d.worker.group.name for d in owned}
    cells = page.locator(f'.gpu[data-job="{job["id"]}"]')
    expect(cells).to_have_count(6)
    for uid, group in held.items():
        cell = page.locator(f'.gpu[data-uid="{uid}"]')
        expect(cell).to_have_attribute("data-group", group)
        expect(cell.locator(".owner")).to_have_text(f"#{job['id']} {group}")
        assert "utilisation" in (cell.get_attribute("title") or "")
    expect(page.locator("#gpu-map .gpu.free")).to_have_count(12 - 6)
    colours = {
        group: page.locator(f'.gpu[data-job="{job["id"]}"][data-group="{group}"]').first.evaluate(
            "cell => getComputedStyle(cell).backgroundColor"
        )
        for group in ("rollout", "actor")
    }
    assert colours["rollout"] != colours["actor"]

    # Totals by job and component, as a chart and a table.
    table = page.locator("#by-job-table")
    expect(table.locator(f'tr[data-job="{job["id"]}"][data-group="rollout"] td.num')).to_have_text("4")
    expect(table.locator(f'tr[data-job="{job["id"]}"][data-group="actor"] td.num')).to_have_text("2")
    expect(page.locator("#by-job-chart .main-svg").first).to_be_visible()
    expect(page.locator("#stat-gpus .value")).to_have_text("12")
    expect(page.locator("#legend")).to_contain_text("overview-job")
    screenshot(page, "cluster-overview")

    # A host that goes silent is flagged lost on the open page, without reloading it.
    live_stack.start_agent("gpu-c", gpus=2, hardware="A100", seed=2).wait_registered()
    expect(page.locator('.node-row[data-node="gpu-c"] .gpu')).to_have_count(2, timeout=60_000)
    live_stack.agent("gpu-c").kill()
    assert wait_until(lambda: Node.objects.get(name="gpu-c").status == NodeStatus.LOST, timeout_s=60)
    lost_row = page.locator('.node-row[data-node="gpu-c"]')
    expect(lost_row).to_have_class("node-row lost", timeout=60_000)
    expect(lost_row.locator(".lost-flag")).to_have_text("LOST")
    expect(page.locator("#stat-nodes-lost .value")).to_have_text("1")
    expect(lost_row.locator(".gpu.lost")).to_have_count(2)
    expect(page.locator('.node-row[data-node="gpu-a"]')).to_have_class("node-row ready")
    assert Device.objects.filter(node__name="gpu-c", status=DeviceStatus.LOST).count() == 2
    screenshot(page, "cluster-node-lost")
