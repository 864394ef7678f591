"""One job's page in a real browser against a live stack with sim agents: the hypergraph and the
charts render; migrations asked for in the page and through the API show up live, without a
reload, and open to their steps; pause, resume and cancel work; a viewer sees no operator control
and the API refuses the viewer's migrate request."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from common.audit import Actor
from common.models import AuditEvent
from jobs import services
from jobs.models import Job, JobState
from scheduler.models import Migration, MigrationState, SchedulingDecision, Tick
from tests.e2e.helpers import real_job, start_ray_agents
from tests.factories import spec
from tests.frontend.conftest import screenshot
from tests.ray_cluster import LocalRayCluster
from tests.services import wait_until
from tests.stack import LiveStack

pytestmark = pytest.mark.django_db(transaction=True)

LIVE_TIMEOUT_MS = 60_000


def long_job(name: str) -> dict[str, Any]:
    """A job that keeps running for the whole test; its policy never migrates on its own, so every
    migration the page shows is one the test asked for."""
    return spec(
        name,
        rollout=4,
        actor=2,
        policy="static-disaggregated",
        workload={"kind": "math", "iterations": 5000, "prompts_per_iteration": 64, "samples_per_prompt": 4},
    )


def draining_job(name: str) -> dict[str, Any]:
    """A job whose rollout drains into a long tail every iteration, under the dynarl policy: it
    soon weighs moving the idle engines' GPUs to the trainer."""
    return {
        "name": name,
        "model": {"name": "qwen2.5-1.5b", "params_b": 1.5},
        "workload": {
            "kind": "math",
            "iterations": 5000,
            "prompts_per_iteration": 256,
            "samples_per_prompt": 8,
            "max_new_tokens": 8192,
        },
        "components": [
            {"name": "rollout", "kind": "rollout", "workers": 6, "min_workers": 2},
            {
                "name": "actor",
                "kind": "actor",
                "workers": 2,
                "min_workers": 2,
                "parallelism": {"tp": 1, "valid_dp": [2, 4, 6]},
                "depends_on": ["rollout"],
            },
        ],
        "policy": {"name": "dynarl", "params": {"u_low": 0.2, "sustain_s": 3.0, "cooldown_s": 10.0}},
    }


def running_job(stack: LiveStack, job_spec: dict[str, Any], **agent: Any) -> int:
    stack.start_agent("gpu-a", gpus=8, hardware="H100", **agent).wait_registered()
    status, job = stack.api("POST", "/api/v1/jobs/", job_spec)
    assert status == 201, job
    running = wait_until(lambda: Job.objects.get(pk=job["id"]).state == JobState.RUNNING, timeout_s=90)
    assert running, stack.logs()
    return int(job["id"])


