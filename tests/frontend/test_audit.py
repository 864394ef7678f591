"""The audit page in a real browser: a job submission appears with who, what, when and why; the
filters narrow the list; a row opens to its payload; the exports carry the same filters."""

from __future__ import annotations

import csv
import io
import json
import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from playwright.sync_api import Page, expect

from common.models import AuditEvent
from tests.factories import spec
from tests.frontend.conftest import screenshot
from tests.stack import LiveStack

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_audit_page_lists_a_submission_and_filters_it(
    live_stack: LiveStack, login: Any, users: dict[str, tuple[str, str]]
) -> None:
    live_stack.start_agent("gpu-a", gpus=8, hardware="H100").wait_registered()
    operator_name = users["operator"][0]
    page: Page = login("operator")
    # Submitted from the operator's browser session, as the jobs page does.
    job = page.evaluate(
        """spec => window.dynarl.api("jobs/", {method: "POST", body: spec,
               headers: {"Idempotency-Key": "audit-page-test"}})""",
        spec("audited-job"),
    )
    submitted = AuditEvent.objects.get(verb="job.submit", object_id=str(job["id"]))
    assert submitted.actor == operator_name
    assert User.objects.get(username=operator_name) == submitted.actor_user

    page.goto("/audit/")
    rows = page.locator("#audit-table tbody tr[data-event]")
    expect(rows.first).to_be_visible()
    expect(page.locator(f'#audit-table tr[data-event="{submitted.pk}"]')).to_contain_text("job.submit")

    page.fill("#filter-actor", operator_name)
    page.fill("#filter-verb", "job.submit")
    expect(rows).to_have_count(1)
    row = rows.first
    expect(row).to_have_attribute("data-event", str(submitted.pk))
    expect(row).to_contain_text(operator_name)
    expect(row).to_contain_text(f"jobs.job#{job['id']}")
    expect(row.locator("a")).to_have_attribute("href", f"/jobs/{job['id']}/")
    expect(page).to_have_url(re.compile(r"actor=operator-user&verb=job\.submit"))

    # The row opens to its payload.
    payload = page.locator(f'tr[data-payload-of="{submitted.pk}"]')
    expect(payload).to_be_hidden()
    row.click()
    expect(payload).to_be_visible()
    expect(payload).to_contain_text('"name": "audited-job"')
    screenshot(page, "audit-filtered")

    # The exports carry the filters and hold the same event.
    csv_href = page.locator("#export-csv").get_attribute("href") or ""
    assert "verb=job.submit" in csv_href and "format=csv" in csv_href
    response = page.request.get(live_stack.url + csv_href)
    assert response.status == 200
    records = list(csv.DictReader(io.StringIO(response.text())))
    assert [(r["id"], r["verb"], r["actor"]) for r in records] == [
        (str(submitted.pk), "job.submit", operator_name)
    ]
    json_href = page.locator("#export-json").get_attribute("href") or ""
    exported = json.loads(page.request.get(live_stack.url + json_href).text())
    assert [e["id"] for e in exported] == [submitted.pk]

    # A time range after the submission holds none of it; one around it holds it again.
    later = timezone.localtime(submitted.at + timedelta(minutes=5))
    page.evaluate(
        """([id, value]) => { const input = document.getElementById(id); input.value = value;
                              input.dispatchEvent(new Event("change", {bubbles: true})); }""",
        ["filter-after", later.strftime("%Y-%m-%dT%H:%M:%S")],
    )
    expect(page.locator("#audit-table tbody")).to_contain_text("No events match")
    page.get_by_role("button", name="Clear").click()
    expect(page.locator("#filter-verb")).to_have_value("")
    page.select_option("#filter-actor-type", "user")
    # Awaited through locators: the table re-renders as the filter lands and as events arrive.
    expect(page).to_have_url(re.compile(r"actor_type=user"))
    expect(page.locator('#audit-table tbody tr[data-verb="job.submit"]')).not_to_have_count(0)
    expect(rows.locator(".badge").filter(has_not_text="user")).to_have_count(0)
    screenshot(page, "audit")
