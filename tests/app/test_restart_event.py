"""The pool calls the restart route on every admission of a run; a restart that restores nothing
(a fresh run at step 0, or a run resuming exactly where it stood with nothing in flight) used to
record `run.restart_from_checkpoint` all the same, so every new run's feed said it had been
restarted (hostile probe, 2026-11-29). Only a restart that changes something is recorded."""

from sqlalchemy import select

from app.events.models import Event
from app.runs.models import Run
from tests.app.api import ack, batch_body, claim, post_batch, restart
from tests.app.factories import add_pool, committed, seed_run


def _restart_events(settings, run_id: str) -> list[Event]:
    with committed(settings) as session:
        return list(
            session.scalars(
                select(Event).where(Event.run_id == run_id, Event.action == "run.restart_from_checkpoint")
            )
        )


def test_only_a_restart_that_changes_something_is_recorded(settings, client) -> None:
    pool_id = add_pool(settings)
    seeded = seed_run(settings)
    # a fresh run's admission: nothing to restore
    assert restart(client, seeded.run_id, pool_id, 0, 0, 0).json() == {"returned": []}
    assert _restart_events(settings, seeded.run_id) == []

    ids = [post_batch(client, seeded, batch_body(2, seed=i)).json()["id"] for i in range(2)]
    assert len(claim(client, pool_id)["batches"]) == 2
    assert ack(client, pool_id, [(ids[0], 1)]).status_code == 200
    with committed(settings) as session:
        run = session.get_one(Run, seeded.run_id)
        run.step, run.total_samples, run.total_tokens = 1, 2, 50

    # a claimed batch goes back: recorded
    assert restart(client, seeded.run_id, pool_id, 1, 2, 50).json() == {"returned": [ids[1]]}
    (event,) = _restart_events(settings, seeded.run_id)
    assert event.details["returned_batches"] == [ids[1]]
    # exactly where it stands, nothing in flight: not recorded again
    assert restart(client, seeded.run_id, pool_id, 1, 2, 50).json() == {"returned": []}
    assert len(_restart_events(settings, seeded.run_id)) == 1
    # progress set back with nothing returned (a step whose checkpoint was lost): recorded
    with committed(settings) as session:
        session.get_one(Run, seeded.run_id).step = 2
    assert restart(client, seeded.run_id, pool_id, 1, 2, 50).json() == {"returned": []}
    assert len(_restart_events(settings, seeded.run_id)) == 2
