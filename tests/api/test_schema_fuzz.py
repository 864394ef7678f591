"""schemathesis over the live OpenAPI document: every operation of ``/api/schema/`` is called on the
ASGI app (as daphne serves it) with generated requests, valid and invalid, as an admin, over a
database holding a running and a queued job, a committed migration, snapshots, decisions,
predictor samples, a tick, alerts and audit events. The checks run are all of schemathesis's
(a server error, a response that breaks its schema, an undocumented status, content type or
header, a request that does not end within the request timeout: each fails the test), with a fixed
seed and a few examples per operation so the run stays short. Two are adjusted, for these reasons:

- ``negative_data_rejection`` is off: an invalid value schemathesis generates for a query
  parameter often serialises into a valid one (``true`` for a list of strings, nothing at all
  for an object), so it reports requests the API rightly answers. Invalid requests are still
  held to every other check, and the leniencies it did find (booleans, page sizes) are fixed and
  tested in test_query_limits.
- ``positive_data_acceptance`` also takes 400 and 422 from the three operations whose rules the
  schema cannot carry: a job spec's content (``POST /jobs/``), a token's owner and expiry
  (``POST /tokens/``), a manual migration's groups and the job's state (``migrate``).

The rows are created once for the module and removed at its end (as a transactional test's
flush does); operations share them, so what one changes (a cancelled job), the next one sees.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import schemathesis
from django.core.management import call_command
from django.db import connection
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from common.models import ApiToken, hash_token
from controlplane.asgi import application
from tests.api.conftest import build_history
from tests.factories import make_cluster, make_user, mark_running, spec, submit

EXAMPLES = 8
REQUEST_TIMEOUT_S = 30  # an export (or anything) that does not end fails its case
ADMIN_KEY = ApiToken.PREFIX + secrets.token_urlsafe(32)
BUSINESS_RULES = ["2xx", "3xx", "400", "401", "403", "404", "409", "422", "429", "5xx"]

CONFIG = SchemathesisConfig.from_dict(
    {
        "seed": 11,
        "request-timeout": REQUEST_TIMEOUT_S,
        "auth": {"openapi": {"bearerAuth": {"bearer": ADMIN_KEY}}},
        "generation": {"deterministic": True, "max-examples": EXAMPLES, "database": "none"},
        "checks": {"negative_data_rejection": {"enabled": False}},
        "operations": [
            {
                "include-path": path,
                "include-method": "POST",
                "checks": {"positive_data_acceptance": {"expected-statuses": BUSINESS_RULES}},
            }
            for path in ("/api/v1/jobs/", "/api/v1/tokens/", "/api/v1/jobs/{id}/migrate/")
        ],
    }
)
# Loaded at import, before pytest-django adds "testserver" to ALLOWED_HOSTS.
schema = schemathesis.openapi.from_asgi(
    "/api/schema/", application, config=CONFIG, headers={"Host": "localhost"}
)


# The test database is set up, and each test runs in a transaction of its own in this thread;
# the app answers from threads of its own, so it sees what this module committed.
pytestmark = [pytest.mark.django_db, pytest.mark.timeout(180)]  # per operation


def committed(work: Callable[[], None]) -> None:
    """Run ``work`` on a connection of its own (autocommit), outside this test's transaction."""

    def run() -> None:
        try:
            work()
        finally:
            connection.close()

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()


@pytest.fixture(scope="module")
def fuzz_data(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """Committed rows for the whole module, removed at its end. Each request's connection is
    closed when it ends (the app gives every request a thread of its own)."""
    with django_db_blocker.unblock(), pytest.MonkeyPatch.context() as patch:
        assert connection.settings_dict["NAME"].startswith("test_"), "not on the test database"
        patch.setitem(connection.settings_dict, "CONN_MAX_AGE", 0)
        try:
            make_cluster({"node-a": ("H100", 4), "node-b": ("H100", 4), "node-c": ("A100", 2)})
            admin = make_user("admin", "admin")
            operator = make_user("operator", "operator")
            make_user("viewer", "viewer")
            ApiToken.objects.create(
                user=admin, name="schemathesis", key_hash=hash_token(ADMIN_KEY), key_prefix=ADMIN_KEY[:12]
            )
            build_history(mark_running(submit(operator, spec("math-small", rollout=4, actor=2))), operator)
            submit(operator, spec("math-queued", rollout=4, actor=2))  # waits: 4 of its 6 GPUs are free
            yield
        finally:
            call_command("flush", interactive=False, verbosity=0)


@pytest.fixture
def admin_key(fuzz_data: None) -> str:
    """The admin's key, active again if an earlier operation revoked it."""
    committed(
        lambda: ApiToken.objects.filter(key_hash=hash_token(ADMIN_KEY)).update(revoked_at=None) and None
    )
    return ADMIN_KEY


@schema.parametrize()
@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_every_operation_answers_as_its_schema_says(case: Any, admin_key: str) -> None:
    case.call_and_validate()
