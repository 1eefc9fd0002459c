"""Envs, episodes, agents and their registries.

An `Env` draws problems and starts `Episode`s. In an episode, agents act in turn:
the engine asks the episode for an agent's observation (text), the agent turns it
into a prompt, the policy completes it, the agent parses the completion into an
action, and the episode steps with it. At the end the episode gives each agent
its final reward (and, for validation, whether it succeeded).

Registration is by decorator at import time (`@register_env("arithmetic")`,
`@register_agent("solver")`); the registries are not meant to change afterwards.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Problem:
    """One problem instance an env poses."""

    id: str
    """Identifies the problem's content (e.g. "3+4"); the engine makes it unique per step."""
    data: Any = None


@dataclass(frozen=True)
class StepResult:
    reward: float = 0.0
    """Per-step reward of the acting agent (most envs give everything as the final reward)."""
    done: bool = False


class Episode(ABC):
    """One rollout of one problem."""

    @abstractmethod
    def observation(self, agent: str) -> str:
        """What `agent` sees now."""

    @abstractmethod
    def step(self, agent: str, action: str, *, truncated: bool = False) -> StepResult:
        """Apply `agent`'s action. `truncated`: the completion hit max_tokens without a stop token."""

    @abstractmethod
    def final_rewards(self) -> dict[str, float]:
        """Each agent's episode reward, once the episode is over."""

    def success(self) -> dict[str, bool]:
        """Per agent: did it do its job? Used for validation success rates."""
        return {}


class Env(ABC):
    agents: ClassVar[tuple[str, ...]]
    """The env's agents, in their default turn order."""

    @abstractmethod
    def sample_problems(self, rng: random.Random, count: int) -> list[Problem]: ...

    def validation_problems(self, count: int, seed: int = 1234) -> list[Problem]:
        """A fixed set of problems (same seed, same problems)."""
        return self.sample_problems(random.Random(seed), count)

    @abstractmethod
    def new_episode(self, problem: Problem) -> Episode: ...

    def max_completion_tokens(self, agent: str) -> int:
        """A sensible max_tokens for `agent`'s completions."""
        return 32


class Agent:
    """Turns observations into prompts and completions into actions. The default is the identity."""

    def __init__(self, name: str) -> None:
        self.name = name

    def build_prompt(self, observation: str) -> str:
        return observation

    def parse_action(self, text: str) -> str:
        return text.strip()


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(item: T) -> T:
            existing = self._items.get(name)
            if existing is not None and existing is not item:
                raise ValueError(f"{self._kind} {name!r} is already registered ({existing!r})")
            self._items[name] = item
            return item

        return decorator

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self._kind} {name!r}; registered: {sorted(self._items)}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items


ENV_REGISTRY: Registry[type[Env]] = Registry("env")
AGENT_REGISTRY: Registry[type[Agent]] = Registry("agent")


EnvT = TypeVar("EnvT", bound=type[Env])
AgentT = TypeVar("AgentT", bound=type[Agent])


def register_env(name: str) -> Callable[[EnvT], EnvT]:
    """Class decorator: make an `Env` subclass available to `make_env(name)`."""

    def decorator(cls: EnvT) -> EnvT:
        ENV_REGISTRY.register(name)(cls)
        return cls  # the subclass itself, not the registry's `type[Env]`

    return decorator


def register_agent(name: str) -> Callable[[AgentT], AgentT]:
    """Class decorator: make an `Agent` subclass available to `make_agent(name)`."""

    def decorator(cls: AgentT) -> AgentT:
        AGENT_REGISTRY.register(name)(cls)
        return cls

    return decorator


def make_env(name: str, **kwargs: Any) -> Env:
    return ENV_REGISTRY.get(name)(**kwargs)


def make_agent(name: str) -> Agent:
    """An agent by its registered name; unregistered names get the identity `Agent`."""
    cls = AGENT_REGISTRY.get(name) if name in AGENT_REGISTRY else Agent
    return cls(name)
