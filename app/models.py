"""Imports every ORM model so that Base.metadata is complete (Alembic, tests)."""

from app.adapters.models import Adapter, Checkpoint, StepMetrics
from app.batches.models import Batch
from app.db import Base
from app.runs.models import Event, Run
from app.tenants.models import ApiKey, Tenant
from app.pools.models import Pool

__all__ = [
    "Adapter",
    "ApiKey",
    "Base",
    "Batch",
    "Checkpoint",
    "Event",
    "Pool",
    "Run",
    "StepMetrics",
    "Tenant",
]
