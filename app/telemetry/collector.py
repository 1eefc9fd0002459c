"""Families read from the database at scrape time (see __init__ for why), and the cache that makes
one reading serve every scrape for a few seconds."""

import logging
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from threading import Event, Lock
from typing import Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session, sessionmaker

from app.adapters.models import StepMetrics
from app.batches.claims import ROLLOUT_RUN
from app.batches.models import Batch
from app.db import utcnow
from app.pools.models import Pool
from app.runs.models import Run
from app.telemetry.purged import PURGED_BATCH_BYTES, PURGED_BATCHES, PURGED_RUNS, PURGED_STEPS, purged_totals
from app.timestamps import as_utc
from contracts.status import MOVABLE_RUN_STATUSES, BatchState, PoolStatus, RunStatus

log = logging.getLogger(__name__)

T = TypeVar("T")

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
    """Every database family, read at each `collect` (a dozen counting queries over the runs, batches
    and step tables: tens of milliseconds and one pooled connection each time). The service serves
    them through a `ScrapeCache`, never once per scrape."""

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


STALLED_READING_S = 30.0
"""A reading under way for longer than this (and than the cache's ttl) is taken as stalled (a
database that stopped answering: no statement timeout ends it). The cache then gives up on it and
the next scrape reads again; meanwhile, and while that one is under way too, scrapes get
`database_up 0` alone, as for a database that cannot be read: not figures that stopped changing,
nor a wait without end."""


MAX_WAITING_SCRAPES = 4
"""Scrapes that wait for a reading under way (several workers); past them, a scrape gets the
previous figures at once. /metrics is open by default and its route runs in the thread pool: a flood
of anonymous scrapers, each waiting, would hold every thread other tenants' requests need."""


def database_down() -> list[Metric]:
    """What a scrape answers of a database it cannot read (DatabaseCollector's failure too)."""
    up = GaugeMetricFamily("loraloom_database_up", "1 if the scrape could read the database.")
    up.add_metric([], 0)
    return [up]


class _Reading:
    """One reading under way: `done` is set when it ends; `started` orders it among the others."""

    __slots__ = ("done", "started")

    def __init__(self, started: float) -> None:
        self.done = Event()
        self.started = started


