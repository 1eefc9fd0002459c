"""Our models of the Tinker wire shapes we accept and answer (tinker 0.38.0's `tinker.types`).

Requests ignore fields we do not use (the SDK adds optional fields between versions); the ones
we use are bounded. Responses carry exactly the fields the SDK reads.
"""

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter

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
MAX_MODEL_SEQ_ID = 1_000_000


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSessionRequest(_Request):
    tags: list[Annotated[str, Field(max_length=MAX_TAG_CHARS)]] = Field(default_factory=list, max_length=64)
    user_metadata: UserMetadata = None
    sdk_version: str = Field(default="unknown", max_length=64)


class SessionHeartbeatRequest(_Request):
    session_id: str = Field(max_length=64)


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
    session_id: str = Field(max_length=64)
    model_seq_id: int = Field(ge=0, le=MAX_MODEL_SEQ_ID)
    base_model: str = Field(min_length=1, max_length=256)
    user_metadata: UserMetadata = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = OptimizerConfig()


class GetInfoRequest(_Request):
    model_id: str = Field(max_length=64)


class FutureRetrieveRequest(_Request):
    request_id: str = Field(max_length=64)


class UntypedAPIFuture(BaseModel):
    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None
    """sample: one id per requested sequence."""


class TryAgain(BaseModel):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"


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
    tinker_path: str = Field(max_length=512)


class WeightsInfoOut(BaseModel):
    """tinker 0.38.0's `types.WeightsInfoResponse`: what a checkpoint loads into."""

    base_model: str
    is_lora: bool = True
    lora_rank: int
    train_unembed: bool
    train_mlp: bool
    train_attn: bool


TrainingRunOut.model_rebuild()  # its checkpoint fields name CheckpointOut, defined after it
