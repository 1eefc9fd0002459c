"""A heartbeat timeout counts from the sweeper's start at the earliest (review, 2026-11-29): while the
service or its database was down (an upgrade running a migration, maintenance) no heartbeat could
land, so the first sweep after a restart longer than a timeout evicted every run and Tinker model
whose client was alive and retrying, before any of them could send its next heartbeat."""

from datetime import timedelta

from sqlalchemy.orm import Session

from app import sweeper
from app.config import Settings
from app.db import make_engine, make_session_factory, utcnow
from app.runs.models import Run
from tests.app.api import create_run, new_tenant, register
from tests.app.test_tinker_queue import TIMEOUT, _heartbeat_at
from tests.app.tinker_calls import new_model, new_session, run_of


def test_nothing_is_silent_until_the_sweeper_has_listened_for_a_whole_timeout(
    client, tenant, db, settings: Settings
) -> None:
    settings = settings.model_copy(update={"tinker_session_timeout_seconds": TIMEOUT})
    engine = make_engine(settings.database_url)
    factory = make_session_factory(engine)
    try:
        run = create_run(client, tenant, heartbeat_timeout=30)
        register(client, slots=4)
        tinker_tenant = new_tenant(client, quota=2)
        session_id = new_session(client, tinker_tenant)
        model = new_model(client, tinker_tenant, session_id=session_id)
        now = utcnow()
        # Both last heard from before an outage longer than either timeout.
        with Session(engine) as s:
            s.get_one(Run, run["id"]).last_heartbeat_at = now - timedelta(seconds=TIMEOUT + 60)
            s.commit()
        _heartbeat_at(db, session_id, now - timedelta(seconds=TIMEOUT + 60))

        restarted = now - timedelta(seconds=5)  # the sweeper started 5 s ago
        first = sweeper.sweep_once(factory, settings=settings, now=now, listening_since=restarted)
        assert first.evicted_runs == [] and first.evicted_tinker_runs == []

        # Still silent a whole timeout after the restart: now they are gone.
        later = restarted + timedelta(seconds=TIMEOUT + 1)
        second = sweeper.sweep_once(factory, settings=settings, now=later, listening_since=restarted)
        assert second.evicted_runs == [run["id"]]
        assert second.evicted_tinker_runs == [run_of(client, tinker_tenant, model)]
    finally:
        engine.dispose()
