"""What Tinker sessions leave behind is purged after a retention (hostile probe 2, finding 11): each
create + finish of a session added a row for ever (85 a second from one tenant), and every
`create_sampling_session` with a model path added another. `purge_finished_sessions` deletes, a
chunk at a time, the sessions finished (or silent) before the retention that own no model, and the
sampling sessions of runs that left; a sampling session is reused for the same weights."""

from datetime import datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app import sweeper
from app.config import Settings
from app.db import utcnow
from app.runs.models import Run
from app.tinker.models import TinkerModel, TinkerSamplingSession, TinkerSession
from app.tinker.service import SESSION_SILENT_SECONDS, SessionsPurged, purge_finished_sessions
from contracts.ids import new_id
from contracts.status import RunStatus
from tests.app.api import WORKER_HEADERS, TenantHandle, register
from tests.app.test_tinker_work import _model

DAY = 86_400.0


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The app's own sweeper (every 2 s in the background) keeps Tinker sessions for ever here: it
    purged the rows these tests purge by hand when its tick fell between their setup and their call
    (chunks of [2, 2, 0] for [2, 2, 1]; a sweep finding 0 for 1), on a slow machine."""
    return settings.model_copy(update={"tinker_session_retention_seconds": 0.0})


def _session(db: Session, tenant_id: str, *, heartbeat: datetime, finished: datetime | None) -> str:
    row = TinkerSession(
        id=new_id("ses"),
        tenant_id=tenant_id,
        sdk_version="t",
        last_heartbeat_at=heartbeat,
        finished_at=finished,
    )
    db.add(row)
    return row.id


def _sampling(db: Session, tenant_id: str, run_id: str, *, created: datetime) -> str:
    row = TinkerSamplingSession(
        id=new_id("smp"),
        tenant_id=tenant_id,
        run_id=run_id,
        step=1,
        model_path="tinker://m/sampler_weights/x",
    )
    row.created_at = created
    db.add(row)
    return row.id


def _left(db: Session, table: type[TinkerSession] | type[TinkerSamplingSession], ids: list[str]) -> set[str]:
    db.expire_all()
    return set(db.scalars(select(table.id).where(table.id.in_(ids))))


def _model_run(client: TestClient, db: Session, tenant: TenantHandle) -> tuple[str, str, str]:
    """(model id, its session's id, its run's id)."""
    model_id, _ = _model(client, tenant)
    model = db.get(TinkerModel, model_id)
    assert model is not None
    ids = (model_id, model.session_id, model.run_id)
    db.rollback()  # ends the transaction: on SQLite it holds the database's write lock
    return ids


def test_finished_and_silent_sessions_without_models_and_samplers_of_left_runs_go(client, tenant, db):
    now = utcnow()
    old, recent = now - timedelta(days=2), now - timedelta(minutes=10)
    model_id, model_session, run_id = _model_run(client, tenant=tenant, db=db)
    _, _, left_run = _model_run(client, tenant=tenant, db=db)
    db.execute(update(TinkerSession).where(TinkerSession.id == model_session).values(finished_at=old))
    db.execute(update(Run).where(Run.id == left_run).values(status=RunStatus.EVICTED))
    doomed = {
        "finished long ago": _session(db, tenant.id, heartbeat=old, finished=old),
        "silent long ago": _session(db, tenant.id, heartbeat=old, finished=None),
    }
    kept = {
        "finished lately": _session(db, tenant.id, heartbeat=recent, finished=recent),
        "live": _session(db, tenant.id, heartbeat=now, finished=None),
        "owns a model": model_session,
    }
    doomed_samplers = [_sampling(db, tenant.id, left_run, created=old)]
    kept_samplers = [
        _sampling(db, tenant.id, run_id, created=old),
        _sampling(db, tenant.id, left_run, created=now),
    ]
    db.commit()

    assert purge_finished_sessions(db, now=now, retention_seconds=DAY) == SessionsPurged(
        sessions=2, sampling_sessions=1, more=False
    )
    db.commit()
    sessions = [*doomed.values(), *kept.values()]
    assert _left(db, TinkerSession, sessions) == set(kept.values())
    assert _left(db, TinkerSamplingSession, doomed_samplers + kept_samplers) == set(kept_samplers)
    assert db.get(TinkerModel, model_id) is not None  # the model (and its run) untouched
    db.rollback()
    # Nothing more is due; a purged session is a 404, like one never made.
    assert purge_finished_sessions(db, now=now, retention_seconds=DAY) == SessionsPurged()
    db.commit()
    headers = {"X-API-Key": "tml-" + tenant.key}
    gone = client.post(
        "/api/v1/session_heartbeat", json={"session_id": doomed["silent long ago"]}, headers=headers
    )
    assert gone.status_code == 404, gone.text
    live = client.post("/api/v1/session_heartbeat", json={"session_id": kept["live"]}, headers=headers)
    assert live.status_code == 200, live.text


def test_a_short_retention_never_takes_a_session_that_may_still_beat(client, tenant, db):
    now = utcnow()
    paused = _session(
        db, tenant.id, heartbeat=now - timedelta(seconds=SESSION_SILENT_SECONDS / 2), finished=None
    )
    done = _session(
        db, tenant.id, heartbeat=now - timedelta(seconds=120), finished=now - timedelta(seconds=120)
    )
    db.commit()
    assert purge_finished_sessions(db, now=now, retention_seconds=60).sessions == 1
    db.commit()
    assert _left(db, TinkerSession, [paused, done]) == {paused}
    db.rollback()
    assert purge_finished_sessions(db, now=now, retention_seconds=0) == SessionsPurged()  # 0: keep for ever


def test_the_purge_goes_a_chunk_at_a_time(client, tenant, db):
    now = utcnow()
    old = now - timedelta(days=2)
    made = [_session(db, tenant.id, heartbeat=old, finished=old) for _ in range(5)]
    db.commit()
    chunks = []
    while True:
        out = purge_finished_sessions(db, now=now, retention_seconds=DAY, chunk=2)
        db.commit()
        chunks.append(out.sessions)
        if not out.more:
            break
        assert len(chunks) < 10
    assert chunks == [2, 2, 1]
    assert _left(db, TinkerSession, made) == set()


def test_a_sampling_session_is_reused_for_the_same_weights(client, tenant, db):
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    r = client.post(
        "/api/v1/save_weights_for_sampler",
        json={"model_id": model_id, "seq_id": 1, "path": "w"},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    (item,) = client.post("/v1/pool/manual/claim", json={"pool_id": pool_id}, headers=WORKER_HEADERS).json()[
        "items"
    ]
    result = {"request_id": item["request_id"], "metrics": {"step": 1}}
    client.post(
        "/v1/pool/manual/results", json={"pool_id": pool_id, "results": [result]}, headers=WORKER_HEADERS
    )
    path = f"tinker://{model_id}/sampler_weights/w"
    ids = set()
    for _ in range(5):
        r = client.post("/api/v1/create_sampling_session", json={"model_path": path}, headers=headers)
        assert r.status_code == 200, r.text
        ids.add(r.json()["sampling_session_id"])
    assert len(ids) == 1
    db.expire_all()
    assert db.scalar(select(func.count()).select_from(TinkerSamplingSession)) == 1
    db.rollback()  # ends the transaction: on SQLite it holds the database's write lock
    info = client.get(f"/api/v1/samplers/{ids.pop()}", headers=headers)
    assert info.status_code == 200 and info.json()["model_path"] == path


def test_the_sweeper_runs_the_purge(client, tenant, db, settings):
    """Wired into the sweeper (app/sweeper.py), with the setting's retention."""
    now = utcnow()
    old = _session(db, tenant.id, heartbeat=now - timedelta(days=3), finished=now - timedelta(days=3))
    recent = _session(db, tenant.id, heartbeat=now, finished=now)
    db.commit()
    with_retention = settings.model_copy(update={"tinker_session_retention_seconds": DAY})
    result = sweeper.sweep_once(client.app.state.session_factory, settings=with_retention, now=now)
    assert result.errors == [] and result.purged_tinker_sessions == 1
    assert _left(db, TinkerSession, [old, recent]) == {recent}
