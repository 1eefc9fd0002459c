"""GET /metrics: the Prometheus text format, optionally behind LORALOOM_METRICS_TOKEN."""

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from app.auth import SettingsDep, bearer_token, same_secret
from app.errors import Unauthorized
from app.telemetry.collector import DatabaseCollector
from app.telemetry.http import multiprocess_dir

router = APIRouter(tags=["health"])


@router.get(
    "/metrics",
    operation_id="prometheusMetrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}},
)
def metrics(request: Request, settings: SettingsDep) -> Response:
    """Prometheus metrics (requests, batches, runs, slots, pools). With LORALOOM_METRICS_TOKEN set,
    scrapers send `Authorization: Bearer <token>`."""
    token = settings.metrics_token
    if token is not None and not same_secret(bearer_token(request), token.get_secret_value()):
        raise Unauthorized("invalid metrics token")
    registry: CollectorRegistry = request.app.state.metrics_registry
    if multiprocess_dir() is not None:
        # The request families of every worker, summed from the shared directory.
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=multiprocess_dir())  # type: ignore[no-untyped-call]
        registry.register(DatabaseCollector(request.app.state.session_factory))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
