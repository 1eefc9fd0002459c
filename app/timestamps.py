"""Every stored time is UTC; SQLite hands datetimes back naive. One coercion for all of them."""

from datetime import UTC, datetime
from typing import Annotated

from pydantic import AfterValidator


def as_utc(value: datetime) -> datetime:
    """`value` as an aware UTC datetime (a naive one is taken to be UTC already)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


UtcDatetime = Annotated[datetime, AfterValidator(as_utc)]
"""A datetime field that always serialises with its UTC offset."""
