"""Manual-mode work between the service and the pool (the Tinker API, DESIGN §11).

A Tinker `forward`, `forward_backward` or `optim_step` is stored by the service as a pending
future; the pool claims the pending work of its active manual runs (per model in `seq_id` order,
up to and including the next `optim_step` or `load_weights`: the step boundary), executes it in
shared passes and posts each result back. A claim is held by the claiming pool while it lives; after
a pool crash the next one restores the run from its last optim_step's checkpoint and replays the
step's delivered forward_backwards (`ManualWorkItem.replay`). Torch-free and fastapi-free: both
ends use these models.
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LossFn = Literal["cross_entropy", "importance_sampling", "ppo", "cispo"]
WorkKind = Literal[
    "forward",
    "forward_backward",
    "optim_step",
    "save_weights_for_sampler",
    "sample",
    "save_weights",
    "load_weights",
]
MAX_ITEMS_PER_CLAIM = 256
GREEDY_TEMPERATURE = 1e-5
"""Sampling temperatures below this are greedy, as at 0 (vLLM's epsilon; `contracts.wire` bounds a
rollout batch's temperature by the same number). Accepted, not refused: Tinker's SDK bounds nothing,
and a tiny temperature is a common spelling of "nearly greedy" that the samplers Tinker runs on take."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _StrictModel(BaseModel):
    """Typed as the Tinker API types it: a number field takes a JSON number, never a boolean or a
    string (pydantic's lax mode read `true` as a learning rate of 1.0 and `"3"` as 3 samples; hostile
    probe h1, finding 5); an int field takes no float; a boolean field no number or string. An int is
    a float here: JSON has one number type. Stored requests were written by these models, so a
    stored request always passes again (the claim reads them with these models)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ManualDatum(_Model):
    """One Tinker datum, as the pool needs it: the model input and per-position loss inputs
    (position i predicts `target_tokens[i]` from `tokens[: i + 1]`)."""

    tokens: list[int] = Field(min_length=1, max_length=131_072)
    target_tokens: list[int]
    weights: list[float]
    logprobs: list[float] | None = None
    """The sampler's logprobs of the targets (importance_sampling, ppo)."""
    advantages: list[float] | None = None
    """Per-position advantages (importance_sampling, ppo)."""

    @model_validator(mode="after")
    def _aligned(self) -> "ManualDatum":
        n = len(self.tokens)
        for name in ("target_tokens", "weights", "logprobs", "advantages"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries; the model input has {n} tokens")
        return self


class AdamStep(_StrictModel):
    """The request's Adam parameters (AdamW with decoupled weight decay, as in torch)."""

    learning_rate: float = Field(gt=0, le=1.0)
    beta1: float = Field(ge=0, lt=1)
    beta2: float = Field(ge=0, lt=1)
    eps: float = Field(gt=0, le=1.0)
    weight_decay: float = Field(ge=0, le=1.0)
    grad_clip_norm: float = Field(ge=0, le=1e9)
    """0: no clipping."""


class SamplingSpec(_StrictModel):
    """A `sample` request: `num_samples` continuations of `prompt` from the run's adapter as it was
    saved at `step` (the live slot when the run is still there, else that step's saved copy), or
    from the base model (`step` None, the item's `run_id` empty)."""

    prompt: list[int] = Field(min_length=1, max_length=131_072)
    num_samples: int = Field(ge=1, le=64)
    max_tokens: int = Field(ge=1, le=4096)
    temperature: float = Field(ge=0, le=100)
    """0: greedy (the most likely token at every step), and so is every temperature below
    GREEDY_TEMPERATURE (1e-5): dividing the logits by one overflowed them. NaN, negatives and more
    than 100 are refused (422, naming the field). Bounds not tightened on purpose: this model also
    reads requests already stored, at every claim."""
    top_k: int = Field(ge=-1, le=1_000_000)
    top_p: float = Field(gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop_tokens: list[int] = Field(default_factory=list, max_length=64)
    stop_strings: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, max_length=64
    )
    """Matched against the decoded generated text (the base model's tokenizer, on the pool)."""
    stop_at_eos: bool = False
    """The SDK's `stop=None`: the model's end-of-sequence token ends a sequence."""
    step: int | None = Field(default=None, ge=1)
    base_model: str | None = Field(default=None, max_length=512)
    """Set (and `step` None) for the base model without an adapter."""
    prompt_logprobs: bool = False
    """Also the logprob of every prompt token after the first (from the prefill)."""
    prompt_logprobs_last_n: int | None = Field(default=None, ge=1)
    """Only the last N prompt tokens' logprobs (the others are None)."""


class ClipThresholds(_StrictModel):
    """The `loss_fn_config` of ppo and cispo: the bounds of the importance ratio's clip,
    `clip(r, low, high)` with r = exp(lp - old_lp) (trainer_core.policy_terms; unset, the pool's
    defaults 0.8 and 1.2, Tinker's). A ratio is positive and 1 on-policy, so 0 <= low <= 1 <= high:
    a low above 1 or a high below 1 clips even an on-policy token, and low > high is an empty
    interval (clamp then answers `high` for every token; `5.0` and `-3.0` were taken and trained on:
    hostile probe h1, finding 5). A low below 0 would clip nothing that 0 does not: refused as the
    mistake it is. Checked where a request enters (app.tinker.work), not on `ManualWorkItem`, which
    also reads the requests stored before this check."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    clip_low_threshold: float | None = Field(default=None, ge=0, le=1)
    clip_high_threshold: float | None = Field(default=None, ge=1)


CLIP_KEYS = tuple(ClipThresholds.model_fields)
LOSS_FN_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": CLIP_KEYS,
    "cispo": CLIP_KEYS,
}
"""The `loss_fn_config` keys each loss reads (trainer_core.policy_terms.tinker_loss); any other key
is refused, named, rather than ignored (a misspelt clip bound trained with the default)."""


class SampledSequence(_Model):
    tokens: list[int]
    logprobs: list[float]
    """The model's logprob of each sampled token (at temperature 1: what a forward gives)."""
    stop_reason: Literal["stop", "length"]


class ManualWorkItem(_Model):
    """One request. `save_weights_for_sampler` is ordered like the others: the pool answers the
    step its adapter is at (published at every optim_step), once the requests before it ran."""

    request_id: str
    run_id: str
    seq_id: int
    kind: WorkKind
    loss_fn: LossFn | None = None
    loss_fn_config: dict[str, float] = Field(default_factory=dict)
    data: list[ManualDatum] = Field(default_factory=list)
    adam: AdamStep | None = None
    name: str | None = Field(default=None, max_length=128)
    """save_weights_for_sampler, save_weights, load_weights: the name the user gave the weights."""
    source_run_id: str | None = None
    """load_weights: the run whose saved state `name` is loaded."""
    with_optimizer: bool = False
    """load_weights: the optimizer state too (Adam moments and step count), not only the weights."""
    sampling: SamplingSpec | None = None
    replay: bool = False
    """Already run and its result delivered, by a pool that has since died, which held its effect
    (the gradient it added, the weights it loaded) in memory: the pool rebuilds that effect and
    reports only `replayed` (the delivered result never changes)."""


class ManualClaimIn(_Model):
    pool_id: str = Field(min_length=1, max_length=32)
    max_items: int = Field(default=64, ge=1, le=MAX_ITEMS_PER_CLAIM)


class ManualClaimOut(BaseModel):
    items: list[ManualWorkItem]


class ManualResult(_Model):
    request_id: str
    error: str | None = None
    """Set when the pool could not execute the item (the future fails with it)."""
    release: bool = False
    """The pool has not admitted the item's run yet (it became active after the pool's last look):
    the item goes back to pending, to be claimed again."""
    logprobs: list[list[float]] | None = None
    """forward / forward_backward: per datum, the logprob of each target token."""
    elementwise_loss: list[list[float]] | None = None
    sequences: list[SampledSequence] | None = None
    """sample: the sampled sequences."""
    prompt_logprobs: list[float | None] | None = None
    """sample with prompt_logprobs: per prompt token, its logprob given the tokens before it (None
    for the first, and for those before the last N when the request asked for the last N)."""
    metrics: dict[str, float] = Field(default_factory=dict)
    replayed: bool = False
    """The pool rebuilt the effect of a `replay` item: from now on it holds that effect."""


class ManualResultsIn(_Model):
    pool_id: str = Field(min_length=1, max_length=32)
    results: list[ManualResult] = Field(max_length=MAX_ITEMS_PER_CLAIM)
