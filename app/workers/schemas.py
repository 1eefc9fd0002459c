"""Wire shapes of the pool-facing routes: register, heartbeat, state (docs/contracts.md)."""

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

ModuleName = Annotated[str, StringConstraints(min_length=1, max_length=64)]


class PoolRegister(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base_model: str = Field(min_length=1, max_length=256)
    vocab_size: int = Field(ge=1, le=10_000_000)
    max_rank: int = Field(ge=1, le=4096)
    target_modules: list[ModuleName] = Field(min_length=1, max_length=64)
    """Linear layers the pool can adapt; a run may use any subset."""
    slots: int = Field(ge=1, le=1024)
    world_size: int = Field(ge=1, le=1_000_000)
    max_seq_len: int = Field(ge=8, le=10_000_000)


class PoolRegistered(BaseModel):
    pool_id: str
    heartbeat_interval_s: float
    lease_seconds: float


class PoolRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pool_id: str = Field(min_length=1, max_length=32)


class PoolHeartbeatOut(BaseModel):
    status: str


class Progress(BaseModel):
    step: int
    total_tokens: int
    total_samples: int


class PoolRunState(BaseModel):
    run_id: str
    slot: int | None
    status: str
    config: dict[str, Any]
    progress: Progress


class PoolStateOut(BaseModel):
    runs: list[PoolRunState]
