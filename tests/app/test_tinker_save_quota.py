"""Saved training states are bounded per tenant, and the checkpoint listings are paged in SQL
(hostile probe 2, finding 6): every `save_state` under a new name wrote adapter + optimizer state to
the pool's disk with no limit (300 saves, 252 MB for the tiny model), and `/checkpoints` read every
save row whole on each call (247 ms at 300 saves, growing with them). Past the quota a save is a 403
(the official SDK retries a 409 for 5 minutes: tests/app/test_tinker_retry_hints.py)."""

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, func, select

from app.config import Settings
from app.tinker import checkpoints
from app.tinker.models import TinkerFuture
from tests.app.api import WORKER_HEADERS, new_tenant, register
from tests.app.test_tinker_work import _model
from tests.app.tinker_calls import run_of

MOST = 3


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"tinker_max_saves_per_tenant": MOST})


def _save(
    client: TestClient,
    model_id: str,
    headers: dict[str, str],
    seq_id: int,
    name: str,
    kind: str = "save_weights",
) -> Any:
    return client.post(
        f"/api/v1/{kind}", json={"model_id": model_id, "seq_id": seq_id, "path": name}, headers=headers
    )


def _complete_all(client: TestClient, pool_id: str) -> None:
    """The pool runs every pending save, reporting them one at a time (so each completes after the
    one before it)."""
    items = client.post("/v1/pool/manual/claim", json={"pool_id": pool_id}, headers=WORKER_HEADERS).json()[
        "items"
    ]
    for item in sorted(items, key=lambda i: i["seq_id"]):
        result = {"request_id": item["request_id"], "metrics": {"step": 1}}
        r = client.post(
            "/v1/pool/manual/results", json={"pool_id": pool_id, "results": [result]}, headers=WORKER_HEADERS
        )
        assert r.status_code == 200, r.text


def _state_saves(db) -> int:
    db.expire_all()
    n = int(
        db.scalar(select(func.count()).select_from(TinkerFuture).where(TinkerFuture.kind == "save_weights"))
    )
    db.rollback()  # ends the transaction: on SQLite it holds the database's write lock
    return n


def test_a_tenant_keeps_at_most_its_saved_states(client, tenant, db):
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    for seq_id, name in enumerate(["s0", "s1"], start=1):
        assert _save(client, model_id, headers, seq_id, name).status_code == 200
    _complete_all(client, pool_id)
    # One more pending (not yet run by the pool): it counts as kept too.
    assert _save(client, model_id, headers, 3, "s2").status_code == 200

    refused = _save(client, model_id, headers, 4, "s3")
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["code"] == "save_quota"
    assert error["details"] == {"kind": "saved_states", "kept": MOST, "limit": MOST}
    assert "LORALOOM_TINKER_MAX_SAVES_PER_TENANT" in error["message"]
    assert _state_saves(db) == MOST  # nothing stored

    # A kept name saved again overwrites its state: always room.
    assert _save(client, model_id, headers, 4, "s0").status_code == 200
    # Sampler weights are not training states: not counted.
    assert _save(client, model_id, headers, 5, "samp", kind="save_weights_for_sampler").status_code == 200
    # Another tenant has its own quota.
    other = new_tenant(client)
    other_model, other_headers = _model(client, other)
    assert _save(client, other_model, other_headers, 1, "s3").status_code == 200
    _complete_all(client, pool_id)

    # Deleting a checkpoint does not free its place: the pool keeps its state until the run is
    # deleted (save, delete, save again filled the pool's disk under the quota). Its name may be
    # saved again, which overwrites that state.
    gone = client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/weights/s1", headers=headers)
    assert gone.status_code == 204, gone.text
    assert _save(client, model_id, headers, 6, "s3").status_code == 403
    assert _save(client, model_id, headers, 7, "s1").status_code == 200


def test_a_deleted_runs_states_do_not_count(client, tenant):
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    for seq_id in range(1, MOST + 1):
        assert _save(client, model_id, headers, seq_id, f"s{seq_id}").status_code == 200
    _complete_all(client, pool_id)
    assert _save(client, model_id, headers, MOST + 1, "new").status_code == 403
    (run,) = client.get("/v1/runs", headers=tenant.headers).json()["items"]
    assert client.delete(f"/v1/runs/{run['id']}", headers=tenant.headers).status_code in (200, 204)
    fresh, fresh_headers = _model(client, tenant)
    assert _save(client, fresh, fresh_headers, 1, "s1").status_code == 200


