"""Each tenant's `retrieve_future` long polls: at most `most` of them check their futures at once
(the "places"), the others wait in line for a place, first come first served.

Why a line rather than a 429 past the cap: the official SDK's retrieve loop backs off from a 429
exponentially (1, 2, 4 ... 30 s, and Retry-After is not read there), so with more futures than the
cap their results came up to 30 s late. It re-polls at once, without any delay, on a "try again"
answer (and on a 408 or a 5xx), so answering that straight away would make it poll in a tight loop.
Waiting in line costs the service no thread, no database connection and no query: the poll is a
coroutine on the event loop until a place is handed to it (`leave` gives the place to the first in
line), or until its wait is over and it answers "try again" (the SDK then polls again, once).

The line is bounded too (`most_waiting`): past it the poll is refused at once with a 429, which the
SDK backs off from. Used on the event loop only (the route is async); `in_flight` and `waiting` may
be read from another thread (tests).
"""

import asyncio
import contextlib
from collections import Counter, deque

from app.errors import RateLimited


class LongPolls:
    def __init__(self, most: int, *, most_waiting: int, retry_after: int) -> None:
        self.most = most
        self.most_waiting = most_waiting
        self.retry_after = retry_after
        self._held: Counter[str] = Counter()
        self._lines: dict[str, deque[asyncio.Future[None]]] = {}

    def in_flight(self, tenant_id: str) -> int:
        """The tenant's polls holding a place."""
        return self._held[tenant_id]

    def waiting(self, tenant_id: str) -> int:
        """The tenant's polls waiting in line."""
        return len(self._lines.get(tenant_id, ()))

    async def enter(self, tenant_id: str, *, wait_s: float) -> bool:
        """True once the poll holds one of the tenant's places (`leave` gives it back), at once or
        after waiting in line; False when `wait_s` passed in line first (it holds nothing then).
        A 429 (RateLimited) at once, holding nothing, when `most_waiting` polls wait already."""
        line = self._lines.get(tenant_id)
        if not line and self._held[tenant_id] < self.most:
            self._held[tenant_id] += 1
            return True
        if line is None:
            line = self._lines[tenant_id] = deque()
        if len(line) >= self.most_waiting:
            raise RateLimited(
                f"too many long polls for this tenant ({self.most} open and {len(line)} waiting for "
                "a place); retry shortly",
                details={"limit": self.most, "waiting": len(line), "kind": "long_polls"},
                retry_after=self.retry_after,
            )
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line.append(turn)
        try:
            await asyncio.wait((turn,), timeout=wait_s)  # never cancels `turn` itself
        except BaseException:  # cancelled: the client went away, or the server stops
            self._forfeit(tenant_id, turn)
            raise
        if turn.done():
            return True
        self._forfeit(tenant_id, turn)
        return False

    def leave(self, tenant_id: str) -> None:
        """Give a place back: to the first poll in line if one waits (the count stays), else to the
        tenant's free places."""
        line = self._lines.get(tenant_id)
        while line:
            turn = line.popleft()
            if not turn.done():
                turn.set_result(None)
                break
        else:
            self._held[tenant_id] -= 1
            if self._held[tenant_id] <= 0:
                del self._held[tenant_id]
        if line is not None and not line:
            del self._lines[tenant_id]

    def _forfeit(self, tenant_id: str, turn: "asyncio.Future[None]") -> None:
        """A waiter stops waiting: a place handed to it in the meantime goes on to the next."""
        if turn.done() and not turn.cancelled():
            self.leave(tenant_id)
            return
        turn.cancel()
        line = self._lines.get(tenant_id)
        if line is not None:
            with contextlib.suppress(ValueError):
                line.remove(turn)
            if not line:
                del self._lines[tenant_id]
