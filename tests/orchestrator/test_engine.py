"""The multi-agent engine with a scripted sampler: specialization routing, grouping,
reward placement, filters, validation and the concurrency limit."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import pytest

from orchestrator.advantages import RewardPlacement
from orchestrator.engine import AgentPolicy, EngineConfig, MultiAgentEngine, Specialization
from orchestrator.envs import Env, Episode, Problem, StepResult
from orchestrator.filters import FilterMode
from tests.orchestrator.fakes import TOKENIZER, ScriptedSampler, solve

RUN_A, RUN_B = "run_aaaaaaaaaaaa", "run_bbbbbbbbbbbb"


def alternating(prompt: str, j: int) -> str:
    """Right on even samples, wrong on odd ones: every group has variance."""
    answer = solve(prompt)
    return answer if j % 2 == 0 else answer + "1"


def policy(run_id: str, sampler: ScriptedSampler, **kw: Any) -> AgentPolicy:
    return AgentPolicy(run_id=run_id, sampler=sampler, tokenizer=TOKENIZER, **kw)


async def test_single_agent_batch() -> None:
    sampler = ScriptedSampler(alternating)
    engine = MultiAgentEngine(
        EngineConfig(env="arithmetic", problems_per_step=3, samples_per_problem=4, temperature=0.7),
        {"solver": policy(RUN_A, sampler)},
    )
    rollouts = await engine.generate(step=5)
    assert len(rollouts.episodes) == 12
    assert rollouts.mean_final_reward()["solver"] == pytest.approx(
        (1.0 + 0.4) / 2
    )  # wrong: digits, stopped, prefix right
    batches = engine.make_batches(rollouts, {RUN_A: 7})
    assert list(batches) == [RUN_A]
    run_batch = batches[RUN_A]
    batch = run_batch.batch
    assert batch is not None and (run_batch.num_samples, run_batch.num_kept) == (12, 12)
    assert (batch.step, batch.temperature, batch.env, batch.agent) == (7, 0.7, "arithmetic", "solver")
    for sample in batch.examples:
        assert sample.prompt_ids[0] == TOKENIZER.bos_token_id
        assert sample.completion_ids[-1] == TOKENIZER.eos_token_id
        assert len(sample.completion_logprobs) == len(sample.completion_ids) == len(sample.completion_mask)
        assert len(sample.prompt_mask) == len(sample.prompt_ids)
    # GRPO on groups of four: right answers +0.3, wrong -0.3.
    scalars = [s.advantage for s in batch.examples if isinstance(s.advantage, float)]
    assert len(scalars) == len(batch.examples)  # one scalar advantage per sample
    assert sorted({round(a, 6) for a in scalars}) == [-0.3, 0.3]
    # Every sample carries its reward: the service aggregates it per step (metrics, dashboard);
    # only GAE runs train on it (the pool does not buffer it for the others).
    assert sorted({s.reward or 0.0 for s in batch.examples}) == [0.4, 1.0] and None not in {
        s.reward for s in batch.examples
    }
    # One sampler call per problem: the group's shared prompt with n = 4.
    assert len(sampler.prompts) == 12


async def test_same_problem_drawn_twice_is_two_groups() -> None:
    class SameProblemEnv(Env):
        agents = ("solver",)

        def sample_problems(self, rng: random.Random, count: int) -> list[Problem]:
            return [Problem("2+2", (2, 2))] * count

        def new_episode(self, problem: Problem) -> Episode:
            from orchestrator.envs.arithmetic import ArithmeticEpisode

            return ArithmeticEpisode(problem.data)

    engine = MultiAgentEngine(
        EngineConfig(problems_per_step=3, samples_per_problem=2),
        {"solver": policy(RUN_A, ScriptedSampler(alternating))},
        env=SameProblemEnv(),
    )
    rollouts = await engine.generate(step=0)
    by_key = defaultdict(list)
    for s in rollouts.samples:
        by_key[s.key].append(s)
    assert len(by_key) == 3 and all(len(v) == 2 for v in by_key.values())


async def test_groups_never_span_problems_in_engine() -> None:
    """Regression (DESIGN §8): a sampler that solves problem p perfectly and fails q
    completely must give zero advantages: the groups are per problem."""

    def by_problem(prompt: str, j: int) -> str:
        answer = solve(prompt)
        return answer if int(answer) % 2 == 0 else "x"

    engine = MultiAgentEngine(
        EngineConfig(problems_per_step=8, samples_per_problem=4),
        {"solver": policy(RUN_A, ScriptedSampler(by_problem))},
    )
    rollouts = await engine.generate(step=1)
    rewards = {s.reward for s in rollouts.samples}
    assert len(rewards) == 2  # both kinds of problem occur, so a cross-problem group would see variance
    batch = engine.make_batches(rollouts)[RUN_A].batch
    assert batch is not None and all(s.advantage == 0.0 for s in batch.examples)
    problems_per_key = defaultdict(set)
    for s in rollouts.samples:
        problems_per_key[s.key].add(s.problem_id)
    assert all(len(v) == 1 for v in problems_per_key.values())


async def test_lora_mode_each_agent_goes_only_to_its_own_run() -> None:
    solver = ScriptedSampler(alternating)
    checker = ScriptedSampler(lambda prompt, j: "y" if j % 2 else "n")
    engine = MultiAgentEngine(
        EngineConfig(
            env="solver_checker",
            specialization=Specialization.LORA,
            problems_per_step=2,
            samples_per_problem=4,
        ),
        {"solver": policy(RUN_A, solver), "checker": policy(RUN_B, checker)},
    )
    assert engine.run_ids == [RUN_A, RUN_B]
    rollouts = await engine.generate(step=0)
    batches = engine.make_batches(rollouts)
    a, b = batches[RUN_A].batch, batches[RUN_B].batch
    assert a is not None and b is not None
    assert (a.agent, b.agent) == ("solver", "checker")
    assert len(a.examples) == len(b.examples) == 8
    # Solver prompts are questions; checker prompts carry the solver's answer and "ok?".
    assert all(TOKENIZER.decode(s.prompt_ids).endswith("=") for s in a.examples)
    assert all(TOKENIZER.decode(s.prompt_ids).endswith(" ok?") for s in b.examples)
    # Each sampler served only its own agent.
    assert all(p.endswith("=") for p in solver.prompts) and all(p.endswith("ok?") for p in checker.prompts)
    assert {s.run_id for s in rollouts.samples if s.agent == "solver"} == {RUN_A}
    assert {s.run_id for s in rollouts.samples if s.agent == "checker"} == {RUN_B}
    # The checker's prompts differ per episode: one batched call per problem, n = 1.
    assert len(checker.prompts) == 8


async def test_prompt_mode_shares_one_run_with_agent_prefixes() -> None:
    shared = ScriptedSampler(lambda prompt, j: "y" if "ok?" in prompt else solve(prompt))
    engine = MultiAgentEngine(
        EngineConfig(
            env="solver_checker",
            specialization=Specialization.PROMPT,
            problems_per_step=2,
            samples_per_problem=2,
        ),
        {"solver": policy(RUN_A, shared), "checker": policy(RUN_A, shared)},
    )
    batches = engine.make_batches(await engine.generate(step=0))
    batch = batches[RUN_A].batch
    assert list(batches) == [RUN_A] and batch is not None and batch.agent is None
    prompts = [TOKENIZER.decode(s.prompt_ids) for s in batch.examples]
    assert sum(p.startswith("solver: ") for p in prompts) == 4
    assert sum(p.startswith("checker: ") and p.endswith(" ok?") for p in prompts) == 4


def test_specialization_checks() -> None:
    s1, s2 = ScriptedSampler(alternating), ScriptedSampler(alternating)
    two = {"solver": policy(RUN_A, s1), "checker": policy(RUN_B, s2)}
    with pytest.raises(ValueError, match="exactly one agent"):
        MultiAgentEngine(EngineConfig(env="solver_checker", specialization=Specialization.SINGLE), two)
    with pytest.raises(ValueError, match="one run"):
        MultiAgentEngine(EngineConfig(env="solver_checker", specialization=Specialization.PROMPT), two)
    same_run = {"solver": policy(RUN_A, s1), "checker": policy(RUN_A, s2)}
    with pytest.raises(ValueError, match="one run per agent"):
        MultiAgentEngine(EngineConfig(env="solver_checker", specialization=Specialization.LORA), same_run)
    same_sampler = {"solver": policy(RUN_A, s1), "checker": policy(RUN_B, s1)}
    with pytest.raises(ValueError, match="one sampler per agent"):
        MultiAgentEngine(EngineConfig(env="solver_checker", specialization=Specialization.LORA), same_sampler)
    bases = {
        "solver": policy(RUN_A, s1, base_model="tiny-a"),
        "checker": policy(RUN_B, s2, base_model="tiny-b"),
    }
    with pytest.raises(ValueError, match="use 'full'"):
        MultiAgentEngine(EngineConfig(env="solver_checker", specialization=Specialization.LORA), bases)
    assert MultiAgentEngine(
        EngineConfig(env="solver_checker", specialization=Specialization.FULL), bases
    ).run_ids == [
        RUN_A,
        RUN_B,
    ]
    with pytest.raises(ValueError, match="no policy"):
        MultiAgentEngine(
            EngineConfig(env="solver_checker", specialization=Specialization.LORA),
            {"solver": policy(RUN_A, s1)},
        )
    with pytest.raises(ValueError, match="not agents"):
        MultiAgentEngine(EngineConfig(env="arithmetic", turn_order=("checker",)), two)


class CountEnv(Env):
    """Three turns; each step earns 0.1, the episode 1.0 at the end."""

    agents = ("a",)

    def sample_problems(self, rng: random.Random, count: int) -> list[Problem]:
        return [Problem(f"c{i}") for i in range(count)]

    def new_episode(self, problem: Problem) -> Episode:
        class _Episode(Episode):
            turns = 0

            def observation(self, agent: str) -> str:
                return f"turn {self.turns}"

            def step(self, agent: str, action: str, *, truncated: bool = False) -> StepResult:
                self.turns += 1
                return StepResult(reward=0.1, done=self.turns == 3)

            def final_rewards(self) -> dict[str, float]:
                return {"a": 1.0}

        return _Episode()


@pytest.mark.parametrize(("placement", "expected"), [("last", [0.1, 0.1, 1.1]), ("all", [1.1, 1.1, 1.1])])
async def test_multi_turn_reward_placement(placement: str, expected: list[float]) -> None:
    engine = MultiAgentEngine(
        EngineConfig(
            max_turns=5,
            problems_per_step=1,
            samples_per_problem=2,
            reward_placement=RewardPlacement(placement),
        ),
        {"a": policy(RUN_A, ScriptedSampler(lambda p, j: "ok"))},
        env=CountEnv(),
    )
    rollouts = await engine.generate(step=0)
    for episode in rollouts.episodes:
        assert [s.turn for s in episode.samples] == [0, 1, 2]  # ended by the env before max_turns
        assert [s.reward for s in episode.samples] == pytest.approx(expected)


async def test_dapo_filter_empties_a_batch_without_signal() -> None:
    engine = MultiAgentEngine(
        EngineConfig(problems_per_step=2, samples_per_problem=3, filter_mode=FilterMode.DAPO),
        {"solver": policy(RUN_A, ScriptedSampler(lambda p, j: solve(p)))},
    )
    run_batch = engine.make_batches(await engine.generate(step=0))[RUN_A]
    assert run_batch.empty and (run_batch.num_samples, run_batch.num_kept) == (6, 0)


async def test_validation_success_rate_per_agent() -> None:
    engine = MultiAgentEngine(
        EngineConfig(env="solver_checker", specialization=Specialization.LORA, val_problems=10),
        {
            "solver": policy(RUN_A, ScriptedSampler(lambda p, j: solve(p) if int(solve(p)) % 2 else "0")),
            "checker": policy(RUN_B, ScriptedSampler(lambda p, j: "y")),
        },
    )
    result = await engine.validate(step=3)
    env = engine.env
    odd = sum(sum(p.data) % 2 for p in env.validation_problems(10, seed=engine.config.seed + 7919)) / 10
    assert 0 < odd < 1
    # The checker accepts everything, so it is right exactly when the solver is (answers "0" are wrong
    # except for 0+0, which is even and answered correctly; the solver is right on odd sums).
    assert result.success_rate["solver"] == pytest.approx(result.success_rate["checker"])
    assert result.num_episodes == 10 and result.step == 3


async def test_concurrency_limit() -> None:
    sampler = ScriptedSampler(alternating, delay_s=0.01)
    engine = MultiAgentEngine(
        EngineConfig(problems_per_step=6, samples_per_problem=2, max_concurrency=2),
        {"solver": policy(RUN_A, sampler)},
    )
    await engine.generate(step=0)
    assert sampler.max_in_flight == 2


def test_config_coerces_strings_from_untyped_configs() -> None:
    raw: dict[str, Any] = {"specialization": "lora", "filter_mode": "dapo", "reward_placement": "all"}
    config = EngineConfig(**raw)  # e.g. read from a TOML file
    assert config.specialization is Specialization.LORA
    assert config.filter_mode is FilterMode.DAPO
    assert config.reward_placement is RewardPlacement.ALL
    unknown: dict[str, Any] = {"specialization": "everything"}
    with pytest.raises(ValueError):
        EngineConfig(**unknown)


async def test_gae_sends_rewards_and_no_advantages() -> None:
    """advantage="gae": the trainer's critic computes advantages; each sample carries its reward."""
    sampler = ScriptedSampler(alternating)
    engine = MultiAgentEngine(
        EngineConfig(env="arithmetic", problems_per_step=2, samples_per_problem=4, advantage="gae"),
        {"solver": policy(RUN_A, sampler)},
    )
    rollouts = await engine.generate(step=0)
    batch = engine.make_batches(rollouts)[RUN_A].batch
    assert batch is not None
    assert [s.advantage for s in batch.examples] == [0.0] * 8
    rewards = [s.reward for s in batch.examples]
    assert sorted({r for r in rewards if r is not None}) == [0.4, 1.0] and None not in rewards
    with pytest.raises(ValueError, match="'grpo', 'rloo' or 'gae'"):
        EngineConfig(env="arithmetic", advantage="ppo")  # type: ignore[arg-type]
