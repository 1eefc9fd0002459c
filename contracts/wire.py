"""Wire types for rollout batches (JSON and msgpack), shared by the SDK, the service and the
trainer, and the one definition of what a trainable sample is (`sample_problems`). Torch-free."""

import math
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any

import msgspec


class TrainingSample(msgspec.Struct, forbid_unknown_fields=True):
    """One rollout: a prompt and the completion the inference policy sampled."""

    prompt_ids: list[int]
    prompt_mask: list[bool]
    completion_ids: list[int]
    completion_mask: list[bool]
    """False on completion tokens that carry no loss (e.g. tool output)."""
    completion_logprobs: list[float]
    """Inference-policy logprob of each completion token."""
    advantage: float | list[float] | None = None
    """A scalar for the whole completion, or one per completion token. Required by the service."""
    teacher_logprobs: list[float] | None = None
    reward: float | None = None
    """The sample's scalar reward, as the orchestrator scored it: the service aggregates it per rollout
    step into the run's metrics; a run with GAE advantages places it at the last completion token."""
    token_rewards: list[float] | None = None
    """One reward per completion token (runs with GAE advantages); overrides `reward` for training."""
    weights: list[float] | None = None
    """One loss weight (>= 0) per completion token, for SFT (`cross_entropy`); default: completion_mask."""
    metrics: dict[str, float] | None = None
    """Free per-sample measurements (e.g. `{"format_ok": 1.0}`), aggregated per rollout step like
    `reward`; at most MAX_SAMPLE_METRICS names of at most MAX_LABEL_CHARS characters."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


class TrainingBatch(msgspec.Struct, forbid_unknown_fields=True):
    """What an orchestrator posts for one rollout step of one run."""

    examples: list[TrainingSample]
    temperature: float = 1.0
    step: int = 0
    """The orchestrator's rollout step (the adapter step it sampled with)."""
    env: str | None = None
    agent: str | None = None


json_encoder = msgspec.json.Encoder()
msgpack_encoder = msgspec.msgpack.Encoder()
batch_json_decoder = msgspec.json.Decoder(TrainingBatch)
batch_msgpack_decoder = msgspec.msgpack.Decoder(TrainingBatch)


# --------------------------------------------------------------------------- the one validation

MAX_EXAMPLES_PER_BATCH = 4096
"""A cap on samples per batch; bigger rollout steps are split into several batches."""

MAX_LABEL_CHARS = 256
"""Longest `env` / `agent` label, and longest per-sample metric name."""

MAX_SAMPLE_METRICS = 16
"""Most names in one sample's `metrics`."""

MAX_BATCH_STEP = 2**31 - 1
"""Largest rollout `step` (the service stores it in a 32-bit column)."""

MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
"""The sampling temperatures a batch may state. The trainer divides float32 logits by it: 5e-324 is
0 in float32 and 1e308 infinite (that run's loss was then non-finite); below 1e-5 samplers sample
greedily (vLLM's epsilon), and the Tinker API's sampling takes at most 100."""

MAX_ABS_SCALAR = 3.4028234663852886e38
"""Largest magnitude of a `reward` or a metric value: float32's largest finite value. The trainer
reads rewards as float32, and the service's per-step statistics of rewards and metrics (sums of
squared deviations, in float64) cannot overflow for values within it."""


def _label_problem(label: str) -> str | None:
    if len(label) > MAX_LABEL_CHARS:
        return f"is longer than {MAX_LABEL_CHARS} characters"
    if "\x00" in label:  # Postgres text cannot hold one
        return "must not contain a NUL character"
    return None


