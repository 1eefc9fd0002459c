"""Our models of the Tinker wire shapes we accept and answer (tinker 0.38.0's `tinker.types`).

Requests ignore fields we do not use (the SDK adds optional fields between versions); the ones
we use are bounded. Responses carry exactly the fields the SDK reads.
"""

import json
import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
)

from app.errors import ValidationFailed, problem
from app.runs.schemas import validation_problems
from contracts.run_config import KNOWN_TARGET_MODULES

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
"""train_unembed: LoRA on the unembedding (with tied embeddings, a delta of its own)."""
TINKER_LORA_ALPHA = 32.0
"""The LoRA alpha of a Tinker model (the SDK does not send one)."""

assert set(ATTN_MODULES + MLP_MODULES + UNEMBED_MODULES) == KNOWN_TARGET_MODULES


MAX_USER_METADATA_BYTES = 16 * 1024
"""A model's or session's user_metadata, as JSON: it is stored and sent back in every listing."""


def _storable_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """user_metadata is stored in a JSON column and sent back in every listing of the tenant's models:
    what either cannot hold is refused here, or it would be stored and break those listings. Its values
    are Any, so pydantic checks none of this: NaN and infinities (Python's json parses them; JSON and
    Postgres have none) and lone surrogates (`"\\ud800"` parses to one; no UTF-8 response holds it)."""
    if value is None:
        return None
    try:
        stored = json.dumps(value, allow_nan=False)  # as the JSON column writes it (ASCII, escaped)
    except ValueError as exc:
        raise ValueError("user_metadata holds a number that is not finite (NaN or Infinity)") from exc
    if len(stored) > MAX_USER_METADATA_BYTES:
        raise ValueError(f"user_metadata is over {MAX_USER_METADATA_BYTES} bytes as JSON")
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # as a response sends it back
    except UnicodeEncodeError as exc:
        raise ValueError("user_metadata holds a lone surrogate (not Unicode text)") from exc
    return value


UserMetadata = Annotated[dict[str, Any] | None, AfterValidator(_storable_metadata)]
user_metadata_adapter: TypeAdapter[dict[str, Any] | None] = TypeAdapter(UserMetadata)

MAX_TAG_CHARS = 256
MAX_TAGS = 64
"""A session's tags: at most MAX_TAGS of MAX_TAG_CHARS characters each. Their characters are not
checked: the service keeps no tag (create_session drops them), and the official SDK sends
`TINKER_TAGS` split on commas as written (`"a, b,"` is `["a", " b", ""]`), which the run names'
rule would refuse, failing the client's creation."""

Tag = Annotated[str, Field(max_length=MAX_TAG_CHARS)]
MAX_MODEL_SEQ_ID = 1_000_000
MAX_SEQ_ID = 2**31 - 1
"""A request's `seq_id` (the column is a 32-bit integer)."""

# --- ids, paths and names: bounded where they enter ------------------------------------------

MAX_ID_CHARS = 64
"""The longest model, session or request id a Tinker body or path may carry: the bound of /v1's
path ids (app.runs.deps.RunIdPath) and of the columns that hold them. The service's own ids are far
shorter: `ses_`, `req_`, `smp_` + 12 hex digits, a model `{session}:train:{model_seq_id}` at most 30
characters (model_seq_id <= MAX_MODEL_SEQ_ID). A longer one is a 422 naming the field: unbounded, a
5000-character id came back whole in its 404 (hostile probe h1, finding 8)."""
PRINTABLE = r"^[\x21-\x7e]+$"
"""Every id and `tinker://` path the service makes is printable ASCII without spaces: anything else
(a space, a control character) is a 422 naming the field, never a query."""
TinkerId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS, pattern=PRINTABLE)]

MAX_SAVE_NAME_CHARS = 128
MAX_TINKER_PATH_CHARS = 256
"""A `tinker://{model_id}/sampler_weights/{name}` path is at most 9 + 64 + 17 + 128 = 218
characters; the column a sampling session keeps it in holds 256."""
TinkerPath = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_TINKER_PATH_CHARS, pattern=PRINTABLE)
]

MAX_BASE_MODEL_CHARS = 256
"""As `RunConfig.base_model` and the pools' column."""
BASE_MODEL_PATTERN = r"^[^\x00-\x1f\x7f]+$"
"""A base model's name has no control character (a NUL reached Postgres: hostile probe h1, finding 7)."""
BaseModelName = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_BASE_MODEL_CHARS, pattern=BASE_MODEL_PATTERN)
]

BASE_SAMPLER_PREFIX = "smpbase_"
MAX_SAMPLER_ID_CHARS = len(BASE_SAMPLER_PREFIX) + math.ceil(4 * (4 * MAX_BASE_MODEL_CHARS) / 3)
"""A base model's sampling session id is its name (up to 4 bytes a character in UTF-8), base64
without padding (app.tinker.sampling.base_sampler_id); any other is an id of MAX_ID_CHARS."""
SamplerId = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_SAMPLER_ID_CHARS, pattern=PRINTABLE)
]

