"""A run's configuration: the contract between users, the service and the trainer.

Torch-free on purpose: the control plane validates configs with these models, the
worker trains with them, and `orch.toml` in a run directory holds one of them.
Every field is bounded; unknown fields are errors.
"""

import json
import types
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationInfo, field_validator, model_validator

DEFAULT_BASE_MODEL = "loraloom-tiny"
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
KNOWN_TARGET_MODULES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}
)
"""The attention and MLP projections, and `lm_head` (the unembedding; with tied embeddings its LoRA
delta is the adapter's own, the shared weight stays frozen)."""

METADATA_MAX_KEYS = 64
METADATA_MAX_BYTES = 16 * 1024
"""As canonical JSON (compact, non-ASCII characters escaped, as the request hash has it): metadata is
stored with the run and sent back in every listing of the tenant's runs (200 to a page), so its size
bounds theirs. The Tinker API caps a model's user_metadata at the same 16 KiB."""
METADATA_MAX_VALUES = 1000
"""Every string, number, boolean, array and table inside metadata counts one: a 1 MB body of 510,000
zeros once cost 2.6 s of server CPU per create (each check walks every item)."""
METADATA_MAX_DEPTH = 8
"""Levels of tables and arrays, metadata's own table the first."""


def _numeric(annotation: Any) -> bool:
    """int, float, or an optional / tuple of them."""
    if annotation in (int, float):
        return True
    if get_origin(annotation) in (Union, types.UnionType, tuple):
        args = [a for a in get_args(annotation) if a not in (type(None), Ellipsis)]
        return bool(args) and all(_numeric(a) for a in args)
    return False


