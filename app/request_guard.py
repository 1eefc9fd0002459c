"""The request guard (applied by app/front.py): what is checked before a request reaches a route,
and so before any database session opens.

- The body is read whole here, with its size limit (413) and a read deadline (408). The limit is
  `max_body_bytes` for the routes that carry bulk data (`BULK_ROUTES`) and `max_small_body_bytes`
  for every other one, so an anonymous client cannot make the service read 64 MB into memory and
  scan it on the way to a route that takes a run's config. A client
  that sends the headers and part of a body (slow or on purpose) therefore holds a socket and
  a coroutine, never a database connection: authentication, which needs the database, runs
  only once the body is in memory.
- Except on the bulk routes of the pool and the Tinker API, whose JSON bodies FastAPI parses (on
  the event loop) before the route's authentication runs: there the credential is checked before
  the body is read (`check_credential`), and a caller the route would refuse gets that route's
  401 or 403 at once, its body unread (a 66 MB anonymous body took 5.4 s of the event loop and
  1.7 GB on its way to a 401). The worker token is compared in place; a Tinker key is looked up in
  the key caches (app/key_cache.py), and, when they do not know it, in the database in a worker
  thread (the key is then cached for the route). The database connection
  is held for that lookup only, never while the body arrives.
- And on the tenants' bulk routes (rollout batches, `/v1/adapters`), so that anonymous bodies
  cannot fill the body budget below (a 503 for every tenant's upload): a missing or malformed
  Authorization header, or a key the caches know to be wrong, is the route's 401 at once; a key
  the caches do not know is looked up only when the body may be large (`_PRECHECKED_BODY_BYTES`),
  and only to refuse it: a valid key is left for the route to cache, and a failed lookup lets the
  request through to the route, so the batch route's fast path answers the same requests, and
  the database's failures the same way, as without the check (`_tenant_credential`).
- The bytes of bodies being read are counted against one budget per process
  (`max_buffered_body_bytes`, `BodyBudget`): a body that would take the total past it gets a 503
  with Retry-After (a body alone is always taken), so stalled bodies cannot pile up in memory
  without bound. A body stops counting once it arrived whole, or when its request ends (408, 413,
  a disconnect: a request whose client left before its body's end is not run at all). A body whose tenant the credential check above found (a tenants' or Tinker bulk
  route with a valid key) also counts against its tenant's share of the budget
  (`tenant_max_buffered_body_bytes`, half by default): past it that tenant gets a 429 of its own,
  so one tenant's stalled uploads (nine 60 MB batches held nearly whole, again each body deadline)
  no longer fill the budget and make every other tenant's requests a 503.
- JSON bodies are checked before any parser recurses into them: UTF-8 (else 422), nesting depth
  (a byte scan, no recursion; else 422), and no NUL character in any string or key (Postgres
  text cannot hold one; else 422 naming the field, or the body when it is over 1 MiB).
  These checks run before authentication, so each is linear, at C or numpy speed, and never parses
  a large body (a 60 MB string once took 19 s of the event loop here, and a 16 MB body with a NUL
  2 GB of memory); bodies over 1 MiB are checked in a worker thread, so the event loop serves the
  others meanwhile (numpy releases the GIL).
- The query string and path may not hold a NUL either (422 naming the parameter), and must be UTF-8
  once percent-decoded (422): the server decodes them with U+FFFD for what is not, so a route
  would look up, store or echo text the client never sent (`run_\ufffd\ufffd not found`).
- `Authorization`, `Content-Type` and `Idempotency-Key` may be sent once (422 naming the header): the
  routes read one of the copies, so a second one could mean another key or body type than the one used.
- A body with a Content-Encoding other than identity is refused (415): no route decodes one, and
  a compressed body read as it is would be misreported (a gzip batch as "not UTF-8"), a body
  labelled gzip but sent plain accepted.

Every refusal is the uniform error body of app/errors.py.
"""

import asyncio
import json
import re
import sys
from collections.abc import Callable
from typing import Any, Literal, NamedTuple
from urllib.parse import parse_qsl, unquote, unquote_to_bytes

import numpy as np
from fastapi.responses import JSONResponse
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import State
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from app.auth import (
    INVALID_KEY,
    INVALID_TOKEN_CHALLENGE,
    bearer_token,
    cached_key,
    hash_key,
    known_key,
    require_worker,
    same_secret,
)
from app.config import Settings
from app.errors import AppError, RateLimited, ServiceUnavailable, Unauthorized, error_body
from app.key_cache import CachedKey, key_cache, key_miss_cache
from app.serving import MAX_HEADER_BYTES
from app.tenants.models import ApiKey
from app.tinker.auth import tinker_key_hash

MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays/objects accepted in a JSON body (the deepest legitimate one is ~6)."""

_JSON_MEDIA_SUFFIX = "+json"

_LARGE_BODY_BYTES = 1 << 20
"""Bodies above this are checked off the event loop."""

_LOCATED_BODY_BYTES = 64 << 10
"""A NUL or an over-long integer in a body up to this size is named by its field; in a larger one,
for the whole body (`["body"]`). Naming the field means walking every value of the parsed body in
Python, before authentication and, up to _LARGE_BODY_BYTES, on the event loop: a 1 MiB body of half
a million numbers took 1.2-2.3 s (64 KiB: a few tens of milliseconds)."""

# Rollout batches, the one large and hot JSON body, are decoded by msgspec into typed structs whose
# nesting is fixed (a deeper value fails the type at its second level, without recursing): the
# depth scan (about a third of the decode's time there) is left out for them.
_TYPED_BATCH_ROUTE = re.compile(r"^/v1/runs/[^/]+/batches$")

BULK_ROUTES = re.compile(
    r"^(/v1/runs/[^/]+/batches|/v1/adapters"
    r"|/v1/pool/runs/[^/]+/adapters/[^/]+|/v1/pool/manual/results"
    r"|/api/v1/forward_backward|/api/v1/asample)$"
)
"""The paths whose POST or PUT bodies may be as large as `max_body_bytes`: rollout batches, adapter
uploads (the tenants' and the pool's), the pool's Tinker results (logprobs of a round's tokens,
sampled sequences) and the Tinker API's training data and sampling prompts (a prompt may be a
round's tokens, over 1 MiB as JSON; limited to what such a prompt takes: `SAMPLE_BYTES_PER_TOKEN`).
The pool's and the Tinker API's other routes (sessions, models, optimizer steps, saves,
registration, heartbeats, claims, acks, step reports) take small JSON documents."""

TAR_UPLOAD_ROUTE = "/v1/adapters"
"""The tenants' adapter upload: its body is an uncompressed tar (app/adapters/tenant_router.py)."""
_POOL_TAR_UPLOAD_ROUTE = re.compile(r"^/v1/pool/runs/[^/]+/adapters/[^/]+$")
"""The pool's adapter upload: a tar too (app/adapters/pool_router.py), with the same 415."""

SAMPLE_ROUTE = "/api/v1/asample"
SAMPLE_BYTES_PER_TOKEN = 16
"""JSON bytes a sampling prompt's token may take: an id below 10,000,000 (the largest vocabulary a
pool registers) is 7 digits, and its separator and some whitespace fit in the rest. A prompt holds
at most `tinker_max_tokens_per_round` tokens, so a sample's body is limited to that many times
this, plus 64 KiB for the rest of the request (4 MiB by default), not `max_body_bytes`: its JSON is
parsed on the event loop before the route runs, so even a tenant with a valid key could stall
every other tenant with a 64 MB body (a 66 MB `[1,1,...]` took 2.5 s of the loop)."""

_CHECKED_FIRST = ("/v1/pool/", "/api/v1/")
"""Bulk routes whose credential is checked before their body is read (see `check_credential`)."""

_TENANT_BULK = re.compile(r"^/v1/(runs/[^/]+/batches|adapters)$")
"""The tenants' bulk routes: their Bearer key is checked before the body too (`_tenant_credential`);
both answer a 401 before anything else (their first dependency is the tenant's key)."""

_PRECHECKED_BODY_BYTES = 64 << 10
"""On the tenants' bulk routes, a body declared larger than this (or not declared: chunked) has an
uncached key looked up before it is read. A smaller one is read first, as before (no lookup, no
thread): stalled, it holds at most this much of the body budget (8192 of them fill the default
512 MiB; per-address connection limits belong to the proxy in front)."""

BUSY_RETRY_AFTER_SECONDS = 1

CLIENT_GONE = "loraloom.client_gone"
"""Set in the request's scope when its client disconnected before its body's end (nothing was run
for it): the front layer records it as 499, nginx's "client closed request", not as an error."""


Refused = Literal["tenant", "service"]
"""Why `BodyBudget.take` refused: the body's tenant holds its share (429), or the process holds
the whole budget (503)."""


