"""Request and response bodies of the runs API, and parsing of the create body (JSON or TOML)."""

import hashlib
import json
import re
import threading
import tomllib
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from app import http_semantics
from app.errors import PayloadTooLarge, UnsupportedMediaType, ValidationFailed
from app.request_guard import (
    first_path,
    has_digit_run,
    integer_too_long,
    integer_too_long_message,
    long_integer_in_json,
    max_int_digits,
    nested_deeper,
    nul_path,
    too_deep,
)
from app.runs.models import Run
from app.runs.toml_bounds import TomlTextExcess, skeleton_excess, toml_skeleton, toml_text_excess
from app.timestamps import UtcDatetime
from contracts.names import MAX_RUN_NAME_CHARS, RUN_NAME_PATTERN, RUN_NAME_RULE, run_name_problem
from contracts.pool_api import INT32_MAX, InitFrom
from contracts.progress import Progress
from contracts.run_config import METADATA_MAX_VALUES, Excess, RunConfig, metadata_excess, shape_excess
from contracts.status import RunStatus

TOML_CONTENT_TYPES = frozenset({"application/toml", "text/toml", "text/x-toml"})

MAX_TOML_BODY_BYTES = 64 * 1024
"""A TOML create body's size (a 413 above). TOML is parsed in pure Python, so a 1 MB array of zeros
took 0.8 s of CPU before any of the body's bounds could be checked. A valid config is small (its
metadata at most 16 KiB as JSON), and the CLI sends a TOML file re-written without its comments."""

MAX_CREATE_BODY_VALUES = METADATA_MAX_VALUES + 1000
"""Values (each string, number, boolean, array and object counts one) in a whole create body: the
metadata's plus room for every other field (a few dozen). Counted before anything walks the body
item by item, so a long array elsewhere (an unknown field, `lora.target_modules`: 510,001 errors
once) is refused as cheaply as one in metadata."""


class InitFromRun(BaseModel):
    """Start from one of the tenant's own runs: its adapter of `step` (default: the newest), or its
    checkpoint of `checkpoint`, with that checkpoint's optimizer and schedule state when `with_optimizer`."""

    model_config = ConfigDict(extra="forbid")

    run_id: str | None = Field(default=None, pattern=r"^run_[0-9a-f]{12}$", examples=["run_97e3b736da57"])
    adapter_id: str | None = Field(
        default=None,
        max_length=16,
        description="An adapter uploaded with POST /v1/adapters (instead of run_id).",
    )
    step: Annotated[int, Field(ge=0, le=INT32_MAX)] | Literal["latest"] | None = Field(
        default=None, description="An adapter step (>= 1), or latest (the default without checkpoint)."
    )
    checkpoint: Annotated[int, Field(ge=0, le=INT32_MAX)] | Literal["latest"] | None = Field(
        default=None, description="A checkpoint step, or latest: the pool that trained the run loads it."
    )
    with_optimizer: bool = Field(
        default=False, description="With checkpoint: also its optimizer and schedule (resume/fork exactly)."
    )

    @field_validator("step", "checkpoint", mode="before")
    @classmethod
    def _stored_step(cls, value: Any) -> Any:
        """A step as the database stores it (a 32-bit column), checked before the union's own
        validation: that one took `true` as step 1 and a float 1.0 as 1, and named each member of
        the union in its errors; a step past the column's range was a 500 (OverflowError, SQLite) or
        a 422 that named no field (Postgres), and a negative one a 404."""
        if value is None or value == "latest":
            return value
        if type(value) is not int:  # bool is an int subclass: `true` is no step
            raise PydanticCustomError("int_type", "must be an integer step or 'latest'")
        if value < 0:
            raise PydanticCustomError("greater_than_equal", "must be at least {ge}", {"ge": 0})
        if value > INT32_MAX:
            raise PydanticCustomError(
                "less_than_equal", "must be at most {le} (a step's bound)", {"le": INT32_MAX}
            )
        return value

    @model_validator(mode="after")
    def _one_source(self) -> "InitFromRun":
        if (self.run_id is None) == (self.adapter_id is None):
            raise ValueError("give run_id or adapter_id, exactly one")
        if self.adapter_id is not None and (self.step is not None or self.checkpoint is not None):
            raise ValueError("an uploaded adapter has no step or checkpoint")
        if self.step is not None and self.checkpoint is not None:
            raise ValueError("give step (an adapter) or checkpoint, not both")
        if self.with_optimizer and self.checkpoint is None:
            raise ValueError("with_optimizer needs checkpoint")
        return self


