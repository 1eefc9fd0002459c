"""Group-relative advantages (GRPO, RLOO) and where an episode's reward lands.

Groups are keyed by `GroupKey(problem_id, turn, agent)`: the samples that answer
the same problem, at the same turn, as the same agent. The multi-agent trainer
of the source documents keyed groups by rollout index arithmetic and so mixed
samples of different problems into one group (DESIGN §8); here a key without a
problem id cannot be built, and the functions refuse anything but `GroupKey`.

Reward placement. An episode (trajectory) may hold several completions per
agent (several turns). By default (`RewardPlacement.LAST`) the episode's final
reward for an agent goes to that agent's *last* completion in the episode, and
earlier completions keep only their per-step rewards: the sequence-level twin
of the source's "reward at the last valid token". `ALL` gives the final reward
to every completion of the agent instead (useful when per-turn groups would
otherwise see only zeros). In single-turn envs both are the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum
from typing import Literal, NamedTuple


class GroupKey(NamedTuple):
    """The key of a GRPO group: never spans problems."""

    problem_id: str
    turn: int
    agent: str


class RewardPlacement(StrEnum):
    LAST = "last"
    ALL = "all"


AdvantageMethod = Literal["grpo", "rloo"]


def group_indices(keys: Sequence[GroupKey]) -> dict[GroupKey, list[int]]:
    """Sample indices per group, groups in order of first appearance."""
    groups: dict[GroupKey, list[int]] = {}
    for i, key in enumerate(keys):
        if not isinstance(key, GroupKey):
            raise TypeError(f"group keys must be GroupKey(problem_id, turn, agent), got {key!r}")
        groups.setdefault(key, []).append(i)
    return groups


def _check(rewards: Sequence[float], keys: Sequence[GroupKey]) -> None:
    if len(rewards) != len(keys):
        raise ValueError(f"{len(rewards)} rewards but {len(keys)} keys")
    for r in rewards:
        if not math.isfinite(r):
            raise ValueError(f"reward {r} is not finite")


def grpo_advantages(
    rewards: Sequence[float],
    keys: Sequence[GroupKey],
    *,
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> list[float]:
    """A_i = r_i - mean(group), divided by (std(group) + eps) when `normalize_std`.

    The std is the population std (ddof=0). A group of one sample gets 0."""
    _check(rewards, keys)
    out = [0.0] * len(rewards)
    for idx in group_indices(keys).values():
        values = [rewards[i] for i in idx]
        mean = sum(values) / len(values)
        scale = 1.0
        if normalize_std:
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
            scale = 1.0 / (std + eps)
        for i in idx:
            out[i] = (rewards[i] - mean) * scale
    return out


def rloo_advantages(rewards: Sequence[float], keys: Sequence[GroupKey]) -> list[float]:
    """A_i = r_i - mean of the *other* samples of the group (leave-one-out baseline).

    Equals n/(n-1) * (r_i - mean(group)); a group of one sample gets 0."""
    _check(rewards, keys)
    out = [0.0] * len(rewards)
    for idx in group_indices(keys).values():
        n = len(idx)
        if n < 2:
            continue
        total = sum(rewards[i] for i in idx)
        for i in idx:
            out[i] = rewards[i] - (total - rewards[i]) / (n - 1)
    return out


def compute_advantages(
    rewards: Sequence[float],
    keys: Sequence[GroupKey],
    *,
    method: AdvantageMethod = "grpo",
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> list[float]:
    if method == "grpo":
        return grpo_advantages(rewards, keys, normalize_std=normalize_std, eps=eps)
    if method == "rloo":
        if normalize_std:
            raise ValueError("normalize_std applies to grpo only")
        return rloo_advantages(rewards, keys)
    raise ValueError(f"unknown advantage method {method!r}")


def place_rewards(
    step_rewards: Sequence[float],
    final_reward: float,
    placement: RewardPlacement = RewardPlacement.LAST,
) -> list[float]:
    """The training reward of each of one agent's completions in one episode.

    `step_rewards` are the per-step rewards of the agent's completions, in order;
    `final_reward` is the agent's episode reward (see the module docstring)."""
    out = list(step_rewards)
    if not out:
        return out
    if placement == RewardPlacement.LAST:
        out[-1] += final_reward
    elif placement == RewardPlacement.ALL:
        out = [r + final_reward for r in out]
    else:
        raise ValueError(f"unknown reward placement {placement!r}")
    return out
