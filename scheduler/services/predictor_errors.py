"""Predictor error: once a committed migration has settled, compare what the policy predicted
for the donor, the recipient and the job with what the signals now show."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings

from common import audit
from common.audit import Actor
from jobs.models import Job
from scheduler.core.signals import GroupSignals
from scheduler.models import Migration, MigrationState, PredictorSample, PredictorScope


def settle(job: Job, signals: Mapping[str, GroupSignals], now: Any) -> list[PredictorSample]:
    recorded: list[PredictorSample] = []
    cutoff = now - timedelta(seconds=settings.PREDICTOR_SETTLE_S)
    kinds = dict(job.groups.values_list("name", "kind"))
    for migration in Migration.objects.filter(
        job=job, state=MigrationState.COMMITTED, settled=False, finished_at__lte=cutoff
    ).select_related("decision"):
        chosen = (migration.decision.chosen or {}) if migration.decision else {}
        prediction = (chosen.get("chosen") or {}).get("prediction")
        if prediction:
            observed = {
                PredictorScope.DONOR: (migration.donor, signals.get(migration.donor)),
                PredictorScope.RECIPIENT: (migration.recipient, signals.get(migration.recipient)),
            }
            for scope, (group, s) in observed.items():
                if group and s is not None:
                    recorded.append(
                        PredictorSample.objects.create(
                            migration=migration,
                            job=job,
                            scope=scope,
                            group=group,
                            component=kinds.get(group, ""),
                            predicted=float(prediction[f"{scope}_after"]),
                            observed=s.tokens_per_s,
                            recorded_at=now,
                        )
                    )
            recorded.append(
                PredictorSample.objects.create(
                    migration=migration,
                    job=job,
                    scope=PredictorScope.JOB,
                    predicted=float(prediction["job_after"]),
                    observed=job.tokens_per_s,
                    recorded_at=now,
                )
            )
        migration.settled = True
        migration.save(update_fields=["settled"])
        audit.record(
            Actor.scheduler(),
            "predictor.settle",
            migration,
            job=job,
            payload={"samples": len(recorded), "had_prediction": bool(prediction)},
        )
    return recorded
