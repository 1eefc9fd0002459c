"""Request and response shapes of the batch routes (docs/contracts.md)."""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.batches.validation import documented_batch_schema
from app.timestamps import UtcDatetime
from contracts.status import BatchState

MSGPACK_CONTENT_TYPES = frozenset({"application/msgpack", "application/x-msgpack", "application/vnd.msgpack"})
JSON_CONTENT_TYPES = frozenset({"application/json", ""})


# The constrained decoder's own schema; app/openapi.py turns its `$defs` into components.
_BATCH_SCHEMA = documented_batch_schema()

SUBMIT_BATCH_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "One rollout step of one run: a TrainingBatch, as JSON or msgpack (same fields).",
        "content": {
            "application/json": {"schema": _BATCH_SCHEMA},
            "application/msgpack": {"schema": _BATCH_SCHEMA},
        },
    }
}


class BatchOut(BaseModel):
    """A stored rollout batch, as a tenant sees it."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    run_id: str
    rollout_step: int
    num_samples: int
    num_tokens: int
    state: BatchState
    trained_step: int | None
    created_at: UtcDatetime


class BatchPage(BaseModel):
    items: list[BatchOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last one.")