class BodyBudget:
    """Request-body bytes being read at once, in this process (`max_buffered_body_bytes`), and of
    them each known tenant's (`tenant_limit`: its share). Used from the event loop only (the guard
    reads bodies there), so no lock."""

    def __init__(self, limit: int, tenant_limit: int | None = None) -> None:
        self.limit = limit
        self.tenant_limit = limit if tenant_limit is None else tenant_limit
        self.used = 0
        self.by_tenant: dict[str, int] = {}

    def take(self, nbytes: int, *, held: int, tenant_id: str | None = None) -> Refused | None:
        """Count `nbytes` more for a body that holds `held` already, if they fit (None), else why
        not. A body that is alone (its tenant's only one; the process's only one) may always grow,
        so a body up to its route's limit is never refused for good. The tenant's share is checked
        first: a tenant past it is told so (its own limit), not that the service is busy."""
        if tenant_id is not None:
            tenant_used = self.by_tenant.get(tenant_id, 0)
            if tenant_used + nbytes > self.tenant_limit and tenant_used > held:
                return "tenant"
        if self.used + nbytes > self.limit and self.used > held:
            return "service"
        self.used += nbytes
        if tenant_id is not None:
            self.by_tenant[tenant_id] = tenant_used + nbytes
        return None

    def give(self, nbytes: int, tenant_id: str | None = None) -> None:
        self.used -= nbytes
        if tenant_id is not None and nbytes:
            left = self.by_tenant[tenant_id] - nbytes
            if left > 0:
                self.by_tenant[tenant_id] = left
            else:
                del self.by_tenant[tenant_id]  # tenants come and go: no entry left behind


def tenant_body_share(settings: Settings) -> int:
    """`tenant_max_buffered_body_bytes`, or half the budget: one tenant's stalled bodies leave the
    other half to the others, and at the defaults (512 MiB, 64 MiB bodies) a tenant still uploads
    four bodies of the largest size at once, each arriving in full (honest uploads arrive in
    well under a second and stop counting; a stalled one counts until its body deadline)."""
    share = settings.tenant_max_buffered_body_bytes
    return settings.max_buffered_body_bytes // 2 if share is None else share


def body_budget(state: State, settings: Settings) -> BodyBudget:
    """The app's body budget (made on first use from `settings`)."""
    budget: BodyBudget | None = getattr(state, "body_budget", None)
    if budget is None:
        budget = BodyBudget(settings.max_buffered_body_bytes, tenant_body_share(settings))
        state.body_budget = budget
    return budget