SHOWN_CHARS = MAX_TINKER_PATH_CHARS
"""The most of a client's id, path or key a message repeats (`shown`): every id and path the
service makes is repeated whole."""


def shown(value: str) -> str:
    """`value` as an error message may repeat it: whole up to SHOWN_CHARS characters, else its
    start and its length. Every id a route takes is bounded already; this bounds what a message
    echoes whatever reached it (a base sampler id, a loss_fn_config key)."""
    if len(value) <= SHOWN_CHARS:
        return value
    return f"{value[:SHOWN_CHARS]}... ({len(value)} characters)"


class _Request(BaseModel):
    """A Tinker request body. Strict where the Tinker API is typed: a number field takes a JSON
    number, never a boolean or a string (an int is a float: JSON has one number type), an int
    field no float, a string field no number, a boolean no number or string. Lax, a save's
    `"path": 0` took the default name and `NaN` the name "nan", and load_weights' `"optimizer": "no"`
    loaded the optimizer state (hostile probe h1, finding 5). Fields we do not use are ignored (the
    SDK adds optional ones between versions)."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)


_R = TypeVar("_R", bound=_Request)


BODY_LOC = ("body",)
"""Where every Tinker 422 names a field of the request's body: under "body", as FastAPI writes a
typed body's (`["body", "tags", "3"]`), whether the route's body is typed or read by its service (a
JSON object, a protobuf ForwardBackwardRequest). A path or query parameter is under "path"/"query"."""


def body_problem(loc: Sequence[str | int], msg: str, kind: str = "value_error") -> dict[str, Any]:
    """`app.errors.problem` at `loc` in the request's body (`BODY_LOC` + `loc`)."""
    return problem((*BODY_LOC, *loc), msg, kind)


def field_named(loc: Sequence[str]) -> str:
    """A field's path as a message names it: `data.3.model_input`, without the leading "body" every
    body field's `loc` has (`body` for the body as a whole)."""
    inner = loc[len(BODY_LOC) :] if tuple(loc[: len(BODY_LOC)]) == BODY_LOC else loc
    return ".".join(inner) or "body"


def invalid(what: str, problems: list[dict[str, Any]], *, note: str = "") -> ValidationFailed:
    """A 422 whose message names each field that is wrong (`loc: msg`, the first few): the SDK
    shows users the message, not the details."""
    said = "; ".join(f"{field_named(p['loc'])}: {p['msg']}" for p in problems[:8])
    return ValidationFailed(f"invalid {what}: {said}{note}", details=problems)


