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
    """Up to `limit` steps >= since_step that have a trainer report or rollout batches, and the
    `since_step` of the next page (None at the end)."""
    trained = {
        m.step: m
        for m in session.scalars(
            select(StepMetrics)
            .where(StepMetrics.run_id == run_id, StepMetrics.step >= since_step)
            .order_by(StepMetrics.step)
            .limit(limit + 1)
        )
    }
    rollouts = {
        r.rollout_step: r for r in list_stats(session, run_id=run_id, since_step=since_step, limit=limit + 1)
    }
    steps = sorted(trained.keys() | rollouts.keys())
    # Each source brought up to limit + 1 steps, so the first limit + 1 of the union are exact.
    page, rest = steps[:limit], steps[limit:]
    items = []
    for step in page:
        fields: dict[str, object] = {"step": step}
        if (m := trained.get(step)) is not None:
            fields |= dict(m.values) | {"created_at": m.created_at}
        if (r := rollouts.get(step)) is not None:
            fields |= _rollout_fields(r)
        items.append(MetricsItem.model_validate(fields))
    return items, (rest[0] if rest else None)