def _scalar_problem(value: float) -> str | None:
    if not math.isfinite(value):
        return "is not finite"
    if abs(value) > MAX_ABS_SCALAR:
        return f"is beyond float32's range (|value| <= {MAX_ABS_SCALAR:.7g})"
    return None


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a batch."""

    sample: int | None
    """Index of the sample in `examples`; None for a batch-level field."""
    field: str
    """The field at fault (e.g. `completion_logprobs`, `temperature`, `body`)."""
    problem: str
    """What is wrong, in words that name the field (so the text stands alone in a log line)."""

    def loc(self) -> list[str]:
        """Where in the body, as a pydantic-style path: `["body", "examples", "3", "prompt_ids"]`."""
        if self.field == "body":
            return ["body"]
        if self.sample is None:
            return ["body", self.field]
        sample = ["body", "examples", str(self.sample)]
        return sample if self.field == "examples" else [*sample, self.field]

    def as_dict(self) -> dict[str, Any]:
        """As an item of a 422's `details`: the `{loc, msg, type}` every 422 of the service lists
        (what generated clients and the CLI read), and `sample`, `field`, `problem` as well (what
        batch clients read)."""
        return {
            "loc": self.loc(),
            "msg": self.problem,
            "type": "value_error",
            "sample": self.sample,
            "field": self.field,
            "problem": self.problem,
        }


def _first_non_finite(values: list[float]) -> int | None:
    """Index of the first NaN/inf in `values`, or None if all are finite."""
    # sum() is one C loop; a NaN or inf anywhere makes it non-finite. Only then (or on an
    # overflow of huge finite values) look for the culprit element by element.
    if math.isfinite(sum(values)):
        return None
    return next((i for i, v in enumerate(values) if not math.isfinite(v)), None)


def _logprob_problems(field: str, values: list[float]) -> list[tuple[str, str]]:
    bad = _first_non_finite(values)
    if bad is not None:
        return [(field, f"{field} value {values[bad]!r} at position {bad} is not finite")]
    if values and max(values) > 0.0:
        pos = next(i for i, v in enumerate(values) if v > 0.0)
        return [(field, f"{field} value {values[pos]!r} at position {pos} is positive (logprobs are <= 0)")]
    return []


def _token_problems(field: str, ids: list[int], vocab_size: int | None) -> list[tuple[str, str]]:
    if not ids:
        return []
    out = []
    low = min(ids)
    if low < 0:
        out.append((field, f"token id {low} at position {ids.index(low)} of {field} is negative"))
    high = max(ids)
    if vocab_size is not None and high >= vocab_size:
        out.append(
            (
                field,
                f"token id {high} at position {ids.index(high)} of {field} is outside the vocabulary "
                f"[0, {vocab_size})",
            )
        )
    return out


def _length_problems(sample: TrainingSample) -> list[tuple[str, str]]:
    n_prompt, n_completion = len(sample.prompt_ids), len(sample.completion_ids)
    # field -> (its values, None when absent; the length they must have; the field that length is of)
    expected: dict[str, tuple[Sized | None, int, str]] = {
        "prompt_mask": (sample.prompt_mask, n_prompt, "prompt_ids"),
        "completion_mask": (sample.completion_mask, n_completion, "completion_ids"),
        "completion_logprobs": (sample.completion_logprobs, n_completion, "completion_ids"),
        "advantage": (
            sample.advantage if isinstance(sample.advantage, list) else None,
            n_completion,
            "completion_ids",
        ),
        "teacher_logprobs": (sample.teacher_logprobs, n_completion, "completion_ids"),
        "token_rewards": (sample.token_rewards, n_completion, "completion_ids"),
        "weights": (sample.weights, n_completion, "completion_ids"),
    }
    return [
        (field, f"{field} has {len(values)} entries, {of} {n}")
        for field, (values, n, of) in expected.items()
        if values is not None and len(values) != n
    ]


def sample_problems(
    sample: TrainingSample, *, seq_len: int, vocab_size: int | None, full: bool = True
) -> list[tuple[str, str]]:
    """Every rule `sample` breaks, as (field, problem) pairs; empty when it can be trained.

    The one definition of a trainable sample. `full=False` checks what training needs to be safe
    and exact (the pool's Packer, before a sample is buffered): the sample is not empty and fits
    `seq_len`, every per-token list matches its ids, token ids are in the vocabulary (`vocab_size`
    None: only non-negative), the advantage is present and finite. `full=True` (the service, before a
    batch is stored) adds the rules of the product: a non-empty prompt and completion, and finite
    logprobs <= 0.
    """
    out = _shape_problems(sample, seq_len=seq_len, full=full)
    if out and out[0][1].startswith("empty sample"):
        return out
    out += _token_problems("prompt_ids", sample.prompt_ids, vocab_size)
    out += _token_problems("completion_ids", sample.completion_ids, vocab_size)
    out += _advantage_value_problems(sample.advantage)
    out += _optional_value_problems(sample)
    if full:
        out += _logprob_problems("completion_logprobs", sample.completion_logprobs)
        if sample.teacher_logprobs is not None:
            out += _logprob_problems("teacher_logprobs", sample.teacher_logprobs)
    return out


def sample_shape_problems(sample: TrainingSample, *, seq_len: int) -> list[tuple[str, str]]:
    """The length rules of `sample_problems(full=True)` alone (no per-token work): what the
    service's constrained decoder cannot express."""
    return _shape_problems(sample, seq_len=seq_len, full=True)


def _shape_problems(sample: TrainingSample, *, seq_len: int, full: bool) -> list[tuple[str, str]]:
    n_prompt, n_completion = len(sample.prompt_ids), len(sample.completion_ids)
    if n_prompt + n_completion == 0:
        return [("prompt_ids", "empty sample (no prompt and no completion tokens)")]
    out: list[tuple[str, str]] = []
    if n_prompt + n_completion > seq_len:
        out.append(
            (
                "prompt_ids+completion_ids",
                f"{n_prompt + n_completion} tokens (prompt {n_prompt} + completion {n_completion}) "
                f"> seq_len {seq_len}",
            )
        )
    if full and n_prompt == 0:
        out.append(("prompt_ids", "prompt_ids is empty"))
    if full and n_completion == 0:
        out.append(("completion_ids", "completion_ids is empty"))
    out += _length_problems(sample)
    if sample.advantage is None:
        out.append(("advantage", "advantage is missing (a number, or one per completion token)"))
    return out


def _finite_list_problems(field: str, values: list[float] | None) -> list[tuple[str, str]]:
    bad = None if values is None else _first_non_finite(values)
    if values is None or bad is None:
        return []
    return [(field, f"{field} value {values[bad]!r} at position {bad} is not finite")]


def _optional_value_problems(sample: TrainingSample) -> list[tuple[str, str]]:
    """Rewards, weights and metrics: finite; weights >= 0; metrics bounded."""
    out = _finite_list_problems("token_rewards", sample.token_rewards)
    out += _finite_list_problems("weights", sample.weights)
    if sample.weights and not out and min(sample.weights) < 0.0:
        pos = next(i for i, w in enumerate(sample.weights) if w < 0.0)
        out.append(("weights", f"weights value {sample.weights[pos]!r} at position {pos} is negative"))
    if sample.reward is not None and (problem := _scalar_problem(sample.reward)) is not None:
        out.append(("reward", f"reward {sample.reward!r} {problem}"))
    metrics = sample.metrics or {}
    if len(metrics) > MAX_SAMPLE_METRICS:
        out.append(("metrics", f"metrics has {len(metrics)} names; at most {MAX_SAMPLE_METRICS}"))
    for name, value in metrics.items():
        if not name or len(name) > MAX_LABEL_CHARS:
            out.append(("metrics", f"metric name {name[:40]!r} must have 1 to {MAX_LABEL_CHARS} characters"))
        elif "\x00" in name:
            out.append(("metrics", f"metric name {name[:40]!r} must not contain a NUL character"))
        elif (problem := _scalar_problem(value)) is not None:
            out.append(("metrics", f"metric {name!r} value {value!r} {problem}"))
    return out


def _advantage_value_problems(advantage: float | list[float] | None) -> list[tuple[str, str]]:
    if isinstance(advantage, list):
        bad = _first_non_finite(advantage)
        if bad is not None:
            return [("advantage", f"advantage value {advantage[bad]!r} at position {bad} is not finite")]
    elif advantage is not None and not math.isfinite(advantage):
        return [("advantage", f"advantage is {advantage!r}")]
    return []


def batch_field_problems(batch: TrainingBatch) -> list[Problem]:
    """The rules about the batch's own fields (not its samples)."""
    out: list[Problem] = []
    n = len(batch.examples)
    if n == 0:
        out.append(Problem(None, "examples", "must hold at least one sample"))
    elif n > MAX_EXAMPLES_PER_BATCH:
        out.append(
            Problem(
                None, "examples", f"has {n} samples; at most {MAX_EXAMPLES_PER_BATCH} per batch (split it)"
            )
        )
    if not MIN_TEMPERATURE <= batch.temperature <= MAX_TEMPERATURE:  # NaN fails too
        out.append(
            Problem(
                None,
                "temperature",
                f"must be in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], not {batch.temperature!r}",
            )
        )
    if not 0 <= batch.step <= MAX_BATCH_STEP:
        out.append(Problem(None, "step", f"must be in [0, {MAX_BATCH_STEP}], not {batch.step}"))
    for name in ("env", "agent"):
        label = getattr(batch, name)
        if label is not None and (problem := _label_problem(label)) is not None:
            out.append(Problem(None, name, problem))
    return out


def batch_problems(batch: TrainingBatch, *, seq_len: int, vocab_size: int | None) -> list[Problem]:
    """Every rule broken by `batch` for a run with this seq_len and base-model vocabulary (None: unknown)."""
    out = batch_field_problems(batch)
    if len(batch.examples) > MAX_EXAMPLES_PER_BATCH:
        return out  # not worth checking the samples of a batch that is refused anyway
    for index, sample in enumerate(batch.examples):
        out += [
            Problem(index, field, problem)
            for field, problem in sample_problems(sample, seq_len=seq_len, vocab_size=vocab_size)
        ]
    return out