class BodyGuard:
    """The checks above, for app/front.py (which answers what the guard lets through)."""

    def __init__(
        self, *, max_body_bytes: int, max_small_body_bytes: int, body_timeout_seconds: float
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self.max_small_body_bytes = min(max_small_body_bytes, max_body_bytes)
        self.body_timeout_seconds = body_timeout_seconds

    def is_bulk(self, scope: Scope) -> bool:
        return scope.get("method") in ("POST", "PUT") and BULK_ROUTES.match(scope.get("path", "")) is not None

    def body_limit(self, scope: Scope, settings: Settings | None) -> int:
        if not self.is_bulk(scope):
            return self.max_small_body_bytes
        if scope.get("path") == SAMPLE_ROUTE and settings is not None:
            sample = SAMPLE_BYTES_PER_TOKEN * settings.tinker_max_tokens_per_round + (64 << 10)
            return min(self.max_body_bytes, max(self.max_small_body_bytes, sample))
        return self.max_body_bytes

    async def check(self, scope: Scope, receive: Receive, send: Send) -> tuple[bytes, Receive] | None:
        """(the body, a `receive` that replays it) for the app; or None: the request was refused
        (the refusal sent with `send`)."""
        headers = dict(scope.get("headers") or [])
        state: State | None = getattr(scope.get("app"), "state", None)
        settings: Settings | None = getattr(state, "settings", None)
        limit = self.body_limit(scope, settings)
        refusal = _head_refusal(scope, headers, limit)
        if refusal is not None:
            await _refuse(send, *refusal)
            return None
        tenant_id: str | None = None
        if state is None or settings is None:  # not the service's app (its settings are on app.state)
            budget = None
        else:
            if self.is_bulk(scope):
                refused, tenant_id = await check_credential(scope, state, settings)
                if refused is not None:
                    await _refuse(
                        send,
                        refused.status,
                        error_body(refused.code, refused.message, refused.details),
                        refused.headers,
                    )
                    return None
            budget = body_budget(state, settings)
        body, disconnected, refusal = await self._read_body(receive, limit, budget, tenant_id)
        if refusal is not None:
            await _refuse(send, *refusal)
            return None
        if disconnected and _cut_short(headers, len(body)):
            # The client left before its body's end: an aborted request, answered by nothing (no
            # answer reaches it). What arrived is only a prefix of what was sent, and a prefix can
            # still parse as something else than what was meant (a TOML config cut at a line, a JSON
            # body whose declared length was longer): the request is not run, nothing is stored.
            # A request that declares no body (a heartbeat whose client did not wait for the
            # answer) is whole, and is run as before.
            scope[CLIENT_GONE] = True
            return None
        # The adapter uploads' bodies are never checked as JSON: their routes answer another type than
        # a tar with their own 415 (a JSON check here would answer a mislabelled tar "not UTF-8" first).
        content_type = (
            b"application/x-tar"
            if scope.get("path") == TAR_UPLOAD_ROUTE or _POOL_TAR_UPLOAD_ROUTE.match(scope.get("path", ""))
            else headers.get(b"content-type", b"")
        )
        # msgspec decodes the batch route's body (an over-long integer is its own 422, naming the field).
        typed = _TYPED_BATCH_ROUTE.match(scope.get("path", "")) is not None
        if len(body) > _LARGE_BODY_BYTES and _is_json(content_type):
            problem = await run_in_threadpool(_json_problem, content_type, body, typed=typed)
        else:
            problem = _json_problem(content_type, body, typed=typed)
        if problem is not None:
            await _refuse(send, 422, problem)
            return None

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # waits for the disconnect, as a real receive would

        return body, replay

    async def _read_body(
        self, receive: Receive, limit: int, budget: BodyBudget | None, tenant_id: str | None
    ) -> tuple[bytes, bool, tuple[int, dict[str, Any]] | None]:
        """(body, client disconnected before the body's end, refusal or None). The bytes read are counted against `budget`
        (and `tenant_id`'s share of it, when known) while the body arrives, and given back however
        the reading ends."""
        chunks: list[bytes] = []
        size = held = 0
        try:
            # One deadline for the whole body (not a wait_for, and its task, per chunk: a 0.4 MB
            # batch arrives in several chunks).
            async with asyncio.timeout(self.body_timeout_seconds):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return b"".join(chunks), True, None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        return b"", False, (413, _too_large(limit))
                    if budget is not None and size > held:
                        refused = budget.take(size - held, held=held, tenant_id=tenant_id)
                        if refused == "tenant":
                            return b"", False, (RateLimited.status, _tenant_busy(budget.tenant_limit))
                        if refused is not None:
                            return b"", False, (503, _busy())
                        held = size
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return (chunks[0] if len(chunks) == 1 else b"".join(chunks)), False, None
        except TimeoutError:
            return b"", False, (408, _timeout(self.body_timeout_seconds))
        finally:
            if budget is not None:
                budget.give(held, tenant_id)


class Credential(NamedTuple):
    """What `check_credential` found before a bulk body is read: the route's refusal, if it would
    refuse the caller, and else the caller's tenant when known (its share of the body budget)."""

    refusal: AppError | None = None
    tenant_id: str | None = None


_LET_THROUGH = Credential()


async def check_credential(scope: Scope, state: State, settings: Settings) -> Credential:
    """For a bulk route of the pool or the Tinker API, before its body is read: the 401 or 403 its
    route would answer the request's credential with; else a valid Tinker key's tenant (none for
    the pool's worker token, or a route checked after the read). The pool's worker token is
    compared in place; a Tinker key is known to the key caches, or looked up in a worker thread (a
    database query). The tenants' bulk routes: `_tenant_credential`."""
    path: str = scope.get("path", "")
    if _TENANT_BULK.match(path) is not None:
        # POST only: another method there is the router's 405, whoever asks.
        if scope.get("method") != "POST":
            return _LET_THROUGH
        return await _tenant_credential(Request(scope), state)
    if not path.startswith(_CHECKED_FIRST):
        return _LET_THROUGH
    request = Request(scope)
    try:
        if path.startswith("/v1/pool/"):
            token = bearer_token(request)
            worker = settings.worker_token
            if worker is not None and same_secret(token, worker.get_secret_value()):
                return _LET_THROUGH
            # Not the worker token: refused either way; whether 401 or 403 (another role's valid
            # credential) may take a database lookup.
            return Credential(await run_in_threadpool(_worker_refusal, request, state, settings))
        digest = tinker_key_hash(request)
        if (hit := cached_key(state, digest)) is not None:
            return Credential(tenant_id=hit.tenant_id)
    except AppError as refused:
        return Credential(refused)
    return await run_in_threadpool(_tinker_credential, state, digest)


async def _tenant_credential(request: Request, state: State) -> Credential:
    """For a tenants' bulk route: the route's 401 when its body need not be read to know it; else
    the key's tenant when the caches or the guard's lookup know it, or nothing (the route decides,
    as it did). Never a refusal but a 401 the route would answer too: both routes refuse a caller
    before they look at the body."""
    try:
        # No header or a malformed one: the route's own first check, and its message.
        digest = hash_key(bearer_token(request))
        if (hit := cached_key(state, digest)) is not None:  # a cached miss raises the route's 401 instead
            return Credential(tenant_id=hit.tenant_id)  # the hot path: one dict lookup
    except Unauthorized as refused:
        # A Bearer route's 401 names its scheme (cached_key's miss carries none: the Tinker API
        # shares it, and its X-API-Key has no scheme to name).
        refused.challenge = refused.challenge or INVALID_TOKEN_CHALLENGE
        return Credential(refused)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) <= _PRECHECKED_BODY_BYTES:
        # Read first, as before, and charged to no tenant: stalled, it holds at most this much.
        return _LET_THROUGH
    return await run_in_threadpool(_tenant_key_credential, state, digest)