def _not_a_number(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return any(_not_a_number(v) for v in value)
    return isinstance(value, bool | str)


class JsonNumbers(BaseModel):
    """A model whose number fields take JSON numbers only, as its JSON schema says."""

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode would take `true` or `"3"` for a number; the documented schema (a JSON
        # number) does not, and neither does the service.
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _numeric(field.annotation) and _not_a_number(value):
            raise ValueError("must be a number (not a boolean or a string)")
        return value


class _Strict(JsonNumbers):
    # allow_inf_nan=False: a NaN or infinity (JSON's NaN/Infinity that Python's parser takes, 1e999,
    # TOML's nan/inf) is refused as "Input should be a finite number", not by whichever bound it
    # happens to fail first ("less than or equal to 1" for a NaN lr).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class LoraSettings(_Strict):
    rank: int = Field(default=8, ge=1, le=256, description="LoRA rank r.")
    alpha: float = Field(
        default=16.0, gt=0, le=4096, description="LoRA alpha; the delta is scaled by alpha / rank."
    )
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: tuple[str, ...] = Field(
        default=DEFAULT_TARGET_MODULES,
        min_length=1,
        max_length=8,
        description="Linear layers that get an adapter (names as in Llama/Qwen/Mistral; lm_head: the unembedding).",
        json_schema_extra={
            "items": {"type": "string", "enum": list[JsonValue](sorted(KNOWN_TARGET_MODULES))},
            "uniqueItems": True,
        },
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
    betas: tuple[float, float] = Field(
        default=(0.9, 0.999),
        description="AdamW betas, each in [0, 1).",
        json_schema_extra={"prefixItems": [{"type": "number", "minimum": 0, "exclusiveMaximum": 1}] * 2},
    )
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


LossKind = Literal["token_is", "sequence_is", "cross_entropy", "ppo", "cispo"]
RL_LOSS_KINDS = frozenset({"token_is", "sequence_is", "ppo", "cispo"})
"""The kinds that train on advantages (everything but SFT's cross_entropy)."""


class LossSettings(_Strict):
    """The run's loss; formulas in `trainer_core/loss.py`'s docstring and the README's config table."""

    kind: LossKind = Field(
        default="token_is",
        description=(
            "token_is / sequence_is: importance-sampled policy gradient with ratio masking (token or whole "
            "sequence); cross_entropy: SFT, weighted by the loss mask or per-token `weights`; ppo: clipped "
            "surrogate; cispo: clipped IS weight (stop-gradient) times the logprob."
        ),
    )
    mask_ratio_low: float = Field(
        default=0.125,
        gt=0.0,
        le=1.0,
        description="token_is/sequence_is: mask tokens whose ratio is below this.",
    )
    mask_ratio_high: float = Field(
        default=8.0,
        ge=1.0,
        le=1000.0,
        description="token_is/sequence_is: mask tokens whose ratio is above this.",
    )
    kl_coef: float = Field(
        default=0.0, ge=0.0, le=100.0, description="RL kinds: k3 KL penalty towards the inference policy."
    )
    clip_low: float = Field(
        default=0.2, ge=0.0, le=1.0, description="ppo/cispo: the ratio is clipped below at 1 - clip_low."
    )
    clip_high: float = Field(
        default=0.2,
        ge=0.0,
        le=100.0,
        description="ppo/cispo: the ratio is clipped above at 1 + clip_high (clip-higher: > clip_low).",
    )
    dual_clip: float | None = Field(
        default=None,
        gt=1.0,
        le=100.0,
        description="ppo: dual clip c; a negative-advantage token's loss is at most -c * A.",
    )
    kl_ref_coef: float = Field(
        default=0.0,
        ge=0.0,
        le=100.0,
        description="RL kinds: KL penalty towards the reference policy (the base model without adapter).",
    )
    kl_ref_estimator: Literal["k1", "k2", "k3"] = Field(
        default="k3", description="Estimator of KL(policy || reference) for kl_ref_coef."
    )
    entropy_coef: float = Field(
        default=0.0, ge=0.0, le=10.0, description="RL kinds: entropy bonus (subtracted from the loss)."
    )

    @model_validator(mode="after")
    def _rl_terms_need_rl(self) -> "LossSettings":
        if self.kind not in RL_LOSS_KINDS:
            used = [name for name in ("kl_coef", "kl_ref_coef", "entropy_coef") if getattr(self, name) != 0.0]
            if used:
                raise ValueError(f"{', '.join(used)} apply to RL kinds only, not {self.kind!r}")
        if self.dual_clip is not None and self.kind != "ppo":
            raise ValueError(f"dual_clip applies to kind 'ppo' only, not {self.kind!r}")
        return self


class AdvantageSettings(_Strict):
    """Where advantages come from: the client (GRPO/RLOO in the orchestrator) or a per-run critic."""

    estimator: Literal["client", "gae"] = Field(
        default="client",
        description=(
            "client: advantages sent with each sample. gae: the run gets a value head; samples carry "
            "`reward` (at the last loss token) or `token_rewards`, and the trainer computes GAE."
        ),
    )
    gamma: float = Field(default=1.0, ge=0.0, le=1.0, description="gae: discount.")
    lam: float = Field(default=0.95, ge=0.0, le=1.0, description="gae: lambda.")
    value_coef: float = Field(default=0.5, gt=0.0, le=100.0, description="gae: weight of the value loss.")
    value_clip: float = Field(
        default=1.0,
        gt=0.0,
        le=1e6,
        description="gae: the value error's gradient is clipped at this (Huber loss with this delta).",
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
        "no batch_size accounting. Only the Tinker API makes manual runs: POST /v1/runs refuses "
        "`manual` (422), and a manual run takes no rollout batches (409 run_is_manual).",
    )
    lora: LoraSettings = LoraSettings()
    optim: OptimSettings = OptimSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    batch_size: int = Field(default=8, ge=1, le=65_536, description="Samples per optimizer step.")
    max_steps: int = Field(default=100, ge=1, le=1_000_000)
    seq_len: int = Field(default=512, ge=8, le=131_072, description="Longest sample (prompt + completion).")
    loss: LossSettings = LossSettings()
    advantage: AdvantageSettings = AdvantageSettings()
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
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            f"Free-form user labels (TOML-writable values): ≤ {METADATA_MAX_KEYS} keys; when a run is "
            f"created also ≤ {METADATA_MAX_BYTES // 1024} KiB as canonical JSON (compact, non-ASCII "
            f"characters escaped), ≤ {METADATA_MAX_VALUES:,} values (each string, number, boolean, "
            f"array and table inside counts one) and ≤ {METADATA_MAX_DEPTH} levels of nesting (this "
            "table the first)."
        ),
        json_schema_extra={"maxProperties": METADATA_MAX_KEYS},
    )

    @field_validator("metadata")
    @classmethod
    def _metadata_toml(cls, value: dict[str, Any]) -> dict[str, Any]:
        problem = _toml_problem(value, "metadata")
        if problem is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _metadata_small(self) -> "RunConfig":
        if len(self.metadata) > METADATA_MAX_KEYS:
            raise ValueError(f"metadata has more than {METADATA_MAX_KEYS} keys")
        return self

    @model_validator(mode="after")
    def _gae_needs_rl(self) -> "RunConfig":
        if self.advantage.estimator == "gae" and self.loss.kind not in RL_LOSS_KINDS:
            raise ValueError(f"advantage.estimator 'gae' needs an RL loss kind, not {self.loss.kind!r}")
        return self


@dataclass(frozen=True)
class Excess:
    """A size bound a value exceeds (see `shape_excess`, `metadata_excess`)."""

    bound: Literal["values", "depth", "bytes"]
    limit: int
    measured: int
    """The value's size by that bound; a lower bound when `at_least` (the walk stopped there)."""
    at_least: bool = False

    def describe(self, what: str) -> str:
        """E.g. "config.metadata holds at least 510001 values (at most 1000)"."""
        measured = f"at least {self.measured}" if self.at_least else str(self.measured)
        if self.bound == "values":
            return f"{what} holds {measured} values (at most {self.limit})"
        if self.bound == "depth":
            return f"{what} is nested too deeply: {measured} levels (at most {self.limit})"
        return f"{what} is {measured} bytes as canonical JSON (at most {self.limit})"


def shape_excess(value: Any, *, max_values: int, max_depth: int | None = None) -> Excess | None:
    """Whether a parsed JSON/TOML value holds more than `max_values` values or nests deeper than
    `max_depth` levels (`value` itself, if a table or array, is the first), or None.

    Cheap on hostile input, before anything walks it item by item: a table or array is counted by its
    length before it is looked into, so the walk stops once `max_values` are counted (at most that
    many items are visited) and never builds a path. Iterative: any depth. Too many values is
    reported before too deep (the depth of what was not visited is unknown)."""
    count, deepest = 0, 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, dict | list):
            continue
        deepest = max(deepest, depth)
        count += len(item)
        if count > max_values:
            return Excess("values", max_values, count, at_least=True)
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    if max_depth is not None and deepest > max_depth:
        return Excess("depth", max_depth, deepest)
    return None


