"""Wiring /metrics into an app: its registry, the request families (counted by app/front.py), the route."""

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from app.telemetry.collector import CachedCollector, ScrapeCache, database_cache
from app.telemetry.http import HttpMetrics, multiprocess_dir
from app.telemetry.router import router

PAGE_SECONDS = 1.0
"""How long a rendered page is served again (LORALOOM_METRICS_CACHE_SECONDS if shorter). Rendering
costs with the number of series (every route template x method x status seen): 0.25 s for the
740 KB a client's requests of every route, method and bad header made of it, rendered for each of
32 anonymous scrapers in a loop, took another tenant's requests to 7.8 s. Once a second at most, one
at a time; the request counts are then up to a second old."""


def install_metrics(app: FastAPI) -> HttpMetrics:
    """Each app has its own registry (tests build many apps in one process); in multiprocess
    mode the request families go to the shared directory instead (app/telemetry/__init__.py). The
    database families are read at most once per `metrics_cache_seconds`, and the page rendered at most
    once per PAGE_SECONDS (app/telemetry/collector.py `ScrapeCache`)."""
    seconds = app.state.settings.metrics_cache_seconds
    # Several workers: a scrape waits for the reading under way (ScrapeCache, on counters).
    one_process = multiprocess_dir() is None
    cache = database_cache(app.state.session_factory, seconds, previous_while_reading=one_process)
    app.state.metrics_cache = cache
    registry = CollectorRegistry()
    registry.register(CachedCollector(cache))
    app.state.metrics_registry = registry

    def render() -> bytes:
        if multiprocess_dir() is None:
            return generate_latest(registry)
        # The request families of every worker, summed from the shared directory.
        shared = CollectorRegistry()
        MultiProcessCollector(shared, path=multiprocess_dir())  # type: ignore[no-untyped-call]
        shared.register(CachedCollector(cache))
        return generate_latest(shared)

    # A page stalled as long as the database's reading is rendered again: the reading's cache then
    # answers the database down at once.
    app.state.metrics_page = ScrapeCache(
        render, min(PAGE_SECONDS, seconds), stalled=render, previous_while_reading=one_process
    )
    http = HttpMetrics(None if multiprocess_dir() is not None else registry)
    app.include_router(router)
    return http
