"""The SDK client against a real local HTTP server (uvicorn on 127.0.0.1) that
injects 5xx, 429 with Retry-After, stalls and dropped connections."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from contracts.http import parse_retry_after
from contracts.run_config import RunConfig
from contracts.wire import TrainingBatch, TrainingSample
from orchestrator import errors
from orchestrator.client import AsyncLoraloomClient, BatchFormat, LoraloomClient
from orchestrator.models import Run
from tests.orchestrator.fake_service import FakeService
from tests.orchestrator.servers import FAST, FaultInjector, Seen


@pytest.fixture
def client(base_url: str, service: FakeService) -> Iterator[LoraloomClient]:
    with LoraloomClient(base_url, service.api_key, retry=FAST, timeout=5.0) as c:
        yield c


def _batch(step: int = 0, n: int = 2) -> TrainingBatch:
    return TrainingBatch(
        examples=[
            TrainingSample(
                prompt_ids=[1, 5, 6],
                prompt_mask=[True] * 3,
                completion_ids=[7, 2],
                completion_mask=[True, True],
                completion_logprobs=[-0.5, -0.125],  # float32-exact: the binary form stores float32
                advantage=float(i) - 0.5,
            )
            for i in range(n)
        ],
        step=step,
    )


def test_run_lifecycle_typed(client: LoraloomClient) -> None:
    run = client.create_run("lifecycle", RunConfig(batch_size=4, max_steps=3))
    assert isinstance(run, Run) and run.status == "active"
    assert run.run_config.batch_size == 4
    assert client.get_run(run.id) == run
    assert run.id in [r.id for r in client.list_runs().items]
    assert client.heartbeat(run.id).status == "active"
    evicted = client.evict_run(run.id, "done with it")
    assert (evicted.status, evicted.eviction_reason, evicted.evicted_by) == (
        "evicted",
        "done with it",
        "user",
    )
    assert client.delete_run(run.id).status == "deleted"


def test_create_run_idempotent_replay(client: LoraloomClient, service: FakeService) -> None:
    first = client.create_run("idem", {"batch_size": 2}, idempotency_key="key-create-1")
    again = client.create_run("idem", {"batch_size": 2}, idempotency_key="key-create-1")
    assert first.id == again.id
    with pytest.raises(errors.Conflict):
        client.create_run("idem", {"batch_size": 3}, idempotency_key="key-create-1")


@dataclass
class StallingFaults(FaultInjector):
    """The fault injector with one more fault, "stall": the request is read, held until the client
    gives up on it (its timeout closes the connection), then handled, its answer going nowhere: a
    server that took the request too late. Unlike "slow:<seconds>", nothing depends on how long the
    client's wait is against the server's."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self._take_stall(scope["method"], scope["path"]):
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            self.seen.append(Seen(scope["method"], scope["path"], headers.get("idempotency-key"), STALL))
            await self._stall(scope, receive)
        else:
            await super().__call__(scope, receive, send)

    def _take_stall(self, method: str, path: str) -> bool:
        with self._lock:
            queue = self._faults.get((method, path))
            if queue and queue[0] == STALL:
                queue.popleft()
                return True
            return False

    async def _stall(self, scope: dict, receive: Any) -> None:
        body: list[bytes] = []
        while (message := await receive())["type"] == "http.request":
            body.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        while (await receive())["type"] != "http.disconnect":  # the client's timeout
            pass
        replayed = iter([{"type": "http.request", "body": b"".join(body), "more_body": False}])

        async def receive_again() -> dict:
            return next(replayed, {"type": "http.disconnect"})

        async def nowhere(message: dict) -> None:
            pass

        await self.app(scope, receive_again, nowhere)


STALL = "stall"


@pytest.fixture(scope="module")
def faults(service: FakeService) -> StallingFaults:
    return StallingFaults(service.app)


