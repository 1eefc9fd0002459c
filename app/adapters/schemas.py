"""Wire shapes of adapters, step metrics and checkpoints (docs/contracts.md)."""

from datetime import UTC, datetime
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
"""A PEFT adapter directory holds exactly these two files."""

METRIC_NAMES = (
    "loss",
    "entropy",
    "mismatch_kl",
    "masked_fraction",
    "grad_norm",
    "lr",
    "tokens",
    "samples",
    "step_time_s",
)


def _utc(value: datetime) -> datetime:
    # SQLite hands back naive datetimes; every stored time is UTC.
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


UtcDatetime = Annotated[datetime, AfterValidator(_utc)]


class AdapterStored(BaseModel):
    step: int
    size_bytes: int = Field(description="Bytes of the PEFT directory (both files).")
    sha256: str = Field(description="Of adapter_model.safetensors; also the download's ETag.")


class AdapterOut(AdapterStored):
    created_at: UtcDatetime


class AdapterList(BaseModel):
    items: list[AdapterOut]


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
    tokens: int | None = Field(default=None, ge=0)
    samples: int | None = Field(default=None, ge=0)
    step_time_s: float | None = Field(default=None, ge=0.0)


class StepReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=1, le=10_000_000, description="The run step that just completed (1-based).")
    total_tokens: int = Field(ge=0)
    total_samples: int = Field(ge=0)
    metrics: StepMetricsIn = Field(default_factory=StepMetricsIn)


class MetricsItem(StepMetricsIn):
    model_config = ConfigDict(extra="ignore")

    step: int
    created_at: UtcDatetime


class MetricsList(BaseModel):
    items: list[MetricsItem]


class CheckpointReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0, le=10_000_000)
    total_samples: int = Field(ge=0, description="Samples trained in completed steps up to this checkpoint.")


class CheckpointOut(BaseModel):
    run_id: str
    step: int
    total_samples: int
    created_at: UtcDatetime


class TrainerEvict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, max_length=4096, examples=["loss is NaN at step 12"])