def parse_request(model: type[_R], body: object, *, call: str) -> _R:
    """`body` (a route's JSON object) as `model`, or a 422 naming the fields (`invalid`)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid(f"{call} request", validation_problems(exc, prefix=BODY_LOC)) from exc


SeqId = Annotated[int, Field(ge=0, le=MAX_SEQ_ID)]


class CreateSessionRequest(_Request):
    tags: list[Tag] = Field(default_factory=list, max_length=MAX_TAGS)
    user_metadata: UserMetadata = None
    sdk_version: str = Field(default="unknown", max_length=64)


class SessionHeartbeatRequest(_Request):
    session_id: TinkerId


class LoraConfig(_Request):
    rank: int = Field(ge=1, le=256)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True

    def target_modules(self) -> tuple[str, ...]:
        return (
            (ATTN_MODULES if self.train_attn else ())
            + (MLP_MODULES if self.train_mlp else ())
            + (UNEMBED_MODULES if self.train_unembed else ())
        )


class OptimizerConfig(_Request):
    type: str = Field(default="adamw", max_length=32)


class CreateModelRequest(_Request):
    session_id: TinkerId
    model_seq_id: int = Field(ge=0, le=MAX_MODEL_SEQ_ID)
    base_model: BaseModelName
    user_metadata: UserMetadata = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = OptimizerConfig()


class GetInfoRequest(_Request):
    model_id: TinkerId


class FutureRetrieveRequest(_Request):
    request_id: TinkerId


class OrderedRequest(_Request):
    """A request in its model's order: `seq_id` numbers it (a retry with the same one is the same
    request)."""

    model_id: TinkerId
    seq_id: SeqId


class OptimStepRequest(OrderedRequest):
    adam_params: object = None
    """An object of AdamParams (contracts.tinker_work.AdamStep checks it, its numbers finite first:
    app.tinker.finite)."""


class SaveWeightsRequest(OrderedRequest):
    path: str | None = None
    """The name the weights are saved under (None: the default name; checked by
    app.tinker.work.SAVE_NAME_RE)."""


class SaveWeightsForSamplerRequest(SaveWeightsRequest):
    kind: str = Field(default="snapshot", max_length=32)


class LoadWeightsRequest(_Request):
    """Into a new model (`session_id` + `model_seq_id`, the SDK's create-from-state) or into an
    existing one (`model_id` + `seq_id`)."""

    path: TinkerPath
    optimizer: bool = False
    model_id: TinkerId | None = None
    seq_id: SeqId | None = None
    session_id: TinkerId | None = None
    model_seq_id: int | None = Field(default=None, ge=0, le=MAX_MODEL_SEQ_ID)
    user_metadata: UserMetadata = None


class CreateSamplingSessionRequest(_Request):
    session_id: TinkerId | None = None
    model_path: TinkerPath | None = None
    base_model: BaseModelName | None = None


class SampleRequest(_Request):
    """The envelope of a sample request; its sampling parameters become a
    contracts.tinker_work.SamplingSpec (strict too), its prompt tokens are read by
    app.tinker.sampling."""

    sampling_session_id: SamplerId
    num_samples: int = 1
    prompt: object = None
    sampling_params: object = None
    prompt_logprobs: bool | None = None
    prompt_logprobs_last_n: int | None = None


class UntypedAPIFuture(BaseModel):
    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None
    """sample: one id per requested sequence."""


class TryAgain(BaseModel):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"
    queue_state_reason: str | None = None
    """Why the request waits (app.tinker.service.queue_state); the SDK logs it. Left out when None."""


class SupportedModel(BaseModel):
    model_name: str
    max_context_length: int
    trainable: bool = True
    sampleable: bool = False


class ServerCapabilities(BaseModel):
    supported_models: list[SupportedModel]


SDK_BYTES_PER_TOKEN = 4
"""What the Tinker SDK counts for a token when it sizes its forward_backward chunks (int32 in its
protobuf body; tinker 0.38.0, `_estimate_chunk_bytes_count_proto`)."""


class ClientConfig(BaseModel):
    """The SDK's feature flags, set to what loraloom serves: API keys (no JWT exchange), plain
    httpx, uncompressed protobuf forward_backward bodies, per-request futures."""

    pjwt_auth_enabled: bool = False
    credential_default_source: str = "api_key"
    use_pyqwest_transport: bool = False
    proto_compress_fwdbwd: bool = False
    parallel_fwdbwd_chunks: bool = False
    sample_use_retrieve_futures: bool = False
    custom_loss_server_side: bool = False
    sample_join_sampling_session: bool = False
    fwdbwd_max_chunk_len: int
    """Datums per forward_backward request the SDK sends (app.tinker.work.MAX_DATUMS_PER_REQUEST)."""
    fwdbwd_max_chunk_bytes_count: int
    """The SDK's estimate of a request's bytes, which counts each token as SDK_BYTES_PER_TOKEN plus
    the loss inputs' bytes: at most this keeps a request's tokens within the service's limit."""

    @classmethod
    def for_limits(cls, *, max_datums: int, max_tokens: int) -> "ClientConfig":
        return cls(
            fwdbwd_max_chunk_len=max_datums, fwdbwd_max_chunk_bytes_count=max_tokens * SDK_BYTES_PER_TOKEN
        )


class ModelData(BaseModel):
    arch: str | None = None
    model_name: str
    tokenizer_id: str


class GetInfoResponse(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    type: Literal["get_info"] = "get_info"
    model_data: ModelData
    model_id: str
    is_lora: bool = True
    lora_rank: int
    model_name: str


class TrainingRunOut(BaseModel):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool = True
    corrupted: bool = False
    lora_rank: int
    last_request_time: str
    last_checkpoint: "CheckpointOut | None" = None
    """The newest training checkpoint (save_state), if any."""
    last_sampler_checkpoint: "CheckpointOut | None" = None
    """The newest sampler checkpoint (save_weights_for_sampler), if any."""
    user_metadata: dict[str, str] | None = None


class Cursor(BaseModel):
    offset: int
    limit: int
    total_count: int


class TrainingRunsOut(BaseModel):
    training_runs: list[TrainingRunOut]
    cursor: Cursor


class CheckpointOut(BaseModel):
    """tinker 0.38.0's `types.Checkpoint`: what `save_state` (training) or
    `save_weights_for_sampler` (sampler) named."""

    checkpoint_id: str
    """`weights/<name>` or `sampler_weights/<name>`: the path's last two segments."""
    checkpoint_type: Literal["training", "sampler"]
    time: str
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False


class CheckpointsOut(BaseModel):
    checkpoints: list[CheckpointOut]
    cursor: Cursor | None = None


class WeightsInfoRequest(_Request):
    tinker_path: TinkerPath


class WeightsInfoOut(BaseModel):
    """tinker 0.38.0's `types.WeightsInfoResponse`: what a checkpoint loads into."""

    base_model: str
    is_lora: bool = True
    lora_rank: int
    train_unembed: bool
    train_mlp: bool
    train_attn: bool


TrainingRunOut.model_rebuild()  # its checkpoint fields name CheckpointOut, defined after it
