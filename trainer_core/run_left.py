"""Which answers of the run source mean "this run has left the pool" (issue 10).

Between the master's state sync and the publish of a run's step (adapter upload, checkpoint record,
step report, acknowledgements), the run's owner may evict or delete it, its tenant may go away, the
service may fail or complete it. The service then answers the pool's request about that run with a
4xx naming the run's state. Such an answer concerns one run only: the pool releases that run's slot
and trains every other run on. Anything else (the pool itself unknown, a 5xx after retries) is not
about one run and still stops the pool.

The codes are listed in docs/contracts.md ("When a run leaves mid-step").
"""

from contracts.http import ApiError

RUN_LEFT_CODES = frozenset(
    {
        "run_not_active",  # step report, restart: the run is evicted, completed, failed or deleted
        "run_not_trainable",  # adapter upload: the run is deleted or failed
        "run_evicted",
        "invalid_transition",  # the pool's own evict of a run that already stopped
        "ack_rejected",  # the run's claimed batches are no longer this pool's (its leases went back)
        "not_found",  # the run (or its tenant) no longer exists
    }
)
"""Error codes of answers about one run that say it no longer trains in this pool."""

POOL_CODES_PREFIX = "pool_"
"""`pool_not_found`, `pool_dead`, `pool_stopped`: about the pool, never about one run."""


def run_has_left(exc: BaseException) -> bool:
    """Whether `exc`, raised by a request about one run, says that run has left (see module doc)."""
    if not isinstance(exc, ApiError) or exc.status is None:
        return False
    code = exc.code or ""
    if code.startswith(POOL_CODES_PREFIX):
        return False
    if exc.status in (404, 410):
        return True  # the run (or its tenant) is gone
    return exc.status == 409 and code in RUN_LEFT_CODES