def open_job_page(page: Page, job_id: int) -> None:
    page.goto(f"/jobs/{job_id}/")
    expect(page.locator("#job-page")).to_have_attribute("data-ready", "true", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#live")).to_have_class("live connected", timeout=LIVE_TIMEOUT_MS)


def test_an_operator_watches_and_steers_a_running_job(live_stack: LiveStack, login: Any) -> None:
    job_id = running_job(live_stack, long_job("page-job"))
    page: Page = login("operator")
    open_job_page(page, job_id)

    # Header, hypergraph (one node per group, one edge) and the charts.
    expect(page.locator("#job-name")).to_have_text("page-job")
    expect(page.locator("#job-state")).to_have_text("running")
    expect(page.locator("#job-policy")).to_have_text("static-disaggregated")
    # The scheduler's last tick, and why it moved nothing: this policy never does.
    expect(page.locator("#last-tick")).to_contain_text(
        "no change — static-disaggregated never moves GPUs", timeout=LIVE_TIMEOUT_MS
    )
    expect(page.locator("#hypergraph g.hg-node")).to_have_count(2, timeout=LIVE_TIMEOUT_MS)
    expect(page.locator('#hypergraph g.hg-node[data-group="rollout"]')).to_contain_text("4 GPUs")
    expect(page.locator('#hypergraph g.hg-node[data-group="actor"]')).to_contain_text("2 GPUs")
    expect(page.locator('#hypergraph g.hg-edge[data-edge="rollout->actor"]')).to_have_count(1)
    expect(page.locator("#gantt .barlayer .point")).to_have_count(6)  # one bar per GPU held
    expect(page.locator("#util-chart .main-svg").first).to_be_visible()
    expect(page.locator("#throughput-chart .main-svg").first).to_be_visible()
    expect(page.locator("#util-chart .scatterlayer .trace")).to_have_count(2, timeout=LIVE_TIMEOUT_MS)
    # Live telemetry keeps extending the series.
    points_before = page.evaluate("document.getElementById('util-chart').data[0].x.length")
    # A function, not an expression: Playwright would eval() an expression, which the page's CSP refuses.
    page.wait_for_function(
        f"() => document.getElementById('util-chart').data[0].x.length > {points_before}",
        timeout=LIVE_TIMEOUT_MS,
    )
    screenshot(page, "job-page-running")

    # Anything that reloaded the page would lose this.
    page.evaluate("window.__keptAcrossEvents = 'still here'")

    # A bad request is answered at its field.
    page.select_option("#migrate-donor", "rollout")
    page.select_option("#migrate-recipient", "actor")
    page.fill("#migrate-workers", "9")
    page.click("#migrate-submit")
    expect(page.locator('#migrate-form .field-error[data-field="workers"]')).to_contain_text(
        "only 4 workers", timeout=LIVE_TIMEOUT_MS
    )
    assert Migration.objects.filter(job_id=job_id).count() == 0

    # A manual migration from the page: its state follows the live events to committed.
    page.fill("#migrate-workers", "1")
    page.fill("#migrate-reason", "give the trainer one more GPU")
    page.click("#migrate-submit")
    expect(page.locator('#migrate-form .field-error[data-field="workers"]')).to_be_empty()
    expect(page.locator("#control-message")).to_contain_text("started", timeout=LIVE_TIMEOUT_MS)
    first = Migration.objects.get(job_id=job_id)
    row = page.locator(f'#migration-log tr.migration[data-migration-id="{first.migration_id}"]')
    expect(row).to_have_attribute("data-state", "committed", timeout=LIVE_TIMEOUT_MS)
    expect(row).to_contain_text("rollout → actor")
    expect(page.locator('#hypergraph g.hg-node[data-group="actor"]')).to_contain_text(
        "3 GPUs", timeout=LIVE_TIMEOUT_MS
    )

    # One asked for through the API (not by this page) arrives over the socket.
    status, body = live_stack.api(
        "POST", f"/api/v1/jobs/{job_id}/migrate/", {"donor": "actor", "recipient": "rollout", "workers": 1}
    )
    assert status == 202, body
    second = page.locator(f'#migration-log tr.migration[data-migration-id="{body["migration_id"]}"]')
    expect(second).to_have_count(1, timeout=LIVE_TIMEOUT_MS)
    expect(second).to_have_attribute("data-state", "committed", timeout=LIVE_TIMEOUT_MS)
    expect(second).to_contain_text("actor → rollout")
    # Its decision joined the log, and the timeline marks both migrations.
    expect(page.locator("#decision-log tr.decision", has_text=body["migration_id"])).to_have_count(
        1, timeout=LIVE_TIMEOUT_MS
    )
    expect(page.locator("#gantt")).to_contain_text("migration committed", timeout=LIVE_TIMEOUT_MS)
    assert page.evaluate("window.__keptAcrossEvents") == "still here"

    # A migration opens to its steps, each with a duration.
    row.click()
    steps = page.locator("#migration-log table.steps tr.step")
    committed = Migration.objects.get(pk=first.pk)
    assert committed.state == MigrationState.COMMITTED
    expect(steps).to_have_count(committed.steps.count())
    durations = page.locator("#migration-log table.steps td.step-duration").all_inner_texts()
    assert durations and all(text.endswith(" s") for text in durations), durations
    expect(page.locator("#migration-log table.steps")).to_contain_text("start_workers")
    # The operator's decision opens to what was asked for and why.
    page.locator("#decision-log tr.decision", has_text=first.migration_id).click()
    expect(page.locator("#decision-log .decision-detail")).to_contain_text("give the trainer one more GPU")
    screenshot(page, "job-page-migrations")

    # The log filters by strategy and state.
    migration_rows = page.locator("#migration-log tr.migration")
    page.select_option("#migration-state", "rolled_back")
    expect(migration_rows).to_have_count(0)
    expect(page.locator("#migration-log")).to_contain_text("No migration matches.")
    page.select_option("#migration-state", "committed")
    expect(migration_rows).to_have_count(2)
    page.select_option("#migration-strategy", "restart")
    expect(migration_rows).to_have_count(0)
    page.select_option("#migration-strategy", "p2p")
    expect(migration_rows).to_have_count(2)
    page.select_option("#migration-strategy", "")
    page.select_option("#migration-state", "")

    # Pause and resume the scheduler.
    page.click("#pause-btn")
    expect(page.locator("#job-state")).to_have_text("paused_scheduling", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#resume-btn")).to_be_visible()
    expect(page.locator("#pause-btn")).to_be_hidden()
    assert Job.objects.get(pk=job_id).state == JobState.PAUSED_SCHEDULING
    page.click("#resume-btn")
    expect(page.locator("#job-state")).to_have_text("running", timeout=LIVE_TIMEOUT_MS)
    assert Job.objects.get(pk=job_id).state == JobState.RUNNING

    # Cancel asks first; keeping the job changes nothing.
    page.click("#cancel-btn")
    expect(page.locator("#cancel-dialog")).to_be_visible()
    page.click("#cancel-keep")
    expect(page.locator("#cancel-dialog")).to_be_hidden()
    assert Job.objects.get(pk=job_id).state == JobState.RUNNING
    page.click("#cancel-btn")
    page.fill("#cancel-detail", "done watching")
    page.click("#cancel-confirm")
    expect(page.locator("#job-state")).to_have_text("cancelled", timeout=LIVE_TIMEOUT_MS)
    cancelled = Job.objects.get(pk=job_id)
    assert cancelled.state == JobState.CANCELLED and cancelled.state_detail == "done watching"
    expect(page.locator("#pause-btn")).to_be_disabled()
    assert page.evaluate("window.__keptAcrossEvents") == "still here"
    screenshot(page, "job-page-cancelled")


def test_a_viewer_sees_no_controls_and_the_api_refuses_the_viewers_migrate(
    live_stack: LiveStack, login: Any, users: dict[str, tuple[str, str]]
) -> None:
    # Slow enough a sim that the rollout's idle tail outlasts the policy's sustain window.
    job_id = running_job(live_stack, draining_job("viewed-job"), speed=2.0)
    page: Page = login("viewer")
    open_job_page(page, job_id)
    expect(page.locator("#hypergraph g.hg-node")).to_have_count(2, timeout=LIVE_TIMEOUT_MS)
    for control in (
        "#controls",
        "#migrate-form",
        "#pause-btn",
        "#resume-btn",
        "#cancel-btn",
        "#cancel-dialog",
    ):
        expect(page.locator(control)).to_have_count(0)

    # The policy's first decision arrives live; it opens to the candidates it weighed.
    weighed = SchedulingDecision.objects.filter(job_id=job_id).exclude(candidates=[])
    started = time.monotonic()
    assert wait_until(weighed.exists, timeout_s=120), (
        list(SchedulingDecision.objects.filter(job_id=job_id).values_list("reason", "detail")),
        list(Tick.objects.filter(job_id=job_id).values_list("outcome", flat=True)[:20]),
        Job.objects.filter(pk=job_id).values("state", "iteration").first(),
    )
    print(f"first weighed decision after {time.monotonic() - started:.1f} s")
    decision = weighed.order_by("at").first()
    assert decision is not None
    row = page.locator(f'#decision-log tr.decision[data-decision-id="{decision.pk}"]')
    expect(row).to_have_count(1, timeout=LIVE_TIMEOUT_MS)
    row.click()
    candidates = page.locator("#decision-log table.candidates tbody tr")
    expect(candidates).to_have_count(len(decision.candidates))
    expect(page.locator("#decision-log table.candidates tr.chosen")).to_have_count(1)
    expect(page.locator("#decision-log table.candidates")).to_contain_text("→")
    screenshot(page, "job-page-viewer")

    # The control plane restarts; what changed meanwhile comes with the hello after the reconnect.
    page.evaluate("window.__keptAcrossReconnect = 'still here'")
    live_stack.server.stop()
    expect(page.locator("#live")).to_have_class("live disconnected", timeout=LIVE_TIMEOUT_MS)
    services.pause_scheduling(job_id, Actor.system("test"), "paused while the page was cut off")
    live_stack.server.start()
    expect(page.locator("#live")).to_have_class("live connected", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#job-state")).to_have_text("paused_scheduling", timeout=LIVE_TIMEOUT_MS)
    expect(page.locator("#job-reason")).to_contain_text("paused while the page was cut off")
    assert page.evaluate("window.__keptAcrossReconnect") == "still here"

    answer = page.evaluate(
        """async (jobId) => {
            try {
                await window.dynarl.api(`jobs/${jobId}/migrate/`, {
                    method: "POST", body: {donor: "rollout", recipient: "actor", workers: 1},
                });
                return {status: 202};
            } catch (failure) {
                return {status: failure.status, code: failure.error.code};
            }
        }""",
        job_id,
    )
    assert answer == {"status": 403, "code": "permission_denied"}
    viewer = users["viewer"][0]
    assert not Migration.objects.filter(job_id=job_id, requested_by=viewer).exists()
    assert not AuditEvent.objects.filter(actor=viewer, verb="job.migrate").exists()


def test_a_real_jobs_page_draws_its_reward_curve_as_it_trains(
    live_stack: LiveStack, login: Any, ray_cluster: LocalRayCluster, warm_start_cache: Path
) -> None:
    """A job on the ray backend (its agentic variant): its page gains a point of the reward curve
    and of the rollout's throughput and lengths for every iteration trained, live, says which
    weights the engines hold, and what the episodes' tool calls and KV reuse were."""
    start_ray_agents(live_stack, ray_cluster, warm_start_cache)
    spec = real_job("real-page", kind="agentic", iterations=3, max_turns=3, tool_latency_s=0.01)
    spec["components"].insert(2, {"name": "tools", "kind": "tool", "workers": 1})
    status, job = live_stack.api("POST", "/api/v1/jobs/", spec)
    assert status == 201, job
    page: Page = login("viewer")
    open_job_page(page, int(job["id"]))
    expect(page.locator("#training")).to_be_visible()
    expect(page.locator("#job-state")).to_have_text("succeeded", timeout=300_000)
    expect(page.locator("#reward-chart .scatterlayer .trace").first.locator(".point")).to_have_count(
        3, timeout=LIVE_TIMEOUT_MS
    )
    expect(page.locator("#rollout-chart .barlayer .point")).to_have_count(3)
    expect(page.locator("#training-meta")).to_contain_text("iteration 2: reward")
    expect(page.locator("#training-meta")).to_contain_text("weights v3 on every engine")
    expect(page.locator("#training-meta")).to_contain_text("tool calls in")
    expect(page.locator("#training-meta")).to_contain_text("of the context from the prefix caches")
    screenshot(page, "job-page-real-training")


def test_a_simulated_jobs_page_has_no_training_card(live_stack: LiveStack, login: Any) -> None:
    job_id = running_job(live_stack, long_job("sim-page"))
    page: Page = login("viewer")
    open_job_page(page, job_id)
    expect(page.locator("#training")).to_have_count(0)
