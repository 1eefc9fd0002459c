"""Env and agent registries, and the built-in envs (`arithmetic`, `solver_checker`)."""

from orchestrator.envs import arithmetic as _builtin  # noqa: F401  (registers the built-in envs)
from orchestrator.envs.arithmetic import ArithmeticEnv, SolverCheckerEnv, score_answer
from orchestrator.envs.base import (
    AGENT_REGISTRY,
    ENV_REGISTRY,
    Agent,
    Env,
    Episode,
    Problem,
    Registry,
    StepResult,
    make_agent,
    make_env,
    register_agent,
    register_env,
)

__all__ = [
    "AGENT_REGISTRY",
    "ENV_REGISTRY",
    "Agent",
    "ArithmeticEnv",
    "Env",
    "Episode",
    "Problem",
    "Registry",
    "SolverCheckerEnv",
    "StepResult",
    "make_agent",
    "make_env",
    "register_agent",
    "register_env",
    "score_answer",
]
