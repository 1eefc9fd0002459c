"""Requests by route template and status, and their latency (per process; see __init__); counted
by app/front.py."""

import os

from prometheus_client import CollectorRegistry, Counter, Histogram

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
