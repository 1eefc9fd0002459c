"""Reward filters, as the multi-agent trainer of the source documents applies
them to UID groups (its UID is our `GroupKey`: problem, turn, agent).

Modes (`ratio` is `filter_ratio`, in [0, 1]):

- `none`: keep everything.
- `mean`: drop the floor(G * ratio) groups with the lowest mean reward (G = number of groups).
- `std`: drop the floor(G * ratio) groups with the lowest range-normalised variance,
  var(group, ddof=0) / R**2, where R = max - min of all rewards being filtered. The
  range is the batch's, not the group's: with the group's own range a group with
  rewards {0, 0.01} would score as high as {0, 1} and be kept although it holds
  almost no signal; the batch range makes the score comparable across batches and
  reward scales while ranking groups as their plain variance does.
- `dapo`: drop every group whose rewards are all equal (zero variance: every
  advantage in it is 0, so it carries no learning signal), as DAPO's dynamic
  sampling does. The ratio is ignored: at ratio 0 (and any other) dapo still drops
  all zero-variance groups, and never drops a group that has variance.
- `uid`: inside each group, drop the floor(n * ratio) samples farthest from the group
  mean (n = the group's size); whole groups stay.

Ties (equal scores, equal deviations) are broken by order: the group (or sample)
that appears first is dropped first, so results are deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from orchestrator.advantages import GroupKey, group_indices

ZERO_VARIANCE_TOL = 1e-12


class FilterMode(StrEnum):
    NONE = "none"
    MEAN = "mean"
    STD = "std"
    DAPO = "dapo"
    UID = "uid"


@dataclass(frozen=True)
class FilterResult:
    kept: list[int]
    """Indices of the samples kept, ascending."""
    removed_groups: list[GroupKey] = field(default_factory=list)
    """Groups dropped whole (mean, std, dapo)."""

    def removed(self, total: int) -> list[int]:
        keep = set(self.kept)
        return [i for i in range(total) if i not in keep]


def _variance(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


def range_normalised_variance(values: Sequence[float], reward_range: float) -> float:
    if reward_range <= ZERO_VARIANCE_TOL:
        return 0.0
    return _variance(values) / reward_range**2


def filter_samples(
    rewards: Sequence[float],
    keys: Sequence[GroupKey],
    *,
    mode: FilterMode | str = FilterMode.NONE,
    ratio: float = 0.0,
) -> FilterResult:
    """Which samples survive the filter (see the module docstring for each mode)."""
    mode = FilterMode(mode)
    if not 0.0 <= ratio <= 1.0 or math.isnan(ratio):
        raise ValueError(f"filter ratio must be in [0, 1], not {ratio}")
    if len(rewards) != len(keys):
        raise ValueError(f"{len(rewards)} rewards but {len(keys)} keys")
    groups = group_indices(keys)
    everything = list(range(len(rewards)))
    if mode == FilterMode.NONE or not groups:
        return FilterResult(kept=everything)

    if mode == FilterMode.UID:
        dropped: set[int] = set()
        for idx in groups.values():
            k = math.floor(len(idx) * ratio)
            if k == 0:
                continue
            mean = sum(rewards[i] for i in idx) / len(idx)
            by_distance = sorted(idx, key=lambda i: (-abs(rewards[i] - mean), i))
            dropped.update(by_distance[:k])
        return FilterResult(kept=[i for i in everything if i not in dropped])

    if mode == FilterMode.DAPO:
        drop_groups = [
            key
            for key, idx in groups.items()
            if max(rewards[i] for i in idx) - min(rewards[i] for i in idx) <= ZERO_VARIANCE_TOL
        ]
    else:
        if mode == FilterMode.MEAN:
            scores = {key: sum(rewards[i] for i in idx) / len(idx) for key, idx in groups.items()}
        else:  # STD
            reward_range = max(rewards) - min(rewards)
            scores = {
                key: range_normalised_variance([rewards[i] for i in idx], reward_range)
                for key, idx in groups.items()
            }
        k = math.floor(len(groups) * ratio)
        order = list(groups)  # first appearance; sorted() is stable, so ties drop the earlier group
        drop_groups = sorted(order, key=lambda key: scores[key])[:k]

    dropped_keys = set(drop_groups)
    kept = [i for i in everything if keys[i] not in dropped_keys]
    return FilterResult(kept=kept, removed_groups=drop_groups)
