"""The retention purge (app/retention.py, run by the sweeper): a deleted run goes, past
`deleted_run_retention_seconds` after its deletion, with every row about it; events go past
`event_retention_seconds`; both a bounded chunk per transaction, two sweepers at once included; and
what clients hold (an Idempotency-Key, a run list cursor, a feed cursor or Last-Event-ID) still works.

The app under test keeps everything (both retentions 0, so its own background sweeper purges
nothing); the tests sweep with the retentions on (`keep`)."""

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import func, or_, select, text, update
from sqlalchemy.dialects.postgresql import asyncpg
from sqlalchemy.orm import Session, sessionmaker

from app import sweeper
from app.adapters.models import Adapter, Checkpoint, StepMetrics
from app.batches.models import Batch
from app.config import Settings
from app.db import make_engine, make_session_factory
from app.events.models import Event
from app.events.service import record_event
from app.retention import RunsPurged, due_runs_query, purge_deleted_runs
from app.rollouts.models import RolloutStats
from app.runs.models import Run
from app.tinker.models import TinkerFuture, TinkerModel, TinkerSamplingSession, TinkerSession
from contracts.ids import new_id
from tests.app.api import TenantHandle, create_run
from tests.app.factories import committed, make_run, make_tenant
from tests.common import backend_under_test

DAY = 86_400.0
RUN_RETENTION = 7 * DAY
EVENT_RETENTION = 30 * DAY


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The suite's settings (tests/conftest.py), with both retentions off for the app itself."""
    return settings.model_copy(update={"deleted_run_retention_seconds": 0, "event_retention_seconds": 0})


@pytest.fixture
def keep(settings: Settings) -> Settings:
    """The settings the tests sweep with: the defaults' retentions."""
    return settings.model_copy(
        update={"deleted_run_retention_seconds": RUN_RETENTION, "event_retention_seconds": EVENT_RETENTION}
    )


