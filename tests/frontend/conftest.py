"""Browser tests: headless Debian Chromium driven by Playwright against a live stack (daphne,
Celery worker and beat, sim agents) on the test database."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.contrib.auth.models import Group, User
from playwright.sync_api import Browser, BrowserContext, Page, ViewportSize, expect, sync_playwright

from tests import stack
from tests.services import REPO_ROOT
from tests.stack import LiveStack

CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = REPO_ROOT / "test-artifacts" / "screenshots"
VIEWPORT: ViewportSize = {"width": 1440, "height": 900}
# Pages wait on a live stack sharing two cores with the test: give every check time.
ACTION_TIMEOUT_MS = 30_000
expect.set_options(timeout=20_000)

# The live stack fixtures (tests/stack.py), for the browser tests.
live_stack = stack.live_stack
stack_settings = stack.stack_settings


# Playwright's sync API keeps an event loop in this thread, and Django refuses ORM calls from a
# thread with a running loop. The test's own ORM calls never overlap the loop, so the guard is
# lifted in this process only; the servers under test keep it (see service_env below). The
# browser lives as long as this package's tests: a loop left running would break later tests
# that call async_to_sync (the live-event tests).
ASYNC_UNSAFE = "DJANGO_ALLOW_ASYNC_UNSAFE"


@pytest.fixture(scope="package")
def browser() -> Iterator[Browser]:
    previous = os.environ.get(ASYNC_UNSAFE)
    os.environ[ASYNC_UNSAFE] = "true"
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            yield chromium
        finally:
            chromium.close()
            if previous is None:
                os.environ.pop(ASYNC_UNSAFE, None)
            else:
                os.environ[ASYNC_UNSAFE] = previous


@pytest.fixture
def service_env(service_env: dict[str, str]) -> dict[str, str]:
    """The live stack's processes run with Django's async-safety guard on."""
    return {key: value for key, value in service_env.items() if key != ASYNC_UNSAFE}


@pytest.fixture
def users() -> dict[str, tuple[str, str]]:
    """One user per role, in the test database: role -> (username, password)."""
    accounts: dict[str, tuple[str, str]] = {}
    for role in ("admin", "operator", "viewer"):
        username, password = f"{role}-user", f"{role}-secret-pw"
        user = User.objects.create_user(username=username, password=password)
        user.groups.add(Group.objects.get_or_create(name=role)[0])
        accounts[role] = (username, password)
    return accounts


@pytest.fixture
def login(
    browser: Browser, live_stack: LiveStack, users: dict[str, tuple[str, str]]
) -> Iterator[Callable[[str], Page]]:
    """``login("operator")`` opens a fresh browser context and signs in through /login/."""
    contexts: list[BrowserContext] = []

    def sign_in(role: str) -> Page:
        username, password = users[role]
        context = browser.new_context(viewport=VIEWPORT, base_url=live_stack.url)
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(ACTION_TIMEOUT_MS)
        page.goto("/login/")
        page.fill("#id_username", username)
        page.fill("#id_password", password)
        page.click("button[type=submit]")
        expect(page).not_to_have_url(re.compile(r"/login/"))
        expect(page.locator("#whoami")).to_have_text(username)
        page.wait_for_load_state("load")
        return page

    yield sign_in
    for context in contexts:
        context.close()


def screenshot(page: Page, name: str) -> Path:
    """Save a full-page screenshot under test-artifacts/screenshots/<name>.png (an artifact)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
