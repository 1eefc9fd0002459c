"""The same Tinker request sent twice at once (the SDK retries a request whose answer it did not get):
both pass the "stored already?" check before either commits, and the second's insert meets the first's
on a unique index. It answers with the first one's future, as a retry after the fact does, instead of a
500 (review of 2026-11-23, M5). The window is made deterministic: both requests are held at a barrier
after their check and before their insert."""

import threading
from typing import Any

import httpx
import pytest

from app.main import create_app
from app.serving import uvicorn_options
from app.tinker import service as tinker_service
from app.tinker import work
from tests.app.api import LiveServer, new_tenant, register
from tests.app.test_tinker_work import PROTOBUF, _datum, _fwdbwd_body

pytestmark = pytest.mark.postgres_only


def _create_model_request(http: Any, tenant: Any) -> tuple[dict[str, str], dict[str, Any]]:
    """The tenant's Tinker headers and a create_model body in a new session of its own."""
    headers = {"X-API-Key": "tml-" + tenant.key}
    session_id = http.post("/api/v1/create_session", json={}, headers=headers).json()["session_id"]
    create = {
        "session_id": session_id,
        "model_seq_id": 0,
        "base_model": "loraloom-tiny",
        "lora_config": {"rank": 4, "train_unembed": False, "train_mlp": False},
    }
    return headers, create


def _twice_at_once(send) -> list[httpx.Response]:
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(send())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return answers


def test_twin_creates_and_submissions_get_one_future(settings, monkeypatch):
    both_checked = threading.Barrier(2, timeout=10)
    real_run_config, real_check = tinker_service._run_config, work.check_pending_room

    def run_config_after_both_checked(*args, **kwargs):
        both_checked.wait()
        return real_run_config(*args, **kwargs)

    def room_after_both_checked(*args, **kwargs):
        both_checked.wait()
        return real_check(*args, **kwargs)

    with (
        LiveServer(create_app(settings), **uvicorn_options()) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        register(http)
        tenant = new_tenant(http)
        headers, create = _create_model_request(http, tenant)
        session_id = create["session_id"]
        monkeypatch.setattr(tinker_service, "_run_config", run_config_after_both_checked)
        created = _twice_at_once(lambda: http.post("/api/v1/create_model", json=create, headers=headers))
        monkeypatch.setattr(tinker_service, "_run_config", real_run_config)
        assert [r.status_code for r in created] == [200, 200], [r.text for r in created]
        assert created[0].json() == created[1].json()  # the same future: one model
        model_id = f"{session_id}:train:0"

        body = _fwdbwd_body(model_id, 1, [_datum([1, 2, 3])])
        monkeypatch.setattr(work, "check_pending_room", room_after_both_checked)
        submitted = _twice_at_once(
            lambda: http.post("/api/v1/forward_backward", content=body, headers=headers | PROTOBUF)
        )
        monkeypatch.setattr(work, "check_pending_room", real_check)
        assert [r.status_code for r in submitted] == [200, 200], [r.text for r in submitted]
        assert submitted[0].json()["request_id"] == submitted[1].json()["request_id"]
        runs = httpx.get(f"{server.url}/v1/runs", headers=tenant.headers).json()["items"]
        assert len(runs) == 1


def test_a_twin_create_that_commits_between_the_checks_is_found(client, tenant, monkeypatch):
    """The first request commits after the second's "created already?" query and before its "does
    the model exist?" look: the second answers with the first's future (it was a 422 saying the
    model had been loaded from saved weights)."""
    headers, create = _create_model_request(client, tenant)
    first = client.post("/api/v1/create_model", json=create, headers=headers)
    assert first.status_code == 200, first.text
    real, calls = tinker_service._create_future, []

    def not_yet_committed_at_first(session, model_id):
        calls.append(model_id)
        return None if len(calls) == 1 else real(session, model_id)

    monkeypatch.setattr(tinker_service, "_create_future", not_yet_committed_at_first)
    second = client.post("/api/v1/create_model", json=create, headers=headers)
    assert second.status_code == 200, second.text
    assert second.json() == first.json() and len(calls) == 2
