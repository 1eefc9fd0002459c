"""Per-tenant limits, so one tenant flooding cannot starve another (README, "Limits").

- Requests in flight: at most `tenant_max_in_flight` authenticated requests of one tenant are
  being handled at once; the next gets a 429 with Retry-After (the SDK backs off and retries).
  Counted in the process: with several uvicorn workers the limit is per worker.
- Event streams per tenant: at most `tenant_max_event_streams` open at once (the API's and the
  dashboard's; a stream lasts up to an hour, long after its request stopped counting as in flight);
  the next is a 429 (app/events/router.py `counted_stream`).
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
EVENT_STREAMS_RETRY_AFTER_SECONDS = 5
QUEUED_RUNS_RETRY_AFTER_SECONDS = 10


class InFlight:
    """Counts each tenant's requests in flight (thread-safe: sync dependencies run in a threadpool);
    with another `kind`, what else a tenant holds open at once (its event streams)."""

    def __init__(
        self,
        limit: int,
        *,
        kind: str = "requests_in_flight",
        retry_after: int = IN_FLIGHT_RETRY_AFTER_SECONDS,
    ) -> None:
        self.limit = limit
        self.kind = kind
        self.retry_after = retry_after
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def acquire(self, tenant_id: str) -> None:
        with self._lock:
            if self._counts[tenant_id] >= self.limit:
                what = self.kind.replace("_", " ")
                raise RateLimited(
                    f"too many {what} for this tenant (limit {self.limit}); retry shortly",
                    details={"limit": self.limit, "kind": self.kind},
                    retry_after=self.retry_after,
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
