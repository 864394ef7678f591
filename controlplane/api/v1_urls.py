"""/api/v1/: tokens, whoami, the audit trail, nodes, devices and the cluster summary."""

from django.urls import URLPattern, URLResolver, path
from rest_framework.routers import SimpleRouter

from controlplane.api import views

router = SimpleRouter()
router.register("tokens", views.TokenViewSet, basename="token")
router.register("audit-events", views.AuditEventViewSet, basename="audit-event")
router.register("nodes", views.NodeViewSet, basename="node")
router.register("devices", views.DeviceViewSet, basename="device")

urlpatterns: list[URLPattern | URLResolver] = [
    path("whoami/", views.WhoAmIView.as_view(), name="whoami"),
    path("cluster/", views.ClusterSummaryView.as_view(), name="cluster-summary"),
    *router.urls,
]
