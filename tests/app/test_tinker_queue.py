"""A Tinker model that waits for a place says why, and one nobody drives any more leaves (probe
report, finding 5); a wrong method on a Tinker route is a 405, and a `tinker://` path without a
model id a 422 (finding 9).

- With the tenant's quota in use, `create_lora_training_client` succeeds (the model's run is
  queued, as on Tinker, where the SDK waits out its concurrent-training-clients limit), and every
  "try again" of its work now carries `queue_state` and `queue_state_reason`, which the unmodified
  SDK hands to its QueueStateLogger (`Training for <model> is paused. Reason: ...`).
- A model whose session stopped heartbeating for `tinker_session_timeout_seconds` is evicted by the
  sweeper, the reason naming the session: queued always, active unless it has a live sampler
  checkpoint (sampling it needs the run). Deterministic: heartbeats are set in the database and the
  function is called with its `now`; the app's own background sweeper is given a timeout it never
  reaches here.
"""

import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
import tinker
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import select, text, update
from sqlalchemy.orm import Session, sessionmaker
from tinker import types

from app import sweeper
from app.config import MAX_RETENTION_SECONDS, Settings
from app.db import make_engine, make_session_factory, utcnow
from app.runs.models import Run
from app.tinker import abandoned
from app.tinker import router as tinker_router
from app.tinker import service as tinker_service
from app.tinker.models import TinkerFuture, TinkerModel, TinkerSession
from contracts.ids import new_id
from contracts.status import RunStatus
from tests.app.api import TenantHandle, new_tenant, register
from tests.app.tinker_calls import AnsweringPool, new_model, new_session, run_of, tinker_headers

TIMEOUT = 600.0


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The app's background sweeper (every 2 s) never evicts a model here: the tests call the
    eviction themselves, with their own `now` and timeout."""
    return settings.model_copy(update={"tinker_session_timeout_seconds": MAX_RETENTION_SECONDS})


@pytest.fixture
def factory(settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long poll says "try again" after 0.1 s instead of 2 (the answers are under test, not the wait)."""
    monkeypatch.setattr(tinker_router, "LONG_POLL_S", 0.1)


def _optim_step(client: Any, tenant: TenantHandle, model_id: str, seq_id: int = 1) -> str:
    """A pending request of the model's run (JSON: no protobuf needed); its request id."""
    body = {"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": 0.01}}
    r = client.post("/api/v1/optim_step", json=body, headers=tinker_headers(tenant))
    assert r.status_code == 200, r.text
    return str(r.json()["request_id"])


def _retrieve(client: Any, tenant: TenantHandle, request_id: str) -> dict[str, Any]:
    r = client.post(
        "/api/v1/retrieve_future", json={"request_id": request_id}, headers=tinker_headers(tenant)
    )
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def _status(client: TestClient, tenant: TenantHandle, run_id: str) -> dict[str, Any]:
    r = client.get(f"/v1/runs/{run_id}", headers=tenant.headers)
    assert r.status_code == 200, r.text
    run: dict[str, Any] = r.json()
    return run


# --- why a model waits -------------------------------------------------------------------------


def test_a_queued_models_try_again_names_the_quota_and_the_runs_holding_it(client, quick_polls):
    register(client)  # two slots
    tenant = new_tenant(client, quota=1)
    first = new_model(client, tenant)
    waiting = new_model(client, tenant)
    first_run, waiting_run = run_of(client, tenant, first), run_of(client, tenant, waiting)
    assert _status(client, tenant, waiting_run)["status"] == "queued"

    answer = _retrieve(client, tenant, _optim_step(client, tenant, waiting))
    assert answer["type"] == "try_again"
    assert answer["queue_state"] == "paused_rate_limit"
    reason = answer["queue_state_reason"]
    assert reason.startswith(
        f"the model's run {waiting_run} is queued: the tenant's quota of 1 concurrent runs is in use "
        f"(by {first_run}); it starts when one of them leaves: DELETE /v1/runs/{{id}} frees a place"
    ), reason
    assert f"{TIMEOUT:g}" not in reason  # the app's own setting is named, not this module's constant

    # Work of a model that holds its slot waits for the pool only: no reason, the body as before.
    request_id = _optim_step(client, tenant, first)
    assert _retrieve(client, tenant, request_id) == {
        "type": "try_again",
        "request_id": request_id,
        "queue_state": "active",
    }


def test_a_model_waiting_for_a_slot_is_paused_for_capacity(client, quick_polls):
    register(client, slots=1)
    tenant, other = new_tenant(client, quota=2), new_tenant(client, quota=2)
    new_model(client, other)  # takes the pool's one slot
    waiting = new_model(client, tenant)
    answer = _retrieve(client, tenant, _optim_step(client, tenant, waiting))
    assert answer["queue_state"] == "paused_capacity"
    assert answer["queue_state_reason"] == (
        f"the model's run {run_of(client, tenant, waiting)} is queued: "
        "all 1 slots of the pool serving loraloom-tiny are taken"
    )