def checked_run_name(name: str) -> str:
    """The name rule (contracts.names) as a pydantic validator: a run's name, an uploaded adapter's."""
    problem = run_name_problem(name)
    if problem is not None:  # `{problem}`: the message is data, never a format template
        raise PydanticCustomError(problem.type, "{problem}", {"problem": problem.message})
    return name


RunName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_RUN_NAME_CHARS,
        description=RUN_NAME_RULE,
        examples=["gsm8k-r8"],
        json_schema_extra={"pattern": RUN_NAME_PATTERN},  # documented; AfterValidator enforces the rule
    ),
    AfterValidator(checked_run_name),
]
"""A new run's name (contracts.names: the one rule the SDK and the CLI check too). Rows stored
before the rule keep their names: only what comes in is checked."""


class RunCreate(BaseModel):
    """Create a run. As TOML: a top-level `name = "..."` and a `[config]` table (sub-tables
    `[config.lora]`, `[config.optim]`, ...)."""

    model_config = ConfigDict(extra="forbid")

    name: RunName
    config: RunConfig = Field(default_factory=RunConfig, description="Omitted fields take their defaults.")
    init_from: InitFromRun | None = Field(
        default=None,
        description=(
            "Start from the adapter of one of the tenant's runs; its base model, lora rank, alpha and "
            "target modules must be this run's."
        ),
    )

    def request_hash(self) -> str:
        """sha256 of the canonical body: the same run whether it came as JSON or TOML, in any key order."""
        body = self.model_dump(mode="json", exclude={"init_from"} if self.init_from is None else None)
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


class RunOut(BaseModel):
    id: str
    tenant_id: str
    name: str
    status: RunStatus
    slot: int | None = Field(description="Slot index 0..slots-1 while active, else null.")
    base_model: str
    config: RunConfig
    progress: Progress
    init_from: InitFrom | None = Field(
        default=None, description="The adapter the run started from (the step resolved at creation)."
    )
    eviction_reason: str | None
    evicted_by: Literal["user", "trainer", "orchestrator", "heartbeat"] | None
    failure_reason: str | None
    waiting_reason: str | None = Field(
        default=None, description="Why a queued run waits (GET /v1/runs/{id} only); null otherwise."
    )
    created_at: UtcDatetime
    updated_at: UtcDatetime
    started_at: UtcDatetime | None
    finished_at: UtcDatetime | None
    last_heartbeat_at: UtcDatetime | None

    @classmethod
    def from_run(cls, run: Run) -> "RunOut":
        return cls(
            id=run.id,
            tenant_id=run.tenant_id,
            name=run.name,
            status=run.status,
            slot=run.slot,
            base_model=run.base_model,
            config=run.config,
            progress=Progress(step=run.step, total_tokens=run.total_tokens, total_samples=run.total_samples),
            init_from=InitFrom.model_validate(run.init_from) if run.init_from else None,
            eviction_reason=run.eviction_reason,
            evicted_by=run.evicted_by,
            failure_reason=run.failure_reason,
            created_at=run.created_at,
            updated_at=run.updated_at,
            started_at=run.started_at,
            finished_at=run.finished_at,
            last_heartbeat_at=run.last_heartbeat_at,
        )


