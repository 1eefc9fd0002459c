"""A run's events as a feed: oldest first, paged by an opaque cursor, exactly once.

Ids alone cannot be a feed's cursor on Postgres: ids are taken at INSERT, but transactions
commit in any order, so event 9 may become visible after a reader has already moved past 10.
So every event carries its transaction's id (`txid`, from pg_current_xact_id()), the feed is
ordered by (txid, id), and a read serves only events whose transaction is older than the oldest
transaction of this database still running: that prefix can no longer grow, and every later
event sorts after it. The price: an event waits for transactions that began before its own to
finish (milliseconds for this service's short transactions). Only this database's transactions
count (pg_stat_activity, pg_prepared_xacts): a long transaction in another database of a shared
cluster does not hold the feed back. SQLite serialises writers, so there txid is 0 and the order
is the id's.
"""

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, or_, select, text
from sqlalchemy.orm import Session

from app.errors import ValidationFailed
from app.events.models import Event

_NO_HORIZON = 2**63 - 1

MAX_TXID = 2**63 - 1
"""The largest txid a cursor may hold: `events.txid` is a BIGINT."""
MAX_EVENT_ID = 2**31 - 1
"""The largest event id a cursor may hold: `events.id` is an INTEGER, 32 bits on Postgres, which
binds the value as the column's type (past it: "out of range"). SQLite keeps the column as its 64-bit
rowid, but could pass this only after 2**31 events, more than the Postgres column holds at all.
Past these bounds the drivers cannot bind a value: SQLite raised OverflowError (a 500), Postgres
"bigint out of range" (a 500, or a live stream that broke after its 200)."""


@dataclass(frozen=True)
class FeedPosition:
    txid: int
    id: int

    def encode(self) -> str:
        raw = json.dumps([self.txid, self.id], separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, cursor: str, *, field: str = "cursor", where: str = "query") -> "FeedPosition":
        """The position a cursor of `encode` names; a 422 (ValidationFailed, at `where`/`field`) for
        anything else, values out of the columns' range included."""
        try:
            raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
            txid, event_id = json.loads(raw)
            if not all(type(v) is int for v in (txid, event_id)):
                raise TypeError("not a position")
            if not (0 <= txid <= MAX_TXID and 0 <= event_id <= MAX_EVENT_ID):
                raise ValueError("a position out of the columns' range")
            return cls(txid, event_id)
        except (binascii.Error, ValueError, TypeError, UnicodeDecodeError) as exc:
            raise ValidationFailed(
                f"invalid {field}",
                details=[{"loc": [where, field], "msg": "not a cursor from this API", "type": "cursor"}],
            ) from exc


# The oldest running transaction of this database, as a full (epoch-qualified) id: the running
# ids of the snapshot (xid8) whose low 32 bits are a backend_xid of this database; else the
# snapshot's xmax (every id below it has ended). Events are written only by the service's own
# role, whose sessions pg_stat_activity always shows.
_HORIZON_SQL = text(
    """
    WITH snap AS (SELECT pg_current_snapshot() AS s),
    mine AS (
        SELECT backend_xid::text::bigint AS x FROM pg_stat_activity
        WHERE datname = current_database() AND backend_xid IS NOT NULL
        UNION ALL
        SELECT transaction::text::bigint FROM pg_prepared_xacts WHERE database = current_database()
    )
    SELECT coalesce(
        (SELECT min(r.x8) FROM (SELECT pg_snapshot_xip(s)::text::bigint AS x8 FROM snap) AS r
         WHERE (r.x8 & 4294967295) IN (SELECT x FROM mine)),
        (SELECT pg_snapshot_xmax(s)::text::bigint FROM snap)
    )
    """
)


def _horizon(session: Session) -> int:
    """Events with a txid below this are final (their transactions have all ended)."""
    if session.get_bind().dialect.name != "postgresql":
        return _NO_HORIZON
    # pg_stat_activity is read once per transaction and cached: read it afresh.
    session.execute(text("SELECT pg_stat_clear_snapshot()"))
    return int(session.scalar(_HORIZON_SQL))


def read_feed(
    session: Session,
    *,
    run_id: str,
    after: FeedPosition | None,
    since: datetime | None,
    limit: int,
) -> tuple[list[Event], FeedPosition | None, bool]:
    """Up to `limit` events of `run_id` after `after` (and at or after `since`), oldest first.

    Returns the events, the position to continue from (the last event's, or `after` when there
    was none), and whether more events were ready beyond this page.
    """
    horizon = _horizon(session)  # first: whatever is below it is visible to the next statement
    stmt = select(Event).where(Event.run_id == run_id, Event.txid < horizon)
    if after is not None:
        stmt = stmt.where(or_(Event.txid > after.txid, and_(Event.txid == after.txid, Event.id > after.id)))
    if since is not None:
        stmt = stmt.where(Event.at >= since)
    rows = list(session.scalars(stmt.order_by(Event.txid, Event.id).limit(limit + 1)))
    more = len(rows) > limit
    rows = rows[:limit]
    position = FeedPosition(rows[-1].txid, rows[-1].id) if rows else after
    return rows, position, more