def _wait_for(check: Callable[[], bool], what: str) -> None:
    """Poll `check` (a hang guard, not a time bound under test)."""
    deadline = time.monotonic() + 60
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_unmodified_sdk_logs_why_training_is_paused_and_goes_on_once_a_place_frees(
    http, monkeypatch, caplog, quick_polls
):
    """The SDK logs a pause once it has lasted its grace period (15 minutes in tinker 0.38), then
    every minute; the grace is set to 0 here, nothing else of the SDK is changed."""
    monkeypatch.setattr("tinker.lib.queue_state_logger.PAUSE_GRACE_PERIOD", 0)
    caplog.set_level(logging.WARNING, logger="tinker.lib.queue_state_logger")
    pool_id = register(http)
    tenant = new_tenant(http, quota=1)
    service = tinker.ServiceClient(base_url=str(http.base_url), api_key="tml-" + tenant.key)
    try:
        holding = service.create_lora_training_client(
            base_model="loraloom-tiny", rank=4, train_mlp=False, train_unembed=False
        ).result()
        waiting = service.create_lora_training_client(
            base_model="loraloom-tiny", rank=4, train_mlp=False, train_unembed=False
        ).result()
        holding_run, waiting_run = (
            run_of(http, tenant, holding.model_id),
            run_of(http, tenant, waiting.model_id),
        )
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
        )
        future = waiting.forward_backward([datum], "cross_entropy")

        def paused() -> list[str]:
            return [r.getMessage() for r in caplog.records if "is paused" in r.getMessage()]

        _wait_for(lambda: bool(paused()), "the SDK's pause warning")
        assert paused()[0].startswith(
            f"Training for {waiting.model_id} is paused. Reason: the model's run {waiting_run} is "
            f"queued: the tenant's quota of 1 concurrent runs is in use (by {holding_run})"
        ), paused()

        # The place frees: the waiting model's run is admitted and its request served.
        assert http.delete(f"/v1/runs/{holding_run}", headers=tenant.headers).status_code == 200
        with AnsweringPool(str(http.base_url), pool_id):
            output = future.result(timeout=60)  # a hang guard
        assert output.metrics == {"loss:sum": 1.0}
    finally:
        service.close("success").result()


# --- models nobody drives leave -----------------------------------------------------------------


def _session_of(db: Session, model_id: str) -> str:
    model = db.get(TinkerModel, model_id)
    assert model is not None
    session_id = model.session_id
    db.rollback()  # on SQLite an open transaction holds the write lock
    return session_id


def _heartbeat_at(db: Session, session_id: str, at: datetime, *, finished: bool = False) -> None:
    values: dict[str, Any] = {"last_heartbeat_at": at}
    if finished:
        values["finished_at"] = at
    db.execute(update(TinkerSession).where(TinkerSession.id == session_id).values(**values))
    db.commit()


def _sampler_checkpoint(db: Session, tenant: TenantHandle, model_id: str, *, deleted: bool = False) -> None:
    """A completed save_weights_for_sampler of the model, as the pool's result leaves it."""
    result: dict[str, Any] = {"path": f"tinker://{model_id}/sampler_weights/final", "loraloom_step": 0}
    if deleted:
        result["loraloom_deleted"] = True
    db.add(
        TinkerFuture(
            id=new_id("req"),
            tenant_id=tenant.id,
            kind="save_weights_for_sampler",
            model_id=model_id,
            seq_id=99,
            status="complete",
            result=result,
            completed_at=utcnow(),
        )
    )
    db.commit()


def _evict(factory: sessionmaker[Session], settings: Settings, now: datetime) -> list[str]:
    with factory() as session:
        runs = abandoned.evict_abandoned_models(session, now=now, timeout_seconds=TIMEOUT, settings=settings)
        session.commit()
        return [run.id for run in runs]