class TimesOutStalls(httpx.HTTPTransport):
    """Gives the requests the server is told to stall a short timeout, and every other request the
    client's own: an answered request never becomes a retry because the machine was slow."""

    def __init__(self) -> None:
        super().__init__()
        self.stalled: dict[tuple[str, str], int] = {}

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        what = (request.method, request.url.path)
        if self.stalled.get(what, 0) > 0:
            self.stalled[what] -= 1
            request.extensions["timeout"] = httpx.Timeout(STALL_TIMEOUT_S).as_dict()
        return super().handle_request(request)


STALL_TIMEOUT_S = 0.2


@pytest.mark.parametrize("fault", ["503", "500", "drop", "drop_after", STALL])
@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_submit_retries_reuse_one_key_and_store_once(
    base_url: str, service: FakeService, faults: FaultInjector, fault: str, fmt: BatchFormat
) -> None:
    transport = TimesOutStalls()
    with LoraloomClient(base_url, service.api_key, retry=FAST, transport=transport) as client:
        run = client.create_run("retry", {})
        path = f"/v1/runs/{run.id}/batches"
        faults.inject("POST", path, fault, fault)
        if fault == STALL:
            transport.stalled[("POST", path)] = 2
        info = client.submit_batch(run.id, _batch(step=3), fmt=fmt)
    seen = faults.requests_to("POST", path)
    assert [s.fault for s in seen] == [fault, fault, None]
    assert len({s.idempotency_key for s in seen}) == 1 and seen[0].idempotency_key
    # The batch is stored exactly once, even when the server took it and the answer was lost.
    assert len(service.batches[run.id]) == 1
    assert info.id == service.batches[run.id][0]["id"]
    assert (info.rollout_step, info.num_samples) == (3, 2)
    assert service.payloads[info.id] == _batch(step=3)


def test_429_honours_retry_after(client: LoraloomClient, faults: FaultInjector, service: FakeService) -> None:
    run = client.create_run("ratelimited", {})
    path = f"/v1/runs/{run.id}/batches"
    faults.inject("POST", path, "429:0.4")
    started = time.monotonic()
    client.submit_batch(run.id, _batch())
    assert time.monotonic() - started >= 0.4  # the backoff alone would be <= 0.05 s
    seen = faults.requests_to("POST", path)
    assert len(seen) == 2 and seen[0].idempotency_key == seen[1].idempotency_key
    assert len(service.batches[run.id]) == 1


def test_distinct_logical_requests_get_distinct_keys(client: LoraloomClient, faults: FaultInjector) -> None:
    run = client.create_run("keys", {})
    client.submit_batch(run.id, _batch())
    client.submit_batch(run.id, _batch())
    keys = [s.idempotency_key for s in faults.requests_to("POST", f"/v1/runs/{run.id}/batches")]
    assert len(keys) == 2 and keys[0] != keys[1]


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        ("400", errors.BadRequest),
        ("401", errors.Unauthorized),
        ("403", errors.Forbidden),
        ("404", errors.NotFound),
        ("409", errors.Conflict),
        ("413", errors.PayloadTooLarge),
        ("422", errors.ValidationError),
    ],
)
def test_other_4xx_are_not_retried(
    client: LoraloomClient, faults: FaultInjector, status: str, cls: type[errors.ApiError]
) -> None:
    run = client.create_run("no-retry", {})
    path = f"/v1/runs/{run.id}/batches"
    faults.inject("POST", path, status)
    with pytest.raises(cls) as info:
        client.submit_batch(run.id, _batch())
    assert info.value.status == int(status) and info.value.code == "injected"
    assert len(faults.requests_to("POST", path)) == 1


def test_typed_errors_carry_code_message_details(client: LoraloomClient, faults: FaultInjector) -> None:
    missing = "run_" + "0" * 12
    with pytest.raises(errors.NotFound) as nf:
        client.get_run(missing)
    assert (nf.value.status, nf.value.code) == (404, "not_found") and missing in nf.value.message
    assert len(faults.requests_to("GET", f"/v1/runs/{missing}")) == 1

    with pytest.raises(errors.ValidationError) as bad:
        client.create_run("bad", {"batch_size": 0, "bogus": 1})
    assert bad.value.status == 422 and bad.value.code == "validation_error"
    assert {tuple(d["loc"]) for d in bad.value.details} == {("batch_size",), ("bogus",)}


