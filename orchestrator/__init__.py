"""loraloom SDK: the typed client of the service, samplers, envs, advantages,
filters, the multi-agent rollout engine and the rollout loop.

`LocalSampler` (torch + transformers) is imported lazily from `orchestrator.samplers`.
"""

from contracts.http import RetryPolicy
from contracts.tokenizer import CharTokenizer
from orchestrator.advantages import (
    GroupKey,
    RewardPlacement,
    compute_advantages,
    grpo_advantages,
    rloo_advantages,
)
from orchestrator.client import AsyncLoraloomClient, LoraloomClient
from orchestrator.engine import AgentPolicy, EngineConfig, MultiAgentEngine, Specialization
from orchestrator.errors import (
    ApiError,
    Conflict,
    DeadlineExceeded,
    LoraloomError,
    NotFound,
    ResponseTooLarge,
    RetryExhausted,
    RunEvicted,
    RunFailed,
    Unauthorized,
    ValidationError,
)
from orchestrator.filters import FilterMode, filter_samples
from orchestrator.loop import LoopConfig, RolloutLoop, StepReport
from orchestrator.models import AdapterInfo, BatchInfo, Progress, Run, StepMetrics
from orchestrator.samplers import Completion, OpenAICompatibleSampler, Sampler
from orchestrator.sft import SFTExample, SFTLoop, SFTStep

__all__ = [
    "AdapterInfo",
    "AgentPolicy",
    "ApiError",
    "AsyncLoraloomClient",
    "BatchInfo",
    "CharTokenizer",
    "Completion",
    "Conflict",
    "DeadlineExceeded",
    "EngineConfig",
    "FilterMode",
    "GroupKey",
    "LoopConfig",
    "LoraloomClient",
    "LoraloomError",
    "MultiAgentEngine",
    "NotFound",
    "OpenAICompatibleSampler",
    "Progress",
    "ResponseTooLarge",
    "RetryExhausted",
    "RetryPolicy",
    "RewardPlacement",
    "RolloutLoop",
    "Run",
    "RunEvicted",
    "SFTExample",
    "SFTLoop",
    "SFTStep",
    "RunFailed",
    "Sampler",
    "Specialization",
    "StepMetrics",
    "StepReport",
    "Unauthorized",
    "ValidationError",
    "compute_advantages",
    "filter_samples",
    "grpo_advantages",
    "rloo_advantages",
]
