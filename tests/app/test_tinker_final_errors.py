"""An error no retry can clear is a status the official SDK (pinned, unmodified) raises at once.

The SDK retries every 408, 409, 429 and 5xx: ten times with backoff in its HTTP client (about a
minute; `x-should-retry: false` stops that layer only), and for 5 minutes around a submission
(`InternalClientHolder.execute_with_retries`, which reads the status alone). A model whose run's
Idempotency-Key (`tinker:{model_id}`) the tenant used already for another run was the runs API's 409
`idempotency_conflict`: create_model hung for a minute, load_weights for five, before the user saw
it. It is a 422 `model_id_taken` now. Each test counts the requests the server saw for the route:
exactly one, so the SDK raised on the first answer.
"""

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import tinker
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.config import Settings
from app.main import create_app
from app.runs.models import Run
from app.tinker.models import TinkerModel
from tests.app.api import LiveServer, TenantHandle, new_tenant, register
from tests.app.test_tinker_long_polls import _wait_until
from tests.app.test_tinker_retry_hints import BASE_MODEL, _run_pool, _saves, _sdk, _training

SDK_WAIT_S = 120
"""Only a bound on a hung test: the SDK answers on its first response, or the counts fail."""


class _Answers:
    """ASGI middleware: (path, status) of every answer under /api/v1, in order."""

    def __init__(self, app: ASGIApp, answers: list[tuple[str, int]]) -> None:
        self.app = app
        self.answers = answers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/api/v1/"):
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.answers.append((scope["path"], message["status"]))
            await send(message)

        await self.app(scope, receive, sending)


@pytest.fixture
def served(settings: Settings) -> Iterator[tuple[LiveServer, list[tuple[str, int]]]]:
    app = create_app(settings)
    answers: list[tuple[str, int]] = []
    app.add_middleware(_Answers, answers=answers)
    with LiveServer(app) as server:
        yield server, answers


def _take_key(http: httpx.Client, tenant: TenantHandle, model_id: str) -> str:
    """A run of the tenant's made through /v1/runs with the key a model's run would have."""
    r = http.post(
        "/v1/runs",
        json={"name": "mine", "config": {"base_model": BASE_MODEL}},
        headers=tenant.headers | {"Idempotency-Key": f"tinker:{model_id}"},
    )
    assert r.status_code == 201, r.text
    run_id: str = r.json()["id"]
    return run_id


def _refusal(error: Any, *, model_id: str, run_id: str) -> None:
    """The SDK's exception carries our status, our uniform body and the message naming the cause."""
    assert isinstance(error, tinker.UnprocessableEntityError)
    assert error.status_code == 422
    assert isinstance(error.body, dict)
    assert error.body["error"]["code"] == "model_id_taken"
    assert error.body["error"]["details"]["run_id"] == run_id
    assert f"model {model_id} cannot be created" in str(error)
    assert f"'tinker:{model_id}' was already used for run {run_id}" in str(error)


def _stored(db: Session, tenant_id: str) -> tuple[list[str], int]:
    """(the tenant's Tinker model ids, its runs)."""
    db.expire_all()
    models = list(db.scalars(select(TinkerModel.id).where(TinkerModel.tenant_id == tenant_id)))
    runs = db.scalar(select(func.count()).select_from(Run).where(Run.tenant_id == tenant_id)) or 0
    db.rollback()  # ends the transaction: on SQLite it holds the database's write lock
    return sorted(models), runs


def test_create_model_whose_run_key_is_taken_raises_at_once_through_the_sdk(served, db):
    server, answers = served
    with httpx.Client(base_url=server.url, timeout=30) as http:
        tenant = new_tenant(http)
        service = _sdk(server, tenant)
        try:
            model_id = f"{service.holder.get_session_id()}:train:0"  # the SDK's first model
            run_id = _take_key(http, tenant, model_id)
            with pytest.raises(tinker.APIStatusError) as refused:
                service.create_lora_training_client(
                    base_model=BASE_MODEL, rank=4, train_unembed=False, train_mlp=False
                ).result(timeout=SDK_WAIT_S)
        finally:
            service.close("success").result()
    _refusal(refused.value, model_id=model_id, run_id=run_id)
    assert [status for path, status in answers if path == "/api/v1/create_model"] == [422]
    assert _stored(db, tenant.id) == ([], 1)  # no model, no second run


def test_load_weights_into_a_model_whose_run_key_is_taken_raises_at_once_through_the_sdk(served, db):
    server, answers = served
    with httpx.Client(base_url=server.url, timeout=30) as http:
        pool_id = register(http)
        tenant = new_tenant(http, quota=3)
        service = _sdk(server, tenant)
        try:
            training = _training(service)  # model 0
            saving = training.save_state("kept")
            _wait_until(lambda: _saves(db, tenant.id) == 1, "the save is stored")
            _run_pool(http, pool_id, 1)
            path = saving.result(timeout=SDK_WAIT_S).path
            model_id = f"{service.holder.get_session_id()}:train:1"  # the SDK's next model
            run_id = _take_key(http, tenant, model_id)
            with pytest.raises(tinker.APIStatusError) as refused:
                service.create_training_client_from_state(path).result(timeout=SDK_WAIT_S)
        finally:
            service.close("success").result()
    _refusal(refused.value, model_id=model_id, run_id=run_id)
    assert [status for path, status in answers if path == "/api/v1/load_weights"] == [422]
    assert _stored(db, tenant.id) == ([training.model_id], 2)  # the first model's and mine only
