"""Step adapters past a run's newest `run_adapters_kept` are pruned by the sweeper, rows then files
(app/adapters/pruning.py): exactly the newest K stay, with the steps something still refers to (a
queued or active run's `init_from`, a live Tinker sampler checkpoint); a pruned step's download is a
404 that says so; 0 keeps all; a chunk deletes a bounded number of rows; a step published again after
its rows went keeps its new files.

The app under test keeps every adapter (`run_adapters_kept` 0, so its own background sweeper prunes
nothing); the tests sweep with a bound (`keep`), calling the sweep themselves."""

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from app import sweeper
from app.adapters.models import Adapter
from app.adapters.pruning import AdapterScan, AdaptersPruned, prune_step_adapters, remove_pruned_files
from app.config import Settings
from app.db import make_engine, make_session_factory, utcnow
from app.projection import TRASH_DIR
from app.runs.admission import lock_admission
from app.runs.models import Run
from app.tinker.models import CHECKPOINT_DELETED, TinkerFuture
from contracts.ids import new_id
from tests.app.api import WORKER_HEADERS, TenantHandle, create_run
from tests.app.factories import committed, make_run, make_tenant
from tests.app.test_adapters import FILES, tar_bytes
from tests.common import wait_for_a_lock_waiter

KEPT = 3
Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The suite's settings (tests/conftest.py), with every adapter kept by the app itself."""
    return settings.model_copy(update={"run_adapters_kept": 0})


@pytest.fixture
def keep(settings: Settings) -> Settings:
    """The settings the tests sweep with."""
    return settings.model_copy(update={"run_adapters_kept": KEPT})


@pytest.fixture
def factory(settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    engine.dispose()


def _row(run_id: str, step: int) -> Adapter:
    """An adapter row as a trainer leaves it, published in step order: rows added in one transaction
    would otherwise share their publication time to the microsecond, and the newest published are
    kept as well as the newest steps."""
    published = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=step)
    return Adapter(
        run_id=run_id, step=step, path=f"x/{step}", size_bytes=1, sha256="0" * 64, created_at=published
    )


def _adapter(step: int) -> bytes:
    """A tar of a PEFT adapter whose weights tell the steps apart."""
    tensors = {
        f"{Q_PROJ}.lora_A.weight": torch.full((4, 32), float(step)),
        f"{Q_PROJ}.lora_B.weight": torch.ones(32, 4),
    }
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    return tar_bytes({FILES[0]: json.dumps(config).encode(), FILES[1]: save(tensors)})


def publish(client: TestClient, run_id: str, *steps: int) -> None:
    for step in steps:
        r = client.put(
            f"/v1/pool/runs/{run_id}/adapters/{step}",
            content=_adapter(step),
            headers=WORKER_HEADERS | {"Content-Type": "application/x-tar"},
        )
        assert r.status_code == 201, r.text


def steps_in_db(settings: Settings, run_id: str) -> list[int]:
    with committed(settings) as session:
        return sorted(session.scalars(select(Adapter.step).where(Adapter.run_id == run_id)))


def steps_on_disk(settings: Settings, run_id: str) -> list[int]:
    broadcast = settings.runs_dir / run_id / "broadcast"
    return sorted(
        int(p.name.removeprefix("step_")) for p in broadcast.iterdir() if p.name.startswith("step_")
    )


def archived_steps(settings: Settings, run_id: str) -> list[int]:
    cache = settings.runs_dir / run_id / "cache"
    return sorted(int(p.name.split("_")[2]) for p in cache.glob("adapter_step_*.tar.gz"))


def trash_is_empty(settings: Settings) -> bool:
    trash = settings.runs_dir / TRASH_DIR
    return not trash.exists() or not any(trash.iterdir())


