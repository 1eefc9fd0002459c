"""Tokenizer, registries and the built-in envs' rewards."""

from __future__ import annotations

import random

import pytest

from contracts.tokenizer import CharTokenizer, encode_prompt
from orchestrator.envs import (
    ENV_REGISTRY,
    Agent,
    ArithmeticEnv,
    Env,
    Episode,
    Problem,
    SolverCheckerEnv,
    StepResult,
    make_agent,
    make_env,
    register_env,
    score_answer,
)


def test_tokenizer_vocabulary_is_small_and_stable() -> None:
    tok = CharTokenizer()
    assert tok.vocab_size == 83 <= 128
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    # Pinned ids: the built-in tiny model is trained on these.
    assert tok.encode("3+4=") == [7, 15, 8, 19]
    assert tok.encode("ok?") == [45, 41, 20]
    assert tok.encode("yZ\n") == [55, 82, 30]
    assert tok.encode("1", add_bos=True, add_eos=True) == [1, 5, 2]
    assert tok.encode("é") == [3]


def test_tokenizer_roundtrip() -> None:
    tok = CharTokenizer()
    text = "solver: 12+30=42 ok? y"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([1, 5, 6, 2, 0]) == "12"
    assert tok.decode([1, 5, 2], skip_special_tokens=False) == "<bos>1<eos>"
    assert tok.decode([5, 3, 6]) == "1\ufffd2"  # never "12": junk must not pass for an answer
    assert tok.decode([5, 200]) == "1\ufffd"
    assert encode_prompt(tok, "1+1=") == [1, 5, 15, 5, 19]


@pytest.mark.parametrize(
    ("response", "truncated", "expected"),
    [
        ("7", False, 1.0),
        ("7", True, 0.5),  # right digits but cut at max_tokens: .1 digits + .2 length + .2 match
        ("8", False, 0.4),  # digits .1 + stopped .1 + length .2 + no match
        ("17", False, 0.2),  # digits, stopped, wrong length, first char "1" vs "7"
        ("", False, 0.1),  # only stopped
        ("x", True, 0.2),  # right length only
    ],
)
def test_score_answer_single_digit(response: str, truncated: bool, expected: float) -> None:
    assert score_answer(response, "7", truncated=truncated) == pytest.approx(expected)


def test_score_answer_partial_digits() -> None:
    # "12" vs "15": digits .1, stopped .1, length .2, half the digits .1
    assert score_answer("12", "15", truncated=False) == pytest.approx(0.5)
    assert score_answer("1", "15", truncated=False) == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("difficulty", "terms", "digits"), [(0, 2, 1), (1, 2, 2), (2, 3, 2), (3, 3, 3), (4, 4, 3)]
)
def test_difficulty(difficulty: int, terms: int, digits: int) -> None:
    env = ArithmeticEnv(difficulty)
    assert (env.num_terms, env.max_digits) == (terms, digits)
    for p in env.sample_problems(random.Random(0), 20):
        assert len(p.data) == terms and all(0 <= t < 10**digits for t in p.data)
        assert p.id == "+".join(map(str, p.data))
    assert ArithmeticEnv(0).max_completion_tokens("solver") == 4  # "18" + EOS + 1
    assert ArithmeticEnv(3, num_terms=5).num_terms == 5


def test_arithmetic_episode() -> None:
    env = make_env("arithmetic")
    episode = env.new_episode(Problem("3+4", (3, 4)))
    assert episode.observation("solver") == "3+4="
    assert episode.step("solver", "7").done
    assert episode.final_rewards() == {"solver": 1.0} and episode.success() == {"solver": True}
    assert env.validation_problems(5) == env.validation_problems(5)


@pytest.mark.parametrize(
    ("answer", "verdict", "solver", "checker", "ok"),
    [
        ("7", "y", 1.0, 1.0, (True, True)),  # J = 1
        ("7", "n", 0.5, 0.2, (True, False)),  # right answer rejected: J = 0
        ("8", "n", 0.5 * 0.4, 1.0, (False, True)),  # wrong answer caught: J = 1, no bonus for the solver
        ("8", "y", 0.5 * 0.4, 0.2, (False, False)),
        ("7", "maybe", 0.5, 0.0, (True, False)),  # malformed verdict: no format credit either
    ],
)
def test_solver_checker_joint_reward(
    answer: str, verdict: str, solver: float, checker: float, ok: tuple[bool, bool]
) -> None:
    env = SolverCheckerEnv()
    episode = env.new_episode(Problem("3+4", (3, 4)))
    assert not episode.step("solver", answer).done
    assert episode.observation("checker") == f"3+4={answer} ok?"
    assert episode.step("checker", make_agent("checker").parse_action(f" {verdict.upper()} ")).done
    assert episode.final_rewards() == pytest.approx({"solver": solver, "checker": checker})
    assert tuple(episode.success().values()) == ok


def test_registries() -> None:
    assert {"arithmetic", "solver_checker"} <= set(ENV_REGISTRY.names())
    assert type(make_agent("nobody")) is Agent
    with pytest.raises(KeyError, match="unknown env"):
        make_env("nope")

    class _Dummy(Env):
        agents = ("a",)

        def sample_problems(self, rng: random.Random, count: int) -> list[Problem]:
            return [Problem("x")] * count

        def new_episode(self, problem: Problem) -> Episode:
            raise NotImplementedError

    registered = register_env("test_dummy_env")(_Dummy)
    assert registered is _Dummy and isinstance(make_env("test_dummy_env"), _Dummy)
    with pytest.raises(ValueError, match="already registered"):
        register_env("arithmetic")(_Dummy)
    assert StepResult().done is False