class ScrapeCache(Generic[T]):
    """The database families of the latest reading (or another value: the rendered page), served for
    `ttl_s` seconds after it ended; then the next scrape reads again. One reading at a time (single
    flight), so /metrics costs the database at most one reading per `ttl_s`, however many clients
    scrape (an open /metrics let anonymous clients run these queries as fast as they could send
    requests, slowing every tenant's requests down).

    A scrape that comes while a reading is under way gets the previous reading at once when
    `previous_while_reading` (one process: its answers never go back in time, and a flood of
    scrapers holds no thread); otherwise, and before the first reading ever ended, it waits for that
    reading. Several workers (the multiprocess mode) each have a cache: a worker's previous reading
    may be older than the one another worker just answered, and a counter seen to drop is a reset
    to Prometheus, so there scrapes wait for the fresh reading (a scrape then sees figures at most
    `ttl_s` plus a reading old: monotonic for a scraper whose interval is longer); at most
    MAX_WAITING_SCRAPES of them at once, the others get the previous figures.

    A reading under way past STALLED_READING_S is given up: the next scrape starts another one (at
    most one given-up reading is left running: a database that hangs every connection holds two
    threads, not one per 30 s), and scrapes answer `stalled()` (the database down) until one ends:
    the figures from before the stall are not served again as those of a database that is up.
    Thread-safe: the route runs in a thread pool."""

    def __init__(
        self,
        read: Callable[[], T],
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        stalled: Callable[[], T] | None = None,
        previous_while_reading: bool = True,
    ) -> None:
        self._read = read
        self.ttl_s = ttl_s
        self._clock = clock
        self._stalled: Callable[[], T] = stalled or database_down  # type: ignore[assignment]
        self.previous_while_reading = previous_while_reading
        self._lock = Lock()
        self._latest: T | None = None
        self._latest_started = float("-inf")
        self._fresh_until = 0.0
        self._reading: _Reading | None = None
        self._given_up: _Reading | None = None
        """A stalled reading still running (its thread is not ours to stop)."""
        self._waiting = 0
        """Scrapes waiting for the reading under way (each holds a thread of the pool)."""

    @property
    def stalled_after_s(self) -> float:
        return max(self.ttl_s, STALLED_READING_S)

    def _at_once(self, now: float) -> T | None:
        """What a scrape answers without reading nor waiting, if anything (under the lock)."""
        reading = self._reading
        if reading is not None and now - reading.started > self.stalled_after_s:
            if self._given_up is None or self._given_up.done.is_set():
                self._given_up, self._reading = reading, None  # the next scrape reads again
            return self._stalled()  # (if two readings hang, the database does not answer)
        if self._latest is not None and now < self._fresh_until:
            return self._latest
        if reading is None:
            return None  # this scrape reads
        if self._latest is not None:
            if self._given_up is not None and self._latest_started < self._given_up.started:
                return self._stalled()  # the figures from before a stall are not "up"
            if self.previous_while_reading:
                return self._latest  # the previous figures while the next are being read
        if self._waiting >= MAX_WAITING_SCRAPES:  # no more threads held waiting (none read before: down)
            return self._latest if self._latest is not None else self._stalled()
        return None

    def get(self) -> T:
        while True:
            with self._lock:
                now = self._clock()
                answer = self._at_once(now)
                if answer is not None:
                    return answer
                reading = self._reading
                if reading is None:
                    reading = self._reading = _Reading(now)
                    break  # this scrape reads
                waited = reading.started + self.stalled_after_s - now
                self._waiting += 1
            try:
                ended = reading.done.wait(max(waited, 0.0))
            finally:
                with self._lock:
                    self._waiting -= 1
            if not ended:
                return self._stalled()  # that reading stalled
            with self._lock:
                if self._latest is not None and self._latest_started >= reading.started:
                    return self._latest
            # that reading raised: read ourselves (DatabaseCollector answers a database it cannot
            # read with database_up 0, so this is only for what it does not catch)
        try:
            value = self._read()
            with self._lock:
                if reading.started >= self._latest_started:  # a given-up reading ending late is older
                    self._latest, self._latest_started = value, reading.started
                    self._fresh_until = self._clock() + self.ttl_s
        finally:
            with self._lock:
                if self._reading is reading:
                    self._reading = None
            reading.done.set()
        return value


class CachedCollector(Collector):
    """What a registry collects: the cache's families (the cache lives on app.state, so the
    per-scrape registry of the multiprocess mode shares it)."""

    def __init__(self, cache: "ScrapeCache[list[Metric]]") -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        yield from self.cache.get()


def database_cache(
    factory: sessionmaker[Session], ttl_s: float, previous_while_reading: bool = True
) -> ScrapeCache[list[Metric]]:
    collector = DatabaseCollector(factory)
    return ScrapeCache(
        lambda: list(collector.collect()), ttl_s, previous_while_reading=previous_while_reading
    )


QUEUED_HELP = (
    "Batches by base model and state: pending = stored and still to be trained (batches of queued "
    "and active runs; a deleted, evicted, completed or failed run's pending batches are never "
    "claimed again and are not counted), claimed = leased to a pool until acked or returned."
)


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

    queue = GaugeMetricFamily("loraloom_batches_queued", QUEUED_HELP, labels=["base_model", "state"])
    # Pending: what a pool will still claim (app/batches/claims.py claims only active rollout runs'
    # batches; a queued run's are claimed once it is admitted). A run that leaves keeps its batch
    # rows until the retention purge; they are never trained.
    still_trained = and_(Batch.state == BatchState.PENDING, Run.status.in_(MOVABLE_RUN_STATUSES), ROLLOUT_RUN)
    rows = session.execute(
        select(Run.base_model, Batch.state, func.count())
        .join(Run, Run.id == Batch.run_id)
        .where(or_(Batch.state == BatchState.CLAIMED, still_trained))
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
