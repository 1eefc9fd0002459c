"""Aggregating rewards and per-sample metrics per rollout step, as batches arrive.

Called under the run row lock that batch ingestion holds (app/batches/service.py), so the
read-merge-write of a step's row never races another batch of the same run. Statistics are
merged exactly (count, mean, M2: Chan et al.'s parallel update), never re-read from payloads.
"""

import json
import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, insert, select, text, update
from sqlalchemy.orm import Session

from app.db import pg_execute, utcnow
from app.events.service import append_event
from app.rollouts.models import RolloutStats
from contracts.arrays import ArrayBatch
from contracts.wire import TrainingBatch

MAX_STEP_METRICS = 32
"""Most distinct per-sample metric names kept per rollout step (each sample has at most
MAX_SAMPLE_METRICS); names beyond it are dropped, so one step's row stays small."""


@dataclass(frozen=True)
class Summary:
    """count, mean, M2, min, max of a set of values (empty: count 0)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    min: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: list[float]) -> "Summary":
        if not values:
            return cls()
        mean = math.fsum(values) / len(values)
        return cls(len(values), mean, math.fsum((v - mean) ** 2 for v in values), min(values), max(values))

    def merge(self, other: "Summary") -> "Summary":
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        n = self.count + other.count
        delta = other.mean - self.mean
        assert self.min is not None and self.max is not None and other.min is not None
        assert other.max is not None
        return Summary(
            n,
            self.mean + delta * other.count / n,
            self.m2 + other.m2 + delta * delta * self.count * other.count / n,
            min(self.min, other.min),
            max(self.max, other.max),
        )

    @property
    def std(self) -> float:
        """Population standard deviation (numpy's default, ddof=0)."""
        return math.sqrt(max(self.m2, 0.0) / self.count) if self.count else 0.0

    def public(self) -> dict[str, Any]:
        """What the API shows: mean, std, min, max, count."""
        return {"mean": self.mean, "std": self.std, "min": self.min, "max": self.max, "count": self.count}

    def as_list(self) -> list[Any]:
        return [self.count, self.mean, self.m2, self.min, self.max]

    @classmethod
    def from_list(cls, raw: list[Any]) -> "Summary":
        count, mean, m2, lo, hi = raw
        return cls(int(count), float(mean), float(m2), lo, hi)


@dataclass(frozen=True)
class StepStats:
    """A step's stats row as add_batch reads it (the columns of _STATS_OF_STEP)."""

    id: int
    samples: int | None
    reward_count: int
    reward_mean: float
    reward_m2: float
    reward_min: float | None
    reward_max: float | None
    metrics: dict[str, Any]


def reward_summary(row: RolloutStats) -> Summary:
    return Summary(row.reward_count, row.reward_mean, row.reward_m2, row.reward_min, row.reward_max)


def metric_summaries(row: RolloutStats) -> dict[str, Summary]:
    return {name: Summary.from_list(raw) for name, raw in sorted(row.metrics.items())}


_STATS_OF_STEP = select(
    RolloutStats.id,
    RolloutStats.samples,
    RolloutStats.reward_count,
    RolloutStats.reward_mean,
    RolloutStats.reward_m2,
    RolloutStats.reward_min,
    RolloutStats.reward_max,
    RolloutStats.metrics,
).where(RolloutStats.run_id == bindparam("run_id"), RolloutStats.rollout_step == bindparam("step"))
# Built once (values come as parameters), so SQLAlchemy reuses the compiled forms.
_INSERT_STATS = insert(RolloutStats)
_UPDATE_STATS = update(RolloutStats).where(RolloutStats.id == bindparam("stats_id"))

# Postgres: the step's row written (either way: the upsert) and the event appended in one round trip.
_WRITE_STATS_AND_EVENT_PG = text(
    """
WITH stats AS (
    INSERT INTO rollout_stats (run_id, rollout_step, samples, reward_count, reward_mean, reward_m2,
                               reward_min, reward_max, metrics, updated_at)
    VALUES (:run_id, :rollout_step, :samples, :reward_count, :reward_mean, :reward_m2,
            :reward_min, :reward_max, CAST(:metrics AS json), :updated_at)
    ON CONFLICT (run_id, rollout_step) DO UPDATE SET
        samples = excluded.samples, reward_count = excluded.reward_count,
        reward_mean = excluded.reward_mean, reward_m2 = excluded.reward_m2,
        reward_min = excluded.reward_min, reward_max = excluded.reward_max,
        metrics = excluded.metrics, updated_at = excluded.updated_at
)
INSERT INTO events (at, action, actor, tenant_id, run_id, api_key_id, details, txid)
VALUES (:updated_at, :action, :actor, :tenant_id, :run_id, NULL, CAST(:details AS json),
        pg_current_xact_id()::text::bigint)
"""
)


def batch_rewards(batch: TrainingBatch | ArrayBatch) -> Summary:
    """The summary of a batch's rewards (its samples without one left out)."""
    return Summary.of([s.reward for s in batch.examples if s.reward is not None])


def add_batch(
    session: Session,
    *,
    run_id: str,
    tenant_id: str,
    batch_id: int,
    batch: TrainingBatch | ArrayBatch,
    step_stats: tuple[StepStats | None] | None = None,
    rewards: Summary | None = None,
) -> None:
    """Merge a stored batch's rewards and metrics into its rollout step; record a `batch.received`
    event with the step's aggregate so far. Call under the run row lock, in the batch's transaction.

    Core statements on the session's connection (ingestion's hot path builds no ORM object): the
    step's row read, then written and the event appended (one statement on Postgres).
    `step_stats`: the step's row (in a 1-tuple; None inside: no row yet) when the caller read it
    under the run row lock already (app/batches/one_statement.py), so it is not read again.
    `rewards`: `batch_rewards(batch)` when the caller has it already (ingestion stores it in the
    batch's row too), so it is not computed again."""
    if rewards is None:
        rewards = batch_rewards(batch)
    per_metric: dict[str, list[float]] = {}
    for sample in batch.examples:
        for name, value in (sample.metrics or {}).items():
            per_metric.setdefault(name, []).append(value)

    connection = session.connection()
    row: Any
    if step_stats is not None:
        (row,) = step_stats
    else:
        row = connection.execute(_STATS_OF_STEP, {"run_id": run_id, "step": batch.step}).one_or_none()
    if row is None:
        samples, total = 0, rewards
        metrics: dict[str, Summary] = {}
    else:
        samples = row.samples or 0
        old = Summary(row.reward_count, row.reward_mean, row.reward_m2, row.reward_min, row.reward_max)
        total = old.merge(rewards)
        metrics = {name: Summary.from_list(raw) for name, raw in sorted(row.metrics.items())}
    for name, values in per_metric.items():
        if name in metrics or len(metrics) < MAX_STEP_METRICS:
            metrics[name] = metrics.get(name, Summary()).merge(Summary.of(values))
    samples += len(batch.examples)
    new: dict[str, Any] = {
        "samples": samples,
        "reward_count": total.count,
        "reward_mean": total.mean,
        "reward_m2": total.m2,
        "reward_min": total.min,
        "reward_max": total.max,
        "metrics": {name: s.as_list() for name, s in metrics.items()},
        "updated_at": utcnow(),
    }
    details = {
        "batch_id": batch_id,
        "rollout_step": batch.step,
        "samples": len(batch.examples),
        "step_samples": samples,
        "reward": total.public() if total.count else None,
    }
    event = {"action": "batch.received", "actor": "orchestrator", "tenant_id": tenant_id, "run_id": run_id}
    if connection.dialect.name == "postgresql":
        pg_execute(  # on the psycopg connection directly, prepared (app/db.py)
            connection,
            _WRITE_STATS_AND_EVENT_PG,
            new
            | event
            | {
                "rollout_step": batch.step,
                "metrics": json.dumps(new["metrics"]),
                "details": json.dumps(details),
            },
        )
        return
    if row is None:
        connection.execute(_INSERT_STATS, new | {"run_id": run_id, "rollout_step": batch.step})
    else:
        connection.execute(_UPDATE_STATS, new | {"stats_id": row.id})
    append_event(connection, **event, details=details)


def list_stats(session: Session, *, run_id: str, since_step: int, limit: int) -> list[RolloutStats]:
    return list(
        session.scalars(
            select(RolloutStats)
            .where(RolloutStats.run_id == run_id, RolloutStats.rollout_step >= since_step)
            .order_by(RolloutStats.rollout_step)
            .limit(limit)
        )
    )
