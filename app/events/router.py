"""GET /v1/runs/{run_id}/events: the run's feed as JSON pages, or as a live Server-Sent Events
stream when the client sends `Accept: text/event-stream` (resumable with Last-Event-ID)."""

import json
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import Annotated

import anyio
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import Response, StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import Receive, Scope, Send

from app.auth import TenantDep
from app.db import SessionDep
from app.events.deletion import DELETION_ACTION, deletion_delivered
from app.events.feed import FeedPosition, read_feed
from app.events.schemas import EventList, EventOut
from app.limits import InFlight
from app.pagination import DEFAULT_LIMIT, LimitQuery
from app.runs.deps import OwnedRunDep
from app.shutdown import ShutdownNotice
from app.tenants.models import ApiKey
from app.timestamps import UtcDatetime

router = APIRouter(tags=["events"])

SSE_POLL_SECONDS = 0.5
"""How often a live stream looks for new events: a step reaches a watcher within about this."""
SSE_KEEPALIVE_SECONDS = 15.0
"""A comment line this often keeps proxies from closing an idle stream."""
SSE_MAX_SECONDS = 3600.0
"""A stream ends after this long; EventSource reconnects with Last-Event-ID and loses nothing."""
SSE_RECHECK_SECONDS = 5.0
"""How often a live stream checks that its credential still holds: a stream opened before its key
was revoked (or its dashboard session ended) ends within about this, and the reconnect is a 401
(an EventSource does not retry that). Before, it went on for up to SSE_MAX_SECONDS."""

StillAllowed = Callable[[Session], bool]
"""Whether the viewer that opened a stream may still read it (one query, in the stream's session)."""


def key_still_valid(api_key_id: str) -> StillAllowed:
    """An API key's stream: the key exists and is not revoked (its tenant not deleted)."""

    def allowed(session: Session) -> bool:
        revoked_at = session.execute(select(ApiKey.revoked_at).where(ApiKey.id == api_key_id)).first()
        return revoked_at is not None and revoked_at[0] is None

    return allowed


FeedCursor = Annotated[
    str | None,
    Query(
        max_length=512,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="`next_cursor` (or an event's `cursor`) to go on after; omit to start.",
    ),
]


LastEventId = Annotated[
    str | None,
    Header(
        alias="Last-Event-ID",
        max_length=128,
        description="An event's `id` (its cursor), sent by an EventSource that reconnects: go on after it.",
    ),
]


def start_of(cursor: str | None, last_event_id: str | None) -> FeedPosition | None:
    """Where a page or a stream starts: after the Last-Event-ID when an EventSource resumes, else
    after `cursor`. Both are checked whenever given, before a stream's 200 is sent: a bad one is a
    422, never a stream that breaks after its 200 (which an EventSource reopened every few seconds
    with the same id). A 422 rather than starting over from the beginning or the latest event: this
    service sends only ids that decode, so a bad Last-Event-ID was written by someone, not replayed
    by a browser, and an EventSource that gets a non-200 answer stops without retrying (WHATWG
    HTML, "fail the connection"), so there is no error loop either."""
    after = FeedPosition.decode(cursor, field="cursor") if cursor else None
    if last_event_id:
        return FeedPosition.decode(last_event_id, field="Last-Event-ID", where="header")
    return after


def _page(
    session: Session, run_id: str, after: FeedPosition | None, since: datetime | None, limit: int
) -> EventList:
    rows, position, more = read_feed(session, run_id=run_id, after=after, since=since, limit=limit)
    items = [EventOut.from_event(e, FeedPosition(e.txid, e.id).encode()) for e in rows]
    return EventList(items=items, next_cursor=position.encode() if position else None, has_more=more)


@router.get(
    "/v1/runs/{run_id}/events",
    operation_id="listRunEvents",
    response_model=EventList,
    responses={
        200: {
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
            "description": "JSON page, or an SSE stream",
        },
        204: {
            "description": "SSE only: the run was deleted and its `run.deleted` event is behind "
            "`Last-Event-ID` (or `cursor`), before `since`, or purged: the stream has nothing more to "
            "send, and an EventSource stops reconnecting"
        },
    },
)
def list_events(
    run: OwnedRunDep,
    principal: TenantDep,
    session: SessionDep,
    request: Request,
    cursor: FeedCursor = None,
    since: Annotated[UtcDatetime | None, Query(description="Only events at or after this time.")] = None,
    limit: LimitQuery = DEFAULT_LIMIT,
    accept: Annotated[str | None, Header()] = None,
    last_event_id: LastEventId = None,
) -> EventList | Response:
    """The run's lifecycle, oldest first: created, queued (why), admitted, every batch received
    (with the rollout step's reward so far), every trained step (with its metrics), adapters
    published, checkpoints, and how it ended (who and why). Every event exactly once across pages.
    A live stream ends after the run's `run.deleted` event (its feed never grows again)."""
    after = start_of(cursor, last_event_id)
    if accept is not None and "text/event-stream" in accept:
        allowed = key_still_valid(principal.api_key_id)
        return event_stream(
            request,
            session,
            run_id=run.id,
            tenant_id=run.tenant_id,
            after=after,
            since=since,
            allowed=allowed,
        )
    return _page(session, run.id, after, since, limit)


