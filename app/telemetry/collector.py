"""Families read from the database at scrape time (see __init__ for why)."""

import logging
from collections.abc import Iterator
from datetime import datetime

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.adapters.models import StepMetrics
from app.batches.models import Batch
from app.db import utcnow
from app.pools.models import Pool
from app.runs.models import Run
from app.telemetry.purged import PURGED_BATCH_BYTES, PURGED_BATCHES, PURGED_RUNS, PURGED_STEPS, purged_totals
from app.timestamps import as_utc
from contracts.status import BatchState, PoolStatus, RunStatus

log = logging.getLogger(__name__)

OTHER_MODEL = "<other>"
"""The base_model label of runs for a base model no pool ever registered (tenant-chosen strings)."""

POOL_FIGURES = {
    "tokens_per_s": (
        "loraloom_pool_tokens_per_second",
        "Tokens the pool trained per second in its latest step.",
    ),
    "step_time_s": ("loraloom_pool_step_seconds", "Duration of the pool's latest reported run step."),
    "pack_efficiency": (
        "loraloom_pool_pack_efficiency",
        "Real tokens / packed row capacity (padding excluded) of the pool's latest step, 0..1.",
    ),
    "mfu": ("loraloom_pool_mfu", "Model FLOPs utilisation of the pool's latest step (GPU pools), 0..1."),
}


class DatabaseCollector(Collector):
    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("loraloom_database_up", "1 if the scrape could read the database.")
        try:
            with self.factory() as session:
                if session.get_bind().dialect.name == "postgresql":
                    # One snapshot for every count: the purge committing between the purged totals
                    # and a row count would show a counter below its last scrape (a reset to
                    # Prometheus). SQLite's read transaction is one snapshot already.
                    session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
                families = list(_families(session))
        except Exception as exc:  # the scrape still answers: request metrics, and database_up 0
            log.warning("metrics: database unreadable: %s", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families


def _families(session: Session) -> Iterator[Metric]:
    pools = list(session.scalars(select(Pool).order_by(Pool.registered_at)))
    known_models = sorted({p.base_model for p in pools})
    live = {p.base_model: p for p in pools if p.status == PoolStatus.ALIVE}

    def model_label(base_model: str) -> str:
        return base_model if base_model in known_models else OTHER_MODEL

    runs = GaugeMetricFamily("loraloom_runs", "Runs by state.", labels=["state"])
    by_state = dict(session.execute(select(Run.status, func.count()).group_by(Run.status)).tuples().all())
    for state in RunStatus:
        runs.add_metric([state.value], by_state.get(state.value, 0))
    yield runs

    # Counters: the rows left plus what the retention purge deleted (never down, app/telemetry/purged.py).
    purged = purged_totals(session)
    created = CounterMetricFamily(
        "loraloom_runs_created", "Runs created (any state, deleted and purged included)."
    )
    created.add_metric([], sum(by_state.values()) + purged.get(PURGED_RUNS, 0))
    yield created

    count, size = session.execute(select(func.count(), func.coalesce(func.sum(Batch.payload_bytes), 0))).one()
    batches = CounterMetricFamily("loraloom_batches_ingested", "Rollout batches accepted.")
    batches.add_metric([], count + purged.get(PURGED_BATCHES, 0))
    yield batches
    nbytes = CounterMetricFamily("loraloom_batch_bytes_ingested", "Bytes of rollout batch payloads accepted.")
    nbytes.add_metric([], size + purged.get(PURGED_BATCH_BYTES, 0))
    yield nbytes

    steps = CounterMetricFamily("loraloom_steps_trained", "Run steps the trainer reported.")
    reported = session.scalar(select(func.count()).select_from(StepMetrics)) or 0
    steps.add_metric([], reported + purged.get(PURGED_STEPS, 0))
    yield steps

    queue = GaugeMetricFamily(
        "loraloom_batches_queued",
        "Batches waiting (pending) or being trained (claimed), by base model.",
        labels=["base_model", "state"],
    )
    rows = session.execute(
        select(Run.base_model, Batch.state, func.count())
        .join(Run, Run.id == Batch.run_id)
        .where(Batch.state.in_([BatchState.PENDING, BatchState.CLAIMED]))
        .group_by(Run.base_model, Batch.state)
    ).tuples()
    totals: dict[tuple[str, str], int] = {
        (m, s.value): 0 for m in known_models for s in (BatchState.PENDING, BatchState.CLAIMED)
    }
    for base_model, batch_state, n in rows:
        key = (model_label(base_model), batch_state)
        totals[key] = totals.get(key, 0) + n
    for (base_model, batch_state), n in sorted(totals.items()):
        queue.add_metric([base_model, batch_state], n)
    yield queue

    active = dict(
        session.execute(
            select(Run.base_model, func.count())
            .where(Run.status == RunStatus.ACTIVE)
            .group_by(Run.base_model)
        )
        .tuples()
        .all()
    )
    used = GaugeMetricFamily(
        "loraloom_pool_slots_used", "Slots of a live pool held by active runs.", labels=["base_model", "pool"]
    )
    free = GaugeMetricFamily(
        "loraloom_pool_slots_free",
        "Slots of a live pool free for queued runs.",
        labels=["base_model", "pool"],
    )
    for base_model, pool in sorted(live.items()):
        n = active.get(base_model, 0)
        used.add_metric([base_model, pool.id], n)
        free.add_metric([base_model, pool.id], max(pool.slots - n, 0))
    yield used
    yield free

    now = utcnow()
    alive = GaugeMetricFamily(
        "loraloom_pool_up", "1 while a live pool serves the base model.", labels=["base_model"]
    )
    age = GaugeMetricFamily(
        "loraloom_pool_heartbeat_age_seconds",
        "Seconds since the live pool's last heartbeat.",
        labels=["base_model"],
    )
    for base_model in known_models:
        serving = live.get(base_model)
        alive.add_metric([base_model], 1 if serving else 0)
        if serving is not None:
            age.add_metric([base_model], _age(now, serving.last_heartbeat_at))
    yield alive
    yield age

    figures = {
        name: GaugeMetricFamily(metric, doc, labels=["base_model"])
        for name, (metric, doc) in POOL_FIGURES.items()
    }
    for base_model in live:
        latest = session.scalar(
            select(StepMetrics.values)
            .join(Run, Run.id == StepMetrics.run_id)
            .where(Run.base_model == base_model)
            .order_by(StepMetrics.created_at.desc(), StepMetrics.id.desc())
            .limit(1)
        )
        for name, family in figures.items():
            value = (latest or {}).get(name)
            if isinstance(value, int | float):
                family.add_metric([base_model], float(value))
    yield from figures.values()


def _age(now: datetime, then: datetime) -> float:
    return max((now - as_utc(then)).total_seconds(), 0.0)
