"""Imports every ORM model so that Base.metadata is complete (Alembic, tests)."""

from app.adapters.models import Adapter, Checkpoint, StepMetrics
from app.batches.models import Batch
from app.db import Base
from app.events.models import Event
from app.pools.models import Pool
from app.rollouts.models import RolloutStats
from app.runs.models import Run
from app.telemetry.models import PurgedCount
from app.tenants.models import ApiKey, DeletedRunId, Tenant
from app.tinker.models import TinkerFuture, TinkerModel, TinkerSamplingSession, TinkerSession
from app.ui.models import UiSession

__all__ = [
    "Adapter",
    "ApiKey",
    "Base",
    "Batch",
    "Checkpoint",
    "DeletedRunId",
    "Event",
    "Pool",
    "PurgedCount",
    "RolloutStats",
    "Run",
    "StepMetrics",
    "Tenant",
    "UiSession",
    "TinkerFuture",
    "TinkerModel",
    "TinkerSamplingSession",
    "TinkerSession",
]