@pytest.fixture
def factory(settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    engine.dispose()


# --------------------------------------------------------------------------- rows about a run


def leave_rows(session: Session, *, run_id: str, tenant_id: str, n: int = 2) -> str:
    """`n` rows of every kind that names the run (and one Tinker model of it, with its creation
    record and a sampling session); returns the Tinker model's id."""
    now = datetime.now(UTC)
    for i in range(n):
        session.add(
            Batch(
                run_id=run_id,
                idempotency_key=f"key-{i}",
                request_hash="0" * 64,
                rollout_step=i,
                num_samples=1,
                num_tokens=8,
                sample_offset=i,
                payload_path=f"runs/{run_id}/rollouts/{i}.msgpack",
                payload_bytes=1,
                payload_sha256="0" * 64,
                state="trained",
            )
        )
        session.add(StepMetrics(run_id=run_id, step=i + 1, values={"loss": 1.0}))
        session.add(
            Adapter(
                run_id=run_id,
                step=i + 1,
                path=f"runs/{run_id}/broadcast/step_{i + 1}",
                size_bytes=1,
                sha256="0" * 64,
            )
        )
        session.add(Checkpoint(run_id=run_id, step=i + 1, total_samples=i))
        session.add(RolloutStats(run_id=run_id, rollout_step=i))
        record_event(session, action="test.row", actor="system", tenant_id=tenant_id, run_id=run_id)
    owner = TinkerSession(id=new_id("ses"), tenant_id=tenant_id, sdk_version="test")
    session.add(owner)
    session.flush()
    model_id = f"{owner.id}:train:0"
    session.add(
        TinkerModel(id=model_id, tenant_id=tenant_id, session_id=owner.id, model_seq_id=0, run_id=run_id)
    )
    # The creation record names the model only (no run_id), as app.tinker.service.complete_future writes it.
    session.add(
        TinkerFuture(
            id=new_id("req"),
            tenant_id=tenant_id,
            kind="create_model",
            model_id=model_id,
            status="complete",
            result={"model_id": model_id},
            completed_at=now,
        )
    )
    for seq_id in range(1, n + 1):
        session.add(
            TinkerFuture(
                id=new_id("req"),
                tenant_id=tenant_id,
                kind="forward_backward",
                model_id=model_id,
                seq_id=seq_id,
                run_id=run_id,
                status="complete",
                result={"loss": 1.0},
                completed_at=now,
            )
        )
    session.add(
        TinkerSamplingSession(
            id=new_id("smp"), tenant_id=tenant_id, run_id=run_id, step=1, model_path=f"tinker://{model_id}/x"
        )
    )
    session.flush()
    return model_id


def rows_about(session: Session, run_id: str, model_id: str) -> dict[str, int]:
    """Rows naming the run (or its Tinker model), per table."""

    def count(model: Any, *where: Any) -> int:
        return session.scalar(select(func.count()).select_from(model).where(*where)) or 0

    return {
        "runs": count(Run, Run.id == run_id),
        "batches": count(Batch, Batch.run_id == run_id),
        "step_metrics": count(StepMetrics, StepMetrics.run_id == run_id),
        "adapters": count(Adapter, Adapter.run_id == run_id),
        "checkpoints": count(Checkpoint, Checkpoint.run_id == run_id),
        "rollout_stats": count(RolloutStats, RolloutStats.run_id == run_id),
        "events": count(Event, Event.run_id == run_id),
        "tinker_futures": count(
            TinkerFuture, or_(TinkerFuture.run_id == run_id, TinkerFuture.model_id == model_id)
        ),
        "tinker_models": count(TinkerModel, TinkerModel.run_id == run_id),
        "tinker_sampling_sessions": count(TinkerSamplingSession, TinkerSamplingSession.run_id == run_id),
    }


def deleted_at(settings: Settings, run_id: str, when: datetime) -> None:
    """Move the run's deletion (its row's updated_at) to `when`."""
    with committed(settings) as s:
        s.execute(update(Run).where(Run.id == run_id, Run.status == "deleted").values(updated_at=when))


def delete(client: TestClient, tenant: TenantHandle, run_id: str) -> None:
    r = client.delete(f"/v1/runs/{run_id}", headers=tenant.headers)
    assert r.status_code == 200, r.text


def nothing_left(counts: dict[str, int]) -> bool:
    return set(counts.values()) == {0}


# --------------------------------------------------------------------------- the purge


def test_a_deleted_run_goes_with_every_row_about_it_and_the_rest_stays(
    client: TestClient, tenant: TenantHandle, settings: Settings, keep: Settings, factory
) -> None:
    old = create_run(client, tenant, name="old")["id"]
    live = create_run(client, tenant, name="live")["id"]
    with committed(settings) as s:
        models = {run: leave_rows(s, run_id=run, tenant_id=tenant.id) for run in (old, live)}
    delete(client, tenant, old)
    recent = create_run(client, tenant, name="recent")["id"]
    with committed(settings) as s:
        models[recent] = leave_rows(s, run_id=recent, tenant_id=tenant.id)
    delete(client, tenant, recent)

    now = datetime.now(UTC)
    deleted_at(settings, old, now - timedelta(seconds=RUN_RETENTION + 60))
    deleted_at(settings, recent, now - timedelta(seconds=RUN_RETENTION - 3600))
    with committed(settings) as s:  # the live run's rows from a month ago; its lifecycle events are new
        s.execute(
            update(Event)
            .where(Event.run_id == live, Event.action == "test.row")
            .values(at=now - timedelta(seconds=EVENT_RETENTION + 60))
        )
        before = {run: rows_about(s, run, model) for run, model in models.items()}
    assert not any(nothing_left(counts) for counts in before.values())
    assert before[old]["events"] > 2  # created, deleted and its rows'

    result = sweeper.sweep_once(factory, settings=keep, now=now)

    assert result.errors == []
    assert result.purged_runs == [old]
    assert result.purged_run_rows == sum(before[old].values())
    assert result.purged_events == 2  # the live run's month-old ones
    with committed(settings) as s:
        after = {run: rows_about(s, run, model) for run, model in models.items()}
    assert nothing_left(after[old]), after[old]
    assert after[recent] == before[recent]
    assert after[live] == before[live] | {"events": before[live]["events"] - 2}
    assert client.get(f"/v1/runs/{old}", headers=tenant.headers).status_code == 404
    assert client.get(f"/v1/runs/{recent}", headers=tenant.headers).json()["status"] == "deleted"
    assert client.get(f"/v1/runs/{live}", headers=tenant.headers).json()["status"] == "active"

    again = sweeper.sweep_once(factory, settings=keep, now=now)
    assert (again.errors, again.purged_runs, again.purged_run_rows, again.purged_events) == ([], [], 0, 0)


def test_retention_zero_keeps_everything(settings: Settings, keep: Settings, factory) -> None:
    """The app's own settings here: both retentions 0."""
    with committed(settings) as s:
        tenant, _ = make_tenant(s)
        run = make_run(s, tenant, status="deleted")
        model = leave_rows(s, run_id=run.id, tenant_id=tenant.id)
    long_ago = datetime.now(UTC) - timedelta(days=3650)
    deleted_at(settings, run.id, long_ago)
    with committed(settings) as s:
        s.execute(update(Event).values(at=long_ago))
        before = rows_about(s, run.id, model)

    result = sweeper.sweep_once(factory, settings=settings)
    assert (result.errors, result.purged_runs, result.purged_events) == ([], [], 0)
    with committed(settings) as s:
        assert rows_about(s, run.id, model) == before


def _total_rows(session: Session) -> int:
    return sum(
        session.scalar(select(func.count()).select_from(model)) or 0
        for model in (
            Run,
            Batch,
            StepMetrics,
            Adapter,
            Checkpoint,
            RolloutStats,
            Event,
            TinkerFuture,
            TinkerModel,
            TinkerSamplingSession,
        )
    )


def test_the_purge_goes_a_bounded_chunk_a_transaction(
    settings: Settings, keep: Settings, factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunk = 3
    with committed(settings) as s:
        tenant, _ = make_tenant(s)
        runs = [make_run(s, tenant, status="deleted") for _ in range(4)]
        models = {run.id: leave_rows(s, run_id=run.id, tenant_id=tenant.id, n=3) for run in runs}
        live = make_run(s, tenant, status="active")
        for _ in range(7):
            record_event(s, action="test.old", actor="system", tenant_id=tenant.id, run_id=live.id)
    now = datetime.now(UTC)
    for run in runs:
        deleted_at(settings, run.id, now - timedelta(seconds=RUN_RETENTION + 60))
    with committed(settings) as s:
        s.execute(
            update(Event)
            .where(Event.action == "test.old")
            .values(at=now - timedelta(seconds=EVENT_RETENTION + 60))
        )
        # On SQLite the newest event stays (app/retention.py): let it be one that is not purged.
        record_event(s, action="test.new", actor="system", tenant_id=tenant.id, run_id=live.id)
        doomed_rows = sum(sum(rows_about(s, run, model).values()) for run, model in models.items())

    chunks: list[tuple[RunsPurged, int]] = []
    real = purge_deleted_runs

    def counted(session: Session, **kwargs: Any) -> RunsPurged:
        before = _total_rows(session)
        out = real(session, **kwargs)
        chunks.append((out, before - _total_rows(session)))  # counted apart from what it reports
        return out

    monkeypatch.setattr(sweeper, "purge_deleted_runs", counted)
    monkeypatch.setattr(sweeper, "MAX_PURGE_CHUNKS", 4)  # a sweep stops after 4 chunks, the next goes on

    first = sweeper.sweep_once(factory, settings=keep, now=now, purge_chunk=chunk)
    assert first.errors == []
    assert len(chunks) == 4
    assert first.purged_run_rows == 4 * chunk
    assert first.purged_events == 7  # in chunks of its own: 3, 3, 1
    results = [first]
    while results[-1].purged_run_rows or results[-1].purged_events:
        results.append(sweeper.sweep_once(factory, settings=keep, now=now, purge_chunk=chunk))
        assert results[-1].errors == []
        assert len(results) < 20
    assert len(chunks) >= doomed_rows // chunk
    assert all(deleted == out.rows <= chunk for out, deleted in chunks), chunks
    assert sum(out.rows for out, _ in chunks) == doomed_rows
    assert sorted(run for r in results for run in r.purged_runs) == sorted(models)
    assert sum(r.purged_events for r in results) == 7
    with committed(settings) as s:
        assert all(nothing_left(rows_about(s, run, model)) for run, model in models.items())
        assert s.get(Run, live.id) is not None
        assert s.scalar(select(func.count()).select_from(Event).where(Event.run_id == live.id)) == 1


def test_two_sweepers_at_once_split_the_work_without_errors(settings: Settings, keep: Settings) -> None:
    """Two service processes (an engine each) sweeping the same backlog at the same moment."""
    with committed(settings) as s:
        tenant, _ = make_tenant(s)
        runs = [make_run(s, tenant, status="deleted") for _ in range(12)]
        models = {run.id: leave_rows(s, run_id=run.id, tenant_id=tenant.id, n=4) for run in runs}
        live = make_run(s, tenant, status="active")
        for _ in range(60):
            record_event(s, action="test.old", actor="system", tenant_id=tenant.id, run_id=live.id)
    now = datetime.now(UTC)
    for run in runs:
        deleted_at(settings, run.id, now - timedelta(seconds=RUN_RETENTION + 60))
    with committed(settings) as s:
        s.execute(
            update(Event)
            .where(Event.action == "test.old")
            .values(at=now - timedelta(seconds=EVENT_RETENTION + 1))
        )
        record_event(s, action="test.new", actor="system", tenant_id=tenant.id, run_id=live.id)

    start = threading.Barrier(2)
    results: list[list[sweeper.SweepResult]] = [[], []]
    failures: list[BaseException] = []

    def sweep(mine: list[sweeper.SweepResult]) -> None:
        engine = make_engine(settings.database_url)
        try:
            own = make_session_factory(engine)
            start.wait()
            while True:
                result = sweeper.sweep_once(own, settings=keep, now=now, purge_chunk=5)
                mine.append(result)
                if result.errors or not (result.purged_run_rows or result.purged_events):
                    return
        except BaseException as exc:  # surfaced below, not lost in the thread
            failures.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=sweep, args=(mine,)) for mine in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    assert [r.errors for mine in results for r in mine if r.errors] == []
    purged = [[run for r in mine for run in r.purged_runs] for mine in results]
    assert not set(purged[0]) & set(purged[1])  # no run purged twice
    assert sorted(purged[0] + purged[1]) == sorted(models)
    assert sum(r.purged_events for mine in results for r in mine) == 60
    with committed(settings) as s:
        assert all(nothing_left(rows_about(s, run, model)) for run, model in models.items())
        assert s.scalar(select(func.count()).select_from(Event).where(Event.run_id == live.id)) == 1


# --------------------------------------------------------------------------- what clients hold


def _feed(
    client: TestClient,
    tenant: TenantHandle,
    run_id: str,
    *,
    params: Any = None,
    last_event_id: str | None = None,
) -> dict[str, Any]:
    resume = {"Last-Event-ID": last_event_id} if last_event_id else {}
    r = client.get(f"/v1/runs/{run_id}/events", params=params, headers=tenant.headers | resume)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_a_feed_cursor_naming_a_purged_event_goes_on_from_the_next_one(
    client: TestClient, tenant: TenantHandle, settings: Settings, keep: Settings, factory
) -> None:
    run = create_run(client, tenant)["id"]
    with committed(settings) as s:
        for i in range(4):
            record_event(s, action=f"test.{i}", actor="system", tenant_id=tenant.id, run_id=run)
    everything = _feed(client, tenant, run)["items"]
    actions = [e["action"] for e in everything]
    assert actions[-4:] == ["test.0", "test.1", "test.2", "test.3"]
    # A client has read up to test.1; test.0 .. test.2 then age past the retention.
    cursor = everything[len(actions) - 3]["cursor"]
    now = datetime.now(UTC)
    with committed(settings) as s:
        s.execute(
            update(Event)
            .where(Event.run_id == run, Event.action.in_(("test.0", "test.1", "test.2")))
            .values(at=now - timedelta(seconds=EVENT_RETENTION + 60))
        )
    assert sweeper.sweep_once(factory, settings=keep, now=now).purged_events == 3

    after_cursor = _feed(client, tenant, run, params={"cursor": cursor})
    assert [e["action"] for e in after_cursor["items"]] == ["test.3"]
    resumed = _feed(client, tenant, run, last_event_id=cursor)
    assert [e["action"] for e in resumed["items"]] == ["test.3"]
    since = _feed(client, tenant, run, params={"since": (now - timedelta(days=400)).isoformat()})
    assert [e["action"] for e in since["items"]] == actions[:-4] + ["test.3"]


def test_a_cursor_at_the_newest_event_still_sees_the_next_one_after_everything_was_purged(
    client: TestClient, tenant: TenantHandle, settings: Settings, keep: Settings, factory
) -> None:
    """SQLite numbers a new row after the largest id left in its table: had the purge deleted the
    newest event, the next one would reuse an id a cursor already holds, and that cursor skip it."""
    run = create_run(client, tenant)["id"]
    with committed(settings) as s:
        for i in range(3):
            record_event(s, action=f"test.{i}", actor="system", tenant_id=tenant.id, run_id=run)
    page = _feed(client, tenant, run)
    cursor = page["next_cursor"]
    assert page["items"][-1]["action"] == "test.2"
    now = datetime.now(UTC)
    with committed(settings) as s:
        s.execute(update(Event).values(at=now - timedelta(seconds=EVENT_RETENTION + 60)))
        total = s.scalar(select(func.count()).select_from(Event)) or 0
    purged = sweeper.sweep_once(factory, settings=keep, now=now).purged_events
    assert purged == (total - 1 if backend_under_test() == "sqlite" else total)

    with committed(settings) as s:
        record_event(s, action="test.next", actor="system", tenant_id=tenant.id, run_id=run)
    assert [e["action"] for e in _feed(client, tenant, run, params={"cursor": cursor})["items"]] == [
        "test.next"
    ]


def test_a_purged_run_is_gone_for_its_key_and_its_list_cursor(
    client: TestClient, tenant: TenantHandle, settings: Settings, keep: Settings, factory
) -> None:
    """Before the purge an Idempotency-Key sent again answers the deleted run; after it, the key makes a
    new run (the retention is at least a day, far past any retry). A run list cursor naming the purged
    run goes on with the next one."""
    first = create_run(client, tenant, name="first")["id"]
    body = {"name": "keyed", "config": {}}
    headers = tenant.headers | {"Idempotency-Key": "create-once"}
    made = client.post("/v1/runs", json=body, headers=headers)
    assert made.status_code == 201, made.text
    keyed = made.json()["id"]
    page = client.get("/v1/runs", params={"limit": 1}, headers=tenant.headers).json()
    assert [r["id"] for r in page["items"]] == [keyed]
    delete(client, tenant, keyed)
    replay = client.post("/v1/runs", json=body, headers=headers)
    assert (replay.status_code, replay.json()["id"], replay.json()["status"]) == (200, keyed, "deleted")

    now = datetime.now(UTC)
    deleted_at(settings, keyed, now - timedelta(seconds=RUN_RETENTION + 60))
    assert sweeper.sweep_once(factory, settings=keep, now=now).purged_runs == [keyed]

    assert client.get(f"/v1/runs/{keyed}", headers=tenant.headers).status_code == 404
    listed = client.get("/v1/runs", params={"cursor": page["next_cursor"]}, headers=tenant.headers)
    assert [r["id"] for r in listed.json()["items"]] == [first]
    again = client.post("/v1/runs", json=body, headers=headers)
    assert again.status_code == 201, again.text
    assert again.json()["id"] != keyed


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("name", "default", "least"),
    [
        ("LORALOOM_DELETED_RUN_RETENTION_SECONDS", 7 * DAY, DAY),
        ("LORALOOM_EVENT_RETENTION_SECONDS", 30 * DAY, 3600.0),
    ],
)
def test_the_retentions_are_read_from_the_environment_and_checked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, default: float, least: float
) -> None:
    field = name.removeprefix("LORALOOM_").lower()
    monkeypatch.delenv(name, raising=False)
    assert getattr(Settings(data_dir=tmp_path), field) == default
    for good in ("0", str(least), "315360000"):
        monkeypatch.setenv(name, good)
        assert getattr(Settings(data_dir=tmp_path), field) == float(good)
    for bad in ("-1", str(least - 1), "1", "1e12", "nan", "soon"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValidationError, match=field):
            Settings(data_dir=tmp_path)


