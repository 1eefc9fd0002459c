"""Appending to the audit log. Every service records its events here, in the caller's transaction."""

from typing import Any

from sqlalchemy import Connection, insert, text
from sqlalchemy.orm import Session

from app.db import utcnow
from app.events.models import ACTORS, Event


def _values(
    *,
    action: str,
    actor: str,
    tenant_id: str | None,
    run_id: str | None,
    api_key_id: str | None,
    details: dict[str, Any] | None,
) -> dict[str, Any]:
    """An event's columns (both forms below write the same row)."""
    if actor not in ACTORS:
        raise ValueError(f"unknown actor {actor!r}")
    return {
        "at": utcnow(),
        "action": action,
        "actor": actor,
        "tenant_id": tenant_id,
        "run_id": run_id,
        "api_key_id": api_key_id,
        "details": details or {},
    }


def record_event(
    session: Session,
    *,
    action: str,
    actor: str,
    tenant_id: str | None = None,
    run_id: str | None = None,
    api_key_id: str | None = None,
    details: dict[str, Any] | None = None,
) -> Event:
    """Append to the audit log (in the caller's transaction). Never pass secrets in `details`."""
    event = Event(
        **_values(
            action=action,
            actor=actor,
            tenant_id=tenant_id,
            run_id=run_id,
            api_key_id=api_key_id,
            details=details,
        )
    )
    if session.get_bind().dialect.name == "postgresql":
        event.txid = _TXID  # type: ignore[assignment]
    session.add(event)
    return event


# The feed's order (app/events/feed.py); evaluated by the INSERT itself, no round trip.
_TXID = text("pg_current_xact_id()::text::bigint")
# Built once (the other columns come as parameters), so SQLAlchemy reuses the compiled form.
_INSERT = {"postgresql": insert(Event).values(txid=_TXID), "other": insert(Event)}


def append_event(
    connection: Connection,
    *,
    action: str,
    actor: str,
    tenant_id: str | None = None,
    run_id: str | None = None,
    details: dict[str, Any] | None = None,
) -> None:
    """`record_event` as one Core INSERT on the caller's connection (in its transaction), for hot
    paths that hold no ORM objects. Never pass secrets in `details`."""
    values = _values(
        action=action, actor=actor, tenant_id=tenant_id, run_id=run_id, api_key_id=None, details=details
    )
    dialect = connection.dialect.name
    connection.execute(_INSERT["postgresql" if dialect == "postgresql" else "other"], values)