def _tenant_key_credential(state: State, digest: str) -> Credential:
    """401 when no valid key has this hash (remembered in the miss cache, as the route's lookup
    would), else the key's tenant, for its share of the body budget. A valid key is cached as the
    route's lookup caches it (app/auth.py `known_key`, the revocation bound included), so the route
    does not look it up again: a batch whose key's cache entry had just expired took the documented
    handler and a second lookup (tests/app/test_lean_ingest.py). The tenant is known either way, so
    a tenant's stalled bodies, which never reach the route, are still charged to it. A database
    error lets the request through, charged to no tenant: the route looks the key up again and
    answers what it would have (its uniform 503 if the database is still failing), not the guard."""
    settings: Settings = state.settings
    valid = key_cache(state, settings.api_key_cache_seconds)
    read_in = valid.generation  # before the read: a revocation clearing the cache meanwhile wins
    try:
        with state.session_factory() as session:
            row = session.execute(
                select(ApiKey.id, ApiKey.tenant_id, ApiKey.revoked_at).where(ApiKey.key_hash == digest)
            ).first()
    except SQLAlchemyError:
        return _LET_THROUGH
    if row is None or row.revoked_at is not None:
        key_miss_cache(state, settings.api_key_miss_cache_seconds).put(digest, True)
        return Credential(Unauthorized(INVALID_KEY, challenge=INVALID_TOKEN_CHALLENGE))
    valid.put(digest, CachedKey(tenant_id=row.tenant_id, api_key_id=row.id), read_in=read_in)
    return Credential(tenant_id=row.tenant_id)


def _worker_refusal(request: Request, state: State, settings: Settings) -> AppError | None:
    with state.session_factory() as session:
        try:
            require_worker(request, settings, session, None)
        except AppError as refused:
            return refused
    return None


def _tinker_credential(state: State, digest: str) -> Credential:
    with state.session_factory() as session:
        try:
            key = known_key(state, session, digest)  # cached for the route when valid
        except AppError as refused:
            return Credential(refused)
    return Credential(tenant_id=key.tenant_id)


def _head_refusal(scope: Scope, headers: dict[bytes, bytes], limit: int) -> tuple[int, dict[str, Any]] | None:
    """What the request line and headers alone are refused with, if anything."""
    if _head_bytes(scope) > MAX_HEADER_BYTES:
        # The protocol refuses a head that outgrows the limit while it is still arriving (app/serving.py);
        # one that arrived whole in a single read is caught here, so the limit is exact.
        return 431, _headers_too_large()
    problem = _query_problem(scope) or _repeated_header(scope)
    if problem is not None:
        return 422, problem
    encoding = headers.get(b"content-encoding", b"identity").strip().lower()
    if encoding not in (b"identity", b""):
        return 415, _encoded(encoding)
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return 413, _too_large(limit)
    return None


def _cut_short(headers: dict[bytes, bytes], received: int) -> bool:
    """Whether a request whose client disconnected had a body that did not arrive whole: chunked
    (its last chunk never came, or the server would have said the body ended), or shorter than its
    Content-Length. (The server drops what it buffered once the connection is lost, so a body sent
    whole just before a close counts as cut too: it was never read.)"""
    if headers.get(b"transfer-encoding"):
        return True
    declared = headers.get(b"content-length", b"0").strip()
    return not declared.isdigit() or int(declared) > received


async def _refuse(
    send: Send, status: int, body: dict[str, Any], extra_headers: dict[str, str] | None = None
) -> None:
    # Connection: close on refusals sent before the body was read: the rest of it may still be
    # in flight and must not be read as the next request. `extra_headers`: the refusal's own (a
    # 401's WWW-Authenticate).
    headers = {**(extra_headers or {}), "Connection": "close"}
    if status in (ServiceUnavailable.status, RateLimited.status):  # the body budget's refusals
        headers["Retry-After"] = str(BUSY_RETRY_AFTER_SECONDS)
    response = JSONResponse(body, status_code=status, headers=headers)
    await response({"type": "http"}, _empty_receive, send)


async def _empty_receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def _head_bytes(scope: Scope) -> int:
    """The size of the request line and headers, as sent (near enough: separators counted)."""
    line = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b"")) + 16
    return line + sum(len(name) + len(value) + 4 for name, value in scope.get("headers") or [])


