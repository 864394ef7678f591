"""The jobs page in a real browser: the list and its filters, and the submit form (operators and
admins only): an example spec submitted lands on its job page; a bad spec shows each problem at
its line and creates nothing; a viewer sees no form and the API refuses the viewer's POST."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Page, expect

from common.models import AuditEvent
from jobs.models import Job, JobState
from tests.factories import spec, submit
from tests.frontend.conftest import screenshot
from tests.services import wait_until
from tests.stack import LiveStack

pytestmark = pytest.mark.django_db(transaction=True)

LONG_RUNNING = {"kind": "math", "iterations": 500, "prompts_per_iteration": 64, "samples_per_prompt": 4}

# Three problems the API reports by key path (lines 10, 12 and 13 of this text).
BAD_SPEC = """\
name: bad-job
model: {name: qwen2.5-1.5b, params_b: 1.5}
workload: {kind: math, iterations: 3, prompts_per_iteration: 64, samples_per_prompt: 4}
components:
  - name: rollout
    kind: rollout
    workers: 4
  - name: actor
    kind: actor
    workers: 2
    parallelism: {tp: 1, valid_dp: [1]}
    depends_on: [rolout]
policy: {name: dinarl}
"""


def test_an_operator_submits_an_example_spec_and_lands_on_its_page(
    live_stack: LiveStack, login: Any, users: dict[str, tuple[str, str]]
) -> None:
    live_stack.start_agent("gpu-a", gpus=8, hardware="H100").wait_registered()
    live_stack.start_agent("gpu-b", gpus=8, hardware="H100", seed=1).wait_registered()
    page: Page = login("operator")
    page.goto("/jobs/")
    page.get_by_role("button", name="Submit a job").click()
    expect(page.locator("#submit-card")).to_be_visible()
    picker = page.locator("#example-picker")
    names = picker.locator("option").all_inner_texts()
    assert {"controlplane/demo/math-1.5b-dynarl.yaml", "examples/rlinf-hetero.yaml"} <= set(names)
    assert "examples/math-1.5b-colocated.json" in names
    picker.select_option(label="controlplane/demo/math-1.5b-dynarl.yaml")
    expect(page.locator("#spec-text")).to_have_value(re.compile(r"name: demo-math-1\.5b"))
    screenshot(page, "jobs-submit-form")

    page.get_by_role("button", name="Submit", exact=True).click()
    expect(page).to_have_url(re.compile(r"/jobs/\d+/$"), timeout=30_000)
    job_id = int(page.url.rstrip("/").rsplit("/", 1)[1])
    job = Job.objects.get(pk=job_id)
    assert (job.name, job.owner.username, job.policy) == ("demo-math-1.5b", users["operator"][0], "dynarl")
    assert job.idempotency_key.startswith("web-")
    assert AuditEvent.objects.filter(
        verb="job.submit", object_id=str(job_id), actor=users["operator"][0]
    ).exists()
    screenshot(page, "jobs-submitted-job-page")

    page.goto("/jobs/")
    row = page.locator(f'#jobs-table tr[data-job="{job_id}"]')
    expect(row).to_contain_text("demo-math-1.5b")
    expect(row).to_contain_text(users["operator"][0])
    expect(row.locator("a")).to_have_attribute("href", f"/jobs/{job_id}/")


def test_a_bad_spec_shows_each_problem_at_its_line_and_creates_nothing(
    live_stack: LiveStack, login: Any
) -> None:
    page: Page = login("admin")
    page.goto("/jobs/#submit")
    editor = page.locator("#spec-text")
    editor.fill(BAD_SPEC)
    page.get_by_role("button", name="Submit", exact=True).click()

    problems = page.locator("#spec-errors li")
    expect(problems).to_have_count(3)
    by_path = {
        "components[1].workers": "10",
        "components[1].depends_on[0]": "12",
        "policy.name": "13",
    }
    for path, line in by_path.items():
        item = page.locator(f'#spec-errors li[data-path="{path}"]')
        expect(item).to_have_attribute("data-line", line)
        expect(item).to_contain_text(f"line {line} · {path}:")
        expect(page.locator(f'#spec-gutter .err[data-line="{line}"]')).to_be_visible()
    expect(page.locator('#spec-errors li[data-path="policy.name"]')).to_contain_text(
        "unknown policy 'dinarl'"
    )
    expect(page.locator("#submit-error")).to_contain_text("400")
    expect(page).to_have_url(re.compile(r"/jobs/#submit$"))
    screenshot(page, "jobs-submit-bad-spec")

    # Clicking a problem selects its line in the editor.
    page.locator('#spec-errors li[data-path="policy.name"]').click()
    selected = editor.evaluate("t => t.value.slice(t.selectionStart, t.selectionEnd)")
    assert selected == "policy: {name: dinarl}"

    # A syntax error is placed at the line the parser names.
    editor.fill("name: broken\ncomponents:\n  - name: rollout\n   kind: rollout\n")
    page.get_by_role("button", name="Submit", exact=True).click()
    expect(page.locator("#spec-errors li")).to_have_count(1)
    expect(page.locator("#spec-errors li")).to_contain_text("YAML syntax error")
    line = page.locator("#spec-errors li").get_attribute("data-line")
    assert line in {"3", "4"}
    expect(page.locator(f'#spec-gutter .err[data-line="{line}"]')).to_be_visible()
    assert not Job.objects.exists()


def test_a_viewer_sees_no_submit_form_and_the_api_refuses_the_viewers_post(
    live_stack: LiveStack, login: Any
) -> None:
    page: Page = login("viewer")
    page.goto("/jobs/")
    expect(page.locator("#jobs-table")).to_be_visible()
    expect(page.locator("#open-submit")).to_have_count(0)
    expect(page.locator("#submit-form")).to_have_count(0)
    refused = page.evaluate(
        """spec => window.dynarl.api("jobs/", {method: "POST", body: spec,
               headers: {"Content-Type": "application/yaml", "Idempotency-Key": "viewer-try"}})
             .then(() => 0, (e) => e.status)""",
        BAD_SPEC.replace("dinarl", "dynarl").replace("rolout", "rollout").replace("[1]", "[2]"),
    )
    assert refused == 403
    assert not Job.objects.exists()
    screenshot(page, "jobs-viewer")


def test_the_list_filters_by_state_policy_and_owner(
    live_stack: LiveStack, login: Any, users: dict[str, tuple[str, str]]
) -> None:
    operator = User.objects.get(username=users["operator"][0])
    admin = User.objects.get(username=users["admin"][0])
    live_stack.start_agent("gpu-a", gpus=8, hardware="H100").wait_registered()
    # The first job takes 6 of the 8 GPUs and runs; the other two wait in the queue.
    first = submit(operator, spec("first-dynarl", workload=LONG_RUNNING))
    second = submit(operator, spec("second-static", policy="static-disaggregated"))
    third = submit(admin, spec("third-admins"))
    assert wait_until(lambda: Job.objects.get(pk=first.pk).state == JobState.RUNNING, timeout_s=60)
    assert Job.objects.get(pk=second.pk).state == JobState.PENDING
    page: Page = login("viewer")
    page.goto("/jobs/")
    rows = page.locator("#jobs-table tbody tr[data-job]")
    expect(rows).to_have_count(3)
    expect(page.locator("#job-count")).to_have_text("3 jobs")

    page.select_option("#filter-policy", "static-disaggregated")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-job", str(second.pk))
    expect(page).to_have_url(re.compile(r"\?policy=static-disaggregated$"))

    page.select_option("#filter-policy", "")
    page.fill("#filter-owner", users["admin"][0])
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-job", str(third.pk))

    page.fill("#filter-owner", users["operator"][0])
    expect(rows).to_have_count(2)
    assert {r.get_attribute("data-job") for r in rows.all()} == {str(first.pk), str(second.pk)}
    page.select_option("#filter-state", "pending")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-job", str(second.pk))
    page.select_option("#filter-state", "running")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-job", str(first.pk))
    page.select_option("#filter-state", "failed")
    expect(page.locator("#jobs-table tbody")).to_contain_text("No jobs match")
    screenshot(page, "jobs-filtered-empty")

    # The filters live in the URL: a reload shows the same selection.
    page.reload()
    expect(page.locator("#filter-state")).to_have_value("failed")
    expect(page.locator("#filter-owner")).to_have_value(users["operator"][0])
    page.get_by_role("button", name="Clear").click()
    expect(rows).to_have_count(3)
    expect(page.locator(f'#jobs-table tr[data-job="{first.pk}"] td').nth(1)).to_contain_text("running")
    expect(page.locator(f'#jobs-table tr[data-job="{third.pk}"] td').nth(1)).to_contain_text("pending")
    screenshot(page, "jobs-list")
