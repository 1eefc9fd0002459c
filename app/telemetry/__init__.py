"""Prometheus metrics of the service: GET /metrics.

Two kinds of families, chosen so that several uvicorn workers (and several replicas) answer alike:

- Figures of the system (runs by state, batches and bytes ingested, pending/leased batches, slots,
  pool liveness, the pool's own step figures) are read from the database (`collector.py`), at most
  once per LORALOOM_METRICS_CACHE_SECONDS per process: one reading serves every scrape meanwhile,
  and never two run at once (each is a dozen counting queries; /metrics is open by default). The
  database is the source of truth, so every worker and every replica reports the same numbers
  (each up to that many seconds old: monotonic for a scraper whose interval is longer, see
  `ScrapeCache`), and they survive restarts. Counters are counts of rows that are never deleted
  (runs are marked deleted, not removed).
- Request counts and latencies are per process (`http.py`). With several workers, set
  PROMETHEUS_MULTIPROC_DIR to an empty directory shared by the workers: prometheus_client then
  keeps the values in per-process files, and /metrics sums them (its multiprocess mode).

Bounded labels only: `route` is the route template (unmatched paths are `<unmatched>`), `status`
the HTTP status, `base_model` only names base models a pool registered with (operator-controlled,
a tenant cannot add one), `pool` only live pools; nothing is labelled per run or per tenant.
"""
