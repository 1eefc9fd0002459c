"""A run's configuration: the contract between users, the service and the trainer.

Torch-free on purpose: the control plane validates configs with these models, the
worker trains with them, and `orch.toml` in a run directory holds one of them.
Every field is bounded; unknown fields are errors.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_BASE_MODEL = "loraloom-tiny"
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
KNOWN_TARGET_MODULES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoraSettings(_Strict):
    rank: int = Field(default=8, ge=1, le=256, description="LoRA rank r.")
    alpha: float = Field(
        default=16.0, gt=0, le=4096, description="LoRA alpha; the delta is scaled by alpha / rank."
    )
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: tuple[str, ...] = Field(
        default=DEFAULT_TARGET_MODULES,
        min_length=1,
        max_length=7,
        description="Linear layers that get an adapter (names as in Llama/Qwen/Mistral).",
    )

    @model_validator(mode="after")
    def _known_modules(self) -> "LoraSettings":
        unknown = sorted(set(self.target_modules) - KNOWN_TARGET_MODULES)
        if unknown:
            raise ValueError(f"unknown target_modules {unknown}; known: {sorted(KNOWN_TARGET_MODULES)}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError("target_modules has duplicates")
        return self


class OptimSettings(_Strict):
    lr: float = Field(default=1e-4, gt=0, le=1.0, description="Peak learning rate (AdamW).")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas, each in [0, 1).")
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    max_grad_norm: float = Field(default=1.0, gt=0, le=1e6, description="Per-run gradient-norm clip.")

    @model_validator(mode="after")
    def _betas_in_range(self) -> "OptimSettings":
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError("betas must each be in [0, 1)")
        return self


class SchedulerSettings(_Strict):
    kind: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0, le=100_000)
    min_lr_ratio: float = Field(
        default=0.0, ge=0.0, le=1.0, description="Final lr as a fraction of the peak."
    )


class LossSettings(_Strict):
    kind: Literal["token_is", "sequence_is"] = Field(
        default="token_is",
        description="Importance-ratio masking at token level, or the whole sequence when its ratio leaves the bounds.",
    )
    mask_ratio_low: float = Field(
        default=0.125, gt=0.0, le=1.0, description="Mask tokens whose ratio is below this."
    )
    mask_ratio_high: float = Field(
        default=8.0, ge=1.0, le=1000.0, description="Mask tokens whose ratio is above this."
    )
    kl_coef: float = Field(
        default=0.0, ge=0.0, le=100.0, description="KL penalty towards the inference policy."
    )


class CkptSettings(_Strict):
    interval: int = Field(default=5, ge=1, le=1_000_000, description="Checkpoint every N steps.")
    keep_last: int = Field(default=2, ge=1, le=1000, description="Checkpoints kept per run.")


class RunConfig(_Strict):
    """Everything the trainer needs to train one run."""

    base_model: str = Field(default=DEFAULT_BASE_MODEL, min_length=1, max_length=256)
    mode: Literal["rollout", "manual"] = Field(
        default="rollout",
        description="`manual`: the user steps the run (the Tinker API: forward_backward, optim_step), "
        "no batch_size accounting.",
    )
    lora: LoraSettings = LoraSettings()
    optim: OptimSettings = OptimSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    batch_size: int = Field(default=8, ge=1, le=65_536, description="Samples per optimizer step.")
    max_steps: int = Field(default=100, ge=1, le=1_000_000)
    seq_len: int = Field(default=512, ge=8, le=131_072, description="Longest sample (prompt + completion).")
    loss: LossSettings = LossSettings()
    ckpt: CkptSettings = CkptSettings()
    max_async_level: int = Field(
        default=2,
        ge=0,
        le=1000,
        description="How many steps a rollout batch may lag behind the trained step.",
    )
    heartbeat_timeout: float | None = Field(
        default=None,
        gt=0,
        le=86_400,
        description="Evict the run if the orchestrator is silent this long (s).",
    )
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="Seeds the adapter's initialisation.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Free-form user labels (≤ 64 keys).")

    @model_validator(mode="after")
    def _metadata_small(self) -> "RunConfig":
        if len(self.metadata) > 64:
            raise ValueError("metadata has more than 64 keys")
        return self
