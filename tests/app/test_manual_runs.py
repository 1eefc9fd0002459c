"""A Tinker model's run (`config.mode` manual) is stepped by its user (forward_backward, then
optim_step), never by rollout batches: a batch trained into it applied, and used up, the gradients
the user had accumulated for their next optim_step (found by a hostile-tenant probe: the batch
route answered 201 and the pool trained the batch as a step of the model). Its batches are refused
on both paths of the route, and the claim never hands one out; and such a run is made only by the
Tinker API, never by POST /v1/runs (a manual run there has no model: nothing could ever step it)."""

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from app.batches import ingest_run
from app.batches.models import Batch
from app.config import Settings
from app.main import create_app
from app.runs.models import Run
from tests.app.api import (
    LiveServer,
    TenantHandle,
    batch_body,
    claim,
    create_run,
    new_tenant,
    post_batch,
    register,
)
from tests.app.factories import Seeded, batch_states, committed, rollout_files, row_counts, run_row
from tests.app.tinker_calls import new_model, run_of


@pytest.fixture(params=["documented", "fast"])
def server(request: pytest.FixtureRequest, settings: Settings) -> Iterator[httpx.Client]:
    """A real server whose batch route answers on its documented path only (no key cache) or on
    its fast path (app/batches/lean_route.py) once the key is cached (and the run: no bound reached
    on a slow machine)."""
    cache = 0.0 if request.param == "documented" else 60.0
    app = create_app(
        settings.model_copy(update={"api_key_cache_seconds": cache, "ingest_run_cache_seconds": 60.0})
    )
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        yield client


def _tinker_model_run(client: httpx.Client, tenant: TenantHandle) -> str:
    """A Tinker training model made through the Tinker API; its run's id (from GET /v1/runs)."""
    run_id = run_of(client, tenant, new_model(client, tenant))
    run = client.get(f"/v1/runs/{run_id}", headers=tenant.headers).json()
    assert run["config"]["mode"] == "manual" and run["status"] == "active"
    return run_id


def test_a_tinker_models_run_takes_no_rollout_batch(
    settings: Settings,
    server: httpx.Client,
    fast_calls: list[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    register(server)
    tenant = new_tenant(server)
    run_id = _tinker_model_run(server, tenant)
    seeded = Seeded(tenant.id, tenant.key, run_id)
    loads: list[str] = []
    real_load = ingest_run.load_ingest_run

    def counted(session: Any, **kwargs: Any) -> Any:
        loads.append(kwargs["run_id"])
        return real_load(session, **kwargs)

    monkeypatch.setattr(ingest_run, "load_ingest_run", counted)
    answers = [
        post_batch(server, seeded, batch_body(8)),
        post_batch(server, seeded, batch_body(8), msgpack=True),
        post_batch(server, seeded, batch_body(8), msgpack=True, key="k1"),
        post_batch(server, seeded, {"examples": []}),  # refused for the run before the body is looked at
    ]
    for r in answers:
        assert r.status_code == 409, r.text
        assert r.json()["error"] == {
            "code": "run_is_manual",
            "message": f"run {run_id} is driven through the Tinker API (mode manual); it takes no rollout batches",
            "details": {"mode": "manual"},
        }
    # The variant with the run cache takes the fast path: every refusal from the run as first read (no
    # statement more); the other takes the documented route only.
    if request.node.callspec.params["server"] == "fast":
        assert fast_calls == [run_id] * 4 and loads == [run_id]
    else:
        assert fast_calls == []
    # Nothing stored: no row, no payload file, no sample range reserved.
    assert row_counts(settings, Batch) == (0,) and rollout_files(settings) == []
    with committed(settings) as db:
        assert run_row(db, run_id).submitted_samples == 0
    # The tenant's rollout runs take batches as ever.
    other = create_run(server, tenant)
    assert other["status"] == "active"
    assert post_batch(server, Seeded(tenant.id, tenant.key, other["id"]), batch_body(8)).status_code == 201


def test_the_claim_hands_out_no_batch_of_a_manual_run(settings: Settings, http: httpx.Client) -> None:
    """Batches stored for a run that is manual (before the route refused them) stay unclaimed; a
    run whose stored config predates `mode` is a rollout run."""
    pool = register(http)
    tenant = new_tenant(http)
    manual, legacy = (Seeded(tenant.id, tenant.key, create_run(http, tenant)["id"]) for _ in range(2))
    for seeded in (manual, legacy):
        assert post_batch(http, seeded, batch_body(2)).status_code == 201
    with committed(settings) as db:
        config = run_row(db, manual.run_id).config
        db.execute(update(Run).where(Run.id == manual.run_id).values(config=config | {"mode": "manual"}))
        without_mode = {k: v for k, v in config.items() if k != "mode"}
        db.execute(update(Run).where(Run.id == legacy.run_id).values(config=without_mode))
    batches = claim(http, pool)["batches"]
    assert [batch["run_id"] for batch in batches] == [legacy.run_id]
    states = {state for state, _, _ in batch_states(settings).values()}
    assert states == {"pending", "claimed"}  # the manual run's batch is still pending
    assert claim(http, pool)["batches"] == []


CREATE_MANUAL = [
    ({"name": "m", "config": {"mode": "manual"}}, "application/json"),
    ('name = "m"\n[config]\nmode = "manual"\n', "application/toml"),
]


@pytest.mark.parametrize(("body", "content_type"), CREATE_MANUAL, ids=["json", "toml"])
def test_post_runs_makes_no_manual_run(
    settings: Settings, http: httpx.Client, body: Any, content_type: str
) -> None:
    tenant = new_tenant(http)
    content = body if isinstance(body, str) else httpx.Request("POST", "/", json=body).content
    r = http.post(
        "/v1/runs",
        content=content,
        headers=tenant.headers | {"Content-Type": content_type, "Idempotency-Key": "m1"},
    )
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error"
    assert [d["loc"] for d in error["details"]] == [["body", "config", "mode"]]
    assert "Tinker API" in error["message"]
    assert row_counts(settings, Run) == (0,)
    # `rollout`, said or not, is a run as ever.
    explicit = http.post(
        "/v1/runs", json={"name": "r", "config": {"mode": "rollout"}}, headers=tenant.headers
    )
    assert explicit.status_code == 201, explicit.text