def sampler_save(
    session: Session, *, tenant_id: str, run_id: str, seq_id: int, name: str, step: int
) -> TinkerFuture:
    """A completed `save_weights_for_sampler` of the run's model, as the pool's report leaves it."""
    model_id = f"{run_id}:train:0"
    future = TinkerFuture(
        id=new_id("req"),
        tenant_id=tenant_id,
        kind="save_weights_for_sampler",
        model_id=model_id,
        seq_id=seq_id,
        run_id=run_id,
        status="complete",
        result={
            "path": f"tinker://{model_id}/sampler_weights/{name}",
            "type": "save_weights_for_sampler",
            "loraloom_step": step,
        },
        completed_at=utcnow(),
    )
    session.add(future)
    return future


def test_a_sweep_keeps_the_newest_steps_and_those_referred_to(
    client: TestClient,
    tenant: TenantHandle,
    settings: Settings,
    keep: Settings,
    factory: sessionmaker[Session],
) -> None:
    source = create_run(client, tenant)["id"]
    publish(client, source, *range(1, 11))
    for step in (1, 5):  # cached archives: a pruned step's goes with its directory
        assert client.get(f"/v1/runs/{source}/adapters/{step}", headers=tenant.headers).status_code == 200
    # A run starting from step 2 (queued or active: the pool loads step 2 when it admits it).
    child = client.post(
        "/v1/runs", json={"name": "child", "init_from": {"run_id": source, "step": 2}}, headers=tenant.headers
    )
    assert child.status_code == 201, child.text
    assert child.json()["status"] in ("queued", "active")
    with committed(settings) as session:
        sampler_save(
            session, tenant_id=tenant.id, run_id=source, seq_id=1, name="s", step=3
        )  # saved again: not live
        sampler_save(session, tenant_id=tenant.id, run_id=source, seq_id=2, name="s", step=4)
        deleted = sampler_save(session, tenant_id=tenant.id, run_id=source, seq_id=3, name="gone", step=6)
        deleted.result = {**(deleted.result or {}), CHECKPOINT_DELETED: True}

    result = sweeper.sweep_once(factory, settings=keep)
    assert not result.errors
    kept = [2, 4, 8, 9, 10]  # init_from, the live sampler save, the newest 3
    # 5 step directories, and the archives of steps 1 and 5
    assert (result.pruned_adapters, result.pruned_adapter_files) == (5, 7)
    assert steps_in_db(settings, source) == kept
    assert steps_on_disk(settings, source) == kept
    assert archived_steps(settings, source) == []  # step 1's archive and step 5's went
    assert trash_is_empty(settings)
    again = sweeper.sweep_once(factory, settings=keep)
    assert (again.pruned_adapters, again.pruned_adapter_files, again.errors) == (0, 0, [])

    # The references end: the child leaves, the sampler checkpoint is deleted.
    client.app.state.settings = keep  # type: ignore[attr-defined]  # the routes' retention (the sweeper keeps its own)
    assert client.delete(f"/v1/runs/{child.json()['id']}", headers=tenant.headers).status_code == 200
    with committed(settings) as session:
        for save_ in session.scalars(select(TinkerFuture).where(TinkerFuture.run_id == source)):
            save_.result = {**(save_.result or {}), CHECKPOINT_DELETED: True}
    result = sweeper.sweep_once(factory, settings=keep)
    assert (result.pruned_adapters, result.errors) == (2, [])
    assert steps_in_db(settings, source) == steps_on_disk(settings, source) == [8, 9, 10]

    pruned = client.get(f"/v1/runs/{source}/adapters/4", headers=tenant.headers)
    assert pruned.status_code == 404
    error = pruned.json()["error"]
    assert error["code"] == "adapter_not_found"
    assert "pruned" in error["message"] and "LORALOOM_RUN_ADAPTERS_KEPT" in error["message"]
    assert error["details"] == {"step": 4, "pruned": True, "run_adapters_kept": KEPT, "oldest_kept_step": 8}
    file_of_pruned = client.get(f"/v1/runs/{source}/adapters/1/files/{FILES[1]}", headers=tenant.headers)
    assert file_of_pruned.status_code == 404 and "pruned" in file_of_pruned.json()["error"]["message"]
    never = client.get(f"/v1/runs/{source}/adapters/11", headers=tenant.headers)
    assert never.status_code == 404
    assert never.json()["error"]["message"] == f"run {source} has no adapter for step 11"
    assert client.get(f"/v1/runs/{source}/adapters/8", headers=tenant.headers).status_code == 200
    listed = client.get(f"/v1/runs/{source}/adapters", headers=tenant.headers).json()["items"]
    assert [a["step"] for a in listed] == [8, 9, 10]


