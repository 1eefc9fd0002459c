"""`POST /v1/pool/runs/deleted`: which of the runs a pool has files for it may remove (a deleted run's
checkpoints and saved weights on a pool with its own checkpoint directory; trainer_core.run_files).
Only deletions of runs this service holds count: an id it never saw (another service's run in a shared
directory) is never named; an evicted, completed or failed run keeps its checkpoints (init_from, an
evicted Tinker model); a deleted run keeps them while a queued or active run starts from its
checkpoint, or while a Tinker load of its saved state may still run."""

from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app.adapters.models import Checkpoint
from app.config import Settings
from contracts.pool_api import MAX_DELETED_QUERY
from tests.app.api import WORKER_HEADERS, TenantHandle, create_run, new_tenant, register
from tests.app.factories import committed, end_read, make_run, make_tenant
from tests.app.tinker_calls import answer_work, new_model, new_session, run_of, tinker_headers
from trainer_core.run_files import RunFiles

ROUTE = "/v1/pool/runs/deleted"


def _deleted(client: TestClient, run_ids: list[str]) -> list[str]:
    r = client.post(ROUTE, json={"run_ids": run_ids}, headers=WORKER_HEADERS)
    assert r.status_code == 200, r.text
    return r.json()["deleted"]


def test_only_deleted_runs_are_named(client: TestClient, db: Session) -> None:
    tenant = new_tenant(client, quota=4)
    active = create_run(client, tenant, name="active")["id"]
    evicted = create_run(client, tenant, name="evicted")["id"]
    deleted = create_run(client, tenant, name="deleted")["id"]
    r = client.post(f"/v1/runs/{evicted}/evict", json={"reason": "done"}, headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert client.delete(f"/v1/runs/{deleted}", headers=tenant.headers).status_code == 200
    owner, _ = make_tenant(db)
    completed = make_run(db, owner, status="completed").id
    failed = make_run(db, owner, status="failed").id
    end_read(db)
    unknown = "run_00000000beef"  # another service's run, or one purged after its retention

    asked = [active, evicted, deleted, completed, failed, unknown, deleted]  # a repeat is asked once
    assert _deleted(client, asked) == [deleted]
    assert _deleted(client, [active, completed]) == []


def test_a_deleted_runs_checkpoint_an_init_from_needs_is_kept(
    client: TestClient, tenant: TenantHandle, settings: Settings
) -> None:
    tenant = new_tenant(client, quota=4)
    parent = create_run(client, tenant, name="parent")["id"]
    from_adapter = create_run(client, tenant, name="plain")["id"]
    with committed(settings) as session:
        session.add(Checkpoint(run_id=parent, step=4, total_samples=32))
    child = client.post(
        "/v1/runs",
        json={"name": "child", "init_from": {"run_id": parent, "checkpoint": 4, "with_optimizer": True}},
        headers=tenant.headers,
    )
    assert child.status_code == 201, child.text
    assert client.delete(f"/v1/runs/{parent}", headers=tenant.headers).status_code == 200
    assert client.delete(f"/v1/runs/{from_adapter}", headers=tenant.headers).status_code == 200

    # The child (not yet started, or started without a checkpoint of its own) still loads it.
    assert _deleted(client, [parent, from_adapter]) == [from_adapter]
    r = client.post(f"/v1/runs/{child.json()['id']}/evict", json={"reason": "x"}, headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert _deleted(client, [parent, from_adapter]) == sorted([parent, from_adapter])


def test_bad_questions_are_refused_naming_the_field(client: TestClient, tenant: TenantHandle) -> None:
    for body, loc in [
        ({"run_ids": []}, ["body", "run_ids"]),
        ({"run_ids": ["run_../../etc"]}, ["body", "run_ids", "0"]),
        ({"run_ids": ["run_0123456789AB"]}, ["body", "run_ids", "0"]),
        ({"run_ids": [f"run_{i:012x}" for i in range(MAX_DELETED_QUERY + 1)]}, ["body", "run_ids"]),
        ({"run_ids": ["run_0123456789ab"], "pool_id": "x"}, ["body", "pool_id"]),
    ]:
        r = client.post(ROUTE, json=body, headers=WORKER_HEADERS)
        assert r.status_code == 422, r.text
        assert [d["loc"] for d in r.json()["error"]["details"]] == [loc], r.text
    # Tenants never learn which runs exist: the route is the pool's.
    r = client.post(ROUTE, json={"run_ids": ["run_0123456789ab"]}, headers=tenant.headers)
    assert r.status_code == 403, r.text
    assert client.post(ROUTE, json={"run_ids": ["run_0123456789ab"]}).status_code == 401


class _Service:
    """The pool's question (`DeletedRunsSource`) sent to the service under test."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    def deleted_runs(self, run_ids: list[str]) -> set[str]:
        return set(_deleted(self.client, run_ids))


def test_a_pool_asking_about_runs_the_service_never_saw_removes_nothing(
    client: TestClient, tenant: TenantHandle, tmp_path: Path
) -> None:
    """A pool whose checkpoint directory holds another service's runs (`loraloom worker --url` at a
    remote service from where `loraloom serve` ran: the same default directory; a restored database
    beside the old volume): the service it asks never saw them, and their files stay. Its own deleted
    run still goes (the question is answered, not refused)."""
    home = tmp_path / "runs"
    foreign = [f"run_{i:012x}" for i in range(0xF00, 0xF05)]
    for run_id in foreign:
        (home / run_id / "checkpoints" / "step_1").mkdir(parents=True)
        (home / run_id / "checkpoints" / "step_1" / "STABLE").write_text("1\n")

    files = RunFiles(home, _Service(client))
    assert files.start() == []
    assert sorted(p.name for p in home.iterdir()) == foreign

    ours = create_run(client, tenant, name="ours")["id"]
    (home / ours / "checkpoints").mkdir(parents=True)
    assert client.delete(f"/v1/runs/{ours}", headers=tenant.headers).status_code == 200
    files.left(ours)
    assert files.check(held=()) == [ours]
    assert sorted(p.name for p in home.iterdir() if not p.name.startswith(".")) == foreign
    assert all((home / run_id / "checkpoints" / "step_1" / "STABLE").exists() for run_id in foreign)


def test_a_deleted_models_saved_state_is_kept_while_a_load_of_it_may_run(client: TestClient) -> None:
    """`create_training_client_from_state` from model A's saved state makes model B whose first request
    loads A's `tinker_states/` from the pool's disk (trainer_core.manual); a new pool for B replays
    that load until B's next checkpointed optim_step. Deleting A meanwhile must not remove A's files."""
    tenant = new_tenant(client, quota=4)
    headers = tinker_headers(tenant)
    pool_id = register(client)
    source = new_model(client, tenant)
    saved = client.post(
        "/api/v1/save_weights", json={"model_id": source, "seq_id": 1, "path": "st1"}, headers=headers
    )
    assert saved.status_code == 200, saved.text
    assert [i["kind"] for i in answer_work(client, pool_id)] == ["save_weights"]
    source_run = run_of(client, tenant, source)
    load = {
        "path": f"tinker://{source}/weights/st1",
        "session_id": new_session(client, tenant),
        "model_seq_id": 0,
        "optimizer": True,
    }
    loaded = client.post("/api/v1/load_weights", json=load, headers=headers)
    assert loaded.status_code == 200, loaded.text
    (target_run,) = [
        r["id"]
        for r in client.get("/v1/runs", headers=tenant.headers).json()["items"]
        if r["id"] != source_run
    ]
    assert client.delete(f"/v1/runs/{source_run}", headers=tenant.headers).status_code == 200

    # Pending: the pool has not loaded it yet.
    assert _deleted(client, [source_run]) == []
    claimed = answer_work(client, pool_id)
    assert [(i["kind"], i["source_run_id"]) for i in claimed] == [("load_weights", source_run)]
    # Done, but replayable while B is active: a restarted pool loads it again.
    assert _deleted(client, [source_run]) == []
    # B stops: nothing will load A's state again.
    r = client.post(f"/v1/runs/{target_run}/evict", json={"reason": "done"}, headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert _deleted(client, [source_run]) == [source_run]