class RunList(BaseModel):
    items: list[RunOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


REASON_CHARS = r"[^\x00-\x08\x0b-\x1f\x7f]"
"""An eviction reason is shown in terminals (`loraloom runs show`), pages and run directories: no
control character but tab and newline (an ANSI escape or a carriage return could rewrite what a
terminal shows around it)."""


class EvictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(
        min_length=1,
        max_length=4096,
        pattern=f"^{REASON_CHARS}+$",
        examples=["reward plateaued"],
        description="Free text; tabs and newlines allowed, no other control characters.",
    )
    by: Literal["user", "orchestrator"] = Field(
        default="user",
        description="`orchestrator` when the orchestrator evicts its own run (e.g. no learning signal).",
    )


class HeartbeatOut(BaseModel):
    run_id: str
    status: RunStatus
    last_heartbeat_at: UtcDatetime | None


def validation_problems(exc: ValidationError, *, prefix: tuple[str, ...] = ("body",)) -> list[dict[str, Any]]:
    """Pydantic errors in the same shape as the app's 422 handler: every problem with its field path.
    The offending input is left out on purpose: it may be large or secret."""
    return [
        {"loc": [*prefix, *(str(p) for p in err["loc"])], "msg": err["msg"], "type": err["type"]}
        for err in exc.errors()
    ]


def _malformed(kind: str, problem: str) -> ValidationFailed:
    return ValidationFailed(
        f"malformed {kind} body: {problem}",
        details=[{"loc": ["body"], "msg": problem, "type": f"{kind.lower()}_invalid"}],
    )


_EXCESS_TYPES = {"values": "too_many_values", "depth": "too_deep", "bytes": "too_large"}


def _too_big(loc: list[str], what: str, excess: Excess) -> ValidationFailed:
    message = excess.describe(what)
    detail = {
        "loc": loc,
        "msg": message,
        "type": _EXCESS_TYPES[excess.bound],
        "limit": excess.limit,
        "actual": excess.measured,
    }
    return ValidationFailed(message, details=[detail])


def size_problem(data: Any) -> ValidationFailed | None:
    """The create body's size bounds (config.metadata's, then the whole body's count of values), or
    None. Each walk stops at its bound, so this runs before anything that walks every item (the
    nesting and NUL checks, pydantic, the TOML check, the request hash, the projection)."""
    config = data.get("config") if isinstance(data, dict) else None
    if isinstance(config, dict) and "metadata" in config:
        excess = metadata_excess(config["metadata"])
        if excess is not None:
            return _too_big(["body", "config", "metadata"], "config.metadata", excess)
    excess = shape_excess(data, max_values=MAX_CREATE_BODY_VALUES)
    return None if excess is None else _too_big(["body"], "the body", excess)


def _parsed(body: bytes, media_type: str) -> Any:
    """The body parsed as its media type says, or a 415/422 domain error."""
    # Both parsers' errors are ValueErrors, and so is what Python's int() says of an integer of more
    # than 4300 digits (sys.get_int_max_str_digits), which neither parser turns into its own error:
    # that one is answered as the number too long, in its field (app/request_guard.py).
    if media_type in TOML_CONTENT_TYPES:
        return _parsed_toml(body)
    elif media_type == "" or http_semantics.is_json(media_type):  # none: JSON (the request guard agrees)
        try:
            return json.loads(body)
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError among them
            too_long = long_integer_in_json(
                body
            )  # the request guard answers it first; not if called directly
            if too_long is not None:
                raise ValidationFailed(integer_too_long_message(too_long), details=[too_long]) from exc
            raise _malformed("JSON", str(exc)) from exc
    else:
        raise UnsupportedMediaType(
            f"unsupported Content-Type {media_type!r}; send application/json or application/toml"
        )


_ONE_TOML_PARSE = threading.Lock()
"""tomllib is pure Python: within the text's bounds a 64 KiB body still takes up to ~80 ms of the
GIL, and 8 such parses at once took another tenant's GET /v1/runs from 4 ms to 530 ms (median): one
parse at a time per process leaves the other requests their share (docs/benchmarks.md). A TOML body
is the CLI's and curl's convenience; the SDK sends JSON."""


def _parsed_toml(body: bytes) -> Any:
    """The TOML body parsed, once its text is within the bounds that keep tomllib's time small
    (app/runs/toml_bounds.py), or a 422."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _malformed("TOML", str(exc)) from exc
    skeleton = toml_skeleton(text)
    excess = skeleton_excess(skeleton, max_values=MAX_CREATE_BODY_VALUES)
    if excess is not None:
        raise _toml_too_big(excess)
    too_long = _long_integer_found_first(text, skeleton)
    if too_long is not None:
        raise ValidationFailed(integer_too_long_message(too_long), details=[too_long])
    try:
        with _ONE_TOML_PARSE:
            return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _malformed("TOML", str(exc)) from exc
    except ValueError as exc:
        too_long = long_integer_in_toml(text)
        if too_long is not None:
            raise ValidationFailed(integer_too_long_message(too_long), details=[too_long]) from exc
        raise _malformed("TOML", str(exc)) from exc


def _long_integer_found_first(text: str, skeleton: str) -> dict[str, Any] | None:
    """The 422 detail item of an integer too long for int(), found in its field before the body is
    parsed as it is, or None. Parsed as it is first, such a body was parsed twice: once up to int()'s
    ValueError (which names no field), then again with the number marked (long_integer_in_toml). A
    run of digits outside strings and comments (the skeleton's, underscores left out as int() leaves
    them) is looked for first: for a body with none, nothing is done."""
    limit = max_int_digits()
    if not limit or not has_digit_run(skeleton.replace("_", "").encode(), limit):
        return None
    too_long = long_integer_in_toml(text)
    # Not found in a field: a digit run in a key, a float's, or a body malformed elsewhere; the
    # parse as it is answers (and finds the number again if int() refuses it).
    return too_long if too_long is not None and too_long["loc"] != ["body"] else None


def _toml_too_big(excess: TomlTextExcess) -> ValidationFailed:
    """The 422 of a TOML text past a bound: in the same words and `type` as the checks after the
    parse would use (nesting, the body's values), so a client sees one error whichever answers."""
    if excess.bound == "depth":
        return _malformed("TOML", "nested too deeply")
    if excess.bound == "values":
        return _too_big(["body"], "the body", Excess("values", excess.limit, excess.measured, at_least=True))
    if excess.bound == "key_parts":
        message = (
            f"nested too deeply: a key or table header of {excess.measured} dotted parts "
            f"(at most {excess.limit})"
        )
        kind = "too_deep"
    else:
        message = (
            f"keys too long: checking them walks {excess.measured} key parts (at most {excess.limit}; "
            "each key/value pair counts its key's parts times those and the longest table header's)"
        )
        kind = "keys_too_long"
    detail = {"loc": ["body"], "msg": message, "type": kind, "limit": excess.limit, "actual": excess.measured}
    return ValidationFailed(f"malformed TOML body: {message}", details=[detail])


def parse_run_create(body: bytes, content_type: str | None) -> RunCreate:
    """Parse and validate a create-run body, JSON or TOML, or raise a 413/415/422 domain error."""
    media_type = http_semantics.media_type(content_type)
    if media_type in TOML_CONTENT_TYPES and len(body) > MAX_TOML_BODY_BYTES:
        raise PayloadTooLarge(
            f"a TOML run body is at most {MAX_TOML_BODY_BYTES} bytes (this one is {len(body)}); "
            "send it as JSON, or leave out comments and padding"
        )
    # Before a (recursive) parser sees it; a TOML body's nesting is measured on its text with the
    # strings left out as TOML writes them (app/runs/toml_bounds.py), not as JSON does.
    if media_type not in TOML_CONTENT_TYPES and too_deep(body):
        raise _malformed("JSON", "nested too deeply")
    data = _parsed(body, media_type)
    too_big = size_problem(data)
    if too_big is not None:
        raise too_big
    if nested_deeper(data):  # TOML's dotted headers nest without brackets the byte scan would count
        raise _malformed("TOML" if media_type in TOML_CONTENT_TYPES else "JSON", "nested too deeply")
    if not isinstance(data, dict):
        raise ValidationFailed(
            "the body must be an object with `name` and `config`",
            details=[{"loc": ["body"], "msg": "expected an object", "type": "model_type"}],
        )
    where = nul_path(data)
    if where is not None:  # Postgres text cannot hold a NUL
        raise ValidationFailed(
            "a string holds a NUL character",
            details=[
                {"loc": ["body", *where], "msg": "must not contain a NUL character", "type": "nul_character"}
            ],
        )
    return _validated(data)


_TOML_DECIMAL = re.compile(r"[+-]?[0-9](?:_?[0-9])*")
"""A run of digits as a TOML decimal integer writes it (underscores between digits; int() counts
the digits only). Each match consumes its run: linear."""

_LONG_INTEGER_MARK = "\x00long integer {}\x00"
"""What a too long number is replaced with to find its field: a string no body can hold (NUL)."""


def long_integer_in_toml(text: str) -> dict[str, Any] | None:
    """The 422 detail item of an integer in a TOML body with more digits than Python converts, or
    None (no run of that many digits). For a body tomllib refused with int()'s ValueError: tomllib
    says neither where nor which. Each run of more digits than that is replaced by a string
    standing for it, and the body parsed again to find which field holds one; when that does not
    parse (such a run inside a string too), the detail names the body."""
    limit = max_int_digits()
    if not limit:
        return None
    long_runs: list[int] = []

    def mark(match: re.Match[str]) -> str:
        digits = sum(c.isdigit() for c in match.group())
        if digits <= limit:
            return match.group()
        long_runs.append(digits)
        return json.dumps(_LONG_INTEGER_MARK.format(len(long_runs) - 1))  # a TOML basic string too

    marked = _TOML_DECIMAL.sub(mark, text)
    if not long_runs:
        return None
    # The marks change no key (a digit run in one stays one part), but a run inside a string splits
    # it: the marked text is held to the text's bounds too before it is parsed.
    if toml_text_excess(marked, max_values=MAX_CREATE_BODY_VALUES) is not None:
        return integer_too_long(["body"], long_runs[0], limit)
    try:
        with _ONE_TOML_PARSE:
            data = tomllib.loads(marked)
    except ValueError:
        return integer_too_long(["body"], long_runs[0], limit)
    marks = {_LONG_INTEGER_MARK.format(i): digits for i, digits in enumerate(long_runs)}
    found = first_path(data, lambda item: isinstance(item, str) and item in marks)
    if found is None:
        return integer_too_long(["body"], long_runs[0], limit)
    path, mark_found = found
    return integer_too_long(["body", *path], marks[mark_found], limit)


def _validated(data: dict[str, Any]) -> RunCreate:
    try:
        payload = RunCreate.model_validate(data)
    except ValidationError as exc:
        problems = validation_problems(exc)
        raise ValidationFailed(f"{len(problems)} invalid field(s)", details=problems) from exc
    if payload.config.mode == "manual":
        # The Tinker API creates its runs through the runs service, not this body: a manual run made
        # here would have no model, so nothing could ever step it; it would only hold a quota slot.
        raise ValidationFailed(
            "config.mode 'manual' is the mode of a Tinker training model's run, made by the Tinker "
            "API (create_model), which steps it; a run made here takes rollout batches: leave mode "
            "out or set it to 'rollout'",
            details=[
                {"loc": ["body", "config", "mode"], "msg": "must be 'rollout' here", "type": "literal_error"}
            ],
        )
    return payload
