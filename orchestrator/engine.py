"""The multi-agent rollout engine.

One step: draw `problems_per_step` problems, play `samples_per_problem` episodes of
each (a GRPO group), agents acting in `turn_order` for up to `max_turns` rounds,
with at most `max_concurrency` problems in flight at once (asyncio.Semaphore). The
episodes of one problem advance together, so each agent's turn is one sampler call
for the whole group (`n` completions of one prompt when the prompts agree).

Each agent maps to a policy (`AgentPolicy`: run id, sampler, tokenizer). The
specialization level fixes what the mapping may be:

- `single`: one agent, one run.
- `prompt`: several agents share one run (one adapter); each agent's prompts get
  its own prefix ("<agent>: " unless the policy sets one).
- `lora`: one run per agent, all on the same base model: each agent's samples go
  only to its own run, so each adapter gets only its own agent's gradients (the
  trainer still trains them all in the same step).
- `full`: one run per agent on pools with different base models (same mapping
  as `lora`, base models may differ).

`make_batches` turns a step's rollouts into one `TrainingBatch` per run: rewards →
filter → advantages, grouped by (problem, turn, agent). Filtering comes first, as
in the source trainer, so advantages are centred on the samples actually trained.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from contracts.tokenizer import Tokenizer, encode_prompt
from contracts.wire import MAX_TEMPERATURE, MIN_TEMPERATURE, TrainingBatch, TrainingSample
from orchestrator.advantages import (
    AdvantageMethod,
    GroupKey,
    RewardPlacement,
    compute_advantages,
    place_rewards,
)
from orchestrator.envs import Env, make_agent, make_env
from orchestrator.envs.base import Episode, Problem
from orchestrator.filters import FilterMode, filter_samples
from orchestrator.samplers.base import Completion, Sampler

log = logging.getLogger(__name__)


class Specialization(StrEnum):
    SINGLE = "single"
    PROMPT = "prompt"
    LORA = "lora"
    FULL = "full"


@dataclass
class AgentPolicy:
    """Where an agent's completions come from and where its samples are trained."""

    run_id: str
    sampler: Sampler
    tokenizer: Tokenizer
    prompt_prefix: str | None = None
    """Prepended to the agent's prompts; in `prompt` mode defaults to "<agent>: "."""
    base_model: str | None = None
    """The run's base model, when known: checked against the specialization level."""


