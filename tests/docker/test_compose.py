"""The compose file's structure: every long-running service restarts, and start-up waits on health.

No Docker engine runs here, and no well-kept package ships the Compose schema for offline use, so
the file is checked as data: the rules below are the ones docker/docker-compose.yml promises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.services import REPO_ROOT

COMPOSE = REPO_ROOT / "docker" / "docker-compose.yml"
ONE_SHOT = {"migrate"}  # runs to completion; everything else runs until stopped
NO_HEALTHCHECK = {"beat"}  # its liveness is its process; /healthz reports whether it schedules


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    compose = yaml.safe_load(Path(COMPOSE).read_text())
    assert set(compose) <= {"services", "volumes", "networks", "configs", "secrets", "name"}
    return compose["services"]  # type: ignore[no-any-return]


def test_every_long_running_service_is_restarted(services: dict[str, dict[str, Any]]) -> None:
    long_running = set(services) - ONE_SHOT
    assert {"postgres", "redis", "web", "worker", "beat"} <= long_running
    policies = {name: services[name].get("restart") for name in long_running}
    assert policies == dict.fromkeys(long_running, "unless-stopped")


def test_the_one_shot_migration_is_not_restarted(services: dict[str, dict[str, Any]]) -> None:
    # A compose string "no", not YAML's boolean false.
    assert {name: services[name]["restart"] for name in ONE_SHOT} == dict.fromkeys(ONE_SHOT, "no")


def test_long_running_services_have_healthchecks(services: dict[str, dict[str, Any]]) -> None:
    for name in set(services) - ONE_SHOT - NO_HEALTHCHECK:
        check = services[name].get("healthcheck")
        assert check, f"{name} has no healthcheck"
        assert check["test"][0] in {"CMD", "CMD-SHELL"}, name
        assert {"interval", "timeout", "retries"} <= set(check), name


def test_start_up_waits_on_what_each_service_needs(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: depends_on without conditions"
        for needed, rule in depends.items():
            assert needed in services, f"{name} depends on unknown {needed}"
            if rule["condition"] == "service_healthy":
                assert "healthcheck" in services[needed], f"{name} waits on {needed}'s health, which has none"
            else:
                assert rule["condition"] == "service_completed_successfully"
                assert needed in ONE_SHOT
    for name in {"web", "worker", "beat"}:
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_the_web_healthcheck_script_is_valid_python(services: dict[str, dict[str, Any]]) -> None:
    cmd = services["web"]["healthcheck"]["test"]
    assert cmd[:3] == ["CMD", "python", "-c"]
    compile(cmd[3], "web healthcheck", "exec")
