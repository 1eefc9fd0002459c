"""The pool routes' request and response bodies (docs/contracts.md).

One definition for both ends: the service's FastAPI routes validate and document with
these models, and the pool's HTTP client builds its requests and parses the answers with
them. Torch-free and fastapi-free.
"""

from datetime import datetime
from typing import Annotated, Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from contracts.arrays import ArrayBatch, decode_stored
from contracts.progress import Progress
from contracts.status import RunStatus
from contracts.wire import TrainingBatch

INT32_MAX = 2**31 - 1
"""The largest value of a 32-bit database column (batch ids, steps)."""
INT64_MAX = 2**63 - 1
"""The largest value of a 64-bit database column (sample and token counters)."""
Step = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]

ModuleName = Annotated[str, StringConstraints(min_length=1, max_length=64)]
PoolId = Annotated[str, StringConstraints(min_length=1, max_length=32)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Answer(BaseModel):
    # A newer service may add fields; an older pool ignores them.
    model_config = ConfigDict(extra="ignore")


# --------------------------------------------------------------------------- registration


class PoolRegister(_Request):
    """What a pool can train: the service admits only runs that fit."""

    base_model: str = Field(min_length=1, max_length=256)
    vocab_size: int = Field(ge=1, le=10_000_000)
    max_rank: int = Field(ge=1, le=4096)
    target_modules: list[ModuleName] = Field(min_length=1, max_length=64)
    """Linear layers the pool can adapt; a run may use any subset."""
    slots: int = Field(ge=1, le=1024)
    world_size: int = Field(ge=1, le=1_000_000)
    max_seq_len: int = Field(ge=8, le=10_000_000)
    module_shapes: dict[ModuleName, tuple[int, int]] | None = None
    """(in_features, out_features) of each adaptable module type: uploaded adapters are checked against it."""
    num_layers: int | None = Field(default=None, ge=1, le=100_000)
    """Decoder layers of the base model."""


class PoolRegistered(_Answer):
    pool_id: str
    heartbeat_interval_s: float
    lease_seconds: float
    replaced: list[str] = Field(
        default_factory=list,
        description="Live pools of the same base model this registration replaced (they stop; their "
        "leased work is pending again). A restarted pool replaces its earlier self; anything else "
        "is a second pool for the base model.",
    )


class PoolRef(_Request):
    pool_id: PoolId


class PoolHeartbeatOut(_Answer):
    status: str


class InitFrom(_Answer):
    """Where a run starts from (`init_from`): another run's adapter of `step`, or its checkpoint of
    `checkpoint` (with its optimizer and schedule state when `with_optimizer`), or an adapter the
    tenant uploaded (`adapter_id`)."""

    run_id: str | None = None
    adapter_id: str | None = None
    step: int | None = None
    checkpoint: int | None = None
    with_optimizer: bool = False


class PoolRunState(_Answer):
    """An active run the pool should train."""

    run_id: str
    slot: int | None
    status: RunStatus
    config: dict[str, Any]
    progress: Progress
    init_from: InitFrom | None = None
    """A run without a checkpoint starts from this adapter (GET /v1/pool/runs/{run_id}/init-adapter)."""


class PoolStateOut(_Answer):
    runs: list[PoolRunState]


MAX_DELETED_QUERY = 1000
"""The most run ids one `POST /v1/pool/runs/deleted` may ask about (the pool asks in slices)."""
IssuedRunId = Annotated[str, StringConstraints(pattern=r"^run_[0-9a-f]{12}$")]
"""A run id the service issues (`contracts.ids.is_run_id`): the only names the pool asks about."""


class DeletedRunsIn(_Request):
    """Which of these runs (those the pool has files for) are deleted? The pool keeps a run's checkpoints,
    saved Tinker states and sampler copies until its run is deleted, and learns of deletions only by
    asking: its state lists active runs alone, and a run that left it may have been evicted, completed
    or failed (its checkpoints stay: `init_from` and evicted Tinker models read them)."""

    run_ids: list[IssuedRunId] = Field(min_length=1, max_length=MAX_DELETED_QUERY)


class DeletedRunsOut(_Answer):
    deleted: list[str] = Field(
        description="The asked runs whose files the pool may remove: those the service holds with status "
        "deleted, and those deleted with their tenant (their ids kept as long as a deleted run's row). An id "
        "the service holds nothing for (another service's run, or one purged after its deletion's "
        "retention) is never named: its files stay. A deleted run whose "
        "checkpoint a queued or active run starts from (`init_from`), or whose saved state a Tinker load "
        "still reads, is left out until no run may need it. Sorted."
    )


# --------------------------------------------------------------------------- batches


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
    return dict(_inline_refs(schema, schema.get("$defs", {})))


TRAINING_BATCH_SCHEMA: dict[str, Any] = _training_batch_schema()
"""JSON schema of TrainingBatch (from the msgspec struct, so the docs cannot drift from the decoder)."""


MAX_CLAIM_RUNS = 1024
"""The most run ids one claim may name (`ClaimIn.run_ids`): a pool's most slots (`PoolRegister.slots`)."""


MAX_CLAIM_BATCHES = 256
"""The most batches one claim may lease (a pool's `--max-claim` is held to it)."""


class ClaimIn(_Request):
    pool_id: PoolId
    max_batches: int = Field(
        default=16, ge=1, le=MAX_CLAIM_BATCHES, description="At most this many batches in one lease."
    )
    run_ids: list[IssuedRunId] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_CLAIM_RUNS,
        description="Only batches of these runs (null: of any run, as before this field). A pool whose "
        "buffer is full claims for its runs that have too little buffered, so one run's flood stays queued "
        "here rather than in the pool's memory, and no other run waits behind it. An id that is not one "
        "of the pool's active runs claims nothing; the claim stays fair across the named runs.",
    )


