"""Typed client of the loraloom public API (docs/contracts.md), sync and async.

Every operation is written once, as a generator that yields the HTTP requests it
needs and parses the responses it is sent back (`_Ops`). `LoraloomClient` and
`AsyncLoraloomClient` are thin drivers: they send each request over httpx with
retries, turn error answers into typed exceptions (`orchestrator.errors`) and
feed the responses back into the generator.

Retries: connection errors, timeouts, 429 (honouring Retry-After) and 5xx are
retried with exponential backoff and full jitter; every other 4xx raises at
once. Each logical request carries one `Idempotency-Key` (uuid4), reused by all
its retries, so a batch whose 201 was lost on the wire is stored once.

Bounds (`orchestrator.bounded`): every HTTP attempt has a total deadline
(connect, send, the whole answer: `deadline`, 300 s; `transfer_deadline`, 1 h,
for adapter downloads and uploads) on top of httpx's per-operation `timeout`,
and an answer is read chunk by chunk under a size cap (`max_response_bytes`,
64 MiB), refused unread when its Content-Length is over it. Overruns raise
`DeadlineExceeded` / `ResponseTooLarge` and are not retried. The service has no
streaming route the SDK follows (the run event stream is not used here).

Adapter downloads are streamed to an unnamed temporary file beside the
destination (capped by `max_download_bytes`, 8 GiB, the most an archive may
expand to), then extracted (`orchestrator.archive`) in the calling thread, also
by the async client: this keeps the operation a single piece of code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import tempfile
import time
import uuid
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, TypeVar
from urllib.parse import urlsplit

import httpx
from pydantic import TypeAdapter

from contracts.arrays import NoBinaryForm, to_arrays
from contracts.arrays import encode as encode_arrays
from contracts.http import (
    RetryPolicy,
    Unauthorized,
    ValidationError,
    api_prefix_problem,
    send_with_retries,
    send_with_retries_async,
    tinker_surface_hint,
)
from contracts.ids import MAX_IDEMPOTENCY_KEY, is_idempotency_key, is_run_id
from contracts.names import run_name_problem
from contracts.run_config import RunConfig
from contracts.status import RunStatus
from contracts.wire import Problem, TrainingBatch, json_encoder
from orchestrator import bounded
from orchestrator.archive import DEFAULT_MAX_BYTES, adapter_dir_tar, extract_adapter, read_marker
from orchestrator.errors import ApiError, RunFailed, error_from_response
from orchestrator.models import (
    AdapterDownload,
    AdapterInfo,
    BatchInfo,
    Heartbeat,
    Page,
    Run,
    StepMetrics,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
BatchFormat = Literal["msgpack", "json"]
EvictedBy = Literal["user", "orchestrator"]
AdapterStep = int | Literal["latest"]

_USER_AGENT = "loraloom-sdk/0.1"

DEFAULT_DEADLINE_S = 300.0
"""Total time one HTTP attempt of an API call may take (connect, send, the whole answer)."""
DEFAULT_TRANSFER_DEADLINE_S = 3600.0
"""The same for adapter downloads and uploads: up to gigabytes, on links of a few MB/s."""
DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024**2
"""The largest answer held in memory: pages of runs, batches and metrics are far smaller."""
DEFAULT_MAX_DOWNLOAD_BYTES = DEFAULT_MAX_BYTES
"""The largest adapter archive downloaded (to disk): what `extract_adapter` lets one expand to."""
ADAPTER_PAGE_SIZE = 200
"""Adapters per request of `list_adapters` (the service's largest page: some 40 KB of JSON)."""


def check_run_id(run_id: str) -> str:
    """Refuse anything but `run_` + 12 lowercase hex before it goes into a URL path."""
    if not isinstance(run_id, str) or not is_run_id(run_id):
        raise ValueError(f"not a run id: {run_id!r} (expected run_ + 12 lowercase hex digits)")
    return run_id


@dataclass
class _Request:
    """One HTTP request of an operation; `headers` (with the idempotency key) is fixed across retries."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    accept: tuple[int, ...] = ()
    """Non-2xx statuses that are answers, not errors (304 for adapter downloads)."""
    transfer: bool = False
    """An adapter download or upload: `transfer_deadline` instead of `deadline`."""
    sink: IO[bytes] | None = None
    """Where a successful answer's body goes instead of memory (capped by `max_download_bytes`)."""

    @property
    def what(self) -> str:
        return f"{self.method} {self.path}"


_Op = Generator[_Request, httpx.Response, T]


def _idempotency_headers(key: str | None) -> dict[str, str]:
    if key is not None and not is_idempotency_key(key):
        # Refused here rather than by the service's 422: the same message before anything is sent.
        raise ValueError(
            f"not an idempotency key: {key[:64]!r} (1 to {MAX_IDEMPOTENCY_KEY} printable ASCII "
            "characters without space)"
        )
    return {"Idempotency-Key": key or str(uuid.uuid4())}


def _check_run_name(name: str, *, what: str = "run name") -> None:
    """The service's rule for a run's name (contracts.names; an uploaded adapter's name follows it
    too), checked before anything is sent: the same message as its 422, with no request spent and
    nothing retried."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__}")
    problem = run_name_problem(name)
    if problem is not None:
        raise ValueError(f"{what} {problem.message}")


def _clean_params(**params: Any) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}


def _unquote_etag(value: str | None) -> str | None:
    if not value:
        return None
    value = value.strip()
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"') or None


_RUN_PAGE = TypeAdapter(Page[Run])
_BATCH_PAGE = TypeAdapter(Page[BatchInfo])
_ADAPTER_PAGE = TypeAdapter(Page[AdapterInfo])
_METRICS = TypeAdapter(list[StepMetrics])


class _Ops:
    """The API's operations, transport-free: each yields requests and returns the parsed result."""

    @staticmethod
    def create_run(
        name: str,
        config: RunConfig | Mapping[str, Any] | None,
        idempotency_key: str | None,
        init_from: Mapping[str, Any] | None = None,
    ) -> _Op[Run]:
        _check_run_name(name)
        if isinstance(config, RunConfig):
            # Only what the user set: the service applies the same defaults, and an older
            # service does not choke on fields it has never heard of.
            body_config: dict[str, Any] = config.model_dump(mode="json", exclude_unset=True)
        else:
            body_config = dict(config or {})
        response = yield _Request(
            "POST",
            "/v1/runs",
            json={"name": name, "config": body_config}
            | ({"init_from": dict(init_from)} if init_from is not None else {}),
            headers=_idempotency_headers(idempotency_key),
        )
        return Run.model_validate(response.json())

    @staticmethod
    def get_run(run_id: str) -> _Op[Run]:
        response = yield _Request("GET", f"/v1/runs/{check_run_id(run_id)}")
        return Run.model_validate(response.json())

    @staticmethod
    def list_runs(status: str | None, limit: int | None, cursor: str | None) -> _Op[Page[Run]]:
        response = yield _Request(
            "GET", "/v1/runs", params=_clean_params(status=status, limit=limit, cursor=cursor)
        )
        return _RUN_PAGE.validate_python(response.json())

    @staticmethod
    def evict_run(run_id: str, reason: str, by: EvictedBy) -> _Op[Run]:
        if by not in ("user", "orchestrator"):
            raise ValueError(f"by must be 'user' or 'orchestrator', not {by!r}")
        body: dict[str, Any] = {"reason": reason}
        if by == "orchestrator":
            body["by"] = "orchestrator"
        response = yield _Request(
            "POST", f"/v1/runs/{check_run_id(run_id)}/evict", json=body, headers=_idempotency_headers(None)
        )
        return Run.model_validate(response.json())

    @staticmethod
    def delete_run(run_id: str) -> _Op[Run]:
        response = yield _Request("DELETE", f"/v1/runs/{check_run_id(run_id)}")
        return Run.model_validate(response.json())

    @staticmethod
    def heartbeat(run_id: str) -> _Op[Heartbeat]:
        response = yield _Request("POST", f"/v1/runs/{check_run_id(run_id)}/heartbeat")
        return Heartbeat.model_validate(response.json())

    @staticmethod
    def submit_batch(
        run_id: str, batch: TrainingBatch, fmt: BatchFormat, idempotency_key: str | None
    ) -> _Op[BatchInfo]:
        if not isinstance(batch, TrainingBatch):
            raise TypeError(f"batch must be a contracts.wire.TrainingBatch, not {type(batch).__name__}")
        if fmt == "msgpack":
            # The binary form (contracts/arrays.py): typed arrays the service checks with numpy and
            # stores as sent; the per-token lists are converted here, once.
            try:
                content, ctype = encode_arrays(to_arrays(batch)), "application/msgpack"
            except NoBinaryForm as exc:  # the 422 the service gives the same batch in JSON, unsent
                problem = Problem(exc.index, exc.field, exc.problem)
                raise ValidationError(
                    f"invalid batch: {exc}", code="validation_error", details=[problem.as_dict()]
                ) from None
        elif fmt == "json":
            content, ctype = json_encoder.encode(batch), "application/json"
        else:
            raise ValueError(f"fmt must be 'msgpack' or 'json', not {fmt!r}")
        response = yield _Request(
            "POST",
            f"/v1/runs/{check_run_id(run_id)}/batches",
            content=content,
            headers={"Content-Type": ctype, **_idempotency_headers(idempotency_key)},
        )
        return BatchInfo.model_validate(response.json())

    @staticmethod
    def list_batches(
        run_id: str, state: str | None, limit: int | None, cursor: str | None
    ) -> _Op[Page[BatchInfo]]:
        response = yield _Request(
            "GET",
            f"/v1/runs/{check_run_id(run_id)}/batches",
            params=_clean_params(state=state, limit=limit, cursor=cursor),
        )
        return _BATCH_PAGE.validate_python(response.json())

    @staticmethod
    def list_adapters(run_id: str) -> _Op[list[AdapterInfo]]:
        """Every adapter of the run, oldest step first, following the service's pages."""
        path = f"/v1/runs/{check_run_id(run_id)}/adapters"
        items: list[AdapterInfo] = []
        cursor: str | None = None
        while True:
            response = yield _Request(
                "GET", path, params=_clean_params(limit=ADAPTER_PAGE_SIZE, cursor=cursor)
            )
            page = _ADAPTER_PAGE.validate_python(response.json())
            # Pages are keyed on the step: each must go on past the one before, or a service
            # answering cursors in a cycle (or empty pages with a cursor) would hold this call, and
            # its growing list, for ever.
            steps = [items[-1].step if items else -1] + [a.step for a in page.items]
            if any(a >= b for a, b in itertools.pairwise(steps)) or (page.next_cursor and not page.items):
                raise ApiError(f"GET {path} answered a page that does not go on past step {steps[0]}")
            items += page.items
            if page.next_cursor is None:
                return items
            cursor = page.next_cursor

    @staticmethod
    def latest_adapter(run_id: str) -> _Op[AdapterInfo | None]:
        """The run's newest adapter (highest step) in one request; None while it has none."""
        response = yield _Request(
            "GET",
            f"/v1/runs/{check_run_id(run_id)}/adapters",
            params={"newest_first": "true", "limit": 1},
        )
        items = _ADAPTER_PAGE.validate_python(response.json()).items
        # The highest step, not the first item: a service from before paging ignores both parameters
        # and answers every adapter, oldest first.
        return max(items, key=lambda a: a.step, default=None)

    @staticmethod
    def fetch_adapter(run_id: str, step: AdapterStep, dest_dir: Path) -> _Op[AdapterDownload]:
        if step != "latest" and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ValueError(f"step must be a non-negative int or 'latest', not {step!r}")
        dest = Path(dest_dir)
        marker = read_marker(dest) if dest.is_dir() else None
        headers: dict[str, str] = {}
        if marker and marker.get("sha256"):
            headers["If-None-Match"] = f'"{marker["sha256"]}"'
        # The archive goes to disk, not memory, on the destination's file system (where the
        # adapter will lie anyway; /tmp may be RAM); unnamed, so nothing is left behind.
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=dest.parent) as archive:
            response = yield _Request(
                "GET",
                f"/v1/runs/{check_run_id(run_id)}/adapters/{step}",
                headers=headers,
                accept=(304,),
                transfer=True,
                sink=archive,
            )
            if response.status_code == 304 and marker is not None:
                return AdapterDownload(
                    path=dest, step=marker.get("step"), sha256=marker.get("sha256"), changed=False
                )
            if response.status_code == 304:
                raise ApiError("server answered 304 to a request without If-None-Match", status=304)
            sha = _unquote_etag(response.headers.get("etag"))
            step_header = response.headers.get("x-adapter-step")
            got_step = (
                int(step_header)
                if step_header and step_header.isdigit()
                else (step if isinstance(step, int) else None)
            )
            archive.seek(0)
            extract_adapter(archive, dest, sha256=sha, step=got_step)
        return AdapterDownload(path=dest, step=got_step, sha256=sha, changed=True)

    @staticmethod
    def get_metrics(run_id: str, since_step: int = 0) -> _Op[list[StepMetrics]]:
        """Every step from `since_step` on, following the service's pages."""
        items: list[StepMetrics] = []
        next_step: int | None = since_step
        while next_step is not None:
            response = yield _Request(
                "GET", f"/v1/runs/{check_run_id(run_id)}/metrics", params={"since_step": next_step}
            )
            body = response.json()
            items += _METRICS.validate_python(body["items"])
            next_step = body.get("next_since_step")
        return items

    @staticmethod
    def upload_adapter(adapter_dir: Path, name: str, base_model: str | None) -> _Op[dict[str, Any]]:
        _check_run_name(name, what="adapter name")
        response = yield _Request(
            "POST",
            "/v1/adapters",
            params={"name": name, **({"base_model": base_model} if base_model else {})},
            content=adapter_dir_tar(adapter_dir),
            headers={"Content-Type": "application/x-tar"},
            transfer=True,
        )
        return dict(response.json())


