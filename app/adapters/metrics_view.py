"""A run's metrics per step, paged by step. One step number, two joins: the trainer's report of run
step N with the rollout steps of the batches that step trained (the batches' `trained_step`) and
their rewards; and the rollout statistics of rollout step N (app/rollouts), the batches sampled with
adapter step N, which a later step trains."""

from dataclasses import dataclass, field

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from app.adapters.models import StepMetrics
from app.adapters.schemas import Aggregate, MetricsItem
from app.batches.models import Batch
from app.rollouts.models import RolloutStats
from app.rollouts.service import Summary, list_stats, metric_summaries, reward_summary
from contracts.status import BatchState


def _rollout_fields(row: RolloutStats) -> dict[str, object]:
    reward = reward_summary(row)
    metrics = metric_summaries(row)
    return {
        "samples_received": row.samples,
        "reward": Aggregate(**reward.public()) if reward.count else None,
        "sample_metrics": {n: Aggregate(**s.public()) for n, s in metrics.items()} or None,
    }


@dataclass
class _TrainedStep:
    """The batches one trainer step trained, as `_trained_rollouts` reads them, merged per rollout step."""

    exact: dict[int, Summary] = field(default_factory=dict)
    """Rollout step → the merged reward summaries of its batches this step trained."""
    pooled: dict[int, Summary] = field(default_factory=dict)
    """Rollout step → its whole stats, where this step trained one of its batches stored before
    migration 0019 (no summary of its own). Those stats hold the step's other batches too, so they
    replace the rollout step's exact part: the figure pre-0019 metrics gave, counted once."""

    def add(self, rollout_step: int, batch: Summary | None, stats: Summary | None) -> None:
        exact = self.exact.setdefault(rollout_step, Summary())
        if batch is not None:
            self.exact[rollout_step] = exact.merge(batch)
        elif stats is not None:  # no stats row: no reward was sent for that rollout step
            self.pooled[rollout_step] = stats

    def fields(self) -> dict[str, object]:
        total = Summary()
        for rollout_step in sorted(self.exact):
            total = total.merge(self.pooled.get(rollout_step, self.exact[rollout_step]))
        return {
            "trained_rollout_steps": sorted(self.exact),
            "trained_reward": Aggregate(**total.public()) if total.count else None,
        }


def _trained_rollouts(session: Session, *, run_id: str, first: int, last: int) -> dict[int, _TrainedStep]:
    """Per trainer step in [first, last]: the batches acknowledged as trained in it, their rollout steps
    and rewards. One statement: the run's trained batches with their reward summaries, each batch
    stored before migration 0019 (no summary) joined with its rollout step's stats instead."""
    legacy = and_(
        Batch.reward_count.is_(None),
        RolloutStats.run_id == run_id,
        RolloutStats.rollout_step == Batch.rollout_step,
    )
    rows = session.execute(
        select(
            Batch.trained_step,
            Batch.rollout_step,
            Batch.reward_count,
            Batch.reward_mean,
            Batch.reward_m2,
            Batch.reward_min,
            Batch.reward_max,
            RolloutStats.reward_count,
            RolloutStats.reward_mean,
            RolloutStats.reward_m2,
            RolloutStats.reward_min,
            RolloutStats.reward_max,
        )
        .outerjoin(RolloutStats, legacy)
        .where(
            Batch.run_id == run_id,
            Batch.state == BatchState.TRAINED,
            Batch.trained_step >= first,
            Batch.trained_step <= last,
        )
        .order_by(Batch.trained_step, Batch.id)  # a fixed merge order: the same figures every read
    ).tuples()
    out: dict[int, _TrainedStep] = {}
    for trained_step, rollout_step, *summaries in rows:
        assert trained_step is not None  # the WHERE bounds it
        batch = None if summaries[0] is None else Summary(*summaries[:5])
        stats = None if summaries[5] is None else Summary(*summaries[5:])
        out.setdefault(trained_step, _TrainedStep()).add(rollout_step, batch, stats)
    return out


def metrics_page(
    session: Session, *, run_id: str, since_step: int, limit: int
) -> tuple[list[MetricsItem], int | None]:
    """Up to `limit` steps >= since_step that have a trainer report, or rollout batches with
    rewards or per-sample metrics, and the `since_step` of the next page (None at the end)."""
    trained_rows = list(
        session.scalars(
            select(StepMetrics)
            .where(StepMetrics.run_id == run_id, StepMetrics.step >= since_step)
            .order_by(StepMetrics.step)
            .limit(limit + 1)
        )
    )
    rollout_rows = list_stats(session, run_id=run_id, since_step=since_step, limit=limit + 1)
    # Each source is complete up to its last row when it was cut at limit + 1 rows (else to the end):
    # the union is known up to the smaller of those bounds.
    bound_trained = trained_rows[-1].step if len(trained_rows) > limit else _NO_BOUND
    bound_rollouts = rollout_rows[-1].rollout_step if len(rollout_rows) > limit else _NO_BOUND
    bound = min(bound_trained, bound_rollouts)
    trained = {m.step: m for m in trained_rows if m.step <= bound}
    rollouts = {r.rollout_step: r for r in rollout_rows if r.rollout_step <= bound}
    # A rollout step is listed for its rewards or per-sample metrics; samples alone are no figure.
    with_figures = {step for step, r in rollouts.items() if r.reward_count or r.metrics}
    steps = sorted(trained.keys() | with_figures)
    page = steps[:limit]
    if len(steps) > limit:
        next_step: int | None = steps[limit]
    else:
        next_step = None if bound == _NO_BOUND else bound + 1
    # The pool acknowledges a step's batches after its report: every trainer step that trained a
    # batch has a report, so it is on this page exactly when its step number is.
    trained_batches = _trained_rollouts(session, run_id=run_id, first=page[0], last=page[-1]) if page else {}
    items = []
    for step in page:
        fields: dict[str, object] = {"step": step}
        if (m := trained.get(step)) is not None:
            fields |= dict(m.values) | {"created_at": m.created_at}
        if (trained_step := trained_batches.get(step)) is not None:
            fields |= trained_step.fields()
        if (r := rollouts.get(step)) is not None:
            fields |= _rollout_fields(r)
        items.append(MetricsItem.model_validate(fields))
    return items, next_step


_NO_BOUND = 2**62
