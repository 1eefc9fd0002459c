"""Wire types for rollout batches (JSON and msgpack), shared by the SDK, the
service and the trainer. Torch-free."""

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
