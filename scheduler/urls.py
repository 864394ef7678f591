"""/api/v1/: snapshots, decisions, migrations, predictor samples, ticks and alerts (read-only),
a job's history (its GPU ownership timeline and telemetry per group) and its manual migration."""

from django.urls import URLPattern, URLResolver, path
from rest_framework.routers import SimpleRouter

from scheduler import api

router = SimpleRouter()
router.register("snapshots", api.SnapshotViewSet, basename="snapshot")
router.register("decisions", api.DecisionViewSet, basename="decision")
router.register("migrations", api.MigrationViewSet, basename="migration")
router.register("predictor-samples", api.PredictorSampleViewSet, basename="predictor-sample")
router.register("ticks", api.TickViewSet, basename="tick")
router.register("alerts", api.AlertViewSet, basename="alert")

urlpatterns: list[URLPattern | URLResolver] = [
    path("jobs/<int:pk>/timeline/", api.JobTimelineView.as_view(), name="job-timeline"),
    path("jobs/<int:pk>/telemetry/", api.JobTelemetryView.as_view(), name="job-telemetry"),
    path("jobs/<int:id>/migrate/", api.JobMigrateView.as_view(), name="job-migrate"),
    *router.urls,
]
