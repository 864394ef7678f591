"""/api/v1/: snapshots, decisions, migrations, predictor samples, ticks and alerts (read-only)."""

from django.urls import URLPattern, URLResolver
from rest_framework.routers import SimpleRouter

from scheduler import api

router = SimpleRouter()
router.register("snapshots", api.SnapshotViewSet, basename="snapshot")
router.register("decisions", api.DecisionViewSet, basename="decision")
router.register("migrations", api.MigrationViewSet, basename="migration")
router.register("predictor-samples", api.PredictorSampleViewSet, basename="predictor-sample")
router.register("ticks", api.TickViewSet, basename="tick")
router.register("alerts", api.AlertViewSet, basename="alert")

urlpatterns: list[URLPattern | URLResolver] = list(router.urls)
