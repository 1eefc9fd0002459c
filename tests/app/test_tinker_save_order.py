"""Saves of one path recorded out of request order. A completed save marks the older saves of its
path superseded (`tinker_futures.superseded_at`, app.tinker.work `_supersede_older_saves`), and a
path's reads take its highest request number (seq_id) among the saves left current. The guard: only
saves of a LOWER seq_id are superseded, so an older request whose result the pool posts after a
newer one's leaves the newer current, and the path still names the newer save. Made deterministic
by posting the pool's results by hand, the newer first, in two posts. Also what the path names when
its newer save was deleted before the older one completed (the older is live: the delete forgot
the saves it found), the state migration 0022 restores for rows 0021 ranked
(tests/app/test_tinker_migration_deleted_newest.py). Both databases."""

from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.adapters.pruning import _live_sampler_steps
from app.tinker.models import TinkerFuture
from tests.app.api import WORKER_HEADERS, TenantHandle, register
from tests.app.tinker_calls import new_model, run_of, tinker_headers

SAMPLER = "save_weights_for_sampler"


def _save(client: TestClient, tenant: TenantHandle, model_id: str, seq_id: int) -> str:
    """A sampler save of the name "s"; its request id."""
    body = {"model_id": model_id, "seq_id": seq_id, "path": "s"}
    r = client.post(f"/api/v1/{SAMPLER}", json=body, headers=tinker_headers(tenant))
    assert r.status_code == 200, r.text
    return str(r.json()["request_id"])


def _claim(client: TestClient, pool_id: str) -> dict[int, str]:
    """The pool's claim: request id by seq_id."""
    r = client.post(
        "/v1/pool/manual/claim", json={"pool_id": pool_id, "max_items": 64}, headers=WORKER_HEADERS
    )
    assert r.status_code == 200, r.text
    return {int(i["seq_id"]): str(i["request_id"]) for i in r.json()["items"]}


def _post(client: TestClient, pool_id: str, request_id: str, step: int) -> None:
    """The pool's result for one claimed save: the adapter of `step` (what the path then names)."""
    results = [{"request_id": request_id, "metrics": {"step": float(step)}}]
    r = client.post(
        "/v1/pool/manual/results", json={"pool_id": pool_id, "results": results}, headers=WORKER_HEADERS
    )
    assert r.status_code == 200, r.text


def _current(db: Session, model_id: str) -> dict[int, bool]:
    """seq_id -> whether the save is its path's current one (not superseded)."""
    db.expire_all()
    rows = db.execute(
        select(TinkerFuture.seq_id, TinkerFuture.superseded_at).where(
            TinkerFuture.model_id == model_id, TinkerFuture.kind == SAMPLER, TinkerFuture.status == "complete"
        )
    ).all()
    db.rollback()  # on SQLite an open read holds the app's writes back
    return {int(seq): at is None for seq, at in rows if seq is not None}


def _pinned(db: Session, run_id: str) -> list[tuple[str | None, int | None]]:
    """The (run, step) pairs the pruning keeps for the run's live sampler checkpoints."""
    pinned = [(run, step) for run, step in db.execute(_live_sampler_steps([run_id]))]
    db.rollback()
    return pinned


def _names(client: TestClient, tenant: TenantHandle, path: str) -> int | None:
    """The step `path` resolves to (None: 404)."""
    r = client.get("/api/v1/loraloom/resolve", params={"path": path}, headers=tinker_headers(tenant))
    if r.status_code == 404:
        return None
    assert r.status_code == 200, r.text
    return int(r.json()["step"])


def _listed(client: TestClient, tenant: TenantHandle, model_id: str) -> list[str]:
    r = client.get(f"/api/v1/training_runs/{model_id}/checkpoints", headers=tinker_headers(tenant))
    assert r.status_code == 200, r.text
    return [c["tinker_path"] for c in r.json()["checkpoints"]]


def test_an_older_save_completing_after_a_newer_one_does_not_supersede_it(
    client: TestClient, tenant: TenantHandle, db: Session
) -> None:
    pool_id = register(client)
    model_id = new_model(client, tenant)
    run_id = run_of(client, tenant, model_id)
    path = f"tinker://{model_id}/sampler_weights/s"
    _save(client, tenant, model_id, 1)
    _save(client, tenant, model_id, 2)
    claimed = _claim(client, pool_id)
    assert sorted(claimed) == [1, 2]  # both in the pool's hands at once

    _post(client, pool_id, claimed[2], step=22)  # the newer request completes first
    assert _current(db, model_id) == {2: True}
    _post(client, pool_id, claimed[1], step=11)  # then the older one

    # The older save superseded nothing newer: both stay current, and the path names the newer.
    assert _current(db, model_id) == {1: True, 2: True}
    assert _names(client, tenant, path) == 22
    assert _listed(client, tenant, model_id) == [path]
    assert _pinned(db, run_id) == [(run_id, 22)]

    # A newer request supersedes both.
    _save(client, tenant, model_id, 3)
    (third,) = _claim(client, pool_id).values()
    _post(client, pool_id, third, step=33)
    assert _current(db, model_id) == {1: False, 2: False, 3: True}
    assert _names(client, tenant, path) == 33
    assert _pinned(db, run_id) == [(run_id, 33)]


def test_an_older_save_completing_after_its_path_was_deleted_names_it_again(
    client: TestClient, tenant: TenantHandle, db: Session
) -> None:
    """The newer save completes, the user deletes the path (it marks the saves it finds), then the
    older request completes: its save is live, the path names it, its step stays pinned."""
    pool_id = register(client)
    model_id = new_model(client, tenant)
    run_id = run_of(client, tenant, model_id)
    path = f"tinker://{model_id}/sampler_weights/s"
    _save(client, tenant, model_id, 1)
    _save(client, tenant, model_id, 2)
    claimed = _claim(client, pool_id)
    _post(client, pool_id, claimed[2], step=22)
    deleted = client.delete(
        f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/s", headers=tinker_headers(tenant)
    )
    assert deleted.status_code == 204, deleted.text
    assert _names(client, tenant, path) is None
    assert _pinned(db, run_id) == []

    _post(client, pool_id, claimed[1], step=11)
    assert _current(db, model_id) == {1: True, 2: True}  # the deleted newer one is current too
    assert _names(client, tenant, path) == 11
    assert _listed(client, tenant, model_id) == [path]
    assert _pinned(db, run_id) == [(run_id, 11)]
