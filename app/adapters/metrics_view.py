"""A run's metrics per step: the trainer's step reports joined with the rewards of the rollout
batches of the same step (app/rollouts), paged by step."""

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.adapters.models import StepMetrics
from app.adapters.schemas import Aggregate, MetricsItem
from app.rollouts.models import RolloutStats
from app.rollouts.service import list_stats, metric_summaries, reward_summary


def _rollout_fields(row: RolloutStats) -> dict[str, object]:
    reward = reward_summary(row)
    metrics = metric_summaries(row)
    return {
        "samples_received": row.samples,
        "reward": Aggregate(**reward.public()) if reward.count else None,
        "sample_metrics": {n: Aggregate(**s.public()) for n, s in metrics.items()} or None,
    }


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
    items = []
    for step in page:
        fields: dict[str, object] = {"step": step}
        if (m := trained.get(step)) is not None:
            fields |= dict(m.values) | {"created_at": m.created_at}
        if (r := rollouts.get(step)) is not None:
            fields |= _rollout_fields(r)
        items.append(MetricsItem.model_validate(fields))
    return items, next_step


_NO_BOUND = 2**62
