"""Requests by route template and status, and their latency (per process; see __init__)."""

import os
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UNMATCHED = "<unmatched>"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class HttpMetrics:
    """The request families of one app. In multiprocess mode they live in the shared directory
    (registered nowhere); otherwise in the app's own registry."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.requests = Counter(
            "loraloom_http_requests",
            "HTTP requests answered, by method, route template and status.",
            ["method", "route", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "loraloom_http_request_duration_seconds",
            "Time to answer an HTTP request (to the end of its body), by method and route template.",
            ["method", "route"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )


class RequestMetrics:
    """ASGI middleware: counts each request and times it to the last byte of its response."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route: BaseRoute | None = scope.get("route")  # set by the router once a route matched
            template = getattr(route, "path", None) or UNMATCHED
            method = scope.get("method", "GET")
            self.metrics.requests.labels(method, template, str(status)).inc()
            self.metrics.latency.labels(method, template).observe(time.perf_counter() - started)
