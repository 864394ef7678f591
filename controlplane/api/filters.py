"""Query filters of the project-level endpoints: API tokens, the audit trail, nodes and devices."""

# mypy: disallow-subclassing-any=False
# (django_filters ships no type information; its base classes are Any.)

from __future__ import annotations

import django_filters
from django.db.models import QuerySet

from cluster.models import FREE_DEVICE, Device, DeviceStatus, Node, NodeStatus
from common.api.filters import (
    ApiFilterSet,
    BooleanFilter,
    CharInFilter,
    IdFilter,
    MultiChoiceFilter,
    time_range,
)
from common.models import ActorType, ApiToken, AuditEvent


class TokenFilter(ApiFilterSet):
    user = django_filters.CharFilter(field_name="user__username", label="only this user's tokens (admins)")

    class Meta:
        model = ApiToken
        fields: list[str] = []


class AuditEventFilter(ApiFilterSet):
    actor_type = MultiChoiceFilter(choices=ActorType.choices)
    actor = django_filters.CharFilter(label="username, agent:<node> or scheduler (exact)")
    verb = CharInFilter(label="one or more verbs, e.g. job.submit,job.cancelled")
    object_type = django_filters.CharFilter(label="e.g. jobs.job, scheduler.migration")
    object_id = django_filters.CharFilter()
    job = IdFilter(field_name="job", label="job id")
    request_id = django_filters.CharFilter()
    after, before = time_range("at", "events")
    ordering = django_filters.OrderingFilter(fields=(("at", "at"), ("id", "id")))

    class Meta:
        model = AuditEvent
        fields: list[str] = []


class NodeFilter(ApiFilterSet):
    status = MultiChoiceFilter(choices=NodeStatus.choices)
    name = django_filters.CharFilter(lookup_expr="icontains", label="name contains")
    hardware = django_filters.CharFilter(method="with_hardware", label="has devices of this hardware type")
    ordering = django_filters.OrderingFilter(
        fields=(
            ("name", "name"),
            ("last_heartbeat_at", "last_heartbeat_at"),
            ("registered_at", "registered_at"),
        )
    )

    class Meta:
        model = Node
        fields: list[str] = []

    def with_hardware(self, queryset: QuerySet[Node], name: str, value: str) -> QuerySet[Node]:
        return queryset.filter(devices__hardware=value).distinct()


class DeviceFilter(ApiFilterSet):
    node = django_filters.CharFilter(field_name="node__name", label="node name")
    status = MultiChoiceFilter(choices=DeviceStatus.choices)
    hardware = django_filters.CharFilter()
    job = IdFilter(field_name="worker__group__job", label="owner job id")
    group = django_filters.CharFilter(field_name="worker__group__name", label="owner group name")
    idle = BooleanFilter(
        method="only_idle",
        label="true: devices that may be handed out: free, not reserved by a migration, on ready nodes",
    )
    ordering = django_filters.OrderingFilter(
        fields=(("uid", "uid"), ("utilisation", "utilisation"), ("reported_at", "reported_at"))
    )

    class Meta:
        model = Device
        fields: list[str] = []

    def only_idle(self, queryset: QuerySet[Device], name: str, value: bool) -> QuerySet[Device]:
        # Not called without a value; ``bool`` is also what documents ``idle`` as a boolean.
        return queryset.filter(FREE_DEVICE) if value else queryset.exclude(FREE_DEVICE)
