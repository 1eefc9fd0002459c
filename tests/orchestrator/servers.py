"""Real local HTTP servers for the SDK tests: any ASGI app under uvicorn on
127.0.0.1 (an OS-chosen port), in a background thread, plus a fault injector
that can answer 5xx/429, stall, or drop the connection."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from orchestrator import RetryPolicy


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """Serve `app` on 127.0.0.1; yields its base URL."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="critical",
        access_log=False,
        lifespan="off",
        http="h11",  # FaultInjector's "drop" reaches into h11's request cycle
        proxy_headers=False,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)


@dataclass
class Seen:
    method: str
    path: str
    idempotency_key: str | None
    fault: str | None


@dataclass
class FaultInjector:
    """ASGI middleware. `inject(method, path, *faults)` queues faults for the next requests
    to that route, one per request:

    - "503", "500", "400", ...: answer that status (with the service's error body);
    - "429:<seconds>": answer 429 with that Retry-After;
    - "slow:<seconds>": wait, then handle the request normally (to trip client timeouts);
    - "drop": close the connection without reading or answering the request;
    - "drop_after": handle the request (it takes effect), then close the connection
      instead of sending the answer: the client never learns that it succeeded.
    """

    app: Any
    seen: list[Seen] = field(default_factory=list)
    _faults: dict[tuple[str, str], deque[str]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def inject(self, method: str, path: str, *faults: str) -> None:
        with self._lock:
            self._faults.setdefault((method.upper(), path), deque()).extend(faults)

    def requests_to(self, method: str, path: str) -> list[Seen]:
        return [s for s in self.seen if s.method == method.upper() and s.path == path]

    def _next_fault(self, method: str, path: str) -> str | None:
        with self._lock:
            queue = self._faults.get((method, path))
            return queue.popleft() if queue else None

    @staticmethod
    async def _drop(send: Any) -> None:
        cycle = send.__self__  # uvicorn's h11 RequestResponseCycle
        cycle.transport.close()
        cycle.disconnected = True  # so uvicorn does not try to answer 500 on a closed socket
        await asyncio.sleep(0)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        fault = self._next_fault(method, path)
        self.seen.append(Seen(method, path, headers.get("idempotency-key"), fault))
        if fault is None:
            await self.app(scope, receive, send)
        elif fault == "drop":
            await self._drop(send)
        elif fault == "drop_after":

            async def swallow(message: dict) -> None:
                pass

            await self.app(scope, receive, swallow)
            await self._drop(send)
        elif fault.startswith("slow:"):
            await asyncio.sleep(float(fault.split(":", 1)[1]))
            await self.app(scope, receive, send)
        else:
            status, _, retry_after = fault.partition(":")
            body = b'{"error": {"code": "injected", "message": "injected fault", "details": null}}'
            response_headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]
            if retry_after:
                response_headers.append((b"retry-after", retry_after.encode()))
            await send({"type": "http.response.start", "status": int(status), "headers": response_headers})
            await send({"type": "http.response.body", "body": body})


FAST = RetryPolicy(max_attempts=4, backoff_base_s=0.01, backoff_max_s=0.05)
"""Retries fast enough for tests."""
