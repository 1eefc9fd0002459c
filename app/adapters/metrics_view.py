"""A run's metrics per step, paged by step. One step number, two joins: the trainer's report of run
step N with the rollout steps of the batches that step trained (the batches' `trained_step`) and
their rewards; and the rollout statistics of rollout step N (app/rollouts), the batches sampled with
adapter step N, which a later step trains."""

from collections.abc import Iterable

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


def _trained_fields(pairs: Iterable[tuple[int, RolloutStats | None]]) -> dict[str, object]:
    """A trainer step's `trained_*` fields from its (rollout step, that step's statistics) pairs."""
    steps: list[int] = []
    pooled = Summary()
    for rollout_step, row in pairs:
        steps.append(rollout_step)
        if row is not None:
            pooled = pooled.merge(reward_summary(row))
    return {
        "trained_rollout_steps": steps,
        "trained_reward": Aggregate(**pooled.public()) if pooled.count else None,
    }


def _trained_rollouts(
    session: Session, *, run_id: str, first: int, last: int
) -> dict[int, list[tuple[int, RolloutStats | None]]]:
    """Per trainer step in [first, last]: the rollout steps of the batches acknowledged as trained in
    it (ascending), each with its rollout statistics. One statement: the distinct (trainer step,
    rollout step) pairs of the run's trained batches, joined with rollout_stats."""
    pairs = (
        select(Batch.trained_step, Batch.rollout_step)
        .where(
            Batch.run_id == run_id,
            Batch.state == BatchState.TRAINED,
            Batch.trained_step >= first,
            Batch.trained_step <= last,
        )
        .distinct()
        .subquery()
    )
    rows = session.execute(
        select(pairs.c.trained_step, pairs.c.rollout_step, RolloutStats)
        .outerjoin(
            RolloutStats,
            and_(RolloutStats.run_id == run_id, RolloutStats.rollout_step == pairs.c.rollout_step),
        )
        .order_by(pairs.c.trained_step, pairs.c.rollout_step)
    ).tuples()
    out: dict[int, list[tuple[int, RolloutStats | None]]] = {}
    for trained_step, rollout_step, stats in rows:
        out.setdefault(trained_step, []).append((rollout_step, stats))
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
        if (pairs := trained_batches.get(step)) is not None:
            fields |= _trained_fields(pairs)
        if (r := rollouts.get(step)) is not None:
            fields |= _rollout_fields(r)
        items.append(MetricsItem.model_validate(fields))
    return items, next_step


_NO_BOUND = 2**62