def _headers_too_large() -> dict[str, Any]:
    return error_body(
        "request_header_fields_too_large", f"request line and headers exceed {MAX_HEADER_BYTES} bytes"
    )


def _encoded(encoding: bytes) -> dict[str, Any]:
    return error_body(
        "unsupported_media_type",
        f"Content-Encoding {encoding.decode('latin-1')[:40]!r} is not supported: send the body uncompressed",
    )


def _too_large(limit: int) -> dict[str, Any]:
    return error_body("payload_too_large", f"request body exceeds {limit} bytes")


def _timeout(seconds: float) -> dict[str, Any]:
    return error_body("request_timeout", f"the request body did not arrive within {seconds:g} s")


def _busy() -> dict[str, Any]:
    return error_body(
        ServiceUnavailable.code,
        "the service is receiving too many request bodies at once (max_buffered_body_bytes); retry shortly",
    )


def _tenant_busy(limit: int) -> dict[str, Any]:
    """This tenant's bodies being received hold its share of the body budget: its own limit, in
    the form of the other per-tenant limits' 429 (app/limits.py)."""
    return error_body(
        RateLimited.code,
        f"too many request bodies of this tenant being received at once (limit {limit} bytes: "
        "tenant_max_buffered_body_bytes); retry shortly",
        {"limit": limit, "kind": "buffered_body_bytes"},
    )


def _invalid(loc: list[str], msg: str, kind: str) -> dict[str, Any]:
    where = ".".join(loc)
    return error_body("validation_error", f"{where}: {msg}", [{"loc": loc, "msg": msg, "type": kind}])


def _query_problem(scope: Scope) -> dict[str, Any] | None:
    path = scope.get("path", "")
    raw_path: bytes = scope.get("raw_path", b"")
    if "\x00" in path or "\x00" in unquote(raw_path.decode("latin-1")):
        return _invalid(["path"], "must not contain a NUL character", "nul_character")
    # The server decodes the path with U+FFFD for bytes that are not UTF-8: only a path holding one
    # (rare, and then maybe sent as such, %EF%BF%BD) has its raw bytes checked.
    if "\ufffd" in path and raw_path and not _is_utf8(unquote_to_bytes(raw_path)):
        return _invalid(["path"], _NOT_UTF8, "unicode_error")
    raw_query = scope.get("query_string", b"")
    if (b"%" in raw_query or not raw_query.isascii()) and (problem := _query_not_utf8(raw_query)):
        return problem
    if b"&" in raw_query and (repeated := _repeated_query_parameter(raw_query)):
        return repeated
    if b"%00" not in raw_query and b"\x00" not in raw_query:
        return None
    for name, value in parse_qsl(raw_query.decode("latin-1"), keep_blank_values=True):
        if "\x00" in name or "\x00" in value:
            return _invalid(
                ["query", name.replace("\x00", "")], "must not contain a NUL character", "nul_character"
            )
    return None


def _repeated_query_parameter(raw_query: bytes) -> dict[str, Any] | None:
    """422 naming a query parameter given more than once. No route takes a list in its query, and
    the router keeps the last of a repeated one silently (`?limit=1&limit=500` listed 500 items,
    `?name=a&name=b` stored an adapter named "b")."""
    seen: set[str] = set()
    for name, _ in parse_qsl(raw_query.decode("utf-8", "replace"), keep_blank_values=True):
        if name in seen:
            message = f"query parameter {name!r} is given more than once; give it once"
            return error_body(
                "validation_error",
                message,
                [{"loc": ["query", name], "msg": message, "type": "repeated_query_parameter"}],
            )
        seen.add(name)
    return None


_NOT_UTF8 = "not UTF-8 once percent-decoded"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _query_not_utf8(raw_query: bytes) -> dict[str, Any] | None:
    """422 naming the first parameter whose name or value is not UTF-8 once percent-decoded (the
    router would take it with U+FFFD in place of those bytes: an adapter named `\ufffd`), or None."""
    if _is_utf8(unquote_to_bytes(raw_query)):  # the whole query at once: the common case
        return None
    for field in raw_query.split(b"&"):
        name, _, value = field.partition(b"=")
        decoded_name = unquote_to_bytes(name.replace(b"+", b" "))
        if not _is_utf8(decoded_name):
            return _invalid(["query"], _NOT_UTF8, "unicode_error")
        if not _is_utf8(unquote_to_bytes(value.replace(b"+", b" "))):
            return _invalid(["query", decoded_name.decode()], _NOT_UTF8, "unicode_error")
    return _invalid(["query"], _NOT_UTF8, "unicode_error")  # split across fields: not expected


_SINGLE_HEADERS = frozenset({b"authorization", b"content-type", b"idempotency-key"})


