"""When a live event stream has nothing more to wait for: its run was deleted, and the viewer has
had the deletion (or never will: filtered out by `since`, purged). A deleted run's feed never grows
again, so such a stream only polled, for up to an hour, holding one of the tenant's event-stream
places (and an EventSource reopened it whenever it ended)."""

from datetime import datetime

from sqlalchemy import ColumnElement, select, true
from sqlalchemy.orm import Session

from app.events.feed import FeedPosition
from app.events.models import Event
from app.runs.models import Run
from contracts.status import RunStatus

DELETION_ACTION = "run.deleted"
"""The last event of a run's feed, recorded by app/runs/service.py delete_run: a stream ends once it
sent it."""


def deletion_delivered(
    session: Session, *, run_id: str, after: FeedPosition | None, since: datetime | None
) -> bool:
    """Whether a stream at `after` (filtered by `since`) has nothing more to deliver: the run is
    deleted and its `run.deleted` event lies at or before `after`, or before `since`, or was
    purged (event retention); or the run itself was purged.

    Position, not status alone: on Postgres the run's status reads `deleted` as soon as the deletion
    commits, while its event is served only once every older transaction has ended
    (app/events/feed.py), so "deleted and nothing new" could end a stream before the deletion it
    should deliver. Deletion and event commit together, so a run read as deleted has its event
    visible here unless the event was purged."""
    status = session.scalar(select(Run.status).where(Run.id == run_id))
    if status is None:
        return True  # purged with its events: the reconnect is a 404
    if status != RunStatus.DELETED:
        return False
    # Compared by the database, as the feed filters `since` (SQLite hands back naive datetimes).
    shown: ColumnElement[bool] = true() if since is None else Event.at >= since
    deletion = session.execute(
        select(Event.txid, Event.id, shown.label("shown"))
        .where(Event.run_id == run_id, Event.action == DELETION_ACTION)
        .order_by(Event.txid.desc(), Event.id.desc())
        .limit(1)
    ).first()
    if deletion is None or not deletion.shown:
        return True  # purged by the event retention, or before `since`: it will never be sent
    return after is not None and (deletion.txid, deletion.id) <= (after.txid, after.id)