def test_zero_keeps_every_step(
    client: TestClient, tenant: TenantHandle, settings: Settings, factory: sessionmaker[Session]
) -> None:
    run_id = create_run(client, tenant)["id"]
    publish(client, run_id, *range(1, 6))
    result = sweeper.sweep_once(factory, settings=settings)
    assert (result.pruned_adapters, result.pruned_adapter_files, result.errors) == (0, 0, [])
    assert steps_in_db(settings, run_id) == steps_on_disk(settings, run_id) == [1, 2, 3, 4, 5]


def test_a_step_published_again_after_its_rows_went_keeps_its_files(
    client: TestClient, tenant: TenantHandle, settings: Settings, factory: sessionmaker[Session]
) -> None:
    """The trainer publishes a pruned step again (it resumed from an earlier checkpoint) between the
    commit of the rows' deletion and the removal of the files: the step has a row again, and its
    new files stay (the removal takes only what has no row, under the run's lock)."""
    run_id = create_run(client, tenant)["id"]
    publish(client, run_id, *range(1, 6))
    with factory() as session:
        out = prune_step_adapters(session, kept=KEPT, after_id=0)
        session.commit()
    assert (out.rows, out.runs) == (2, [run_id])
    publish(client, run_id, 2)
    with factory() as session:
        assert remove_pruned_files(session, run_id=run_id, settings=settings) == 1
        session.commit()
    assert steps_in_db(settings, run_id) == steps_on_disk(settings, run_id) == [2, 3, 4, 5]
    assert trash_is_empty(settings)
    r = client.get(f"/v1/runs/{run_id}/adapters/2", headers=tenant.headers)
    assert r.status_code == 200, r.text


def test_a_step_published_again_after_the_run_went_back_is_kept(
    client: TestClient, tenant: TenantHandle, keep: Settings, factory: sessionmaker[Session]
) -> None:
    """A run whose steps went back (a Tinker load_state of step 2) publishes step 3 again: it is the
    newest published, so it stays, though the abandoned branch holds higher step numbers."""
    run_id = create_run(client, tenant)["id"]
    publish(client, run_id, *range(1, 11))
    assert sweeper.sweep_once(factory, settings=keep).errors == []
    assert steps_in_db(keep, run_id) == [8, 9, 10]
    publish(client, run_id, 3)
    assert sweeper.sweep_once(factory, settings=keep).errors == []
    assert steps_in_db(keep, run_id) == steps_on_disk(keep, run_id) == [3, 8, 9, 10]
    # The newest by step and the newest published are kept (at most twice the bound while they
    # differ); once the new branch passes the old one's steps, the old one goes.
    publish(client, run_id, 4, 5)
    assert sweeper.sweep_once(factory, settings=keep).errors == []
    assert steps_in_db(keep, run_id) == [3, 4, 5, 8, 9, 10]
    publish(client, run_id, *range(6, 12))
    assert sweeper.sweep_once(factory, settings=keep).errors == []
    assert steps_in_db(keep, run_id) == steps_on_disk(keep, run_id) == [9, 10, 11]


