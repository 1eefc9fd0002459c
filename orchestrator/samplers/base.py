"""The sampler interface: what the engine needs from an inference backend."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]


@dataclass
class Completion:
    """One sampled completion."""

    token_ids: list[int]
    """Sampled tokens; a stop token that ended the completion is included (the policy must learn to emit it)."""
    logprobs: list[float]
    """Logprob of each sampled token under the sampling policy (see the sampler's docs for which distribution)."""
    text: str | None = None
    finish_reason: FinishReason | None = None
    """`stop` (a stop token was sampled) or `length` (max_tokens reached)."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} logprobs")


@runtime_checkable
class Sampler(Protocol):
    """An inference policy that can be switched to a newer LoRA adapter."""

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] | None = None,
    ) -> list[Completion]:
        """`n` completions per prompt, flat and prompt-major: prompt 0's n completions, then prompt 1's, ..."""
        ...

    async def load_adapter(self, path: str | Path, name: str, step: int) -> None:
        """Sample from the PEFT adapter in directory `path` from now on (`name` must be new for each step)."""
        ...
