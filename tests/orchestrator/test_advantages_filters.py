"""Advantages and filters against hand-computed examples; groups never span problems."""

from __future__ import annotations

import math

import pytest

from orchestrator.advantages import (
    GroupKey,
    RewardPlacement,
    compute_advantages,
    grpo_advantages,
    place_rewards,
    rloo_advantages,
)
from orchestrator.filters import FilterMode, filter_samples, range_normalised_variance


def keys(*spec: tuple[str, int]) -> list[GroupKey]:
    """keys(("p1", 2), ("p2", 3)) → two samples of problem p1 then three of p2 (turn 0, agent a)."""
    return [GroupKey(pid, 0, "a") for pid, n in spec for _ in range(n)]


def test_grpo_mean_baseline() -> None:
    assert grpo_advantages([1.0, 0.0, 0.5, 0.5], keys(("p", 4))) == [0.5, -0.5, 0.0, 0.0]


def test_grpo_std_normalised() -> None:
    # std (ddof=0) of [1, 0, .5, .5] = sqrt(0.125)
    out = grpo_advantages([1.0, 0.0, 0.5, 0.5], keys(("p", 4)), normalize_std=True)
    assert out == pytest.approx([math.sqrt(2), -math.sqrt(2), 0.0, 0.0], rel=1e-5)
    # A zero-variance group stays at 0 instead of dividing by 0.
    assert grpo_advantages([0.3, 0.3], keys(("p", 2)), normalize_std=True) == [0.0, 0.0]


def test_rloo_leave_one_out() -> None:
    out = rloo_advantages([1.0, 0.0, 0.5, 0.5], keys(("p", 4)))
    assert out == pytest.approx([2 / 3, -2 / 3, 0.0, 0.0])
    assert rloo_advantages([1.0], keys(("p", 1))) == [0.0]
    assert compute_advantages([1.0, 0.0], keys(("p", 2)), method="rloo") == [1.0, -1.0]


def test_groups_never_span_problems() -> None:
    """Regression (DESIGN §8): the source trainer grouped across problems. Problem p1 was
    solved by every sample, p2 by none: within each problem there is nothing to learn."""
    rewards = [1.0, 1.0, 0.0, 0.0]
    ks = keys(("p1", 2), ("p2", 2))
    assert grpo_advantages(rewards, ks) == [0.0] * 4  # across problems it would be ±0.5
    assert rloo_advantages(rewards, ks) == [0.0] * 4
    assert filter_samples(rewards, ks, mode="dapo").kept == []
    # Same problem, different turn or agent: separate groups too.
    mixed = [GroupKey("p", 0, "a"), GroupKey("p", 0, "a"), GroupKey("p", 1, "a"), GroupKey("p", 0, "b")]
    assert grpo_advantages([1.0, 0.0, 5.0, 7.0], mixed) == [0.5, -0.5, 0.0, 0.0]


def test_keys_without_problem_are_refused() -> None:
    with pytest.raises(TypeError):
        grpo_advantages([1.0, 0.0], [(0, "a"), (0, "a")])  # type: ignore[list-item]


def test_reward_placement() -> None:
    assert place_rewards([0.0, 0.1, 0.0], 1.0) == [0.0, 0.1, 1.0]
    assert place_rewards([0.0, 0.1, 0.0], 1.0, RewardPlacement.ALL) == [1.0, 1.1, 1.0]
    assert place_rewards([], 1.0) == []


# Four groups of two samples. Means: A .5, B .5, C .1, D 1. Variances: A .25, B 0, C .01, D 0.
REWARDS = [1.0, 0.0, 0.5, 0.5, 0.2, 0.0, 1.0, 1.0]
KEYS = keys(("A", 2), ("B", 2), ("C", 2), ("D", 2))


@pytest.mark.parametrize(
    ("mode", "ratio", "kept"),
    [
        ("none", 0.9, [0, 1, 2, 3, 4, 5, 6, 7]),
        ("mean", 0.0, [0, 1, 2, 3, 4, 5, 6, 7]),
        ("mean", 0.25, [0, 1, 2, 3, 6, 7]),  # floor(4 * .25) = 1 group: C (mean .1)
        ("mean", 0.5, [2, 3, 6, 7]),  # C, then A (ties with B at .5; A comes first)
        ("mean", 1.0, []),
        ("std", 0.25, [0, 1, 4, 5, 6, 7]),  # B (score 0; ties with D, B first)
        ("std", 0.5, [0, 1, 4, 5]),  # B and D (zero variance)
        ("std", 0.75, [0, 1]),  # then C (.01 / 1**2)
        ("dapo", 0.0, [0, 1, 4, 5]),  # every zero-variance group (B, D), whatever the ratio
        ("dapo", 0.25, [0, 1, 4, 5]),
        ("dapo", 1.0, [0, 1, 4, 5]),
    ],
)
def test_group_filters(mode: str, ratio: float, kept: list[int]) -> None:
    assert filter_samples(REWARDS, KEYS, mode=mode, ratio=ratio).kept == kept


def test_filter_reports_removed_groups() -> None:
    result = filter_samples(REWARDS, KEYS, mode=FilterMode.DAPO)
    assert result.removed_groups == [KEYS[2], KEYS[6]]
    assert result.removed(len(REWARDS)) == [2, 3, 6, 7]


def test_std_filter_is_scale_free() -> None:
    # Normalised by the batch range: scaling every reward changes nothing.
    scaled = [10 * r - 3 for r in REWARDS]
    assert filter_samples(scaled, KEYS, mode="std", ratio=0.75).kept == [0, 1]
    assert range_normalised_variance([1.0, 0.0], 2.0) == pytest.approx(0.25 / 4)
    assert range_normalised_variance([1.0, 1.0], 0.0) == 0.0


def test_uid_filter_drops_samples_farthest_from_group_mean() -> None:
    # One group [0, .2, .3, 1]: mean .375, distances .375 .175 .075 .625.
    rewards = [0.0, 0.2, 0.3, 1.0, 0.4, 0.6]
    ks = keys(("E", 4), ("F", 2))
    assert filter_samples(rewards, ks, mode="uid", ratio=0.25).kept == [
        0,
        1,
        2,
        4,
        5,
    ]  # E drops 1.0; F floor(.5)=0
    assert filter_samples(rewards, ks, mode="uid", ratio=0.5).kept == [
        1,
        2,
        5,
    ]  # E drops 1.0, 0; F drops .4 (tie, first)
    assert filter_samples(rewards, ks, mode="uid", ratio=0.0).kept == [0, 1, 2, 3, 4, 5]


def test_filter_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        filter_samples([1.0], keys(("p", 1)), mode="mean", ratio=1.5)
    with pytest.raises(ValueError):
        filter_samples([1.0], keys(("p", 1)), mode="median", ratio=0.5)
    assert filter_samples([], [], mode="mean", ratio=0.5).kept == []