def test_models_of_a_silent_session_leave_and_a_live_one_or_a_sampled_one_stays(
    client, db, factory, settings
):
    register(client)  # two slots
    tenant = new_tenant(client, quota=2)
    now = utcnow()
    gone = new_session(client, tenant)
    active = new_model(client, tenant, session_id=gone, seq=0)
    sampled = new_model(client, tenant, session_id=gone, seq=1)
    queued = new_model(client, tenant, session_id=gone, seq=2)
    live = new_model(client, tenant)  # queued too, its session heartbeating
    ids = {m: run_of(client, tenant, m) for m in (active, sampled, queued, live)}
    assert [_status(client, tenant, ids[m])["status"] for m in (active, sampled, queued, live)] == [
        "active",
        "active",
        "queued",
        "queued",
    ]
    _sampler_checkpoint(db, tenant, sampled)
    _heartbeat_at(db, gone, now - timedelta(seconds=TIMEOUT + 1))

    # Just inside the timeout: nothing leaves.
    assert _evict(factory, settings, now - timedelta(seconds=2)) == []
    # Past it: the queued model, then the active one without a sampler checkpoint; the live
    # session's model takes the freed slot, the sampled model keeps its own.
    assert _evict(factory, settings, now) == [ids[queued], ids[active]]
    for model_id in (queued, active):
        run = _status(client, tenant, ids[model_id])
        assert (run["status"], run["evicted_by"]) == ("evicted", "heartbeat")
        assert run["eviction_reason"] == (
            f"its Tinker session {gone} has sent no heartbeat for more than 600 s "
            "(LORALOOM_TINKER_SESSION_TIMEOUT_SECONDS): the SDK process that drove the model is gone"
        )
    assert _status(client, tenant, ids[sampled])["status"] == "active"
    assert _status(client, tenant, ids[live])["status"] == "active"
    assert _evict(factory, settings, now) == []  # done once

    # Its sampler checkpoint deleted, nothing keeps the silent model's run.
    db.execute(
        update(TinkerFuture)
        .where(TinkerFuture.model_id == sampled)
        .values(result={"path": f"tinker://{sampled}/sampler_weights/final", "loraloom_deleted": True})
    )
    db.commit()
    assert _evict(factory, settings, now) == [ids[sampled]]


def test_a_closed_sessions_queued_model_leaves_with_its_work_failed_by_the_sweep(
    client, db, factory, settings
):
    register(client, slots=1)
    tenant = new_tenant(client, quota=2)
    new_model(client, tenant)  # holds the one slot
    closed = new_session(client, tenant)
    model = new_model(client, tenant, session_id=closed)
    request_id = _optim_step(client, tenant, model)
    r = client.post(f"/api/v1/sessions/{closed}/finish", headers=tinker_headers(tenant))
    assert r.status_code == 204, r.text
    now = utcnow()
    _heartbeat_at(db, closed, now - timedelta(seconds=TIMEOUT + 1), finished=True)

    result = sweeper.sweep_once(
        factory, settings=settings.model_copy(update={"tinker_session_timeout_seconds": TIMEOUT}), now=now
    )
    run_id = run_of(client, tenant, model)
    assert result.evicted_tinker_runs == [run_id]
    reason = (
        f"its Tinker session {closed} was closed (ServiceClient.close) and has sent no heartbeat for "
        "more than 600 s (LORALOOM_TINKER_SESSION_TIMEOUT_SECONDS): no process drives the model any more"
    )
    assert _status(client, tenant, run_id)["eviction_reason"] == reason
    # Its pending request failed in the same sweep, with the reason (and it never got the slot).
    answer = _retrieve(client, tenant, request_id)
    assert reason in answer["error"], answer


def test_a_heartbeat_keeps_the_model(client, db, factory, settings):
    register(client, slots=1)
    tenant = new_tenant(client, quota=2)
    new_model(client, tenant)
    session_id = new_session(client, tenant)
    model = new_model(client, tenant, session_id=session_id)
    _heartbeat_at(db, session_id, utcnow() - timedelta(seconds=TIMEOUT + 1))
    r = client.post(
        "/api/v1/session_heartbeat", json={"session_id": session_id}, headers=tinker_headers(tenant)
    )
    assert r.status_code == 200, r.text
    assert _evict(factory, settings, utcnow()) == []
    assert _status(client, tenant, run_of(client, tenant, model))["status"] == "queued"


@pytest.mark.postgres_only  # SQLite runs one writing transaction at a time: no heartbeat can fall in between
def test_a_heartbeat_committed_between_the_first_read_and_the_lock_keeps_the_model(
    client, db, factory, settings, monkeypatch
):
    """The window made deterministic: the heartbeat commits (another connection) right after the
    eviction's unlocked read found the model due, before it takes the admission lock."""
    register(client, slots=1)
    tenant = new_tenant(client, quota=2)
    new_model(client, tenant)
    session_id = new_session(client, tenant)
    model = new_model(client, tenant, session_id=session_id)
    now = utcnow()
    _heartbeat_at(db, session_id, now - timedelta(seconds=TIMEOUT + 1))
    real_lock = abandoned.lock_admission
    beats: list[int] = []

    def heartbeat_then_lock(session: Session) -> None:
        with factory() as other:
            other.execute(
                update(TinkerSession).where(TinkerSession.id == session_id).values(last_heartbeat_at=now)
            )
            other.commit()
        beats.append(1)
        real_lock(session)

    monkeypatch.setattr(abandoned, "lock_admission", heartbeat_then_lock)
    assert _evict(factory, settings, now) == []
    assert beats == [1]  # the window was taken: the model was found due before the heartbeat
    assert _status(client, tenant, run_of(client, tenant, model))["status"] == "queued"


