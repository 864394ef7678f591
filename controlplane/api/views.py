"""Views for tokens, whoami, the audit trail, nodes, devices and the cluster summary."""

# mypy: disallow-subclassing-any=False, disallow-untyped-decorators=False
# (rest_framework ships no type information; its base classes and @action are Any.)

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.db.models import QuerySet
from django_filters.rest_framework import DjangoFilterBackend
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from cluster.models import Device, Node
from common.api import exports
from common.api.permissions import AnyRole
from common.api.tokens import issue_token, revoke_token
from common.audit import Actor
from common.models import ApiToken, AuditEvent
from common.roles import Role, role_of
from controlplane.api.filters import AuditEventFilter, DeviceFilter, NodeFilter, TokenFilter
from controlplane.api.serializers import (
    AuditEventSerializer,
    ClusterSummarySerializer,
    DeviceSerializer,
    NodeSerializer,
    RevokeSerializer,
    TokenCreatedSerializer,
    TokenCreateSerializer,
    TokenSerializer,
    WhoAmISerializer,
)
from controlplane.selectors import cluster_summary, devices_with_holders, nodes_with_device_counts

# --- identity ----------------------------------------------------------------------------------


class WhoAmIView(APIView):
    """The user this request acts as, and their role."""

    permission_classes = [AnyRole]

    @extend_schema(responses=WhoAmISerializer, operation_id="whoami")
    def get(self, request: Request) -> Response:
        user = request.user
        role = role_of(user)
        token = request.auth if isinstance(request.auth, ApiToken) else None
        data = {
            "username": user.get_username(),
            "role": role.name.lower() if role is not None else "viewer",
            "is_superuser": user.is_superuser,
            "groups": sorted(user.groups.values_list("name", flat=True)),
            "authentication": "token" if token is not None else "session",
            # The token itself, not its rendered dict: the nested serializer reads user and active
            # from the model.
            "token": token,
        }
        return Response(WhoAmISerializer(data).data)


# --- tokens ------------------------------------------------------------------------------------


class TokenViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """API tokens. Everyone manages their own; admins see and revoke everyone's and may issue
    tokens for other users. A token acts with its user's role."""

    serializer_class = TokenSerializer
    permission_classes = [AnyRole]
    filter_backends = [DjangoFilterBackend]
    filterset_class = TokenFilter

    def get_queryset(self) -> QuerySet[ApiToken]:
        tokens = ApiToken.objects.select_related("user").order_by("-created_at", "-id")
        if getattr(self, "swagger_fake_view", False):  # the schema generator has no user
            return tokens.none()
        if role_of(self.request.user) == Role.ADMIN:
            return tokens
        return tokens.filter(user=self.request.user)

    @extend_schema(request=TokenCreateSerializer, responses={201: TokenCreatedSerializer})
    def create(self, request: Request) -> Response:
        """Issue a token. The raw key is in the answer's ``key`` and is never shown again."""
        payload = TokenCreateSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        owner = payload.validated_data.get("user", request.user)
        if owner != request.user and role_of(request.user) != Role.ADMIN:
            raise PermissionDenied("only admins may issue tokens for other users")
        token, raw = issue_token(
            user=owner,
            name=payload.validated_data["name"],
            expires_at=payload.validated_data.get("expires_at"),
            actor=Actor.for_user(request.user),
        )
        # The raw key is shown once, in this answer only.
        return Response({**TokenSerializer(token).data, "key": raw}, status=status.HTTP_201_CREATED)

    @extend_schema(request=RevokeSerializer, responses={200: TokenSerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        """Revoke a token at once; repeating it changes nothing."""
        token = self.get_object()
        payload = RevokeSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        token = revoke_token(
            token.pk, actor=Actor.for_user(request.user), reason=payload.validated_data["reason"]
        )
        return Response(TokenSerializer(token).data)


# --- audit -------------------------------------------------------------------------------------

AUDIT_CSV_COLUMNS = (
    "id",
    "at",
    "actor_type",
    "actor",
    "verb",
    "object_type",
    "object_id",
    "job",
    "reason",
    "payload",
    "request_id",
)


class AuditEventViewSet(viewsets.ReadOnlyModelViewSet):
    """Who did what to which object, why and when: every mutation, newest first."""

    serializer_class = AuditEventSerializer
    filter_backends = [DjangoFilterBackend]
    filterset_class = AuditEventFilter

    def get_queryset(self) -> QuerySet[AuditEvent]:
        return AuditEvent.objects.select_related("actor_user").order_by("-at", "-id")

    @extend_schema(
        filters=True,
        responses={
            (200, exports.CSV_MEDIA_TYPE): OpenApiResponse(
                OpenApiTypes.STR,
                description="CSV, one row per event; columns: "
                + ", ".join(AUDIT_CSV_COLUMNS)
                + " (payload as JSON)",
            ),
            (200, exports.JSON_MEDIA_TYPE): OpenApiResponse(
                AuditEventSerializer(many=True), description="a JSON array of events"
            ),
        },
    )
    @action(
        detail=False,
        methods=["get"],
        renderer_classes=[exports.CSVRenderer, JSONRenderer],
        pagination_class=None,
    )
    def export(self, request: Request) -> Any:
        """Every matching event, streamed: ``?format=csv`` (the default) or ``?format=json``."""
        events = self.filter_queryset(self.get_queryset())
        if request.accepted_renderer.format == "json":

            def items() -> Iterator[dict[str, Any]]:
                for event in events.iterator(chunk_size=exports.ROWS_PER_CHUNK):
                    yield AuditEventSerializer(event).data

            return exports.streaming_response(
                request._request,
                lambda: exports.json_array(items()),
                content_type=exports.JSON_MEDIA_TYPE,
                filename="audit-events.json",
            )

        def rows() -> Iterator[list[Any]]:
            for event in events.values_list(*AUDIT_CSV_COLUMNS).iterator(chunk_size=exports.ROWS_PER_CHUNK):
                yield list(event)

        return exports.streaming_response(
            request._request,
            lambda: exports.csv_lines(AUDIT_CSV_COLUMNS, rows()),
            content_type=exports.CSV_MEDIA_TYPE,
            filename="audit-events.csv",
        )


# --- nodes and devices -------------------------------------------------------------------------


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    """GPU hosts: status, heartbeat, their devices by state and their mean utilisation."""

    serializer_class = NodeSerializer
    filter_backends = [DjangoFilterBackend]
    filterset_class = NodeFilter

    def get_queryset(self) -> QuerySet[Node]:
        return nodes_with_device_counts()


class DeviceViewSet(viewsets.ReadOnlyModelViewSet):
    """Accelerators: hardware, status, utilisation, and the job, group and worker that own them."""

    serializer_class = DeviceSerializer
    filter_backends = [DjangoFilterBackend]
    filterset_class = DeviceFilter

    def get_queryset(self) -> QuerySet[Device]:
        return devices_with_holders()


# --- cluster -----------------------------------------------------------------------------------


class ClusterSummaryView(APIView):
    """GPUs by state, hardware, job and component; nodes by status; jobs by state; queue length."""

    @extend_schema(responses={200: ClusterSummarySerializer}, operation_id="cluster_summary")
    def get(self, request: Request) -> Response:
        return Response(ClusterSummarySerializer(cluster_summary()).data)
