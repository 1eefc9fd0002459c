"""Wire shapes of a run's event feed."""

from typing import Any

from pydantic import BaseModel, Field

from app.events.models import Event
from app.timestamps import UtcDatetime


class EventOut(BaseModel):
    id: int
    at: UtcDatetime
    action: str = Field(
        description="run.created | run.queued | run.admitted | batch.received | run.step | "
        "adapter.published | checkpoint.committed | run.evicted | run.completed | run.failed | "
        "run.deleted | run.restart_from_checkpoint"
    )
    actor: str = Field(description="admin | tenant | trainer | orchestrator | heartbeat | system")
    details: dict[str, Any]
    cursor: str = Field(
        description="This event's position: pass it as `cursor` (or Last-Event-ID) to go on after it."
    )

    @classmethod
    def from_event(cls, event: Event, cursor: str) -> "EventOut":
        return cls(
            id=event.id,
            at=event.at,
            action=event.action,
            actor=event.actor,
            details=event.details,
            cursor=cursor,
        )


class EventList(BaseModel):
    items: list[EventOut]
    next_cursor: str | None = Field(
        description="Where to go on from (also when `items` is empty: poll with it); null only "
        "for an empty feed read from the start."
    )
    has_more: bool = Field(description="More events were ready beyond this page.")