def test_unauthorized(base_url: str) -> None:
    with (
        LoraloomClient(base_url, "wrong-key", retry=FAST) as client,
        pytest.raises(errors.Unauthorized) as info,
    ):
        client.list_runs()
    assert info.value.status == 401


def test_evicted_run_raises_run_evicted(client: LoraloomClient, service: FakeService) -> None:
    run = client.create_run("evictee", {})
    service.evict(run.id, "NaN loss", by="trainer")
    with pytest.raises(errors.RunEvicted) as info:
        client.submit_batch(run.id, _batch())
    assert (info.value.reason, info.value.evicted_by, info.value.status) == ("NaN loss", "trainer", 409)
    assert isinstance(info.value, errors.Conflict)
    with pytest.raises(errors.RunEvicted) as seen:
        client.get_run(run.id).raise_if_stopped()
    assert seen.value.reason == "NaN loss" and seen.value.run_id == run.id


def test_retry_exhausted(client: LoraloomClient, faults: FaultInjector) -> None:
    run = client.create_run("exhaust", {})
    path = f"/v1/runs/{run.id}/heartbeat"
    faults.inject("POST", path, *["503"] * FAST.max_attempts)
    with pytest.raises(errors.RetryExhausted) as info:
        client.heartbeat(run.id)
    assert info.value.attempts == FAST.max_attempts and info.value.status == 503
    assert isinstance(info.value.last_error, errors.ServerError)
    assert len(faults.requests_to("POST", path)) == FAST.max_attempts


def test_connection_refused_is_retried_then_exhausted() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with (
        LoraloomClient(f"http://127.0.0.1:{port}", "k", retry=FAST) as client,
        pytest.raises(errors.RetryExhausted) as info,
    ):
        client.list_runs()
    assert info.value.attempts == FAST.max_attempts
    assert isinstance(info.value.last_error, httpx.ConnectError)


def test_run_ids_are_validated_before_any_request(client: LoraloomClient) -> None:
    # A trailing newline passed the SDK's own `^...$` pattern before it used contracts.ids.
    for bad in ["../etc", "run_XYZ", "run_0123456789ab/../x", "run_0123456789ab\n"]:
        with pytest.raises(ValueError):
            client.get_run(bad)


@pytest.mark.parametrize("key", ["has space", "tab\there", "caf\u00e9", "", "k" * 129, "k1\n"])
def test_idempotency_keys_the_service_refuses_are_refused_before_any_request(
    client: LoraloomClient, service: FakeService, faults: FaultInjector, key: str
) -> None:
    run = client.create_run("keys", {})
    with pytest.raises(ValueError, match="not an idempotency key"):
        client.create_run("keys", {}, idempotency_key=key)
    with pytest.raises(ValueError, match="not an idempotency key"):
        client.submit_batch(run.id, _batch(step=1), idempotency_key=key)
    assert faults.requests_to("POST", f"/v1/runs/{run.id}/batches") == []
    assert client.submit_batch(run.id, _batch(step=1), idempotency_key="step-1!~").rollout_step == 1


def test_download_adapter_uses_etag(client: LoraloomClient, service: FakeService, tmp_path: Path) -> None:
    run = client.create_run("adapters", {})
    files = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"\x00" * 64}
    sha = service.add_adapter(run.id, 1, files)
    assert [(a.step, a.sha256) for a in client.list_adapters(run.id)] == [(1, sha)]

    dest = tmp_path / "latest"
    first = client.fetch_adapter(run.id, "latest", dest)
    assert (first.changed, first.step, first.sha256, first.path) == (True, 1, sha, dest)
    assert (dest / "adapter_model.safetensors").read_bytes() == files["adapter_model.safetensors"]

    again = client.fetch_adapter(run.id, "latest", dest)
    assert (again.changed, again.step) == (False, 1)

    service.add_adapter(run.id, 2, {"adapter_config.json": b'{"r": 8, "v": 2}'})
    assert client.download_adapter(run.id, "latest", dest) == dest
    assert (dest / "adapter_config.json").read_bytes() == b'{"r": 8, "v": 2}'
    assert not (dest / "adapter_model.safetensors").exists()  # replaced whole, not merged
    assert client.fetch_adapter(run.id, 1, tmp_path / "one").step == 1
    with pytest.raises(errors.NotFound):
        client.download_adapter(run.id, 9, tmp_path / "nine")


