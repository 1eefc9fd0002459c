"""Every stored time is UTC; SQLite hands datetimes back naive. One coercion for all of them."""

from datetime import UTC, datetime
from typing import Annotated

from pydantic import AfterValidator


def as_utc(value: datetime) -> datetime:
    """`value` as an aware UTC datetime (a naive one is taken to be UTC already)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _as_utc_in_range(value: datetime) -> datetime:
    """as_utc, refusing as a validation error (a 422 for a client's time) a time whose offset moves
    it past year 1 or 9999 (`9999-12-31T23:59:59-23:59`): datetime raises OverflowError there."""
    try:
        return as_utc(value)
    except OverflowError as exc:
        raise ValueError("is out of range once converted to UTC") from exc


UtcDatetime = Annotated[datetime, AfterValidator(_as_utc_in_range)]
"""A datetime field that always serialises with its UTC offset; as a request's field or parameter,
one that cannot be UTC is a 422."""
