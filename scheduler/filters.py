"""Filters of the scheduler's lists: snapshots, decisions, migrations, predictor samples, ticks,
alerts. Time bounds are ``after`` (inclusive) and ``before`` (exclusive), ISO 8601."""

# mypy: disallow-subclassing-any=False
# (django_filters ships no type information; its base classes are Any.)

from __future__ import annotations

import re

import django_filters
from django.db.models import Q, QuerySet

from common.api.filters import (
    ApiFilterSet,
    BooleanFilter,
    CharInFilter,
    IdFilter,
    MultiChoiceFilter,
    time_range,
)
from scheduler.models import (
    Alert,
    AlertKind,
    HypergraphSnapshot,
    Migration,
    MigrationState,
    PredictorSample,
    PredictorScope,
    SchedulingDecision,
    Tick,
)


def _job() -> IdFilter:
    return IdFilter(field_name="job", label="job id")


class SnapshotFilter(ApiFilterSet):
    job = _job()
    cause = CharInFilter(label="admission, change, periodic or migration (comma-separated)")
    after, before = time_range("taken_at", "taken")
    ordering = django_filters.OrderingFilter(fields=(("taken_at", "taken_at"), ("id", "id")))

    class Meta:
        model = HypergraphSnapshot
        fields: list[str] = []


class DecisionFilter(ApiFilterSet):
    job = _job()
    reason = CharInFilter(label="one or more reasons, e.g. donor_low_utilisation,operator_request")
    policy = django_filters.CharFilter()
    donor = django_filters.CharFilter()
    recipient = django_filters.CharFilter()
    after, before = time_range("at", "decided")
    ordering = django_filters.OrderingFilter(fields=(("at", "at"), ("id", "id")))

    class Meta:
        model = SchedulingDecision
        fields: list[str] = []


class MigrationFilter(ApiFilterSet):
    job = _job()
    state = MultiChoiceFilter(choices=MigrationState.choices, label="one or more states")
    strategy = CharInFilter(
        method="with_strategy",
        label="restart, workload or p2p (matches either side of e.g. workload+p2p), or a whole "
        "strategy; comma-separated values are OR-ed",
    )
    donor = django_filters.CharFilter()
    recipient = django_filters.CharFilter()
    requested_by = django_filters.CharFilter(label="scheduler, or the operator's username")
    after, before = time_range("created_at", "created")
    ordering = django_filters.OrderingFilter(
        fields=(("created_at", "created_at"), ("finished_at", "finished_at"), ("estimated_s", "estimated_s"))
    )

    class Meta:
        model = Migration
        fields: list[str] = []

    def with_strategy(
        self, queryset: QuerySet[Migration], name: str, values: list[str]
    ) -> QuerySet[Migration]:
        wanted = Q()
        for value in values:
            wanted |= Q(strategy__regex=rf"(^|\+){re.escape(value)}(\+|$)")
        return queryset.filter(wanted)


class PredictorSampleFilter(ApiFilterSet):
    job = _job()
    component = CharInFilter(label="component kind(s): rollout, inference, reward, tool, actor")
    scope = MultiChoiceFilter(choices=PredictorScope.choices)
    group = django_filters.CharFilter()
    migration = django_filters.CharFilter(field_name="migration__migration_id", label="migration id")
    after, before = time_range("recorded_at", "recorded")

    class Meta:
        model = PredictorSample
        fields: list[str] = []


class TickFilter(ApiFilterSet):
    job = _job()
    outcome = CharInFilter(label="no_change, decided, migration_in_flight, paused, finished, ...")
    after, before = time_range("started_at", "started")

    class Meta:
        model = Tick
        fields: list[str] = []


class AlertFilter(ApiFilterSet):
    job = _job()
    node = django_filters.CharFilter(field_name="node__name", label="node name")
    kind = MultiChoiceFilter(choices=AlertKind.choices)
    open = BooleanFilter(field_name="cleared_at", lookup_expr="isnull", label="true: not cleared yet")
    after, before = time_range("raised_at", "raised")

    class Meta:
        model = Alert
        fields: list[str] = []