def test_get_metrics_and_list_batches(client: LoraloomClient, service: FakeService) -> None:
    run = client.create_run("metrics", {})
    service.metrics[run.id] = [
        {"step": 1, "loss": 0.5, "lr": 1e-4, "tokens": 10, "samples": 2, "created_at": None}
    ]
    assert [(m.step, m.loss) for m in client.get_metrics(run.id)] == [(1, 0.5)]
    for _ in range(3):
        client.submit_batch(run.id, _batch())
    page = client.list_batches(run.id, limit=2)
    assert len(page.items) == 2 and page.next_cursor
    rest = client.list_batches(run.id, limit=2, cursor=page.next_cursor)
    assert len(rest.items) == 1 and rest.next_cursor is None


async def test_async_client_retries_with_one_key(
    base_url: str, service: FakeService, faults: FaultInjector
) -> None:
    async with AsyncLoraloomClient(base_url, service.api_key, retry=FAST, timeout=5.0) as client:
        run = await client.create_run("async", RunConfig())
        path = f"/v1/runs/{run.id}/batches"
        faults.inject("POST", path, "drop_after", "503", "429:0")
        info = await client.submit_batch(run.id, _batch(step=1))
        assert (await client.get_run(run.id)).id == run.id
        with pytest.raises(errors.NotFound):
            await client.get_run("run_" + "f" * 12)
    seen = faults.requests_to("POST", path)
    assert len(seen) == 4 and len({s.idempotency_key for s in seen}) == 1
    assert [b["id"] for b in service.batches[run.id]] == [info.id]


def test_parse_retry_after() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("0.25") == 0.25
    assert parse_retry_after(None) is None
    assert parse_retry_after("garbage") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past


def test_a_422s_field_errors_are_in_the_sdks_error_text() -> None:
    """The service's message only counts them ("2 invalid field(s)"); the exception's text names them."""
    from contracts.http import ValidationError, error_from_response

    details = [
        {"loc": ["body", "config", "lora", "rank"], "msg": "Input should be greater than or equal to 1"},
        {"loc": ["body", "config", "max_stepz"], "msg": "Extra inputs are not permitted"},
    ]
    body = {"error": {"code": "validation_error", "message": "2 invalid field(s)", "details": details}}
    error = error_from_response(httpx.Response(422, json=body))
    assert isinstance(error, ValidationError) and error.details == details
    assert str(error) == (
        "422 [validation_error] 2 invalid field(s): body.config.lora.rank: Input should be greater than or "
        "equal to 1; body.config.max_stepz: Extra inputs are not permitted"
    )


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "localhost", "ftp://example.org"])
def test_a_base_url_without_http_is_refused_at_construction(url: str) -> None:
    """httpx failed on the first call with its own UnsupportedProtocol, which is no LoraloomError."""
    for client_class in (LoraloomClient, AsyncLoraloomClient):
        with pytest.raises(ValueError, match="must start with http:// or https://"):
            client_class(url, "llk_key")


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/", "https://h/loraloom/v1"]
)
def test_a_base_url_ending_with_v1_is_refused_at_construction(url: str) -> None:
    """Every route already starts with /v1: a base URL copied with it got a 404 on every call."""
    for client_class in (LoraloomClient, AsyncLoraloomClient):
        with pytest.raises(ValueError, match="give the base URL without /v1") as info:
            client_class(url, "llk_key")
        assert repr(url.rstrip("/").removesuffix("/v1")) in str(info.value)  # the URL to give instead
    # A path of its own (a reverse proxy's prefix) stays allowed.
    LoraloomClient("https://h/loraloom", "llk_key").close()


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/api/v1", "http://127.0.0.1:8000/api/v1/"])
def test_a_base_url_ending_with_the_tinker_api_is_refused_at_construction(url: str) -> None:
    """/api/v1 is the Tinker SDK's surface (X-API-Key): every call with this client's Bearer key was a
    401, which read as a wrong key; it was refused as a /v1 URL, with /api as the URL to give instead.
    A URL ending in /api alone is allowed (a proxy's prefix); its 401 names the Tinker surface
    (tests/app/test_cli_usability.py)."""
    for client_class in (LoraloomClient, AsyncLoraloomClient):
        with pytest.raises(ValueError, match="the Tinker SDK's API") as info:
            client_class(url, "llk_key")
        assert "e.g. 'http://127.0.0.1:8000'" in str(info.value)
    LoraloomClient("http://127.0.0.1:8000/api", "llk_key").close()