def test_checkpoints_are_paged_in_sql_without_loading_the_saves(client, tenant, db):
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    names = ["a", "b", "c", "a", "d"]  # "a" saved again: listed once, as its newest save
    for seq_id, name in enumerate(names, start=1):
        kind = "save_weights" if name != "d" else "save_weights_for_sampler"
        assert _save(client, model_id, headers, seq_id, name, kind=kind).status_code == 200
    _complete_all(client, pool_id)
    assert (
        client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/weights/b", headers=headers).status_code
        == 204
    )

    loaded: list[str] = []

    def on_load(target: TinkerFuture, _: Any) -> None:
        loaded.append(target.id)

    event.listen(TinkerFuture, "load", on_load)
    try:
        pages = []
        for offset in (0, 2, 4):
            r = client.get(f"/api/v1/checkpoints?limit=2&offset={offset}", headers=headers)
            assert r.status_code == 200, r.text
            pages.append(r.json())
        listed = client.get(f"/api/v1/training_runs/{model_id}/checkpoints", headers=headers).json()
        runs = client.get("/api/v1/training_runs", headers=headers).json()
    finally:
        event.remove(TinkerFuture, "load", on_load)
    assert loaded == []  # no save row read whole: the listing is built from the columns it shows

    newest_first = ["sampler_weights/d", "weights/a", "weights/c"]
    assert [c["checkpoint_id"] for p in pages for c in p["checkpoints"]] == newest_first
    assert [len(p["checkpoints"]) for p in pages] == [2, 1, 0]
    assert all(p["cursor"]["total_count"] == 3 for p in pages)
    assert [c["checkpoint_id"] for c in listed["checkpoints"]] == newest_first
    assert listed["checkpoints"][0]["tinker_path"] == f"tinker://{model_id}/sampler_weights/d"
    assert listed["checkpoints"][0]["checkpoint_type"] == "sampler"
    (run,) = runs["training_runs"]
    assert run["last_checkpoint"]["checkpoint_id"] == "weights/a"
    assert run["last_sampler_checkpoint"]["checkpoint_id"] == "sampler_weights/d"


@pytest.mark.parametrize("leaves_by", ["evict", "delete"])
def test_at_the_quota_a_save_to_a_model_whose_run_left_is_refused_for_that(client, tenant, db, leaves_by):
    """The run's status is checked before the quota: a save_state to a model whose run left answers
    400 `run_not_active` (it was the 403 `save_quota`), while one to a model whose run is active
    still gets the 403."""
    full, headers = _model(client, tenant)
    for seq_id in range(1, MOST + 1):
        assert _save(client, full, headers, seq_id, f"s{seq_id}").status_code == 200
    gone, _ = _model(client, tenant)
    run_id = run_of(client, tenant, gone)
    if leaves_by == "evict":
        left = client.post(f"/v1/runs/{run_id}/evict", json={"reason": "done here"}, headers=tenant.headers)
    else:
        left = client.delete(f"/v1/runs/{run_id}", headers=tenant.headers)
    assert left.status_code == 200, left.text

    refused = _save(client, gone, headers, 1, "new")
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "run_not_active"
    assert run_id in refused.json()["error"]["message"]
    at_quota = _save(client, full, headers, MOST + 1, "new")
    assert at_quota.status_code == 403 and at_quota.json()["error"]["code"] == "save_quota", at_quota.text
    assert _state_saves(db) == MOST  # nothing stored


def test_states_are_counted_by_each_paths_newest_save(client, tenant, db):
    """A state saved again leaves its older save, marked superseded when the newer completes; the
    quota counts each path once, from its newest save, a deleted checkpoint's too (its state stays
    on the pool), and the pending saves by the path their request names."""
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    for seq_id, name in enumerate(["a", "a", "b", "a"], start=1):
        assert _save(client, model_id, headers, seq_id, name).status_code == 200
        _complete_all(client, pool_id)
    assert _save(client, model_id, headers, 5, "c").status_code == 200  # left pending
    gone = client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/weights/b", headers=headers)
    assert gone.status_code == 204, gone.text

    db.expire_all()
    current = db.scalars(
        select(TinkerFuture.seq_id).where(
            TinkerFuture.model_id == model_id,
            TinkerFuture.kind == "save_weights",
            TinkerFuture.status == "complete",
            TinkerFuture.superseded_at.is_(None),
        )
    ).all()
    db.rollback()
    assert sorted(current) == [3, 4]  # b's save and a's newest

    def kept(name: str) -> tuple[int, int]:
        path = f"tinker://{model_id}/weights/{name}"
        count, has_path = db.execute(
            checkpoints.kept_query(tenant.id, kind="save_weights", path=path, deleted_kept=True)
        ).one()
        db.rollback()
        return int(count), int(has_path)

    assert [kept(name) for name in ("a", "b", "c", "d")] == [(3, 1), (3, 1), (3, 1), (3, 0)]
    refused = _save(client, model_id, headers, 6, "d")
    assert refused.status_code == 403 and refused.json()["error"]["details"]["kept"] == MOST, refused.text
    assert _save(client, model_id, headers, 6, "b").status_code == 200  # the deleted name: overwrites
