"""GET /metrics: the Prometheus text format, optionally behind LORALOOM_METRICS_TOKEN."""

from typing import Annotated

from fastapi import APIRouter, Request, Response, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST

from app.auth import INVALID_TOKEN_CHALLENGE, SettingsDep, bearer_token, same_secret
from app.errors import Unauthorized, raises
from app.telemetry.collector import ScrapeCache

router = APIRouter(tags=["health"])

# Documented as its own scheme; only enforced when LORALOOM_METRICS_TOKEN is set.
METRICS_SCHEME = HTTPBearer(
    scheme_name="MetricsToken",
    description="`LORALOOM_METRICS_TOKEN`, when the service sets one (else /metrics is open).",
    auto_error=False,
)


@router.get(
    "/metrics",
    operation_id="prometheusMetrics",
    response_class=Response,
    responses={
        200: {
            "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
            "description": "Prometheus text format",
        }
    },
)
@raises(Unauthorized)
def metrics(
    request: Request,
    settings: SettingsDep,
    _: Annotated[HTTPAuthorizationCredentials | None, Security(METRICS_SCHEME)],
) -> Response:
    """Prometheus metrics (requests, batches, runs, slots, pools). With LORALOOM_METRICS_TOKEN set,
    scrapers send `Authorization: Bearer <token>`. The figures read from the database are at most
    LORALOOM_METRICS_CACHE_SECONDS old (one reading serves every scrape meanwhile), the page at most
    a second (one rendering serves every scrape meanwhile)."""
    token = settings.metrics_token
    if token is not None and not same_secret(bearer_token(request), token.get_secret_value()):
        raise Unauthorized("invalid metrics token", challenge=INVALID_TOKEN_CHALLENGE)
    page: ScrapeCache[bytes] = request.app.state.metrics_page  # app/telemetry/setup.py
    return Response(page.get(), media_type=CONTENT_TYPE_LATEST)
