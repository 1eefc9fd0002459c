"""POST /api/v1/create_sampling_session checks its `session_id` as every Tinker route does: another
tenant's session, or one that does not exist, is the same uniform 404 and nothing is stored. Before,
the id was ignored: another tenant's session id, or "x", was taken (prober, finding 4). The SDK,
which always sends its own session, is unaffected (test_tinker_sdk*.py, and
test_streamend_readme_tinker.py runs the README's example through it). Both databases."""

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from tests.app.api import new_tenant, register
from tests.app.tinker_calls import BASE_MODEL, answer_work, new_model, new_session, stored, tinker_headers


def _open(client: TestClient, headers: dict[str, str], session_id: str, what: dict[str, str]) -> Any:
    body = {"session_id": session_id, "sampling_session_seq_id": 0, **what}
    return client.post("/api/v1/create_sampling_session", json=body, headers=headers)


@pytest.fixture
def sampler_path(client: TestClient) -> tuple[dict[str, str], str, str]:
    """A tenant's Tinker headers, its session, and a `tinker://` sampler path of its own model (a
    pool serving the base model answers the save)."""
    pool_id = register(client)
    tenant = new_tenant(client)
    model_id = new_model(client, tenant)
    headers = tinker_headers(tenant)
    saved = client.post(
        "/api/v1/save_weights_for_sampler",
        json={"model_id": model_id, "seq_id": 1, "path": "w"},
        headers=headers,
    )
    assert saved.status_code == 200, saved.text
    assert answer_work(client, pool_id)
    return headers, model_id.split(":train:")[0], f"tinker://{model_id}/sampler_weights/w"


def test_another_tenants_session_or_none_is_a_404_and_nothing_is_stored(
    client: TestClient, db: Session, sampler_path: tuple[dict[str, str], str, str]
) -> None:
    headers, own_session, path = sampler_path
    theirs = new_session(client, new_tenant(client))
    before = stored(db)
    for what in ({"model_path": path}, {"base_model": BASE_MODEL}):
        for session_id in (theirs, "x", "ses_000000000000"):
            r = _open(client, headers, session_id, what)
            assert r.status_code == 404, (session_id, what, r.text)
            error = r.json()["error"]
            assert set(error) == {"code", "message", "details"}
            # Another tenant's session reads exactly as a missing one.
            assert (error["code"], error["message"]) == ("not_found", f"session {session_id} not found")
    assert stored(db) == before

    # The caller's own session opens both kinds of sampler, as before.
    for what in ({"model_path": path}, {"base_model": BASE_MODEL}):
        r = _open(client, headers, own_session, what)
        assert r.status_code == 200, r.text
        assert r.json()["type"] == "create_sampling_session"


def test_what_to_sample_is_still_checked_first(
    client: TestClient, sampler_path: tuple[dict[str, str], str, str]
) -> None:
    """A bad body or weights answer as before whatever the session: their 422/404 say what is wrong."""
    headers, _, _ = sampler_path
    r = _open(client, headers, "x", {})
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
    r = _open(client, headers, "x", {"base_model": "no-such-model"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "pool_not_found", r.text
