"""Cursor pagination, newest first.

A cursor is opaque to clients: base64url of the last item's (created_at, id), or, for a list paged
by an integer key alone, of `[kind, key]` (encode_id_cursor). Keyset pagination, unlike offsets,
neither skips nor repeats rows when rows are added between pages.
"""

import base64
import binascii
import json
from datetime import datetime
from typing import Annotated, Any

from fastapi import Query
from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import InstrumentedAttribute, Session

from app.errors import ValidationFailed
from app.timestamps import as_utc

DEFAULT_LIMIT = 50
MAX_LIMIT = 200

LimitQuery = Annotated[int, Query(ge=1, le=MAX_LIMIT, description="Page size (1..200).")]
CursorQuery = Annotated[
    str | None,
    Query(
        max_length=512,
        pattern=r"^[A-Za-z0-9_-]+$",  # base64url: what encode_cursor writes
        description="`next_cursor` of the previous page (opaque); omit for the first page.",
    ),
]


def encode_cursor(created_at: datetime, item_id: str | int) -> str:
    raw = json.dumps([as_utc(created_at).isoformat(), item_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _bad_cursor(msg: str = "not a cursor from this API") -> ValidationFailed:
    return ValidationFailed(
        "invalid cursor", details=[{"loc": ["query", "cursor"], "msg": msg, "type": "cursor"}]
    )


def decode_cursor(cursor: str, id_type: type = str) -> tuple[datetime, str | int]:
    """The (created_at, id) a cursor holds; a 422 for anything this API did not write, down to an
    id of the wrong type, a string Postgres cannot hold (NUL, lone surrogate) or a date out of range."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, item_id = json.loads(raw)
        if type(item_id) is not id_type:  # bool is not int here either
            raise ValueError("bad id")
        if isinstance(item_id, str):
            item_id.encode("utf-8")  # a lone surrogate raises
            if "\x00" in item_id:
                raise ValueError("NUL in id")
            return as_utc(datetime.fromisoformat(created)), item_id
        if isinstance(item_id, int) and 0 <= item_id <= 2**63 - 1:
            return as_utc(datetime.fromisoformat(created)), item_id
        raise ValueError("id out of range")
    except (binascii.Error, ValueError, TypeError, OverflowError) as exc:  # UnicodeError is a ValueError
        raise _bad_cursor() from exc


def encode_id_cursor(item_id: int, kind: str = "id") -> str:
    """The cursor of a list paged by an increasing integer key alone: `[kind, key]`. `kind` names
    the list (and its order) the cursor walks, so that another list's cursor, or one of the same list
    in the other order, is refused rather than read as a key of this one. The batches list, in
    training order, is the plain `"id"`."""
    raw = json.dumps([kind, item_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_id_cursor(cursor: str, *, kind: str = "id", max_id: int = 2**63 - 1) -> int:
    """The key of a cursor `encode_id_cursor(key, kind)` wrote; a 422 for any other."""
    try:
        written_kind, item_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if not isinstance(item_id, int) or isinstance(item_id, bool) or not 0 <= item_id <= max_id:
            raise ValueError("not an id cursor")
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise _bad_cursor() from exc
    if written_kind != kind:
        raise _bad_cursor("a cursor of another list, or of this one in the other order")
    return item_id


def paginate(
    session: Session,
    stmt: Select[Any],
    *,
    created_col: InstrumentedAttribute[datetime],
    id_col: InstrumentedAttribute[Any],
    limit: int,
    cursor: str | None,
) -> tuple[list[Any], str | None]:
    """One page of `stmt`'s entities (newest first) and the cursor of the next page, or None at the end."""
    if cursor is not None:
        created, item_id = decode_cursor(cursor, id_col.type.python_type)
        stmt = stmt.where(or_(created_col < created, and_(created_col == created, id_col < item_id)))
    rows = list(session.scalars(stmt.order_by(created_col.desc(), id_col.desc()).limit(limit + 1)))
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    last = rows[-1]
    return rows, encode_cursor(getattr(last, created_col.key), getattr(last, id_col.key))
