"""The `tinker://` paths of a model whose run is deleted are gone for every call that takes one
(app.tinker.checkpoints.live_saves decides for all of them): load_weights, resolve and
create_sampling_session answered 200 and stored a model and a run, or a sampling session, for a
deleted run's saves, while weights_info and the listings already said 404 (hostile probe h1,
finding 3). Each is now the same 404, and nothing is stored. Real HTTP (uvicorn), both databases.
"""

from typing import Any

import httpx
from sqlalchemy.orm import Session

from tests.app.api import new_tenant, register
from tests.app.tinker_calls import answer_work, new_model, new_session, run_of, stored, tinker_headers


def _saved(http: httpx.Client, headers: dict[str, str], pool_id: str, model_id: str) -> tuple[str, str]:
    """A training state "st1" and sampler weights "s2" of `model_id`, saved by the pool."""
    for seq_id, route, name in ((1, "save_weights", "st1"), (2, "save_weights_for_sampler", "s2")):
        r = http.post(
            f"/api/v1/{route}", json={"model_id": model_id, "seq_id": seq_id, "path": name}, headers=headers
        )
        assert r.status_code == 200, r.text
    assert [i["kind"] for i in answer_work(http, pool_id)] == ["save_weights", "save_weights_for_sampler"]
    return f"tinker://{model_id}/weights/st1", f"tinker://{model_id}/sampler_weights/s2"


def _not_found(r: Any, path: str) -> None:
    assert r.status_code == 404, r.text
    assert r.json()["error"] == {
        "code": "not_found",
        "message": f"checkpoint {path} not found",
        "details": None,
    }


def test_a_deleted_runs_paths_neither_load_nor_resolve_nor_open_samplers_and_nothing_is_stored(
    http: httpx.Client, db: Session
) -> None:
    tenant = new_tenant(http, quota=3)
    headers = tinker_headers(tenant)
    pool_id = register(http)
    model_id = new_model(http, tenant)
    state, sampler = _saved(http, headers, pool_id, model_id)
    other_model = new_model(http, tenant)  # a live model to load into

    # While the run lives, the paths work (and a sampling client is opened on the weights).
    assert http.post("/api/v1/weights_info", json={"tinker_path": state}, headers=headers).status_code == 200
    resolved = http.get("/api/v1/loraloom/resolve", params={"path": sampler}, headers=headers)
    assert resolved.status_code == 200 and resolved.json()["step"] == 1, resolved.text
    opened = http.post("/api/v1/create_sampling_session", json={"model_path": sampler}, headers=headers)
    assert opened.status_code == 200, opened.text
    sampler_id = opened.json()["sampling_session_id"]

    assert (
        http.delete(f"/v1/runs/{run_of(http, tenant, model_id)}", headers=tenant.headers).status_code == 200
    )
    before = stored(db)

    session_id = new_session(http, tenant)
    into_new = {"path": state, "session_id": session_id, "model_seq_id": 0, "optimizer": True}
    _not_found(http.post("/api/v1/load_weights", json=into_new, headers=headers), state)
    into_live = {"path": state, "model_id": other_model, "seq_id": 1, "optimizer": False}
    _not_found(http.post("/api/v1/load_weights", json=into_live, headers=headers), state)
    _not_found(http.get("/api/v1/loraloom/resolve", params={"path": sampler}, headers=headers), sampler)
    for body in (
        {"model_path": sampler},
        {"session_id": session_id, "sampling_session_seq_id": 1, "model_path": sampler},
    ):
        _not_found(http.post("/api/v1/create_sampling_session", json=body, headers=headers), sampler)
    # As weights_info and the listings said already.
    _not_found(http.post("/api/v1/weights_info", json={"tinker_path": state}, headers=headers), state)
    assert http.get("/api/v1/checkpoints", headers=headers).json()["checkpoints"] == []
    # The sampling client opened before the deletion stops too.
    gone = http.get(f"/api/v1/samplers/{sampler_id}", headers=headers)
    assert gone.status_code == 404 and "were deleted" in gone.json()["error"]["message"], gone.text
    sample = {
        "sampling_session_id": sampler_id,
        "prompt": {"chunks": [{"tokens": [1, 2]}]},
        "sampling_params": {},
    }
    assert http.post("/api/v1/asample", json=sample, headers=headers).status_code == 404

    # Nothing stored: no model, run, future or sampling session (the session made above aside).
    assert stored(db) == before
    assert answer_work(http, pool_id) == []


def test_another_models_paths_still_load_after_a_run_is_deleted(http: httpx.Client, db: Session) -> None:
    """The filter is the deleted run's own: a live model's saves load and resolve as before."""
    tenant = new_tenant(http, quota=3)
    headers = tinker_headers(tenant)
    pool_id = register(http)
    doomed, kept = new_model(http, tenant), new_model(http, tenant)
    _saved(http, headers, pool_id, doomed)
    state, sampler = _saved(http, headers, pool_id, kept)
    assert http.delete(f"/v1/runs/{run_of(http, tenant, doomed)}", headers=tenant.headers).status_code == 200

    load = {"path": state, "session_id": new_session(http, tenant), "model_seq_id": 0, "optimizer": True}
    loaded = http.post("/api/v1/load_weights", json=load, headers=headers)
    assert loaded.status_code == 200, loaded.text
    resolved = http.get("/api/v1/loraloom/resolve", params={"path": sampler}, headers=headers)
    assert resolved.status_code == 200 and resolved.json()["run_id"] == run_of(http, tenant, kept)
    assert (
        http.post(
            "/api/v1/create_sampling_session", json={"model_path": sampler}, headers=headers
        ).status_code
        == 200
    )
    listed = http.get("/api/v1/checkpoints", headers=headers).json()["checkpoints"]
    assert sorted(c["tinker_path"] for c in listed) == sorted([state, sampler])
