"""Wiring /metrics into an app: its registry, the request families (counted by app/front.py), the route."""

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from app.telemetry.collector import CachedCollector, database_cache
from app.telemetry.http import HttpMetrics, multiprocess_dir
from app.telemetry.router import router


def install_metrics(app: FastAPI) -> HttpMetrics:
    """Each app has its own registry (tests build many apps in one process); in multiprocess
    mode the request families go to the shared directory instead (app/telemetry/__init__.py). The
    database families are read at most once per `metrics_cache_seconds` (app/telemetry/collector.py)."""
    cache = database_cache(app.state.session_factory, app.state.settings.metrics_cache_seconds)
    app.state.metrics_cache = cache
    registry = CollectorRegistry()
    registry.register(CachedCollector(cache))
    app.state.metrics_registry = registry
    http = HttpMetrics(None if multiprocess_dir() is not None else registry)
    app.include_router(router)
    return http