def _repeated_header(scope: Scope) -> dict[str, Any] | None:
    seen: set[bytes] = set()
    for name, _ in scope.get("headers") or []:
        if name in _SINGLE_HEADERS:
            if name in seen:
                return _invalid(["header", name.decode()], "must be sent once", "repeated_header")
            seen.add(name)
    return None


def _is_json(content_type: bytes) -> bool:
    media = content_type.decode("latin-1").split(";", 1)[0].strip().lower()
    # No Content-Type counts: the runs route parses such a body as JSON.
    return media in ("", "application/json") or media.endswith(_JSON_MEDIA_SUFFIX)


def _json_problem(content_type: bytes, body: bytes, *, typed: bool = False) -> dict[str, Any] | None:
    if not body or not _is_json(content_type):
        return None
    # JSON is UTF-8 (RFC 8259), where a NUL byte is never text; Python's json.loads also reads UTF-16
    # and UTF-32 bytes, ASCII-looking ones with a NUL between their characters, which every scan here
    # (digits, `\\u0000`) would read past.
    if (nul := body.find(b"\x00")) != -1:
        return _invalid(["body"], f"not UTF-8: a NUL byte at {nul} (UTF-16 or UTF-32 text?)", "unicode_error")
    if not body.isascii():
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return _invalid(["body"], f"not UTF-8 (byte {exc.start})", "unicode_error")
    if not typed and too_deep(body):
        return _invalid(["body"], f"nested deeper than {MAX_JSON_DEPTH} levels", "too_deep")
    if not typed:
        too_long = long_integer_in_json(body, locate=len(body) <= _LOCATED_BODY_BYTES)
        if too_long is not None:
            return error_body("validation_error", integer_too_long_message(too_long), [too_long])
    # A raw NUL byte was refused above; an escaped one is `\u0000` not preceded by an escaped
    # backslash (`\\u0000` is a backslash, then the text "u0000").
    if b"\\u0000" not in body or b"\\u0000" not in body.replace(b"\\\\", b""):
        return None
    if len(body) > _LOCATED_BODY_BYTES:
        return _invalid(["body"], "must not contain a NUL character", "nul_character")
    try:
        data = json.loads(body)
    except ValueError:
        return None  # malformed: the route's parser reports it
    where = nul_path(data)
    if where is None:
        return None
    return _invalid(["body", *where], "must not contain a NUL character", "nul_character")


_QUOTE = b'"'
# Each byte as what it does to the nesting level, as int8: +1 for [ {, -1 for ] }, 0 for the rest.
_BRACKET_STEPS = bytes(1 if c in b"[{" else 255 if c in b"]}" else 0 for c in range(256))
_BLOCK_BYTES = 1 << 22  # the scan's temporaries stay a few times this, whatever the body's size


def too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether arrays/objects nest deeper than `limit`: linear, C- and numpy-speed passes, no
    recursion and no regular expression (a regex over a 60 MB string took 19 s). With no more
    brackets than `limit` it cannot be. Else strings are found by their quotes once escaped
    backslashes and escaped quotes are dropped (what is left of the quotes delimits strings), and
    the level of the brackets outside strings is a running sum, block by block (numpy passes, which
    release the GIL). A closing bracket below level 0 is malformed JSON: a parser stops there, so
    nothing after it counts."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    level, in_string = 0, False
    for start in range(0, len(text), _BLOCK_BYTES):
        block = text[start : start + _BLOCK_BYTES]
        steps = np.frombuffer(block.translate(_BRACKET_STEPS), dtype=np.int8).copy()
        if in_string or _QUOTE in block:
            # After each byte: inside a string? (an odd number of quotes so far, counting the block's
            # first byte as inside when the previous block ended inside one)
            inside = np.logical_xor.accumulate(np.frombuffer(block, dtype=np.uint8) == ord('"'))
            if in_string:
                np.logical_not(inside, out=inside)
            steps[inside] = 0  # a quote is no bracket: its own flag does not matter
            in_string = bool(inside[-1])
        levels = np.cumsum(steps, dtype=np.int32)
        levels += level
        if int(levels.min()) < 0:  # malformed: count only up to the first closing bracket too many
            levels = levels[: int(np.argmax(levels < 0))]
            return bool(levels.size) and int(levels.max()) > limit
        if int(levels.max()) > limit:
            return True
        level = int(levels[-1])
    return False


