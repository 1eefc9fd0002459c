"""Request and response shapes of the batch routes (docs/contracts.md)."""

from datetime import UTC, datetime
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainer_core.wire import TrainingBatch

BatchState = Literal["pending", "claimed", "trained"]

MSGPACK_CONTENT_TYPES = frozenset({"application/msgpack", "application/x-msgpack", "application/vnd.msgpack"})
JSON_CONTENT_TYPES = frozenset({"application/json", ""})


def _inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    """Replace `{"$ref": "#/$defs/X"}` by X itself, so the schema stands alone inside an OpenAPI operation."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


def _training_batch_schema() -> dict[str, Any]:
    schema = msgspec.json.schema(TrainingBatch)
    return _inline_refs(schema, schema.get("$defs", {}))


TRAINING_BATCH_SCHEMA: dict[str, Any] = _training_batch_schema()
"""JSON schema of TrainingBatch (from the msgspec struct, so the docs cannot drift from the decoder)."""

SUBMIT_BATCH_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "One rollout step of one run: a TrainingBatch, as JSON or msgpack (same fields).",
        "content": {
            "application/json": {"schema": TRAINING_BATCH_SCHEMA},
            "application/msgpack": {"schema": TRAINING_BATCH_SCHEMA},
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
    created_at: datetime

    @field_validator("created_at")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        # SQLite hands back naive datetimes; everything stored is UTC.
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value


class BatchPage(BaseModel):
    items: list[BatchOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last one.")


class ClaimIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pool_id: str = Field(min_length=1, max_length=32)
    max_batches: int = Field(default=16, ge=1, le=256, description="At most this many batches in one lease.")


class ClaimedBatch(BaseModel):
    id: int
    run_id: str
    slot: int | None
    sample_offset: int = Field(
        description="Index of the batch's first sample among all of the run's samples."
    )
    num_samples: int
    rollout_step: int
    payload: dict[str, Any] = Field(json_schema_extra=TRAINING_BATCH_SCHEMA, description="The TrainingBatch.")


class ClaimOut(BaseModel):
    lease_expires_at: datetime
    batches: list[ClaimedBatch]


class AckItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_id: int
    trained_step: int = Field(
        ge=0, description="The run step whose optimizer update used the batch's last sample."
    )


class AckIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pool_id: str = Field(min_length=1, max_length=32)
    acks: list[AckItem] = Field(min_length=1, max_length=4096)


class AckOut(BaseModel):
    acked: int


class RestartIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pool_id: str = Field(min_length=1, max_length=32)
    checkpoint_step: int = Field(ge=0)
    total_samples: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class RestartOut(BaseModel):
    returned: list[int] = Field(description="Ids of the batches returned to pending, in id order.")
