"""What the dashboard's pages show, read from the database (no HTTP here)."""

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.adapters.metrics_view import metrics_page
from app.adapters.schemas import MetricsItem
from app.events.feed import FeedPosition, read_feed
from app.pools.models import Pool
from app.rollouts.models import RolloutStats
from app.runs.models import Run
from app.tenants.models import Tenant
from app.timestamps import as_utc
from contracts.run_config import RunConfig
from contracts.status import PoolStatus, RunStatus

RUNS_PER_PAGE = 100
CHART_STEPS = 1000
EVENTS_SHOWN = 200


def iso_utc(value: datetime) -> str:
    """A stored time for a `<time datetime>` (the `iso_utc` template filter): ISO 8601 in UTC with
    its `Z`, as the API writes the same time (the page's live events carry the API's)."""
    return as_utc(value).isoformat().removesuffix("+00:00") + "Z"


@dataclass(frozen=True)
class RunRow:
    run: Run
    max_steps: int
    latest_reward: float | None


def runs_of(session: Session, *, tenant_id: str, status: str | None, name: str | None) -> list[RunRow]:
    stmt = select(Run).where(Run.tenant_id == tenant_id)
    stmt = stmt.where(Run.status == status) if status else stmt.where(Run.status != RunStatus.DELETED)
    if name:
        stmt = stmt.where(Run.name.contains(name, autoescape=True))
    runs = list(session.scalars(stmt.order_by(Run.created_at.desc(), Run.id.desc()).limit(RUNS_PER_PAGE)))
    latest: dict[str, float] = {}
    # A deleted run's rewards are no longer shown, as the API's metrics of it are a 404.
    with_metrics = [r.id for r in runs if r.status != RunStatus.DELETED]
    if with_metrics:
        rows = session.execute(
            select(RolloutStats.run_id, RolloutStats.reward_mean)
            .where(RolloutStats.run_id.in_(with_metrics), RolloutStats.reward_count > 0)
            .order_by(RolloutStats.rollout_step.desc())
        ).tuples()
        for run_id, mean in rows:
            latest.setdefault(run_id, mean)
    return [RunRow(r, RunConfig.model_validate(r.config).max_steps, latest.get(r.id)) for r in runs]


def run_page_data(session: Session, *, run: Run) -> dict[str, Any]:
    """Series for the charts and the first events, as the page's JSON block and its tables. A deleted
    run's series are empty, as the API's metrics of it are a 404 (the rows stay until the purge)."""
    items = [] if run.status == RunStatus.DELETED else _chart_items(session, run_id=run.id)
    reward = [[i.step, i.reward.mean] for i in items if i.reward is not None]
    loss = [[i.step, i.loss] for i in items if i.loss is not None]
    events, position, _ = read_feed(session, run_id=run.id, after=None, since=None, limit=EVENTS_SHOWN)
    return {
        "run_id": run.id,
        "step": run.step,
        "max_steps": RunConfig.model_validate(run.config).max_steps,
        "status": run.status,
        "reward": reward,
        "loss": loss,
        "events": events,
        "cursor": position.encode() if position else "",
    }


def _chart_items(session: Session, *, run_id: str) -> list[MetricsItem]:
    items, _ = metrics_page(session, run_id=run_id, since_step=0, limit=CHART_STEPS)
    return items


def cursor_of(txid: int, event_id: int) -> str:
    return FeedPosition(txid, event_id).encode()


@dataclass(frozen=True)
class PoolRow:
    pool: Pool
    used: int


def pools(session: Session, *, live_only: bool = True) -> list[PoolRow]:
    stmt = select(Pool).order_by(Pool.base_model, Pool.registered_at.desc())
    if live_only:
        stmt = stmt.where(Pool.status == PoolStatus.ALIVE)
    active = dict(
        session.execute(
            select(Run.base_model, func.count())
            .where(Run.status == RunStatus.ACTIVE)
            .group_by(Run.base_model)
        )
        .tuples()
        .all()
    )
    return [
        PoolRow(p, active.get(p.base_model, 0) if p.status == PoolStatus.ALIVE else 0)
        for p in session.scalars(stmt)
    ]


@dataclass(frozen=True)
class TenantRow:
    tenant: Tenant
    runs: int
    active: int


def tenants(session: Session) -> list[TenantRow]:
    counts = session.execute(
        select(Run.tenant_id, func.count(), func.count().filter(Run.status == RunStatus.ACTIVE)).group_by(
            Run.tenant_id
        )
    ).tuples()
    by_tenant = {t: (n, a) for t, n, a in counts}
    return [
        TenantRow(t, *by_tenant.get(t.id, (0, 0)))
        for t in session.scalars(select(Tenant).order_by(Tenant.created_at))
    ]
