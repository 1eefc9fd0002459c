"""Built-in envs on sums: `arithmetic` (one solver) and `solver_checker` (two agents).

Prompts are plain text for `contracts.tokenizer.CharTokenizer`: the solver sees
"3+4=" and should answer "7" followed by EOS.

Rewards give partial credit so that a tiny model gets a signal from its first
steps (`score_answer`):

- 1.0 for the exact answer, ended by a stop token;
- otherwise the sum of: 0.1 if the answer is a non-empty string of digits; 0.1 if
  it ended with a stop token (not cut at max_tokens); 0.2 if it has the right
  number of digits; 0.2 x the fraction of the answer's digits that are right,
  position by position from the left. Any wrong answer thus scores at most 0.5,
  below every exact answer.

Difficulty `d` gives sums of `2 + d // 2` numbers of up to `1 + (d + 1) // 2` digits:
0 → single-digit a+b (answers 0..18), 1 → two-digit a+b, 2 → three two-digit
numbers, ... (`num_terms` / `max_digits` override it).

`solver_checker`: the solver answers "a+b=", then the checker sees "a+b=<answer> ok?"
and answers "y" (accept) or "n" (reject). The joint reward J is 1 when the solver
is right and the checker accepts, or the solver is wrong and the checker rejects,
else 0: neither agent gets it alone. Training rewards:
solver = 0.5 [right and accepted] + 0.5 score_answer, checker = 0.8 J + 0.2 [its
verdict is "y" or "n" and stopped]. The solver's team bonus is only for a right answer
that the checker accepts: rewarding it with J would pay it for a wrong answer that the
checker rejects, and the pair then learns to collude (the solver to be wrong, the
checker to reject everything).
Success (validation): solver = exact answer; checker = correct verdict.
"""

from __future__ import annotations

import random

from orchestrator.envs.base import Agent, Env, Episode, Problem, StepResult, register_agent, register_env


def score_answer(response: str, answer: str, *, truncated: bool) -> float:
    """Reward of a solver's `response` for the correct `answer` (module docstring)."""
    if response == answer and not truncated:
        return 1.0
    score = 0.0
    if response and response.isdigit():
        score += 0.1
    if not truncated:
        score += 0.1
    if len(response) == len(answer):
        score += 0.2
    matches = sum(1 for a, r in zip(answer, response, strict=False) if a == r)
    score += 0.2 * matches / len(answer)
    return score


def _terms_for(difficulty: int, num_terms: int | None, max_digits: int | None) -> tuple[int, int]:
    if difficulty < 0:
        raise ValueError("difficulty must be >= 0")
    k = num_terms if num_terms is not None else 2 + difficulty // 2
    d = max_digits if max_digits is not None else 1 + (difficulty + 1) // 2
    if k < 1 or d < 1:
        raise ValueError("num_terms and max_digits must be >= 1")
    return k, d


class _SumEnv(Env):
    def __init__(
        self, difficulty: int = 0, *, num_terms: int | None = None, max_digits: int | None = None
    ) -> None:
        self.difficulty = difficulty
        self.num_terms, self.max_digits = _terms_for(difficulty, num_terms, max_digits)

    def sample_problems(self, rng: random.Random, count: int) -> list[Problem]:
        problems = []
        for _ in range(count):
            terms = tuple(rng.randint(0, 10**self.max_digits - 1) for _ in range(self.num_terms))
            problems.append(Problem(id="+".join(map(str, terms)), data=terms))
        return problems

    def max_completion_tokens(self, agent: str) -> int:
        longest = len(str(self.num_terms * (10**self.max_digits - 1)))
        return longest + 2  # the answer, the stop token, one token of slack


@register_agent("solver")
class SolverAgent(Agent):
    """Answers with the digits it generated (whitespace stripped)."""


@register_agent("checker")
class CheckerAgent(Agent):
    """Its action is what it generated, stripped and lower-cased: "y" accepts, "n" rejects."""

    def parse_action(self, text: str) -> str:
        return text.strip().lower()


class ArithmeticEpisode(Episode):
    def __init__(self, terms: tuple[int, ...]) -> None:
        self.question = "+".join(map(str, terms)) + "="
        self.answer = str(sum(terms))
        self.response: str | None = None
        self.truncated = False

    @property
    def correct(self) -> bool:
        return self.response == self.answer and not self.truncated

    def observation(self, agent: str) -> str:
        return self.question

    def step(self, agent: str, action: str, *, truncated: bool = False) -> StepResult:
        self.response, self.truncated = action, truncated
        return StepResult(done=True)

    def final_rewards(self) -> dict[str, float]:
        return {"solver": score_answer(self.response or "", self.answer, truncated=self.truncated)}

    def success(self) -> dict[str, bool]:
        return {"solver": self.correct}


@register_env("arithmetic")
class ArithmeticEnv(_SumEnv):
    agents = ("solver",)

    def new_episode(self, problem: Problem) -> Episode:
        return ArithmeticEpisode(problem.data)


class SolverCheckerEpisode(ArithmeticEpisode):
    def __init__(self, terms: tuple[int, ...]) -> None:
        super().__init__(terms)
        self.verdict: str | None = None
        self.verdict_well_formed = False

    def observation(self, agent: str) -> str:
        if agent == "solver":
            return self.question
        return f"{self.question}{self.response or ''} ok?"

    def step(self, agent: str, action: str, *, truncated: bool = False) -> StepResult:
        if agent == "solver":
            self.response, self.truncated = action, truncated
            return StepResult(done=False)
        if agent == "checker":
            self.verdict = action
            self.verdict_well_formed = action in ("y", "n") and not truncated
            return StepResult(done=True)
        raise ValueError(f"solver_checker has no agent {agent!r}")

    @property
    def joint(self) -> float:
        accept, reject = self.verdict == "y", self.verdict == "n"
        return 1.0 if (self.correct and accept) or (not self.correct and reject) else 0.0

    def final_rewards(self) -> dict[str, float]:
        answer_score = score_answer(self.response or "", self.answer, truncated=self.truncated)
        accepted_right = 1.0 if self.correct and self.verdict == "y" else 0.0
        return {
            "solver": 0.5 * accepted_right + 0.5 * answer_score,
            "checker": 0.8 * self.joint + 0.2 * float(self.verdict_well_formed),
        }

    def success(self) -> dict[str, bool]:
        return {"solver": self.correct, "checker": self.joint == 1.0}


@register_env("solver_checker")
class SolverCheckerEnv(_SumEnv):
    agents = ("solver", "checker")

    def new_episode(self, problem: Problem) -> Episode:
        return SolverCheckerEpisode(problem.data)

    def max_completion_tokens(self, agent: str) -> int:
        return 3 if agent == "checker" else super().max_completion_tokens(agent)