@dataclass(frozen=True)
class EngineConfig:
    env: str = "arithmetic"
    env_kwargs: Mapping[str, object] = field(default_factory=dict)
    specialization: Specialization = Specialization.SINGLE
    turn_order: tuple[str, ...] | None = None
    """Agents in acting order; the env's default order when None."""
    max_turns: int = 1
    """Rounds of `turn_order` per episode (an episode may end earlier)."""
    problems_per_step: int = 8
    samples_per_problem: int = 8
    """Episodes per problem: the GRPO group size."""
    max_concurrency: int = 8
    """Problems (groups) in flight at once."""
    max_tokens: int | None = None
    """Per completion; the env's suggestion for each agent when None."""
    temperature: float = 1.0
    top_p: float = 1.0
    advantage: AdvantageMethod | Literal["gae"] = "grpo"
    """grpo / rloo: group-relative advantages computed here. gae: for runs with
    `config.advantage.estimator = "gae"` — samples carry their `reward` and the trainer's critic
    computes the advantages (the `advantage` sent is 0 and ignored)."""
    normalize_std: bool = False
    reward_placement: RewardPlacement = RewardPlacement.LAST
    filter_mode: FilterMode = FilterMode.NONE
    filter_ratio: float = 0.0
    val_problems: int = 32
    val_samples_per_problem: int = 1
    val_temperature: float = 0.0
    """0 = greedy."""
    seed: int = 0

    def __post_init__(self) -> None:
        # Accept plain strings ("lora", "dapo", ...) from configs and coerce them once here.
        object.__setattr__(self, "specialization", Specialization(self.specialization))
        object.__setattr__(self, "filter_mode", FilterMode(self.filter_mode))
        object.__setattr__(self, "reward_placement", RewardPlacement(self.reward_placement))
        if self.advantage not in ("grpo", "rloo", "gae"):
            raise ValueError(f"advantage must be 'grpo', 'rloo' or 'gae', not {self.advantage!r}")
        if not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] (the trainer divides "
                f"logits by it), not {self.temperature!r}"
            )
        for name in ("max_turns", "problems_per_step", "samples_per_problem", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0.0 <= self.filter_ratio <= 1.0:
            raise ValueError("filter_ratio must be in [0, 1]")


@dataclass
class AgentSample:
    """One completion of one agent in one episode, with its training reward."""

    run_id: str
    agent: str
    problem_id: str
    episode: int
    """Index of the episode within its problem's group."""
    turn: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    step_reward: float = 0.0
    reward: float = 0.0
    """The reward advantages are computed from (step reward + the placed final reward)."""

    @property
    def key(self) -> GroupKey:
        return GroupKey(self.problem_id, self.turn, self.agent)


@dataclass
class EpisodeRecord:
    problem_id: str
    index: int
    samples: list[AgentSample]
    final_rewards: dict[str, float]
    success: dict[str, bool]


@dataclass
class Rollouts:
    step: int
    episodes: list[EpisodeRecord]

    @property
    def samples(self) -> list[AgentSample]:
        return [s for e in self.episodes for s in e.samples]

    def mean_final_reward(self) -> dict[str, float]:
        """Mean episode reward per agent."""
        totals: dict[str, list[float]] = {}
        for e in self.episodes:
            for agent, r in e.final_rewards.items():
                totals.setdefault(agent, []).append(r)
        return {a: sum(v) / len(v) for a, v in totals.items()}

    def success_rate(self) -> dict[str, float]:
        totals: dict[str, list[bool]] = {}
        for e in self.episodes:
            for agent, ok in e.success.items():
                totals.setdefault(agent, []).append(ok)
        return {a: sum(v) / len(v) for a, v in totals.items()}


@dataclass
class RunBatch:
    """What one step produced for one run."""

    run_id: str
    agents: tuple[str, ...]
    batch: TrainingBatch | None
    """None when every sample was filtered out (no learning signal)."""
    num_samples: int
    num_kept: int
    mean_reward: float

    @property
    def empty(self) -> bool:
        return self.batch is None


@dataclass
class ValidationResult:
    step: int
    success_rate: dict[str, float]
    mean_reward: dict[str, float]
    num_episodes: int


class MultiAgentEngine:
    def __init__(
        self, config: EngineConfig, policies: Mapping[str, AgentPolicy], *, env: Env | None = None
    ) -> None:
        self.config = config
        self.env = env if env is not None else make_env(config.env, **dict(config.env_kwargs))
        self.turn_order: tuple[str, ...] = tuple(config.turn_order or self.env.agents)
        unknown = [a for a in self.turn_order if a not in self.env.agents]
        if unknown:
            raise ValueError(f"agents {unknown} are not agents of env {config.env!r} {self.env.agents}")
        missing = [a for a in self.turn_order if a not in policies]
        if missing:
            raise ValueError(f"no policy for agents {missing}")
        self.policies = {a: policies[a] for a in self.turn_order}
        self.agents = {a: make_agent(a) for a in self.turn_order}
        self._check_specialization()
        self.prefixes = {a: self._prefix(a) for a in self.turn_order}

    def _prefix(self, agent: str) -> str:
        prefix = self.policies[agent].prompt_prefix
        if prefix is None:
            return f"{agent}: " if self.config.specialization == Specialization.PROMPT else ""
        return prefix

    def _check_specialization(self) -> None:
        spec = self.config.specialization
        runs = [p.run_id for p in self.policies.values()]
        if spec == Specialization.SINGLE:
            if len(self.turn_order) != 1:
                raise ValueError(f"specialization 'single' needs exactly one agent, got {self.turn_order}")
        elif spec == Specialization.PROMPT:
            if len(set(runs)) != 1:
                raise ValueError(f"specialization 'prompt' maps every agent to one run, got {runs}")
        elif spec in (Specialization.LORA, Specialization.FULL):
            if len(set(runs)) != len(runs):
                raise ValueError(f"specialization {spec.value!r} needs one run per agent, got {runs}")
            samplers = [id(p.sampler) for p in self.policies.values()]
            if len(set(samplers)) != len(samplers):
                raise ValueError(
                    f"specialization {spec.value!r} needs one sampler per agent (one adapter each)"
                )
            bases = {p.base_model for p in self.policies.values() if p.base_model is not None}
            if spec == Specialization.LORA and len(bases) > 1:
                raise ValueError(
                    f"specialization 'lora' shares one base model, got {sorted(bases)}; use 'full'"
                )
        else:  # pragma: no cover - StrEnum exhausts the cases
            raise ValueError(f"unknown specialization {spec!r}")

    @property
    def run_ids(self) -> list[str]:
        """Distinct runs, in turn order of their first agent."""
        return list(dict.fromkeys(p.run_id for p in self.policies.values()))

    def agents_of(self, run_id: str) -> tuple[str, ...]:
        return tuple(a for a, p in self.policies.items() if p.run_id == run_id)

    def samplers_of(self, run_id: str) -> list[Sampler]:
        """The distinct samplers serving `run_id`'s adapter."""
        seen: dict[int, Sampler] = {}
        for p in self.policies.values():
            if p.run_id == run_id:
                seen.setdefault(id(p.sampler), p.sampler)
        return list(seen.values())

    # ---- rollouts ---------------------------------------------------------------------------

    def _max_tokens(self, agent: str) -> int:
        return self.config.max_tokens or self.env.max_completion_tokens(agent)

    async def _complete(
        self, agent: str, prompts: list[list[int]], temperature: float, top_p: float
    ) -> list[Completion]:
        policy = self.policies[agent]
        if all(p == prompts[0] for p in prompts):
            # The usual first turn: one prompt, a whole group of samples in one call.
            distinct, n = [prompts[0]], len(prompts)
        else:
            distinct, n = prompts, 1
        completions = await policy.sampler.generate(
            distinct,
            n=n,
            max_tokens=self._max_tokens(agent),
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=[policy.tokenizer.eos_token_id],
        )
        if len(completions) != len(prompts):
            raise RuntimeError(
                f"sampler of {agent!r} returned {len(completions)} completions for {len(prompts)}"
            )
        return completions

    async def _play_group(
        self,
        semaphore: asyncio.Semaphore,
        problem_id: str,
        problem: Problem,
        group_size: int,
        temperature: float,
        top_p: float,
    ) -> list[EpisodeRecord]:
        async with semaphore:
            episodes: list[Episode] = [self.env.new_episode(problem) for _ in range(group_size)]
            samples: list[list[AgentSample]] = [[] for _ in range(group_size)]
            live = list(range(group_size))
            for turn in range(self.config.max_turns):
                for agent in self.turn_order:
                    if not live:
                        break
                    policy, actor = self.policies[agent], self.agents[agent]
                    prompts = [
                        encode_prompt(
                            policy.tokenizer,
                            self.prefixes[agent] + actor.build_prompt(episodes[i].observation(agent)),
                        )
                        for i in live
                    ]
                    completions = await self._complete(agent, prompts, temperature, top_p)
                    done: set[int] = set()
                    for i, prompt_ids, completion in zip(live, prompts, completions, strict=True):
                        text = policy.tokenizer.decode(completion.token_ids)
                        result = episodes[i].step(
                            agent, actor.parse_action(text), truncated=completion.finish_reason == "length"
                        )
                        samples[i].append(
                            AgentSample(
                                run_id=policy.run_id,
                                agent=agent,
                                problem_id=problem_id,
                                episode=i,
                                turn=turn,
                                prompt_ids=prompt_ids,
                                completion_ids=list(completion.token_ids),
                                logprobs=list(completion.logprobs),
                                text=text,
                                finish_reason=completion.finish_reason,
                                step_reward=result.reward,
                            )
                        )
                        if result.done:
                            done.add(i)
                    live = [i for i in live if i not in done]
                if not live:
                    break
        records = []
        for i, episode in enumerate(episodes):
            finals = episode.final_rewards()
            for agent in self.turn_order:
                mine = [s for s in samples[i] if s.agent == agent]
                placed = place_rewards(
                    [s.step_reward for s in mine], finals.get(agent, 0.0), self.config.reward_placement
                )
                for s, r in zip(mine, placed, strict=True):
                    s.reward = r
            records.append(EpisodeRecord(problem_id, i, samples[i], finals, episode.success()))
        return records

    async def _play(
        self, problems: Sequence[tuple[str, Problem]], group_size: int, temperature: float, top_p: float
    ) -> list[EpisodeRecord]:
        semaphore = asyncio.Semaphore(self.config.max_concurrency)
        groups = await asyncio.gather(
            *(self._play_group(semaphore, pid, p, group_size, temperature, top_p) for pid, p in problems)
        )
        return [record for group in groups for record in group]

    async def generate(self, step: int) -> Rollouts:
        """The training rollouts of rollout step `step` (problems drawn from seed and step)."""
        rng = random.Random(f"{self.config.seed}:{step}")
        problems = self.env.sample_problems(rng, self.config.problems_per_step)
        # The group id is unique within the step even if the env draws the same problem twice.
        ids = [(f"s{step}/p{i}/{p.id}", p) for i, p in enumerate(problems)]
        episodes = await self._play(
            ids, self.config.samples_per_problem, self.config.temperature, self.config.top_p
        )
        return Rollouts(step=step, episodes=episodes)

    async def validate(self, step: int = 0) -> ValidationResult:
        """Success rate per agent on a fixed set of problems."""
        problems = self.env.validation_problems(self.config.val_problems, seed=self.config.seed + 7919)
        ids = [(f"val/p{i}/{p.id}", p) for i, p in enumerate(problems)]
        episodes = await self._play(
            ids, self.config.val_samples_per_problem, self.config.val_temperature, 1.0
        )
        rollouts = Rollouts(step=step, episodes=episodes)
        rates = rollouts.success_rate()
        return ValidationResult(
            step=step,
            success_rate={a: rates.get(a, 0.0) for a in self.turn_order},
            mean_reward=rollouts.mean_final_reward(),
            num_episodes=len(episodes),
        )

    # ---- batches ------------------------------------------------------------------------------

    def make_batches(
        self, rollouts: Rollouts, adapter_steps: Mapping[str, int] | None = None
    ) -> dict[str, RunBatch]:
        """One `RunBatch` per run: each run gets only the samples of the agents mapped to it.

        `adapter_steps`: the adapter step each run's samples were drawn with (the batch's `step`)."""
        adapter_steps = adapter_steps or {}
        by_run: dict[str, list[AgentSample]] = {r: [] for r in self.run_ids}
        for s in rollouts.samples:
            by_run[s.run_id].append(s)
        out: dict[str, RunBatch] = {}
        for run_id, samples in by_run.items():
            rewards = [s.reward for s in samples]
            keys = [s.key for s in samples]
            kept_idx = filter_samples(
                rewards, keys, mode=self.config.filter_mode, ratio=self.config.filter_ratio
            ).kept
            kept = [samples[i] for i in kept_idx]
            advantages = (
                [0.0] * len(kept)
                if self.config.advantage == "gae"
                else compute_advantages(
                    [s.reward for s in kept],
                    [s.key for s in kept],
                    method=self.config.advantage,
                    normalize_std=self.config.normalize_std,
                )
            )
            agents = self.agents_of(run_id)
            batch = None
            if kept:
                batch = TrainingBatch(
                    examples=[
                        TrainingSample(
                            prompt_ids=s.prompt_ids,
                            prompt_mask=[True] * len(s.prompt_ids),
                            completion_ids=s.completion_ids,
                            completion_mask=[True] * len(s.completion_ids),
                            completion_logprobs=s.logprobs,
                            advantage=a,
                            # GAE trains on it; for every run the service aggregates it (metrics,
                            # dashboard, trackers), and the pool does not buffer it then.
                            reward=s.reward,
                        )
                        for s, a in zip(kept, advantages, strict=True)
                    ],
                    temperature=self.config.temperature,
                    step=adapter_steps.get(run_id, 0),
                    env=self.config.env,
                    agent=agents[0] if len(agents) == 1 else None,
                )
            out[run_id] = RunBatch(
                run_id=run_id,
                agents=agents,
                batch=batch,
                num_samples=len(samples),
                num_kept=len(kept),
                mean_reward=sum(rewards) / len(rewards) if rewards else math.nan,
            )
        return out