def test_a_chunk_deletes_at_most_its_size_and_the_scan_goes_on(
    settings: Settings, factory: sessionmaker[Session]
) -> None:
    """Rows alone (the files are another test's): 2 runs of 6 steps, 3 kept each, chunks of 2."""
    with committed(settings) as session:
        tenant, _ = make_tenant(session)
        runs = [make_run(session, tenant, slot=slot).id for slot in range(2)]
        session.flush()
        for run_id in runs:
            for step in range(1, 7):
                session.add(_row(run_id, step))
    scan = AdapterScan()
    deleted = []
    for _ in range(10):
        with factory() as session:
            out = prune_step_adapters(session, kept=KEPT, after_id=scan.after_id, chunk=2)
            session.commit()
        assert out.rows <= 2
        deleted.append(out.rows)
        scan.after_id = out.after_id
        if not out.more:
            break
    assert sum(deleted) == 6 and not out.more
    for run_id in runs:
        assert steps_in_db(settings, run_id) == [4, 5, 6]
    with factory() as session:  # caught up: nothing new to read
        assert prune_step_adapters(session, kept=KEPT, after_id=scan.after_id, chunk=2).rows == 0


def test_the_scan_reads_only_new_rows_until_its_rescan(
    settings: Settings, factory: sessionmaker[Session]
) -> None:
    """A sweep reads the rows added since the last (cheap), and all of them again once RESCAN_SECONDS
    after its pass began: a step whose reference ended in a run that publishes no more goes then."""
    with committed(settings) as session:
        tenant, _ = make_tenant(session)
        source = make_run(session, tenant).id
        child = make_run(session, tenant, status="queued")
        session.flush()
        child.init_from = {"run_id": source, "step": 1}
        for step in range(1, 6):
            session.add(_row(source, step))
    keep = settings.model_copy(update={"run_adapters_kept": KEPT})
    scan = AdapterScan()
    start = utcnow()
    first = sweeper.sweep_once(factory, settings=keep, now=start, adapter_scan=scan)
    assert first.pruned_adapters == 1 and steps_in_db(settings, source) == [1, 3, 4, 5]
    with committed(settings) as session:
        session.execute(update(Run).where(Run.id == child.id).values(status="completed"))
    soon = sweeper.sweep_once(factory, settings=keep, now=start, adapter_scan=scan)
    assert soon.pruned_adapters == 0  # no new row: the source's adapters were not read again
    later = sweeper.sweep_once(factory, settings=keep, now=start + timedelta(hours=1), adapter_scan=scan)
    assert later.pruned_adapters == 1 and steps_in_db(settings, source) == [3, 4, 5]


@pytest.mark.postgres_only
def test_a_run_created_from_a_step_while_it_is_pruned_keeps_it(
    settings: Settings, factory: sessionmaker[Session]
) -> None:
    """A run's creation holds the admission lock from its read of the `init_from` step to its commit
    (app/runs/service.py); the pruning waits for it, then reads the new run's reference. Without the
    lock the pruning deleted the step the uncommitted run was about to start from."""
    with committed(settings) as session:
        tenant, _ = make_tenant(session)
        source = make_run(session, tenant).id
        for step in range(1, 6):
            session.add(_row(source, step))
    creating = factory()
    watcher = factory()
    try:
        lock_admission(creating)  # what create_run does first
        assert creating.scalar(select(Adapter.step).where(Adapter.run_id == source, Adapter.step == 1)) == 1
        child = make_run(creating, tenant, status="queued")
        child.init_from = {"run_id": source, "step": 1}
        creating.flush()
        outcome: dict[str, AdaptersPruned] = {}

        def prune() -> None:
            with factory() as session:
                outcome["out"] = prune_step_adapters(session, kept=KEPT, after_id=0)
                session.commit()

        pruning = threading.Thread(target=prune)
        pruning.start()
        wait_for_a_lock_waiter(watcher, "the pruning (the admission lock)")
        creating.commit()
        pruning.join(timeout=30)
        assert not pruning.is_alive()
    finally:
        creating.close()
        watcher.close()
    assert outcome["out"].rows == 1
    assert steps_in_db(settings, source) == [1, 3, 4, 5]
