"""Content-Security-Policy on every page (issue 11, finding 10: there was none): scripts and
styles from this server only, no inline script anywhere, inline styles only where this response's
nonce allows them (Plotly's rule sheet, Swagger UI's few rules)."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from tests.factories import make_cluster, make_user, spec, submit

pytestmark = pytest.mark.django_db

# Data blocks (<script type="application/json">, Django's json_script) are never run: allowed.
INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)(?![^>]*type=\"application/json\")[^>]*>", re.IGNORECASE)
STYLE_ATTRIBUTE = re.compile(r"<[^>]+\sstyle=", re.IGNORECASE)


def directives(header: str) -> dict[str, list[str]]:
    parsed: dict[str, list[str]] = {}
    for part in header.split(";"):
        name, *values = part.split()
        parsed[name] = values
    return parsed


def check_page(client: Client, path: str) -> str:
    response = client.get(path)
    assert response.status_code == 200, (path, response.status_code)
    policy = directives(response["Content-Security-Policy"])
    assert policy["default-src"] == ["'self'"]
    assert policy["script-src"] == ["'self'", "'report-sample'"], path  # no inline script, no eval
    assert policy["object-src"] == ["'none'"] and policy["frame-ancestors"] == ["'none'"]
    style = policy["style-src"]
    assert "'unsafe-inline'" not in style
    html = response.content.decode()
    assert not INLINE_SCRIPT.findall(html), (path, INLINE_SCRIPT.findall(html))
    assert not STYLE_ATTRIBUTE.findall(html), (path, STYLE_ATTRIBUTE.findall(html))
    for nonce in re.findall(r'<style[^>]*nonce="([^"]+)"', html):
        assert f"'nonce-{nonce}'" in style, path
    return html


def test_every_dashboard_page_and_the_api_docs_carry_the_policy(client: Client) -> None:
    make_cluster({"node-a": ("H100", 8)})
    operator = make_user("csp-operator", "operator")
    job = submit(operator, spec())
    check_page(client, "/login/")
    client.force_login(operator)
    for path in ("/", "/jobs/", f"/jobs/{job.pk}/", "/audit/"):
        html = check_page(client, path)
        assert 'id="plotly.js-style-global" nonce="' in html, path  # where Plotly writes its CSS rules
    docs = check_page(client, "/api/docs/")
    [script_url] = re.findall(r'<script src="([^"]*\?[^"]*script=[^"]*)"', docs)
    script = client.get(script_url.replace("&amp;", "&"))
    assert script.status_code == 200 and script["Content-Type"].startswith("application/javascript")
    assert "SwaggerUIBundle" in script.content.decode()


def test_nonces_differ_per_response(client: Client) -> None:
    first = directives(client.get("/login/")["Content-Security-Policy"])["style-src"]
    second = directives(client.get("/login/")["Content-Security-Policy"])["style-src"]
    assert first != second