class _CountedStream(StreamingResponse):
    """A live stream holding one of its tenant's event-stream places until it ends, however it ends
    (the request stopped counting as in flight when its handler returned: a stream lasts an hour)."""

    def __init__(self, content: AsyncIterator[str], *, release: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def event_stream(
    request: Request,
    session: Session,
    *,
    run_id: str,
    tenant_id: str,
    after: FeedPosition | None,
    since: datetime | None,
    allowed: StillAllowed,
) -> Response:
    """The run's live stream (the API's and the dashboard's), counted against the tenant's
    `tenant_max_event_streams`: a 429 past it (app/limits.py). It ends once `allowed` says no
    (checked every SSE_RECHECK_SECONDS), once the server begins to shut down, and once it has sent
    the run's deletion (app/events/deletion.py). A stream that would start past the deletion (an
    EventSource reconnecting after it) is a 204 at once, holding no place: an EventSource does not
    reconnect after a non-200 answer, while a stream that ended at once it reopened for ever.
    `session`: the request's (on SQLite a second one would wait for its write lock)."""
    if deletion_delivered(session, run_id=run_id, after=after, since=since):
        return Response(status_code=204, headers={"Cache-Control": "no-cache"})
    streams: InFlight = request.app.state.event_streams
    streams.acquire(tenant_id)
    factory: sessionmaker[Session] = request.app.state.session_factory
    content = stream_events(request, factory, run_id, after, since, allowed)
    return _CountedStream(content, release=lambda: streams.release(tenant_id))


def _read(
    factory: sessionmaker[Session],
    run_id: str,
    after: FeedPosition | None,
    since: datetime | None,
    allowed: StillAllowed | None,
) -> EventList | None:
    """The next page, or None when `allowed` (if given) says the stream is to end: the viewer may no
    longer read it, or it has nothing more to wait for (`_still_worth_streaming`)."""
    with factory() as session:
        if allowed is not None and not allowed(session):
            return None
        return _page(session, run_id, after, since, 200)


def _still_worth_streaming(
    allowed: StillAllowed, run_id: str, after: FeedPosition | None, since: datetime | None
) -> StillAllowed:
    """The periodic check: the viewer may still read the stream, and the run's deletion is not
    behind it. Its own `run.deleted` ends a stream at once (`stream_events`); this catches the
    deletion a stream never gets (before `since`, purged) and a run purged altogether."""

    def check(session: Session) -> bool:
        return allowed(session) and not deletion_delivered(session, run_id=run_id, after=after, since=since)

    return check


async def stream_events(
    request: Request,
    factory: sessionmaker[Session],
    run_id: str,
    after: FeedPosition | None,
    since: datetime | None,
    allowed: StillAllowed,
) -> AsyncIterator[str]:
    # Polling, in a thread (the session is blocking): simple, works across uvicorn workers and
    # replicas alike; each open stream costs one small indexed query per SSE_POLL_SECONDS.
    # It ends, within a poll, once the server begins to shut down: uvicorn waits for every open
    # response before it exits, so a stream held `loraloom serve` up for as long as its client
    # stayed (an hour). The EventSource reconnects, with Last-Event-ID, to the restarted service.
    shutdown: ShutdownNotice = request.app.state.shutdown
    yield f"retry: {int(SSE_POLL_SECONDS * 4000)}\n\n"
    started = last_sent = checked = anyio.current_time()
    while anyio.current_time() - started < SSE_MAX_SECONDS and not shutdown.begun:
        due = anyio.current_time() - checked >= SSE_RECHECK_SECONDS
        recheck = _still_worth_streaming(allowed, run_id, after, since) if due else None
        page = await anyio.to_thread.run_sync(_read, factory, run_id, after, since, recheck)
        if page is None:
            return  # the key was revoked, the session ended (the reconnect gets its 401), the run left
        if due:
            checked = anyio.current_time()
        for item in page.items:
            data = json.dumps(item.model_dump(mode="json"), separators=(",", ":"))
            yield f"id: {item.cursor}\nevent: {item.action}\ndata: {data}\n\n"
            last_sent = anyio.current_time()
            if item.action == DELETION_ACTION:
                return  # nothing happens to a deleted run any more; the reconnect gets a 204
        if page.next_cursor is not None:
            after = FeedPosition.decode(page.next_cursor)
        if page.has_more:
            continue
        if anyio.current_time() - last_sent > SSE_KEEPALIVE_SECONDS:
            yield ": keepalive\n\n"
            last_sent = anyio.current_time()
        if await request.is_disconnected():
            return
        await anyio.sleep(SSE_POLL_SECONDS)
