"""The worker pool's settings: one model, read from LORALOOM_* environment variables (the names
compose and the README use), overridden by command-line flags.

`loraloom worker` and `python -m trainer_core.worker` (the torchrun entry) both build a
`WorkerSettings`: environment first, then the flags given (keyword arguments win over the
environment in pydantic-settings). Relative paths are made absolute once, by the process that
reads them (`resolved()`), so that the ranks torchrun starts never depend on their working
directory.
"""

import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from contracts.pool_api import MAX_CLAIM_BATCHES
from contracts.run_config import DEFAULT_BASE_MODEL, DEFAULT_TARGET_MODULES

DEFAULT_DATA_DIR = Path("./.loraloom/data")
DEFAULT_MODEL_CACHE = Path("./.loraloom/models")

SETTING_ERROR_EXIT = 2
"""A rank's exit code for a `SettingError` (`loraloom worker` exits with it: its usage code)."""


class SettingError(ValueError):
    """A setting the pool cannot run with that only a rank finds out (a base model that does not
    load, target modules the model lacks): the rank logs the message, one line, and exits with
    `SETTING_ERROR_EXIT` instead of a traceback."""

    def __init__(self, message: str, *, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank
        """Every rank raises it at the same point (the master's, or one every rank finds alike): only
        the master logs it. Otherwise the rank that found it does."""


def threads_per_rank(nproc_per_node: int) -> int:
    """The CPU threads each of `nproc_per_node` ranks gets by default: the cores this process may run
    on (its affinity: a container pinned to 2 of 64 CPUs has 2), split between the ranks."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // nproc_per_node)


MAX_SAMPLER_ROUND_BYTES = 16 * 1024**3
"""The most answer bytes one round of external sampling may hold in memory at once."""
_ROUND_BYTES = "sampler_round_bytes"
"""The type of the error of a `sampler_concurrency` × `sampler_max_response_bytes` over that."""
_VARIABLES_DISAGREE = "variables_disagree"
"""The type of the error of two variables of one setting set to different values."""


class WorkerSettings(BaseSettings):
    """Every option of the worker pool. Field name = flag (`--seq-len`) = variable (`LORALOOM_SEQ_LEN`),
    except where `validation_alias` names the variables (compose's names): LORALOOM_MODEL_CACHE,
    LORALOOM_MAX_CONCURRENT_RUNS (or LORALOOM_SLOTS), LORALOOM_WORKER_RANKS. Both variables of one
    setting set to different values is an error naming both (`_refuse_disagreeing_variables`), unless
    the setting is given here (a flag), which wins over both."""

    model_config = SettingsConfigDict(env_prefix="LORALOOM_", extra="ignore", populate_by_name=True)

    def __init__(self, **values: Any) -> None:
        # Before pydantic-settings reads the environment: of two variables of one setting it takes the
        # first set (LORALOOM_SLOTS over LORALOOM_MAX_CONCURRENT_RUNS) without a word.
        _refuse_disagreeing_variables(values, os.environ)
        super().__init__(**values)

    # -- service --------------------------------------------------------------------------------
    url: str = "http://127.0.0.1:8000"
    """Base URL of the service."""
    worker_token: SecretStr | None = None
    """The service's worker token (not needed with `runs_dir`)."""
    worker_token_file: Path | None = None
    """A file holding the worker token (read when `worker_token` is not set; e.g. a Docker secret)."""
    runs_dir: Path | None = None
    """Train the `run_*` directories under this directory instead of the service's runs."""
    heartbeat_file: Path | None = None
    """Touched after every heartbeat the service accepts (the compose healthcheck reads its age)."""

    # -- model ----------------------------------------------------------------------------------
    base_model: str = DEFAULT_BASE_MODEL
    """`loraloom-tiny` (built in), a local Hugging Face directory, or a hub id."""
    model_cache_dir: Path = Field(
        default=DEFAULT_MODEL_CACHE,
        validation_alias=AliasChoices("LORALOOM_MODEL_CACHE", "LORALOOM_MODEL_CACHE_DIR"),
    )
    """Where the built-in model is built and cached (LORALOOM_MODEL_CACHE)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Weights' dtype: auto = bf16 on CUDA, fp32 on the CPU."""
    attention: Literal["auto", "packed", "flash_attention_2", "sdpa", "eager"] = "auto"
    """Attention kernel: auto = flash-attention 2 on CUDA when installed, else packed SDPA."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them
    (`MultiLoRA.enable_gradient_checkpointing`): activation memory per layer drops to its input, at
    about one more forward per step; every run's gradients are unchanged. For long rows on a GPU."""

    # -- pool -----------------------------------------------------------------------------------
    slots: int = Field(
        default=4,
        ge=1,
        le=1024,
        validation_alias=AliasChoices("LORALOOM_SLOTS", "LORALOOM_MAX_CONCURRENT_RUNS"),
    )
    """Concurrent runs (LoRA slots) this pool trains."""
    max_rank: int = Field(default=16, ge=1, le=256)
    """Largest LoRA rank a run may ask for."""
    target_modules: Annotated[tuple[str, ...], NoDecode, Field(min_length=1)] = DEFAULT_TARGET_MODULES
    """Linear layers that get LoRA slots (comma-separated); runs may pick a subset."""
    seq_len: int = Field(default=1024, ge=8)
    """Tokens per packed micro-batch; also the longest sample the pool accepts. Each micro-batch is one
    forward/backward whose host cost barely grows with its length (a 24-layer 0.5B model on an H100:
    160 ms at 1,024 tokens, 254 ms at 16,384), so on a GPU rows of 8k-16k tokens train 6-10x more tokens
    per second than 1,024, memory permitting (the fp32 logits of a 16k row at a 152k vocabulary alone
    take ~10 GB) (docs/benchmarks.md, "GPU figures")."""
    checkpoint_dir: Path | None = None
    """Per-run checkpoints go to checkpoint_dir/<run_id>/checkpoints/ (default: data_dir/runs)."""
    data_dir: Path = DEFAULT_DATA_DIR
    """The service's artifact store when it is shared with the worker (compose: the data volume)."""

    sampler_url: str | None = None
    """An OpenAI-compatible server with LoRA hot-loading (vLLM, `--enable-lora`) that serves Tinker
    `sample` instead of the pool's own layers; it must serve the base model under `base_model`'s
    name and read the pool's checkpoint directory at the same path (trainer_core.external_sampler)."""
    sampler_deadline: float = Field(default=600.0, gt=0, le=86_400)
    """Seconds a round of requests to `sampler_url` may take in all, from its start (connect, the
    generation, the whole answer, however slowly it trickles); a request not answered by then fails
    alone, one still waiting for its turn (`sampler_concurrency`) too. The server answers a completion
    only once all its samples are done, so this bounds a request's whole decoding: raise it for long
    generations on a large model. At most a day: a bound that still ends a hung server."""
    sampler_concurrency: int = Field(default=8, ge=1, le=1024)
    """Requests of a round in flight at once to `sampler_url` (and the pool's connections to it): the
    server batches those it has, so a round of N requests costs about N / this generations."""
    sampler_max_response_bytes: int = Field(default=256 * 1024**2, ge=1024, le=16 * 1024**3)
    """The largest answer read from `sampler_url` (bytes); a larger one fails its request alone. About
    100 bytes a sampled token with its logprob, and prompt logprobs, which vLLM repeats in every
    sample. Memory holds up to this much per answer, `sampler_concurrency` answers at once, so the two
    multiplied are capped at 16 GiB (and this is at least 1 KiB, below which no completion fits)."""

    # -- loop -----------------------------------------------------------------------------------
    pack_timeout: float = Field(default=2.0, ge=0)
    """Seconds buffered work waits for a full pack before a partial one is trained."""
    poll_interval: float = Field(default=0.2, ge=0)
    """Seconds between polls of the run source when idle."""
    max_claim: int = Field(default=64, ge=1, le=MAX_CLAIM_BATCHES)  # more: every claim a 422
    """Rollout batches claimed per request."""
    exit_when_idle: float | None = Field(default=None, ge=0)
    """Exit after this many seconds with no active run and nothing buffered (tests, benchmarks)."""

    # -- launcher (`loraloom worker` only) ------------------------------------------------------
    nproc_per_node: int = Field(
        default=1,
        ge=1,
        validation_alias=AliasChoices("LORALOOM_NPROC_PER_NODE", "LORALOOM_WORKER_RANKS"),
    )
    """Ranks (processes) on this machine; on GPUs, one per GPU."""
    master_port: int | None = Field(default=None, ge=0, le=65535)
    """Port the ranks meet on (one pool per port; default 29517 with several ranks; 0: any free port,
    which torchrun binds itself: `--standalone`, so no other pool can take it between pick and use)."""

    @model_validator(mode="after")
    def _round_fits_in_memory(self) -> "WorkerSettings":
        # On the model, not on either field: the bound is the pair's, and either may be the one the
        # user set (LORALOOM_SAMPLER_CONCURRENCY alone, over the default answer size). The error says
        # both values; `settings_problems` names each as it was given (`_ROUND_BYTES`).
        concurrency, each = self.sampler_concurrency, self.sampler_max_response_bytes
        if concurrency * each > MAX_SAMPLER_ROUND_BYTES:
            raise PydanticCustomError(
                _ROUND_BYTES,
                "sampler_concurrency {concurrency} × sampler_max_response_bytes {each} = {total} bytes "
                "of answers read at once, over {bound} (16 GiB): lower one of the two",
                {
                    "concurrency": concurrency,
                    "each": each,
                    "total": concurrency * each,
                    "bound": MAX_SAMPLER_ROUND_BYTES,
                },
            )
        return self

    @field_validator("target_modules", mode="before")
    @classmethod
    def _split_modules(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(m.strip() for m in value.split(",") if m.strip())
        return value

    @property
    def token(self) -> str | None:
        if self.worker_token:
            return self.worker_token.get_secret_value()
        if self.worker_token_file is not None:
            return self.worker_token_file.read_text().strip() or None
        return None

    @property
    def checkpoint_home(self) -> Path:
        """The directory holding `<run_id>/checkpoints/`: the run directories themselves with
        `runs_dir`, else `checkpoint_dir` (default `data_dir/runs`)."""
        if self.runs_dir is not None:
            return self.runs_dir
        return self.checkpoint_dir if self.checkpoint_dir is not None else self.data_dir / "runs"

    def resolved(self, cwd: Path | None = None) -> "WorkerSettings":
        """A copy with every relative path made absolute against `cwd` (default: the working directory)."""
        base = (cwd or Path.cwd()).resolve()
        updates: dict[str, Path] = {}
        for name in (
            "runs_dir",
            "heartbeat_file",
            "model_cache_dir",
            "checkpoint_dir",
            "data_dir",
            "worker_token_file",
        ):
            value = getattr(self, name)
            if isinstance(value, Path):
                updates[name] = value if value.is_absolute() else base / value
        base_model = Path(self.base_model).expanduser()
        # A local model given as a relative path: the ranks must find it from any directory.
        local = base / base_model if not base_model.is_absolute() else base_model
        new = self.model_copy(update=updates)
        if local.is_dir():
            new = new.model_copy(update={"base_model": str(local)})
        return new

    def flags(self) -> list[str]:
        """Every setting as `--name value` flags for `python -m trainer_core.worker`, the token
        excepted (it travels in the environment: `ps` shows command lines). The port is left out
        (torchrun's own); the rank count is not, though no rank reads it: the ranks inherit the
        launcher's environment, and without the flag its two variables disagreeing stopped every rank
        after the launcher had let the flag settle it."""
        out: list[str] = []
        skip = {"worker_token", "worker_token_file", "master_port"}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name in skip or value is None:
                continue
            text = ",".join(value) if isinstance(value, tuple) else str(value)
            out += [flag_name(name), text]
        return out


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _field_variables(field: str) -> list[str]:
    """The LORALOOM_* variables that set `field`: its `validation_alias` choices, else its own."""
    alias = WorkerSettings.model_fields[field].validation_alias
    if isinstance(alias, AliasChoices):
        return [name for name in alias.choices if isinstance(name, str)]
    return [f"LORALOOM_{field.upper()}"]


def _same_value(field: str, texts: Collection[str]) -> bool:
    """Whether the variables' `texts` mean one value of `field` ("4" and "04", "./m" and "m")."""
    annotation = WorkerSettings.model_fields[field].annotation
    if len(set(texts)) == 1 or annotation is None:
        return len(set(texts)) == 1
    adapter: TypeAdapter[Any] = TypeAdapter(annotation)
    try:
        return len({repr(adapter.validate_python(text.strip())) for text in texts}) == 1
    except ValidationError:
        return False  # one is no value at all: they differ, and the error says both


def _refuse_disagreeing_variables(given: Mapping[str, Any], environ: Mapping[str, str]) -> None:
    """A setting with two variables (LORALOOM_SLOTS and LORALOOM_MAX_CONCURRENT_RUNS, ...) set to
    different values is an error naming both with their values, unless its flag is given: a flag wins
    over every variable, so it settles the question. The same value in both is fine (compose sets one,
    an .env file the other)."""
    by_upper: dict[str, list[str]] = {}
    for key in environ:  # pydantic-settings ignores the case of variable names: so does this
        by_upper.setdefault(key.upper(), []).append(key)
    problems: list[str] = []
    disagreeing: dict[str, str] = {}
    for field in WorkerSettings.model_fields:
        variables = _field_variables(field)
        if field in given or any(v in given for v in variables):
            continue
        set_ = [key for v in variables for key in by_upper.get(v, [])]
        if len(set_) > 1 and not _same_value(field, [environ[key] for key in set_]):
            both = " and ".join(f"{key}={environ[key]!r}" for key in set_)
            disagreeing |= {key: environ[key] for key in set_}
            problems.append(
                f"{both} are two names of one setting ({flag_name(field)}) with different values: unset "
                f"one, give both the same value, or pass {flag_name(field)} (a flag wins over both)"
            )
    if problems:
        error = PydanticCustomError(_VARIABLES_DISAGREE, "{problems}", {"problems": "; ".join(problems)})
        # The input is the variables only: the flags given may hold the worker token.
        raise ValidationError.from_exception_data(
            WorkerSettings.__name__, [InitErrorDetails(type=error, loc=(), input=disagreeing)]
        )


def _setting_variable(name: str, environ: Mapping[str, str]) -> tuple[str, str | None]:
    """The field that a validation error's location `name` points at, and the variable of it that
    is set in `environ` (None if none is). pydantic names an aliased field by its first variable
    whichever was set (LORALOOM_SLOTS for a bad LORALOOM_MAX_CONCURRENT_RUNS): the error must name
    the one the user wrote."""
    for field, info in WorkerSettings.model_fields.items():
        alias = info.validation_alias
        names = alias.choices if isinstance(alias, AliasChoices) else [f"LORALOOM_{field.upper()}"]
        variables = [n for n in names if isinstance(n, str)]
        if name == field or name in variables:
            by_upper = {key.upper(): key for key in environ}  # pydantic-settings ignores the case
            return field, next((by_upper[v] for v in variables if v in by_upper), None)
    return name, None


def settings_problems(
    exc: ValidationError,
    *,
    given: Collection[str],
    environ: Mapping[str, str],
    flags: Mapping[str, str] | None = None,
) -> str:
    """Every problem of `exc` (from building `WorkerSettings`), each setting named as the user gave it:
    its flag when `given` (the fields passed as flags) holds it, spelt as `flags` says when not as
    `flag_name` does; else the LORALOOM_* variable set in `environ`. For both entry points: a
    traceback naming pydantic's alias was what `python -m trainer_core.worker` printed. A bound on two
    settings together names both, with their values and where each came from (flag, variable or
    default): the one the user set may be either."""

    def named(field: str) -> tuple[str, str | None]:
        """`field` as the user gave it, and the variable it came from (None: a flag or the default)."""
        field, variable = _setting_variable(field, environ)
        if variable is not None and field not in given:
            return variable, variable  # the LORALOOM_* variable set
        return (flags or {}).get(field, flag_name(field)), None

    def with_source(field: str, value: object) -> str:
        name, variable = named(field)
        if variable is not None:
            return f"{name}={value} (environment)"
        return f"{name} {value} ({'flag' if field in given else 'default'})"

    problems = []
    for error in exc.errors():
        if error["type"] == _ROUND_BYTES:
            ctx = error.get("ctx", {})
            problems.append(
                f"{with_source('sampler_concurrency', ctx['concurrency'])} × "
                f"{with_source('sampler_max_response_bytes', ctx['each'])} = {ctx['total']} bytes of "
                f"answers read at once, over the bound of {ctx['bound']} (16 GiB): lower one of the two"
            )
        elif not error["loc"]:
            problems.append(error["msg"])  # about the whole model: its message says what
        else:
            name, _ = named(str(error["loc"][0]))
            problems.append(f"{'.'.join([name, *map(str, error['loc'][1:])])}: {error['msg']}")
    return "; ".join(problems)