# --------------------------------------------------------------------------- the index (Postgres)


@pytest.mark.postgres_only
def test_the_due_runs_are_read_through_the_partial_index(settings: Settings) -> None:
    """Among 20,000 runs of which 50 are deleted, the purge's query reads the partial index of deleted
    runs, also as a generic plan (psycopg prepares statements run often)."""
    engine = make_engine(settings.database_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO tenants (id, name, max_concurrent_runs, created_at) VALUES ('t', 't', 2, now())"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO runs (id, tenant_id, name, config, base_model, status, step, total_tokens, "
                    "total_samples, submitted_samples, created_at, updated_at) "
                    "SELECT 'run_' || lpad(to_hex(s), 12, '0'), 't', 'r', '{}', 'm', "
                    "CASE WHEN s % 400 = 0 THEN 'deleted' ELSE 'completed' END, 0, 0, 0, 0, "
                    "now() - s * interval '1 minute', now() - s * interval '1 minute' "
                    "FROM generate_series(1, 20000) s"
                )
            )
            conn.execute(text("ANALYZE runs"))
        query = due_runs_query(cutoff=datetime.now(UTC) - timedelta(days=1), chunk=500)
        sql = query.compile(engine, compile_kwargs={"literal_binds": True})
        compiled = query.compile(dialect=asyncpg.dialect(), compile_kwargs={"render_postcompile": True})
        values = ", ".join(
            f"'{v.isoformat()}'" if isinstance(v, datetime) else str(v)
            for v in (compiled.params[name] for name in compiled.positiontup or ())
        )
        with engine.connect() as conn:
            plain = "\n".join(conn.execute(text(f"EXPLAIN {sql}")).scalars())
            conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
            conn.exec_driver_sql(f"PREPARE due AS {compiled}")
            generic = "\n".join(conn.exec_driver_sql(f"EXPLAIN EXECUTE due({values})").scalars())
        for got in (plain, generic):
            assert "ix_runs_deleted_updated_at" in got, got
            assert "Seq Scan on runs" not in got, got
    finally:
        engine.dispose()