@dataclass(frozen=True)
class ClientSettings:
    """What both clients are configured with."""

    base_url: str
    api_key: str | None = None
    timeout: float | httpx.Timeout = 30.0
    """httpx's, per socket operation (connect, each read, each write, waiting for the pool)."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    deadline: float | None = DEFAULT_DEADLINE_S
    """Seconds one HTTP attempt may take in all (None: no total deadline, only `timeout`)."""
    transfer_deadline: float | None = DEFAULT_TRANSFER_DEADLINE_S
    """`deadline` for adapter downloads and uploads."""
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    """The largest answer read into memory (every answer but a downloaded adapter's)."""
    max_download_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES
    """The largest adapter archive downloaded (to a temporary file)."""

    def __post_init__(self) -> None:
        for name in ("deadline", "transfer_deadline"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds or None, not {value!r}")
        for name in ("max_response_bytes", "max_download_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive number of bytes, not {value!r}")

    def bounds(self, request: _Request) -> dict[str, Any]:
        """The keyword arguments of `bounded.send` for `request`."""
        return {
            "deadline_s": self.transfer_deadline if request.transfer else self.deadline,
            "max_bytes": self.max_response_bytes,
            "sink": bounded.Sink(request.sink, self.max_download_bytes) if request.sink else None,
        }

    def http_kwargs(self) -> dict[str, Any]:
        headers = {"User-Agent": _USER_AGENT}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        timeout = self.timeout if isinstance(self.timeout, httpx.Timeout) else httpx.Timeout(self.timeout)
        return {"base_url": self.base_url, "headers": headers, "timeout": timeout}


_CHARACTER_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", " ": "a space"}


def _character(char: str) -> str:
    """`char` named for an error message: by name or code point, never as itself (it is part of a secret)."""
    if char in _CHARACTER_NAMES:
        return _CHARACTER_NAMES[char]
    kind = "a control character" if char.isascii() else "a non-ASCII character"
    return f"{kind} (U+{ord(char):04X})"


def api_key_problem(api_key: object) -> str | None:
    """Why `api_key` cannot be sent as `Authorization: Bearer <key>`, else None; the CLI's --key is
    checked with it too. A key is a token of printable ASCII without spaces (the service's keys are
    `llk_` + letters and digits). A key read from a file with its line end was refused by httpx on
    each call (an illegal header value, retried as a transport failure), a non-ASCII one (a pasted
    smart character) raised a bare UnicodeEncodeError. The message names the character and its
    position, never the key: a secret must not reach a log."""
    if not isinstance(api_key, str):
        return f"must be a str, not {type(api_key).__name__}"
    for position, char in enumerate(api_key, start=1):
        if not "\x21" <= char <= "\x7e":
            last = " (the last)" if position == len(api_key) else ""
            return (
                f"holds {_character(char)} as character {position} of {len(api_key)}{last}: a key is "
                "printable ASCII without spaces or line ends (one read from a file: strip it)"
            )
    return None


def url_parts_problem(base_url: str) -> str | None:
    """Why `base_url` holds parts a base URL must not, else None (the CLI's --url is checked with it
    too): user:password@, which httpx sends as Basic auth in place of the Bearer key (each call a 401
    that reads as a wrong key), or a query or fragment, which every route's path silently drops (each
    call a bare 404). Its text is not repeated: user info may hold a password."""
    parts = urlsplit(base_url)
    if "@" in parts.netloc:
        return (
            "holds user info (user:password@host): the API key is the only credential, "
            "give the URL without it, e.g. http://host:8000"
        )
    if "?" in base_url or "#" in base_url:
        return "holds a query (?...) or fragment (#...): give the service's base URL alone, e.g. http://host:8000"
    return None


def _settings(
    base_url: str,
    api_key: str | None,
    timeout: float | httpx.Timeout,
    retry: RetryPolicy | None,
    max_attempts: int | None,
    **bounds: Any,
) -> ClientSettings:
    if not base_url.lower().startswith(("http://", "https://")):
        # httpx would fail on the first call with its UnsupportedProtocol, no LoraloomError.
        raise ValueError(
            f"base_url {base_url!r} must start with http:// or https:// (e.g. http://127.0.0.1:8000)"
        )
    if problem := url_parts_problem(base_url):
        raise ValueError(f"base_url {problem}")
    if problem := api_prefix_problem(base_url):
        raise ValueError(f"base_url {problem}")  # each call was a 401 (/api/v1) or a 404 (/v1)
    if not api_key:
        # No route of the SDK answers without one: every call was a 401.
        raise ValueError(
            "api_key is required: every route of the service needs a tenant API key "
            "(an admin creates one with `loraloom keys create <tenant_id>`)"
        )
    if problem := api_key_problem(api_key):
        raise ValueError(f"api_key {problem}")
    policy = retry or RetryPolicy()
    if max_attempts is not None:
        policy = dataclasses.replace(policy, max_attempts=max_attempts)
    return ClientSettings(
        base_url=base_url.rstrip("/"), api_key=api_key, timeout=timeout, retry=policy, **bounds
    )


def _wait_deadline(timeout: float, poll: float) -> float:
    if poll <= 0 or timeout < 0:
        raise ValueError(f"poll must be > 0 and timeout >= 0, not poll={poll!r}, timeout={timeout!r}")
    return time.monotonic() + timeout


def still_queued(run: Run, *, deadline: float, timeout: float) -> bool:
    """Whether `wait_until_active` polls `run` again: False once it is active; raises once it has
    ended (it never will be) or the `deadline` (time.monotonic) has passed."""
    if run.status == RunStatus.ACTIVE:
        return False
    run.raise_if_stopped()  # evicted: RunEvicted with the reason; failed, deleted: RunFailed
    if run.is_terminal:
        raise RunFailed(
            f"run {run.id} is {run.status}: it takes no more batches", run_id=run.id, run_status=run.status
        )
    if time.monotonic() >= deadline:
        why = run.waiting_reason or "the service gave no reason"
        raise TimeoutError(f"run {run.id} is still {run.status} after {timeout:g}s: {why}")
    return True


def _build(http: httpx.Client | httpx.AsyncClient, request: _Request) -> httpx.Request:
    return http.build_request(
        request.method,
        request.path,
        params=request.params,
        json=request.json,
        content=request.content,
        headers=request.headers,
    )


def _check(request: _Request, response: httpx.Response, base_url: str) -> httpx.Response:
    if response.is_success or response.status_code in request.accept:
        return response
    error = error_from_response(response)
    if isinstance(error, Unauthorized) and (hint := tinker_surface_hint(base_url)):
        error.message = f"{error.message}; {hint}"  # a 401 there reads as a wrong key otherwise
    raise error


class LoraloomClient:
    """Synchronous client. Use as a context manager, or call `close()`.

    `base_url`: the service's, without /v1 (e.g. http://127.0.0.1:8000); `api_key`: a tenant API key
    (every route needs one). Both are checked here (ValueError), before any request.
    `transport` lets tests (or users) plug in an httpx transport; everything else
    is the public API of the service, one method per route (and `wait_until_active`).

    Bounds on each HTTP attempt (see the module's docstring): `timeout` per socket operation,
    `deadline` in all (`transfer_deadline` for adapter downloads and uploads; None for none),
    `max_response_bytes` for an answer in memory, `max_download_bytes` for an adapter archive."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float | httpx.Timeout = 30.0,
        retry: RetryPolicy | None = None,
        max_attempts: int | None = None,
        transport: httpx.BaseTransport | None = None,
        deadline: float | None = DEFAULT_DEADLINE_S,
        transfer_deadline: float | None = DEFAULT_TRANSFER_DEADLINE_S,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        max_download_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES,
    ) -> None:
        self.settings = _settings(
            base_url,
            api_key,
            timeout,
            retry,
            max_attempts,
            deadline=deadline,
            transfer_deadline=transfer_deadline,
            max_response_bytes=max_response_bytes,
            max_download_bytes=max_download_bytes,
        )
        self._http = httpx.Client(transport=transport, **self.settings.http_kwargs())
        bounded.install_deadline(self._http)  # a socket operation never outlasts `deadline`

    def __enter__(self) -> LoraloomClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, request: _Request) -> httpx.Response:
        def attempt() -> httpx.Response:
            built = _build(self._http, request)
            return bounded.send(self._http, built, **self.settings.bounds(request))

        return _check(
            request, send_with_retries(attempt, self.settings.retry, request.what), self.settings.base_url
        )

    def _run(self, op: _Op[T]) -> T:
        try:
            request = next(op)
            while True:
                request = op.send(self._send(request))
        except StopIteration as done:
            return done.value
        finally:
            op.close()  # an operation interrupted by an error releases what it holds (a download's file)

    def create_run(
        self,
        name: str,
        config: RunConfig | Mapping[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
        init_from: Mapping[str, Any] | None = None,
    ) -> Run:
        """Create a run; `init_from={"run_id": ..., "step": N | "latest"}` starts it from the adapter of
        one of your runs (same base model, lora rank, alpha and target modules)."""
        return self._run(_Ops.create_run(name, config, idempotency_key, init_from))

    def get_run(self, run_id: str) -> Run:
        return self._run(_Ops.get_run(run_id))

    def wait_until_active(self, run_id: str, *, timeout: float = 600.0, poll: float = 2.0) -> Run:
        """Poll `get_run` until the run is active and return it: a new run waits `queued` for a slot
        (the service refuses its batches with a 409 until then). Heartbeats while it waits, as the
        rollout loop does, so a run with a heartbeat_timeout is not evicted for waiting. Raises
        `RunEvicted` or `RunFailed` if the run ends first, TimeoutError (with the run's
        waiting_reason) after `timeout` seconds."""
        deadline = _wait_deadline(timeout, poll)
        while still_queued(run := self.get_run(run_id), deadline=deadline, timeout=timeout):
            self.heartbeat(run_id)
            time.sleep(poll)
        return run

    def list_runs(
        self, *, status: str | None = None, limit: int | None = None, cursor: str | None = None
    ) -> Page[Run]:
        return self._run(_Ops.list_runs(status, limit, cursor))

    def evict_run(self, run_id: str, reason: str, *, by: EvictedBy = "user") -> Run:
        return self._run(_Ops.evict_run(run_id, reason, by))

    def delete_run(self, run_id: str) -> Run:
        return self._run(_Ops.delete_run(run_id))

    def heartbeat(self, run_id: str) -> Heartbeat:
        return self._run(_Ops.heartbeat(run_id))

    def submit_batch(
        self,
        run_id: str,
        batch: TrainingBatch,
        *,
        fmt: BatchFormat = "msgpack",
        idempotency_key: str | None = None,
    ) -> BatchInfo:
        return self._run(_Ops.submit_batch(run_id, batch, fmt, idempotency_key))

    def list_batches(
        self, run_id: str, *, state: str | None = None, limit: int | None = None, cursor: str | None = None
    ) -> Page[BatchInfo]:
        return self._run(_Ops.list_batches(run_id, state, limit, cursor))

    def list_adapters(self, run_id: str) -> list[AdapterInfo]:
        """Every adapter of the run, oldest step first (as many requests as pages of 200)."""
        return self._run(_Ops.list_adapters(run_id))

    def latest_adapter(self, run_id: str) -> AdapterInfo | None:
        """The run's newest adapter, or None while it has none: one request, however many it keeps.
        `fetch_adapter(run_id, info.step, ...)` downloads it."""
        return self._run(_Ops.latest_adapter(run_id))

    def fetch_adapter(self, run_id: str, step: AdapterStep, dest_dir: str | Path) -> AdapterDownload:
        """Download and extract an adapter; skipped (304) when `dest_dir` already holds it."""
        return self._run(_Ops.fetch_adapter(run_id, step, Path(dest_dir)))

    def download_adapter(self, run_id: str, step: AdapterStep, dest_dir: str | Path) -> Path:
        return self.fetch_adapter(run_id, step, dest_dir).path

    def upload_adapter(
        self, adapter_dir: str | Path, *, name: str = "adapter", base_model: str | None = None
    ) -> dict[str, Any]:
        """Upload a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start runs
        from (`create_run(..., init_from={"adapter_id": ...})`); returns the stored adapter (its `id`)."""
        return self._run(_Ops.upload_adapter(Path(adapter_dir), name, base_model))

    def get_metrics(self, run_id: str, *, since_step: int = 0) -> list[StepMetrics]:
        return self._run(_Ops.get_metrics(run_id, since_step))


class AsyncLoraloomClient:
    """Asynchronous twin of `LoraloomClient` (same methods, awaited)."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float | httpx.Timeout = 30.0,
        retry: RetryPolicy | None = None,
        max_attempts: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        deadline: float | None = DEFAULT_DEADLINE_S,
        transfer_deadline: float | None = DEFAULT_TRANSFER_DEADLINE_S,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        max_download_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES,
    ) -> None:
        self.settings = _settings(
            base_url,
            api_key,
            timeout,
            retry,
            max_attempts,
            deadline=deadline,
            transfer_deadline=transfer_deadline,
            max_response_bytes=max_response_bytes,
            max_download_bytes=max_download_bytes,
        )
        self._http = httpx.AsyncClient(transport=transport, **self.settings.http_kwargs())

    async def __aenter__(self) -> AsyncLoraloomClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, request: _Request) -> httpx.Response:
        async def attempt() -> httpx.Response:
            built = _build(self._http, request)
            return await bounded.send_async(self._http, built, **self.settings.bounds(request))

        return _check(
            request,
            await send_with_retries_async(attempt, self.settings.retry, request.what),
            self.settings.base_url,
        )

    async def _run(self, op: _Op[T]) -> T:
        try:
            request = next(op)
            while True:
                request = op.send(await self._send(request))
        except StopIteration as done:
            return done.value
        finally:
            op.close()  # as in LoraloomClient._run

    async def create_run(
        self,
        name: str,
        config: RunConfig | Mapping[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
        init_from: Mapping[str, Any] | None = None,
    ) -> Run:
        """As `LoraloomClient.create_run`."""
        return await self._run(_Ops.create_run(name, config, idempotency_key, init_from))

    async def get_run(self, run_id: str) -> Run:
        return await self._run(_Ops.get_run(run_id))

    async def wait_until_active(self, run_id: str, *, timeout: float = 600.0, poll: float = 2.0) -> Run:
        """As `LoraloomClient.wait_until_active`."""
        deadline = _wait_deadline(timeout, poll)
        while still_queued(run := await self.get_run(run_id), deadline=deadline, timeout=timeout):
            await self.heartbeat(run_id)
            await asyncio.sleep(poll)
        return run

    async def list_runs(
        self, *, status: str | None = None, limit: int | None = None, cursor: str | None = None
    ) -> Page[Run]:
        return await self._run(_Ops.list_runs(status, limit, cursor))

    async def evict_run(self, run_id: str, reason: str, *, by: EvictedBy = "user") -> Run:
        return await self._run(_Ops.evict_run(run_id, reason, by))

    async def delete_run(self, run_id: str) -> Run:
        return await self._run(_Ops.delete_run(run_id))

    async def heartbeat(self, run_id: str) -> Heartbeat:
        return await self._run(_Ops.heartbeat(run_id))

    async def submit_batch(
        self,
        run_id: str,
        batch: TrainingBatch,
        *,
        fmt: BatchFormat = "msgpack",
        idempotency_key: str | None = None,
    ) -> BatchInfo:
        return await self._run(_Ops.submit_batch(run_id, batch, fmt, idempotency_key))

    async def list_batches(
        self, run_id: str, *, state: str | None = None, limit: int | None = None, cursor: str | None = None
    ) -> Page[BatchInfo]:
        return await self._run(_Ops.list_batches(run_id, state, limit, cursor))

    async def list_adapters(self, run_id: str) -> list[AdapterInfo]:
        """As `LoraloomClient.list_adapters`."""
        return await self._run(_Ops.list_adapters(run_id))

    async def latest_adapter(self, run_id: str) -> AdapterInfo | None:
        """As `LoraloomClient.latest_adapter`."""
        return await self._run(_Ops.latest_adapter(run_id))

    async def fetch_adapter(self, run_id: str, step: AdapterStep, dest_dir: str | Path) -> AdapterDownload:
        return await self._run(_Ops.fetch_adapter(run_id, step, Path(dest_dir)))

    async def download_adapter(self, run_id: str, step: AdapterStep, dest_dir: str | Path) -> Path:
        return (await self.fetch_adapter(run_id, step, dest_dir)).path

    async def upload_adapter(
        self, adapter_dir: str | Path, *, name: str = "adapter", base_model: str | None = None
    ) -> dict[str, Any]:
        """As `LoraloomClient.upload_adapter`."""
        return await self._run(_Ops.upload_adapter(Path(adapter_dir), name, base_model))

    async def get_metrics(self, run_id: str, *, since_step: int = 0) -> list[StepMetrics]:
        return await self._run(_Ops.get_metrics(run_id, since_step))