@pytest.mark.parametrize("key", [None, ""])
def test_a_missing_api_key_is_refused_at_construction(key: str | None) -> None:
    """No route of the SDK answers without a key: every call was a 401."""
    for client_class in (LoraloomClient, AsyncLoraloomClient):
        with pytest.raises(ValueError, match="api_key is required"):
            client_class("http://127.0.0.1:8000", key)  # type: ignore[arg-type]


def test_upload_adapter_names_a_missing_directory_before_any_request(
    client: LoraloomClient, faults: FaultInjector, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-adapter"
    with pytest.raises(FileNotFoundError, match=f"adapter directory {missing} does not exist"):
        client.upload_adapter(missing, name="mine")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no adapter_config.json"):
        client.upload_adapter(tmp_path / "empty", name="mine")
    assert faults.requests_to("POST", "/v1/adapters") == []


def test_wait_until_active_waits_out_the_queue(client: LoraloomClient, service: FakeService) -> None:
    """The README's create-then-submit got a 409 while the run was still queued."""
    run = client.create_run("queued", {})
    service.set_status(run.id, "queued", slot=None, waiting_reason="all 1 slots are taken")

    def activate_after_two_heartbeats() -> None:  # two rounds of poll and heartbeat while queued
        deadline = time.monotonic() + 5  # a client that never heartbeats: the assertion below says so
        while service.heartbeats.get(run.id, 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        service.set_status(run.id, "active", slot=0, waiting_reason=None)

    threading.Thread(target=activate_after_two_heartbeats, daemon=True).start()
    active = client.wait_until_active(run.id, timeout=10, poll=0.05)
    assert active.status == "active"
    assert service.heartbeats[run.id] >= 2  # alive while it waited (heartbeat_timeout)
    client.submit_batch(run.id, _batch())
    assert client.wait_until_active(run.id, timeout=0) == client.get_run(run.id)  # already active


def test_wait_until_active_reports_why_it_gave_up(client: LoraloomClient, service: FakeService) -> None:
    run = client.create_run("waits", {})
    service.set_status(run.id, "queued", waiting_reason="the tenant's quota of 1 concurrent runs is in use")
    with pytest.raises(TimeoutError, match=r"still queued after 0.2s: the tenant's quota of 1 concurrent"):
        client.wait_until_active(run.id, timeout=0.2, poll=0.05)

    service.evict(run.id, "no slot in time", by="user")
    with pytest.raises(errors.RunEvicted) as evicted:
        client.wait_until_active(run.id, timeout=10, poll=0.05)
    assert evicted.value.reason == "no slot in time"
    for status in ("failed", "completed"):
        service.set_status(run.id, status)
        with pytest.raises(errors.RunFailed, match=f"is {status}"):
            client.wait_until_active(run.id, timeout=10, poll=0.05)


async def test_async_wait_until_active(base_url: str, service: FakeService) -> None:
    async with AsyncLoraloomClient(base_url, service.api_key, retry=FAST, timeout=5.0) as client:
        run = await client.create_run("async-queued", {})
        service.set_status(run.id, "queued")
        threading.Timer(0.2, lambda: service.set_status(run.id, "active")).start()
        assert (await client.wait_until_active(run.id, timeout=10, poll=0.05)).status == "active"
        service.evict(run.id, "gone")
        with pytest.raises(errors.RunEvicted):
            await client.wait_until_active(run.id, timeout=10, poll=0.05)
