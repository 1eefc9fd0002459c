"""Tenant routes of what the trainer pushed back per run: adapters (listed, downloaded whole or file
by file, with ETags) and step metrics. API key only; thin: parse, call the service, shape the response."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Path, Query, Response, status
from fastapi.responses import FileResponse

from app.adapters import service
from app.adapters.file_response import OpenFileResponse
from app.adapters.metrics_view import metrics_page
from app.adapters.models import Adapter
from app.adapters.schemas import AdapterList, AdapterOut, MetricsList
from app.auth import SettingsDep
from app.db import SessionDep
from app.errors import RangeNotSatisfiable, ValidationFailed, raises
from app.pagination import MAX_LIMIT, CursorQuery, LimitQuery, decode_id_cursor, encode_id_cursor
from app.runs.deps import undeleted_run
from app.runs.models import Run
from contracts.layout import ADAPTER_CONFIG, ADAPTER_FILES, ADAPTER_WEIGHTS
from contracts.pool_api import INT32_MAX

# Tags per route: metrics are their own group in the document (and in generated clients).
router = APIRouter()

StepPath = Annotated[
    str,
    Path(
        pattern=r"^(latest|[0-9]{1,9})$",
        description="An adapter step, or `latest` for the newest.",
        examples=["latest", "10"],
    ),
]
FileNamePath = Annotated[
    str,
    # Documented, not enforced: any other name is a 404 (an adapter has no such file).
    Path(
        description="One file of the PEFT adapter directory.", json_schema_extra={"enum": list(ADAPTER_FILES)}
    ),
]
IfNoneMatch = Annotated[
    str | None,
    Header(
        alias="If-None-Match",
        max_length=1024,
        description="An `ETag` of an earlier download: the answer is a 304 without a body if it still matches.",
    ),
]


# A deleted run's adapters (listed or downloaded) and metrics are a 404 (app/runs/deps.py).
RunWithAdaptersDep = Annotated[Run, Depends(undeleted_run("adapters"))]
RunWithMetricsDep = Annotated[Run, Depends(undeleted_run("metrics"))]


def _header(description: str) -> dict[str, Any]:
    return {"description": description, "schema": {"type": "string"}}


_ETAG = _header("The adapter's sha256 of its weights, quoted.")
_STEP = _header("The step of the adapter sent (resolves `latest`).")
_BINARY = {"schema": {"type": "string", "format": "binary"}}
_PARTIAL = {
    "content": {"application/octet-stream": _BINARY},
    "description": "The one byte range a `Range: bytes=first-last` header asked for (`first-`, `-length` too), "
    "to resume a download; `If-Range` with another tag than the current ETag sends the whole file (200). "
    "Several ranges are answered whole; a range past the end is a 416.",
    "headers": {"Content-Range": _header("`bytes first-last/size`.")},
}
# A component of its own (app/openapi.py names titled schemas): PEFT's adapter_config.json, as PEFT wrote it.
_ADAPTER_CONFIG = {
    "title": "AdapterConfig",
    "type": "object",
    "description": "PEFT's adapter_config.json (peft_type, r, lora_alpha, target_modules, ...).",
    "properties": {},
    "additionalProperties": True,
}


def _parse_step(step: str) -> int | None:
    """`latest` → None, a non-negative integer → itself; anything else is a 422."""
    if step == "latest":
        return None
    if step.isascii() and step.isdigit() and len(step) <= 9:
        return int(step)
    raise ValidationFailed(
        f"step must be a non-negative integer or 'latest', not {step!r}",
        details=[{"loc": ["path", "step"], "msg": "expected an integer or 'latest'", "type": "step_invalid"}],
    )


def _etag(adapter: Adapter) -> str:
    return f'"{adapter.sha256}"'


def _not_modified(header: str | None, etag: str) -> bool:
    if header is None:
        return False
    candidates = {c.strip().removeprefix("W/") for c in header.split(",")}
    return "*" in candidates or etag in candidates


def _adapter_headers(adapter: Adapter, etag: str | None) -> dict[str, str]:
    headers = {"X-Adapter-Step": str(adapter.step), "Cache-Control": "no-cache"}
    if etag is not None:
        headers["ETag"] = etag
    return headers


AdaptersLimitQuery = Annotated[
    int | None,
    Query(
        ge=1,
        le=MAX_LIMIT,
        description="Page size (1..200); 200 when omitted but `cursor` or `newest_first` is given. "
        "A request with none of the three gets the whole list on one page, oldest first (the form "
        "from before paging; its newest 1,000 if the run keeps more).",
    ),
]
NewestFirstQuery = Annotated[
    bool | None,
    Query(
        description="Newest step first (`newest_first=true&limit=1`: the newest adapter's metadata, "
        "where `GET .../adapters/latest` downloads it); oldest first when omitted or false."
    ),
]
UNPAGED_MOST = 1000
"""The most adapters a request without paging parameters gets: its newest, oldest first. Clients
from before paging read that list whole and take its highest step as the newest, which this keeps
right; a run keeping every step (LORALOOM_RUN_ADAPTERS_KEPT=0) would otherwise answer megabytes a
call, and a tenant could tie the service up with them."""


def _cursor_kind(newest_first: bool) -> str:
    """What an adapters cursor names (app/pagination.py's id cursors): this list and its order, so
    that a batches cursor, or one of the other order (its step would bound the wrong side), is a 422
    rather than a page of the wrong rows."""
    return "adapters_newest_first" if newest_first else "adapters_oldest_first"


@router.get(
    "/v1/runs/{run_id}/adapters", response_model=AdapterList, operation_id="listAdapters", tags=["adapters"]
)
def list_adapters(
    run: RunWithAdaptersDep,
    session: SessionDep,
    limit: AdaptersLimitQuery = None,
    cursor: CursorQuery = None,
    newest_first: NewestFirstQuery = None,
) -> AdapterList:
    """The run's adapters by step, a page at a time; follow `next_cursor` (with the same
    `newest_first`) for the rest. The default page (200) holds every adapter a run keeps by default
    (LORALOOM_RUN_ADAPTERS_KEPT, 64). Without `limit`, `cursor` and `newest_first` the answer is
    every adapter, oldest first, on one page (its newest UNPAGED_MOST if it keeps more): clients
    from before paging read that whole and take the highest step as the newest."""
    if limit is None and cursor is None and newest_first is None:
        newest, _ = service.adapters_page(
            session, run_id=run.id, limit=UNPAGED_MOST, after_step=None, newest_first=True
        )
        return AdapterList(items=[_adapter_out(a) for a in reversed(newest)], next_cursor=None)
    kind = _cursor_kind(bool(newest_first))
    after = None if cursor is None else decode_id_cursor(cursor, kind=kind, max_id=INT32_MAX)
    rows, next_step = service.adapters_page(
        session,
        run_id=run.id,
        limit=MAX_LIMIT if limit is None else limit,
        after_step=after,
        newest_first=bool(newest_first),
    )
    return AdapterList(
        items=[_adapter_out(a) for a in rows],
        next_cursor=None if next_step is None else encode_id_cursor(next_step, kind),
    )


def _adapter_out(a: Adapter) -> AdapterOut:
    return AdapterOut(step=a.step, size_bytes=a.size_bytes, sha256=a.sha256, created_at=a.created_at)


@router.get(
    "/v1/runs/{run_id}/adapters/{step}",
    operation_id="downloadAdapter",
    tags=["adapters"],
    response_class=FileResponse,
    responses={
        200: {
            "content": {"application/gzip": _BINARY},
            "description": "tar.gz of the PEFT adapter directory.",
            "headers": {"ETag": _ETAG, "X-Adapter-Step": _STEP},
        },
        206: _PARTIAL,
        304: {
            "description": "If-None-Match matched the adapter's ETag; no body.",
            "headers": {"ETag": _ETAG, "X-Adapter-Step": _STEP},
        },
    },
)
@raises(RangeNotSatisfiable)
def download_adapter(
    run: RunWithAdaptersDep,
    step: StepPath,
    session: SessionDep,
    settings: SettingsDep,
    if_none_match: IfNoneMatch = None,
) -> Response:
    """The adapter of a step (or the newest) as a tar.gz, with its `ETag`."""
    adapter = service.get_adapter(
        session, run_id=run.id, step=_parse_step(step), kept=settings.run_adapters_kept
    )
    etag = _etag(adapter)
    if _not_modified(if_none_match, etag):
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=_adapter_headers(adapter, etag))
    # The read ends here: a first download builds the archive (seconds for a large adapter), and on
    # SQLite an open transaction holds the database's write lock.
    session.commit()
    return OpenFileResponse(
        service.open_adapter_archive(adapter, settings=settings),
        media_type="application/gzip",
        filename=f"{run.id}_step_{adapter.step}.tar.gz",
        headers=_adapter_headers(adapter, etag),
    )


@router.get(
    "/v1/runs/{run_id}/adapters/{step}/files/{name}",
    operation_id="downloadAdapterFile",
    tags=["adapters"],
    response_class=FileResponse,
    responses={
        200: {
            # Bytes first: a generated client that reads one media type reads both files as bytes.
            "content": {"application/octet-stream": _BINARY, "application/json": {"schema": _ADAPTER_CONFIG}},
            "description": "The file: adapter_config.json as JSON, the safetensors weights as bytes.",
            "headers": {
                "ETag": _header("For the weights, the adapter's sha256, quoted."),
                "X-Adapter-Step": _STEP,
            },
        },
        206: _PARTIAL,
        304: {"description": "If-None-Match matched the file's ETag; no body."},
    },
)
@raises(RangeNotSatisfiable)
def download_adapter_file(
    run: RunWithAdaptersDep,
    step: StepPath,
    name: FileNamePath,
    session: SessionDep,
    settings: SettingsDep,
    if_none_match: IfNoneMatch = None,
) -> Response:
    """One file of the adapter of a step (or the newest)."""
    adapter = service.get_adapter(
        session, run_id=run.id, step=_parse_step(step), kept=settings.run_adapters_kept
    )
    file = service.open_adapter_file(adapter, name=name, settings=settings)
    # The sha256 is of the weights; the config file keeps an ETag of its (mtime, size).
    etag = _etag(adapter) if name == ADAPTER_WEIGHTS else None
    if etag is not None and _not_modified(if_none_match, etag):
        file.close()
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=_adapter_headers(adapter, etag))
    media_type = "application/json" if name == ADAPTER_CONFIG else "application/octet-stream"
    return OpenFileResponse(
        file, media_type=media_type, filename=name, headers=_adapter_headers(adapter, etag)
    )


@router.get(
    "/v1/runs/{run_id}/metrics", response_model=MetricsList, operation_id="getMetrics", tags=["metrics"]
)
def get_metrics(
    run: RunWithMetricsDep,
    session: SessionDep,
    since_step: Annotated[int, Query(ge=0, le=10_000_000, description="Only steps >= this.")] = 0,
    limit: LimitQuery = MAX_LIMIT,
) -> MetricsList:
    """Per step, oldest first: the trainer's loss, entropy, KL, grad norm, lr, tokens, … and the
    mean/std/min/max/count of the rewards (and per-sample metrics) received for that rollout step.
    A deleted run's metrics are a 404, as its adapters are."""
    items, next_step = metrics_page(session, run_id=run.id, since_step=since_step, limit=limit)
    return MetricsList(items=items, next_since_step=next_step)
