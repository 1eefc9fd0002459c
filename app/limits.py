"""Per-tenant limits, so one tenant flooding cannot starve another (README, "Limits").

- Requests in flight: at most `tenant_max_in_flight` authenticated requests of one tenant are
  being handled at once; the next gets a 429 with Retry-After (the SDK backs off and retries).
  Counted in the process: with several uvicorn workers the limit is per worker.
- Queued runs per tenant: at most `tenant_max_queued_runs` runs waiting for a slot; creating
  another is a 429 (app/runs/service.py).
- Pending batches per run: at most `run_max_pending_batches` unclaimed batches and
  `run_max_pending_bytes` of their payloads; a submission over either is a 429 (counted in
  app/batches/service.py, on Postgres in the statement that takes the run row lock but from its
  snapshot, so concurrent submissions may pass the limit by a batch each: a flood guard). After such a
  refusal the run's next batches are counted first, before their decode and payload write
  (`service._refuse_if_still_full`), until the run has room again.
"""

import threading
from collections import Counter

from app.errors import RateLimited

IN_FLIGHT_RETRY_AFTER_SECONDS = 1
PENDING_RETRY_AFTER_SECONDS = 2
QUEUED_RUNS_RETRY_AFTER_SECONDS = 10


class InFlight:
    """Counts each tenant's requests in flight (thread-safe: sync dependencies run in a threadpool)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def acquire(self, tenant_id: str) -> None:
        with self._lock:
            if self._counts[tenant_id] >= self.limit:
                raise RateLimited(
                    f"too many requests in flight for this tenant (limit {self.limit}); retry shortly",
                    details={"limit": self.limit, "kind": "requests_in_flight"},
                    retry_after=IN_FLIGHT_RETRY_AFTER_SECONDS,
                )
            self._counts[tenant_id] += 1

    def release(self, tenant_id: str) -> None:
        with self._lock:
            self._counts[tenant_id] -= 1
            if self._counts[tenant_id] <= 0:
                del self._counts[tenant_id]

    def in_flight(self, tenant_id: str) -> int:
        with self._lock:
            return self._counts[tenant_id]
