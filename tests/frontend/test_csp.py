"""The dashboard works under its Content-Security-Policy: in a real browser, the pages draw their
charts and live views and the browser reports no violation (issue 11, finding 10)."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import ConsoleMessage, Page, expect

from cluster.models import Device
from tests.factories import spec
from tests.services import wait_until
from tests.stack import LiveStack

pytestmark = pytest.mark.django_db(transaction=True)

LONG_RUNNING = {"kind": "math", "iterations": 500, "prompts_per_iteration": 64, "samples_per_prompt": 4}
RECORD_VIOLATIONS = """
window.__cspViolations = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__cspViolations.push(`${e.violatedDirective} ${e.blockedURI} ${e.sourceFile} ${e.sample}`);
});
"""
# The one refusal the policy means: the map library's stylesheet, which plotly's full bundle
# writes at load for map traces the dashboard never draws.
EXPECTED = "style-src-elem inline "
MAP_STYLES = ".maplibregl-map"


def violations(page: Page) -> list[str]:
    found: list[str] = page.evaluate("window.__cspViolations || []")
    return [v for v in found if not (v.startswith(EXPECTED) and "plotly.min.js" in v and MAP_STYLES in v)]


def test_the_dashboard_runs_under_its_content_security_policy(live_stack: LiveStack, login: Any) -> None:
    live_stack.start_agent("csp-gpu", gpus=8, hardware="H100").wait_registered()
    body = spec("csp-job", workload=LONG_RUNNING, policy="static-disaggregated", rollout=4, actor=2)
    status, job = live_stack.api("POST", "/api/v1/jobs/", body)
    assert status == 201, job
    assert wait_until(
        lambda: Device.objects.filter(worker__group__job_id=job["id"]).count() == 6, timeout_s=60
    ), live_stack.logs()[-4000:]

    page: Page = login("operator")
    console: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        # Plotly warns "Cannot addRelatedStyleRule, probably due to strict CSP" when it finds no
        # sheet it may write to. The browser's own report of the map styles is in violations().
        if "strict CSP" in message.text:
            console.append(message.text)

    page.on("console", on_console)
    page.context.add_init_script(RECORD_VIOLATIONS)

    page.goto("/")
    expect(page.locator("#live")).to_have_class("live connected")  # the WebSocket ('self')
    expect(page.locator("#by-job-chart .main-svg").first).to_be_visible()  # Plotly drew
    # Style values the JS sets (job colours, utilisation bars) take effect through CSSOM.
    cell = page.locator(f'.gpu[data-job="{job["id"]}"]').first
    expect(cell).not_to_have_css("background-color", "rgba(0, 0, 0, 0)")
    # Plotly found the nonce'd <style> and wrote its rules there.
    rules = page.evaluate("document.getElementById('plotly.js-style-global').sheet.cssRules.length")
    assert rules > 0
    assert violations(page) == [] and console == [], (violations(page), console)

    page.goto(f"/jobs/{job['id']}/")
    expect(page.locator("#live")).to_have_class("live connected")
    expect(page.locator("#util-chart .main-svg").first).to_be_visible()
    assert violations(page) == [] and console == [], (violations(page), console)

    page.goto("/jobs/")
    expect(page.locator(f'tr[data-job="{job["id"]}"]').first).to_be_visible()
    page.goto("/audit/")
    expect(page.locator("#audit-table tbody tr").first).to_be_visible()
    assert violations(page) == [] and console == [], (violations(page), console)

    page.goto("/api/docs/")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("dynarl API")
    assert violations(page) == [] and console == [], (violations(page), console)
