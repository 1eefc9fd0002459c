"""Work that must happen only once a transaction has committed (e.g. removing a deleted run's
files: a rolled-back deletion must not have destroyed them).

Services never commit (the session dependency does), so they hand such work to the session:
it runs after the outermost commit and is dropped on rollback.
"""

import logging
from collections.abc import Callable

from sqlalchemy import event
from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

_PENDING = "loraloom.after_commit"


def call_after_commit(session: Session, fn: Callable[[], None]) -> None:
    """Run `fn` once the session's outermost transaction commits; drop it on rollback."""
    pending: list[Callable[[], None]] | None = session.info.get(_PENDING)
    if pending is None:
        pending = session.info[_PENDING] = []
        event.listen(session, "after_commit", _run_pending)
        event.listen(session, "after_rollback", _drop_pending)
    pending.append(fn)


def _run_pending(session: Session) -> None:
    if session.in_nested_transaction():  # a savepoint released; the real commit is still to come
        return
    pending: list[Callable[[], None]] = session.info.get(_PENDING, [])
    todo, pending[:] = list(pending), []
    for fn in todo:
        try:
            fn()
        except Exception:  # the commit stands; the start-up rebuild repairs the projection
            log.exception("after-commit work failed")


def _drop_pending(session: Session) -> None:
    if not session.in_nested_transaction():
        session.info.get(_PENDING, []).clear()
