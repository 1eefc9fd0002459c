"""Database → run directories (owned by the control-plane work; stub until then)."""

from sqlalchemy.orm import Session

from app.config import Settings


def rebuild_all(session: Session, settings: Settings) -> None:
    """Rebuild every run directory from the database (idempotent)."""
    return None
