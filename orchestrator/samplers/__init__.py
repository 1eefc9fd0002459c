"""Samplers: `LocalSampler` (transformers + peft, in process) and
`OpenAICompatibleSampler` (a completions server such as vLLM, with runtime LoRA loading)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.samplers.base import Completion, FinishReason, Sampler
from orchestrator.samplers.openai import OpenAICompatibleSampler

if TYPE_CHECKING:  # the type checker sees the lazy attribute below as this import
    from orchestrator.samplers.local import LocalSampler

__all__ = ["Completion", "FinishReason", "LocalSampler", "OpenAICompatibleSampler", "Sampler"]


def __getattr__(name: str) -> type[LocalSampler]:
    # LocalSampler imports torch and transformers; load them only for users who want it.
    if name == "LocalSampler":
        from orchestrator.samplers.local import LocalSampler

        return LocalSampler
    raise AttributeError(name)