def nested_deeper(data: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a parsed value (dicts and lists) nests deeper than `limit`. Iterative: any depth. For
    formats whose nesting the byte scan cannot see, e.g. TOML's dotted table headers (`[a.b.c...]`
    nests without a bracket per level)."""
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def nul_path(data: Any) -> list[str] | None:
    """The path of the first string (value or key) holding a NUL, or None. Iterative: any depth."""
    stack: list[tuple[Any, list[str]]] = [(data, [])]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return path
        elif isinstance(item, dict):
            for key, value in item.items():
                if "\x00" in key:
                    return [*path, key.replace("\x00", "")]
                stack.append((value, [*path, key]))
        elif isinstance(item, list):
            stack.extend((value, [*path, str(i)]) for i, value in enumerate(item))
    return None


# --- integers longer than Python converts -------------------------------------------------------
# int() of a decimal string of more than sys.get_int_max_str_digits() digits (4300 by default) raises
# a ValueError that speaks of Python's internals ("use sys.set_int_max_str_digits()"). json.loads
# and tomllib convert every integer with it, so a client's 5,000-digit number came back as that
# message (the runs route) or a bare 400 "There was an error parsing the body" (FastAPI's typed
# bodies). These find such a number, and its field, so that it is a 422 that says what is wrong.

_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= c <= 0x39 else 0x2E for c in range(256))
"""Each byte as b"0" if an ASCII digit, else b".": a run of digits becomes a run of b"0"."""


def max_int_digits() -> int:
    """The most digits of a decimal integer Python converts (0: no limit)."""
    return sys.get_int_max_str_digits()


def integer_too_long(loc: list[str], digits: int, limit: int) -> dict[str, Any]:
    """The 422 detail item of a number of `digits` digits at `loc` (more than `limit`)."""
    return {
        "loc": loc,
        "msg": f"number too long: {digits} digits (at most {limit})",
        "type": "integer_too_long",
        "limit": limit,
        "actual": digits,
    }


def integer_too_long_message(detail: dict[str, Any]) -> str:
    return f"{'.'.join(detail['loc'])}: {detail['msg']}"


def has_digit_run(text: bytes, longer_than: int) -> bool:
    """Whether `text` holds more than `longer_than` ASCII digits in a row (in a string or not):
    linear, C-speed passes (a substring search, not a regular expression, whose retries at each
    digit of a long run would be quadratic), block by block."""
    needle = b"0" * (longer_than + 1)
    for start in range(0, len(text), _BLOCK_BYTES):
        if needle in text[start : start + _BLOCK_BYTES + longer_than].translate(_DIGITS_AS_ZERO):
            return True
    return False


class LongInteger(NamedTuple):
    """Stands, in a parsed value, for an integer literal of more digits than Python converts."""

    digits: int


def first_path(data: Any, found: Callable[[Any], bool]) -> tuple[list[str], Any] | None:
    """(path, value) of the first value (in document order) for which `found` is true, or None.
    Iterative: any depth."""
    stack: list[tuple[Any, list[str]]] = [(data, [])]
    while stack:
        item, path = stack.pop()
        if found(item):
            return path, item
        if isinstance(item, dict):
            stack.extend((value, [*path, str(key)]) for key, value in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((value, [*path, str(i)]) for i, value in reversed(list(enumerate(item))))
    return None


_DIGITS_IN_ERROR = re.compile(r"value has (\d+) digits")


def long_integer_in_json(body: bytes, *, locate: bool = True) -> dict[str, Any] | None:
    """The 422 detail item of the first integer in a JSON body with more digits than Python converts
    (its field in `loc` when the body parses and `locate`; else `["body"]`), or None. Cheap unless
    the body holds such a run of digits: only then is it parsed (an integer's digits are never split,
    so none can be longer), by the C parser alone unless `locate` (a Python call per integer)."""
    limit = max_int_digits()
    if not limit or not has_digit_run(body, limit):
        return None
    if not locate:
        try:
            json.loads(body)
        except ValueError as exc:
            said = _DIGITS_IN_ERROR.search(str(exc))  # int()'s own error, the digits it counted
            if said is not None:
                return integer_too_long(["body"], int(said[1]), limit)
        return None  # the digits were in strings or floats (or the body is malformed: the route says so)
    seen: list[LongInteger] = []

    def parse_int(text: str) -> int | LongInteger:
        digits = len(text.lstrip("-"))
        if digits > limit:
            seen.append(LongInteger(digits))
            return seen[-1]
        return int(text)

    try:
        data = json.loads(body, parse_int=parse_int)
    except ValueError:  # malformed after the number (or not UTF-8): the number is still what it is
        data = None
    if not seen:
        return None  # the digits were in strings, or in a float (which converts whatever its length)
    found = first_path(data, lambda item: isinstance(item, LongInteger))
    if found is None:  # a key given twice kept its later value: the body still holds the number
        return integer_too_long(["body"], seen[0].digits, limit)
    path, number = found
    return integer_too_long(["body", *path], number.digits, limit)
