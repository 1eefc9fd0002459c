"""The states of runs, rollout batches and pools (stored as these strings)."""

from enum import StrEnum


class RunStatus(StrEnum):
    QUEUED = "queued"
    ACTIVE = "active"
    COMPLETED = "completed"
    EVICTED = "evicted"
    FAILED = "failed"
    DELETED = "deleted"


MOVABLE_RUN_STATUSES = (RunStatus.QUEUED, RunStatus.ACTIVE)
"""Only these can be evicted, completed or failed; every other transition is a 409."""


class BatchState(StrEnum):
    PENDING = "pending"
    CLAIMED = "claimed"
    TRAINED = "trained"


class PoolStatus(StrEnum):
    ALIVE = "alive"
    DEAD = "dead"
    """Silent for longer than the pool timeout; its leases were returned."""
    STOPPED = "stopped"
    """Replaced by a newer registration for the same base model (a restarted pool)."""