def _json_default(item: Any) -> Any:
    # TOML's dates and times: stored as their ISO text (pydantic's JSON dump writes them so).
    isoformat = getattr(item, "isoformat", None)
    return isoformat() if callable(isoformat) else str(item)


def metadata_excess(metadata: Any) -> Excess | None:
    """The first size bound a run's new `metadata` exceeds (values, depth, then bytes), or None.

    For input only (a run being created): a stored run's config is read back without these bounds,
    so a run stored before they existed stays readable. The number of keys is RunConfig's own rule.
    Counting first bounds the byte count's work: with at most METADATA_MAX_VALUES values, the JSON
    encoder's time is that of the strings' bytes."""
    excess = shape_excess(metadata, max_values=METADATA_MAX_VALUES, max_depth=METADATA_MAX_DEPTH)
    if excess is not None:
        return excess
    # Compact and ASCII, as the request hash's canonical form; key order does not change the length.
    size = len(json.dumps(metadata, separators=(",", ":"), default=_json_default))
    return Excess("bytes", METADATA_MAX_BYTES, size) if size > METADATA_MAX_BYTES else None


_INT64 = 2**63


def _not_unicode(text: str) -> bool:
    """Whether `text` holds a lone surrogate (JSON's `"\\ud800"` parses to one): no UTF-8, so no TOML,
    no Postgres text, and no JSON response can hold it."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _scalar_problem(item: Any, path: str) -> str | None:
    """Why a value that is no table or array cannot be written as TOML, or None."""
    if item is None:
        return f"{path} is null; TOML has no null (leave the key out)"
    if isinstance(item, str) and _not_unicode(item):
        return f"{path} holds a lone surrogate (not Unicode text)"
    if isinstance(item, int) and not -_INT64 <= item < _INT64:
        return f"{path} is outside the 64-bit integer range"
    if isinstance(item, float) and (item != item or item in (float("inf"), float("-inf"))):
        return f"{path} is not a finite number"
    return None


def _toml_problem(value: Any, where: str) -> str | None:
    """Why `value` cannot be written as TOML (the run's orch.toml), or None. Iterative: any depth."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            bad_key = next((k for k in item if _not_unicode(k)), None)
            if bad_key is not None:  # named by ascii(): the message must be Unicode itself
                return f"{path} has a key holding a lone surrogate (not Unicode text): {ascii(bad_key)}"
            stack.extend((v, f"{path}.{k}") for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
        elif (problem := _scalar_problem(item, path)) is not None:
            return problem
    return None