@pytest.mark.postgres_only  # SQLite: the heartbeat's transaction cannot begin while the sweep's holds the lock
def test_a_heartbeat_arriving_while_the_eviction_holds_the_session_waits_for_it(
    client, db, factory, settings, monkeypatch
):
    """The heartbeat's UPDATE of the session row waits for the eviction's FOR UPDATE of it, and
    is then taken though its model has left (it came after the deadline)."""
    register(client, slots=1)
    tenant = new_tenant(client, quota=2)
    new_model(client, tenant)
    session_id = new_session(client, tenant)
    model = new_model(client, tenant, session_id=session_id)
    now = utcnow()
    _heartbeat_at(db, session_id, now - timedelta(seconds=TIMEOUT + 1))
    real_evict = abandoned.runs.evict_run
    answered: list[int] = []
    blocked = threading.Event()

    def heartbeat() -> None:
        # What the heartbeat route runs, in its own transaction.
        with factory() as other:
            tinker_service.heartbeat(other, tenant_id=tenant.id, session_id=session_id)
            other.commit()
        answered.append(1)

    def evict_while_a_heartbeat_waits(session: Session, **kwargs: Any) -> Run:
        thread = threading.Thread(target=heartbeat)
        thread.start()
        _wait_for(lambda: _waits_on_a_lock(factory), "the heartbeat to wait on the session's row lock")
        blocked.set()
        assert not answered
        return real_evict(session, **kwargs)

    monkeypatch.setattr(abandoned.runs, "evict_run", evict_while_a_heartbeat_waits)
    assert _evict(factory, settings, now) == [run_of(client, tenant, model)]
    assert blocked.is_set()
    _wait_for(lambda: bool(answered), "the heartbeat's answer")
    assert answered == [1]
    db.expire_all()
    assert db.scalar(select(Run.status).where(Run.id == run_of(client, tenant, model))) == RunStatus.EVICTED


def _waits_on_a_lock(factory: sessionmaker[Session]) -> bool:
    with factory() as session:
        waiting = session.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query ILIKE 'UPDATE tinker_sessions%'"
            )
        )
        return bool(waiting)


def test_the_timeout_is_a_setting_of_at_least_a_minute(monkeypatch, tmp_path):
    assert Settings(data_dir=tmp_path).tinker_session_timeout_seconds == 600.0
    monkeypatch.setenv("LORALOOM_TINKER_SESSION_TIMEOUT_SECONDS", "1800")
    assert Settings(data_dir=tmp_path).tinker_session_timeout_seconds == 1800.0
    monkeypatch.setenv("LORALOOM_TINKER_SESSION_TIMEOUT_SECONDS", "30")
    with pytest.raises(ValidationError, match="tinker_session_timeout_seconds"):
        Settings(data_dir=tmp_path)


# --- wrong methods and malformed paths -----------------------------------------------------------


def test_a_wrong_method_on_a_served_route_is_a_405_naming_the_allowed_ones(client, tenant):
    headers = tinker_headers(tenant)
    r = client.get("/api/v1/create_session", headers=headers)
    assert r.status_code == 405, r.text
    assert r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"
    assert r.json()["error"]["message"] == "GET is not allowed on /api/v1/create_session; allowed: POST"
    r = client.post("/api/v1/get_server_capabilities", headers=headers)
    assert (r.status_code, r.headers["allow"]) == (405, "GET, HEAD")
    r = client.delete(f"/api/v1/training_runs/{new_model(client, tenant)}", headers=headers)
    assert (r.status_code, r.headers["allow"]) == (405, "GET, HEAD")
    # Calls not served stay a 400 saying so, publishing a checkpoint among them (the delete route's
    # `{checkpoint_id:path}` matches its path too).
    r = client.get("/api/v1/no_such_call", headers=headers)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "not_supported"), r.text
    r = client.post("/api/v1/training_runs/m/checkpoints/sampler_weights/x/publish", headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (
        "not supported by loraloom: POST /api/v1/training_runs/m/checkpoints/sampler_weights/x/publish"
    )
    # Still authenticated first.
    assert client.get("/api/v1/create_session").status_code == 401


@pytest.mark.parametrize("path", ["tinker:///sampler_weights/x", "tinker:///weights/x"])
def test_a_tinker_path_without_a_model_id_is_a_422_naming_it(client, tenant, path):
    headers = tinker_headers(tenant)
    r = client.post("/api/v1/weights_info", json={"tinker_path": path}, headers=headers)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"].startswith(f"not a checkpoint path: {path!r}")
    if "sampler" in path:
        r = client.get("/api/v1/loraloom/resolve", params={"path": path}, headers=headers)
        assert r.status_code == 422, r.text
        assert path in r.json()["error"]["message"]
