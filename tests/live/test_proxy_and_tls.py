"""The web server as the run command starts it, behind (or pretending to be behind) a proxy.

Issue 11, finding 10: daphne ran with ``--proxy-headers``, so any client could claim another
address or HTTPS with X-Forwarded-For / X-Forwarded-Proto; and even behind TLS there was no HSTS
and no ``Secure`` cookie. Now the headers count only from ``TRUSTED_PROXIES``, and ``DYNARL_TLS``
turns HSTS and Secure cookies on. Login throttling and the /metrics allow-list see the address
the proxy setting lets through.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.models import ApiToken
from controlplane.stack import build_processes
from tests.factories import make_cluster, make_user, spec
from tests.services import REPO_ROOT, free_port, stop_process_tree, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

CLIENT = "203.0.113.7"  # the address a proxy says the request came from


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


OPENER = urllib.request.build_opener(NoRedirect)


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: str

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    def cookies(self) -> dict[str, str]:
        """Set-Cookie lines by cookie name."""
        return {line.split("=", 1)[0]: line for k, line in self.headers if k.lower() == "set-cookie"}


@dataclass
class Web:
    url: str

    def call(
        self, path: str, method: str = "GET", body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> Answer:
        request = urllib.request.Request(self.url + path, data=body, method=method, headers=headers or {})
        try:
            with OPENER.open(request, timeout=60) as response:
                return Answer(response.status, response.headers.items(), response.read().decode())
        except urllib.error.HTTPError as exc:
            return Answer(exc.code, exc.headers.items(), exc.read().decode(errors="replace"))

    def sign_in(self, username: str, password: str, headers: dict[str, str], origin: str) -> int:
        """The login form as a browser posts it (CSRF cookie and token); the answer's status."""
        form = self.call("/login/", headers=headers)
        token = re.search(r"csrftoken=([^;]+)", form.cookies()["csrftoken"])
        assert token is not None
        body = urllib.parse.urlencode(
            {"username": username, "password": password, "csrfmiddlewaretoken": token.group(1)}
        ).encode()
        answer = self.call(
            "/login/",
            "POST",
            body,
            {
                **headers,
                "Content-Type": "application/x-www-form-urlencoded",
                "Cookie": f"csrftoken={token.group(1)}",
                "Origin": origin,
                "Referer": origin + "/login/",
            },
        )
        return answer.status


@pytest.fixture
def start_web(service_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., Web]]:
    """The run command's own daphne command line, with extra settings."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(**settings: str) -> Web:
        env = {**service_env, "DJANGO_SETTINGS_MODULE": "controlplane.settings", **settings}
        port = free_port()
        command = build_processes(env, "127.0.0.1", port, 0)["web"]
        log = (tmp_path / f"web-{len(procs)}.log").open("wb")
        proc = subprocess.Popen(
            shlex.split(command), env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        procs.append(proc)
        web = Web(f"http://127.0.0.1:{port}")

        def answers() -> bool:
            try:
                urllib.request.urlopen(web.url + "/login/", timeout=2)
            except urllib.error.HTTPError:
                return True
            except OSError:
                return False
            return True

        assert wait_until(answers, timeout_s=60), (tmp_path / f"web-{len(procs) - 1}.log").read_text()
        return web

    yield start
    for proc in procs:
        stop_process_tree(proc)


def submit_location(web: Web, token: str, headers: dict[str, str]) -> str:
    answer = web.call(
        "/api/v1/jobs/",
        "POST",
        json.dumps(spec(rollout=1, actor=1)).encode(),
        {"Authorization": f"Bearer {token}", "Content-Type": "application/json", **headers},
    )
    assert answer.status == 201, answer.body
    location = answer.header("Location")
    assert location is not None
    return location


def test_proxy_headers_from_an_untrusted_peer_change_nothing(start_web: Callable[..., Web]) -> None:
    make_cluster({"node-a": ("H100", 8)})
    operator = make_user("proxy-operator", "operator")
    token = ApiToken.issue(operator, "proxy")[1]
    web = start_web(DYNARL_TLS="1")  # no TRUSTED_PROXIES: this test is nobody's proxy
    spoofed = {"X-Forwarded-For": CLIENT, "X-Forwarded-Proto": "https"}

    # Not HTTPS because a client says so: absolute URLs stay http, and no HSTS goes out.
    assert submit_location(web, token, spoofed).startswith(web.url + "/api/v1/jobs/")
    login = web.call("/login/", headers=spoofed)
    assert login.status == 200 and login.header("Strict-Transport-Security") is None
    # Behind TLS (DYNARL_TLS=1), cookies are Secure whatever the request looked like.
    assert "; Secure" in login.cookies()["csrftoken"]

    # Not another address because a client says so: /metrics goes by the real peer (loopback) ...
    assert web.call("/metrics", headers=spoofed).status == 200
    # ... and so does login throttling: a new X-Forwarded-For per guess does not escape the lock.
    make_user("alice")
    for attempt in range(5):
        forged = {"X-Forwarded-For": f"198.51.100.{attempt + 1}"}
        assert web.sign_in("alice", f"wrong-{attempt}", forged, web.url) in (200, 429)
    assert web.sign_in("alice", "pw-alice", {"X-Forwarded-For": "198.51.100.99"}, web.url) == 429


def test_proxy_headers_from_a_trusted_proxy_are_honoured(start_web: Callable[..., Web]) -> None:
    make_cluster({"node-a": ("H100", 8)})
    operator = make_user("proxy-operator", "operator")
    token = ApiToken.issue(operator, "proxy")[1]
    web = start_web(DYNARL_TLS="1", TRUSTED_PROXIES="127.0.0.0/8")
    host = web.url.removeprefix("http://")
    via_tls = {"X-Forwarded-For": CLIENT, "X-Forwarded-Proto": "https"}

    assert submit_location(web, token, via_tls).startswith(f"https://{host}/api/v1/jobs/")
    login = web.call("/login/", headers=via_tls)
    assert login.header("Strict-Transport-Security") == "max-age=31536000"
    assert "; Secure" in login.cookies()["csrftoken"]

    # The client is the forwarded address: not this machine, so /metrics (loopback only) refuses it.
    refused = web.call("/metrics", headers=via_tls)
    assert refused.status == 403 and CLIENT in json.loads(refused.body)["error"]["message"]
    assert web.call("/metrics").status == 200  # the proxy host itself

    # Throttling counts per forwarded client: one client's lock does not lock another.
    make_user("alice")
    origin = f"https://{host}"
    for attempt in range(5):
        web.sign_in("alice", f"wrong-{attempt}", via_tls, origin)
    assert web.sign_in("alice", "pw-alice", via_tls, origin) == 429
    other = {"X-Forwarded-For": "203.0.113.8", "X-Forwarded-Proto": "https"}
    assert web.sign_in("alice", "pw-alice", other, origin) == 302
