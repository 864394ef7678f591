"""Signing in and out of the dashboard in a real browser."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Browser, Page, expect

from tests.frontend.conftest import VIEWPORT, screenshot
from tests.stack import LiveStack

pytestmark = pytest.mark.django_db(transaction=True)


def test_sign_in_with_the_right_password_and_out_again(
    browser: Browser, live_stack: LiveStack, users: dict[str, tuple[str, str]]
) -> None:
    context = browser.new_context(viewport=VIEWPORT, base_url=live_stack.url)
    page: Page = context.new_page()
    try:
        page.goto("/jobs/")
        expect(page).to_have_url(re.compile(r"/login/\?next=/jobs/"))
        screenshot(page, "login")
        username, password = users["viewer"]
        page.fill("#id_username", username)
        page.fill("#id_password", "not-" + password)
        page.click("button[type=submit]")
        expect(page.get_by_role("alert")).to_contain_text("didn't match")
        expect(page).to_have_url(re.compile(r"/login/"))
        screenshot(page, "login-wrong-password")

        page.fill("#id_username", username)
        page.fill("#id_password", password)
        page.click("button[type=submit]")
        expect(page).to_have_url(re.compile(r"/jobs/$"))
        expect(page.locator("#whoami")).to_have_text(username)
        expect(page.locator(".who .badge")).to_have_text("viewer")

        page.get_by_role("button", name="Sign out").click()
        expect(page).to_have_url(re.compile(r"/login/"))
        page.goto("/")
        expect(page).to_have_url(re.compile(r"/login/\?next=/$"))
    finally:
        context.close()