class ClaimedBatch(_Answer):
    id: int
    run_id: str
    slot: int | None
    sample_offset: int = Field(
        description="Index of the batch's first sample among all of the run's samples."
    )
    num_samples: int
    rollout_step: int
    payload: dict[str, Any] = Field(json_schema_extra=TRAINING_BATCH_SCHEMA, description="The TrainingBatch.")


class ClaimOut(_Answer):
    lease_expires_at: datetime
    batches: list[ClaimedBatch]


class ClaimedBatchStruct(msgspec.Struct):
    """`ClaimedBatch` as the pool uses it, its payload decoded (`claimed_batches`): the binary form
    from a msgpack claim, the list form from a JSON one (or from a source that builds batches)."""

    id: int
    run_id: str
    slot: int | None
    sample_offset: int
    num_samples: int
    rollout_step: int
    payload: TrainingBatch | ArrayBatch


class ClaimedBatchWire(msgspec.Struct):
    """`ClaimedBatch` on the wire: the payload is left encoded (`msgspec.Raw`). In a msgpack claim
    it is the stored batch's bytes as the service stored them (the binary form, contracts/arrays.py),
    spliced in unchanged; in a JSON claim, the list form."""

    id: int
    run_id: str
    slot: int | None
    sample_offset: int
    num_samples: int
    rollout_step: int
    payload: msgspec.Raw


class ClaimStruct(msgspec.Struct):
    lease_expires_at: str
    batches: list[ClaimedBatchWire]


def claimed_batches(claim: ClaimStruct, *, msgpack: bool) -> list[ClaimedBatchStruct]:
    """The claim's batches with their payloads decoded: a msgpack payload straight into an
    `ArrayBatch` (numpy reads its arrays in place), a JSON one into a `TrainingBatch`."""
    return [
        ClaimedBatchStruct(
            id=b.id,
            run_id=b.run_id,
            slot=b.slot,
            sample_offset=b.sample_offset,
            num_samples=b.num_samples,
            rollout_step=b.rollout_step,
            payload=decode_stored(b.payload) if msgpack else _batch_json_decoder.decode(b.payload),
        )
        for b in claim.batches
    ]


_batch_json_decoder = msgspec.json.Decoder(TrainingBatch)


class AckItem(_Request):
    batch_id: int = Field(ge=1, le=INT32_MAX)
    trained_step: int = Field(
        ge=0, le=INT32_MAX, description="The run step whose optimizer update used the batch's last sample."
    )


class AckIn(_Request):
    pool_id: PoolId
    acks: list[AckItem] = Field(min_length=1, max_length=4096)


class AckOut(_Answer):
    acked: int


class RestartIn(_Request):
    pool_id: PoolId
    checkpoint_step: Step
    total_samples: Count
    total_tokens: Count


class RestartOut(_Answer):
    returned: list[int] = Field(description="Ids of the batches returned to pending, in id order.")


# --------------------------------------------------------------------------- per-run pushes


class AdapterStored(_Answer):
    step: int
    size_bytes: int = Field(description="Bytes of the PEFT directory (both files).")
    sha256: str = Field(description="Of adapter_model.safetensors; also the download's ETag.")


class StepMetricsIn(BaseModel):
    """What the trainer measured for one run's step. NaN/Inf are refused: a run whose loss or
    gradients are not finite is evicted by the trainer, not reported."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    loss: float | None = None
    entropy: float | None = None
    mismatch_kl: float | None = None
    masked_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    grad_norm: float | None = Field(default=None, ge=0.0)
    lr: float | None = Field(default=None, ge=0.0)
    tokens: int | None = Field(default=None, ge=0, le=INT64_MAX)
    samples: int | None = Field(default=None, ge=0, le=INT64_MAX)
    step_time_s: float | None = Field(default=None, ge=0.0)
    # The pool's own figures over the packs of this step (all runs' tokens in them), for /metrics.
    tokens_per_s: float | None = Field(default=None, ge=0.0)
    pack_efficiency: float | None = Field(default=None, ge=0.0, le=1.0)
    """Real tokens / packed row capacity (padding is the rest)."""
    mfu: float | None = Field(default=None, ge=0.0, le=1.0)
    """Model FLOPs utilisation, when the pool knows its accelerator's peak (GPU pools)."""


class StepReport(_Request):
    step: int = Field(ge=1, le=10_000_000, description="The run step that just completed (1-based).")
    total_tokens: Count
    total_samples: Count
    metrics: StepMetricsIn = Field(default_factory=StepMetricsIn)


class CheckpointReport(_Request):
    step: int = Field(ge=0, le=10_000_000)
    total_samples: int = Field(
        ge=0, le=INT64_MAX, description="Samples trained in completed steps up to this checkpoint."
    )


class TrainerEvict(_Request):
    reason: str = Field(min_length=1, max_length=4096, examples=["loss is NaN at step 12"])


class RunAfterPush(_Answer):
    """The part of the run that the pool reads back after a step report or an eviction."""

    id: str
    status: RunStatus
    progress: Progress


POOL_GONE = {
    "pool_dead": "declared dead: no heartbeat reached the service within its pool timeout",
    "pool_stopped": "replaced: another pool registered for the same base model (a second worker pool "
    "for it, or this one restarted)",
}
"""The error codes by which the service says it no longer knows a pool, and what each means for
the pool's operator (the pool stops: its leased work went back to pending for the pool now
registered)."""
