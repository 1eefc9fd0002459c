"""`HttpRunSource.fail` against a service older than `POST /v1/pool/runs/{id}/fail` (review finding 3).

Such a service answers the unknown route with Starlette's 404 `not_found` (app/main.py), the same code
as a missing run. Taken as "the run left", it would leave the run active at the service: admitted
again, its `init_from` failing again, forever. The pool evicts it instead, as pools did before the
route, and the eviction's own answer says whether the run is really gone.
"""

import httpx
import pytest

from contracts.http import ApiError, Conflict, NotFound
from contracts.pool_api import RunAfterPush
from trainer_core.http_source import MAX_REASON_CHARS, HttpRunSource
from trainer_core.service_client import PoolServiceClient

RUN = "run_0000000000f1"
REASON = "init_from: checkpoint 4 of run_0000000000aa not found on this pool"


class Client:
    """The two calls `fail` makes; each raises what the test sets, and every call is recorded."""

    def __init__(self, fail_raises: ApiError | None, evict_raises: ApiError | None = None) -> None:
        self.fail_raises, self.evict_raises = fail_raises, evict_raises
        self.calls: list[tuple[str, str, str]] = []

    def fail(self, run_id: str, reason: str) -> RunAfterPush | None:
        self.calls.append(("fail", run_id, reason))
        if self.fail_raises is not None:
            raise self.fail_raises
        return None

    def evict(self, run_id: str, reason: str) -> RunAfterPush | None:
        self.calls.append(("evict", run_id, reason))
        if self.evict_raises is not None:
            raise self.evict_raises
        return None


def _source(client: Client) -> HttpRunSource:
    return HttpRunSource(client)  # type: ignore[arg-type]  # only fail and evict are called


@pytest.mark.parametrize(
    "unknown_route",
    [
        NotFound("Not Found", status=404, code="not_found"),
        ApiError("Method Not Allowed", status=405, code="method_not_allowed"),
    ],
)
def test_a_service_without_the_fail_route_gets_the_run_evicted(unknown_route: ApiError) -> None:
    client = Client(fail_raises=unknown_route)
    _source(client).fail(RUN, REASON)
    assert client.calls == [("fail", RUN, REASON), ("evict", RUN, REASON)]


def test_a_run_really_gone_is_left_alone_after_the_eviction_says_so() -> None:
    gone = NotFound(f"run {RUN} not found", status=404, code="not_found")
    client = Client(fail_raises=gone, evict_raises=gone)
    _source(client).fail(RUN, REASON)  # no error: the run has left, the pool releases its slot
    assert [call[0] for call in client.calls] == ["fail", "evict"]


def test_a_long_reason_is_cut_for_the_eviction_too() -> None:
    client = Client(fail_raises=NotFound("Not Found", status=404, code="not_found"))
    _source(client).fail(RUN, "x" * (MAX_REASON_CHARS + 10))
    assert [len(reason) for _, _, reason in client.calls] == [MAX_REASON_CHARS, MAX_REASON_CHARS]


@pytest.mark.parametrize(
    "answer, raises",
    [
        (None, False),  # failed
        (Conflict("already stopped", status=409, code="invalid_transition"), False),  # it had left
        (NotFound("pool unknown", status=404, code="pool_not_found"), True),  # about the pool: stop
    ],
)
def test_other_answers_evict_nothing(answer: ApiError | None, raises: bool) -> None:
    client = Client(fail_raises=answer)
    if raises:
        with pytest.raises(NotFound):
            _source(client).fail(RUN, REASON)
    else:
        _source(client).fail(RUN, REASON)
    assert client.calls == [("fail", RUN, REASON)]


def test_the_real_client_against_an_older_service_evicts() -> None:
    """Through `PoolServiceClient`: the older service's 404 body for an unknown route (app/main.py's
    handler) on `/fail`, and its evict route answering."""
    seen: list[str] = []

    def older_service(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path.endswith("/fail"):
            return httpx.Response(
                404, json={"error": {"code": "not_found", "message": "Not Found", "details": None}}
            )
        return httpx.Response(
            409, json={"error": {"code": "invalid_transition", "message": "stopped", "details": None}}
        )

    client = PoolServiceClient("http://service", "token", max_attempts=1)
    client._http = httpx.Client(base_url="http://service", transport=httpx.MockTransport(older_service))
    HttpRunSource(client).fail(RUN, REASON)
    assert seen == [f"/v1/pool/runs/{RUN}/fail", f"/v1/pool/runs/{RUN}/evict"]
