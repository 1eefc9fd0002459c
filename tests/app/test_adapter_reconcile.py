"""The reconcile pass (app/adapters/reconcile.py): adapter files no row refers to, and trash entries,
are deleted; what is in flight never is.

The crash windows are made as a crash leaves them: the pruning's rows deleted and committed and the
files' removal never run; a publish's files moved into place and its transaction never committed;
staging directories, temporaries and trash entries placed by hand. Work in flight is held at a pause
point (a publish or an upload stopped mid-way, in a thread), or by a flock as an upload in another
process holds it. Ages are the pass's `now`: an hour and a minute on (LATER), what was just written
is past the grace period."""

import io
import json
import os
import tarfile
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app import projection, sweeper
from app.adapters import reconcile, service, uploads
from app.adapters.models import Adapter, TenantAdapter
from app.adapters.pruning import prune_step_adapters, remove_pruned_files
from app.adapters.reconcile import (
    ORPHAN_GRACE_SECONDS,
    RECONCILE_SECONDS,
    Reconciled,
    ReconcileScan,
    reconcile_adapter_files,
)
from app.adapters.upload import extract_adapter_tar
from app.config import Settings
from app.db import make_engine, make_session_factory, utcnow
from app.main import create_app
from app.projection import TRASH_DIR, remove_tree
from contracts import durable
from contracts.durable import atomic_replace_dir
from contracts.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, step_dir_name, step_of_dir_name
from contracts.pool_api import INT32_MAX
from tests.app.api import POOL_SPEC, TenantHandle, register
from tests.app.factories import committed, make_run, make_tenant
from tests.app.test_adapter_deletion_races import upload_lock_held
from tests.common import wait_for_a_lock_waiter

LATER = timedelta(seconds=ORPHAN_GRACE_SECONDS + 60)
WAIT_S = 30
"""How long a pause point waits for the other side (a safety net: each wait ends at an event)."""
Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """Every adapter kept: the tests prune themselves, when they do."""
    return settings.model_copy(update={"run_adapters_kept": 0})


@pytest.fixture
def factory(settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    engine.dispose()


def _adapter_tar(step: int) -> bytes:
    """A PEFT adapter as the pool publishes it (an uncompressed tar); its weights tell steps apart."""
    tensors = {
        f"{Q_PROJ}.lora_A.weight": torch.full((4, 32), float(step)),
        f"{Q_PROJ}.lora_B.weight": torch.ones(32, 4),
    }
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in ((ADAPTER_CONFIG, json.dumps(config).encode()), (ADAPTER_WEIGHTS, save(tensors))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _new_run(settings: Settings) -> str:
    with committed(settings) as session:
        tenant, _ = make_tenant(session)
        return make_run(session, tenant, status="completed").id


def _publish(
    factory: sessionmaker[Session], settings: Settings, run_id: str, step: int, *, seed: int = 0
) -> None:
    """What the pool's PUT /v1/pool/runs/{id}/adapters/{step} does, committed."""
    with factory() as session:
        body = io.BytesIO(_adapter_tar(seed or step))
        service.store_adapter(session, run_id=run_id, step=step, body=body, settings=settings)
        session.commit()


def _broadcast(settings: Settings, run_id: str) -> Path:
    return settings.runs_dir / run_id / "broadcast"


def _cache(settings: Settings, run_id: str) -> Path:
    return settings.runs_dir / run_id / service.ARCHIVE_CACHE_DIR


def _names(folder: Path) -> list[str]:
    return sorted(os.listdir(folder)) if folder.exists() else []


def _steps_on_disk(settings: Settings, run_id: str) -> list[int]:
    names = _names(_broadcast(settings, run_id))
    return sorted(int(n.removeprefix("step_")) for n in names if n.startswith("step_"))


def _steps_in_db(settings: Settings, run_id: str) -> list[int]:
    with committed(settings) as session:
        return sorted(session.scalars(select(Adapter.step).where(Adapter.run_id == run_id)))


def _cache_archive(factory: sessionmaker[Session], settings: Settings, run_id: str, step: int) -> str:
    """Download the step's archive once (it is cached); returns the cached file's name."""
    with factory() as session:
        adapter = session.scalars(select(Adapter).where(Adapter.run_id == run_id, Adapter.step == step)).one()
        service.open_adapter_archive(adapter, settings=settings).close()
        return service._archive_path(adapter, settings).name


def _trash(settings: Settings) -> Path:
    return settings.runs_dir / TRASH_DIR


def _reconcile(factory: sessionmaker[Session], settings: Settings, *, at: datetime) -> Reconciled:
    """A whole pass (the pages are larger than what the tests make)."""
    return reconcile_adapter_files(factory, settings=settings, scan=ReconcileScan(), now=at)


def _leftover(path: Path) -> Path:
    """A directory holding adapter files, as a crash leaves one."""
    path.mkdir(parents=True)
    (path / ADAPTER_CONFIG).write_text("{}")
    (path / ADAPTER_WEIGHTS).write_bytes(b"\0" * 64)
    return path


class _Pause:
    """Wraps `fn`: after it ran, signals `reached` and waits for `release`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.fn(*args, **kwargs)
        self.reached.set()
        assert self.release.wait(WAIT_S), "the pause point was never released"
        return out


class _Thread(threading.Thread):
    """A thread whose target's exception is raised again by `finish`."""

    def __init__(self, target: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.work = target
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.work()
        except BaseException as exc:  # raised again in the test's thread
            self.error = exc

    def finish(self) -> Any:
        self.join(WAIT_S)
        assert not self.is_alive(), "the thread never finished"
        if self.error is not None:
            raise self.error
        return self.result


# --------------------------------------------------------------------------- runs' step adapters


def test_the_files_of_a_pruning_cut_short_after_its_commit_go(
    settings: Settings, factory: sessionmaker[Session]
) -> None:
    """The crash window of app/adapters/pruning.py: the rows' deletion committed, the files' removal
    never run. The pass removes the pruned steps' directories and archives (and an archive of a step
    published again since, stale), and keeps every step with a row, and its current archive."""
    run_id = _new_run(settings)
    for step in range(1, 7):
        _publish(factory, settings, run_id, step)
    pruned_archive = _cache_archive(factory, settings, run_id, 1)
    stale_archive = _cache_archive(factory, settings, run_id, 5)
    _publish(factory, settings, run_id, 5, seed=50)  # published again: its cached archive is stale
    current_archive = _cache_archive(factory, settings, run_id, 6)
    with factory() as session:
        out = prune_step_adapters(session, kept=3, after_id=0)
        session.commit()
    assert out.runs == [run_id]  # ... and the service stops here: `remove_pruned_files` never runs
    assert _steps_in_db(settings, run_id) == [4, 5, 6]
    assert _steps_on_disk(settings, run_id) == [1, 2, 3, 4, 5, 6]
    assert _names(_cache(settings, run_id)) == sorted([pruned_archive, stale_archive, current_archive])

    done = _reconcile(factory, settings, at=utcnow())
    assert (done.run_files, done.failed) == (5, [])  # 3 step directories, 2 archives
    assert _steps_on_disk(settings, run_id) == _steps_in_db(settings, run_id) == [4, 5, 6]
    assert _names(_cache(settings, run_id)) == [current_archive]
    assert _names(_trash(settings)) == []  # moved there under the run's lock, deleted after the commit
    assert _reconcile(factory, settings, at=utcnow()).run_files == 0


def test_a_publish_whose_commit_never_came_leaves_files_the_pass_removes(
    settings: Settings, factory: sessionmaker[Session]
) -> None:
    run_id = _new_run(settings)
    _publish(factory, settings, run_id, 1)
    with factory() as session:
        service.store_adapter(
            session, run_id=run_id, step=2, body=io.BytesIO(_adapter_tar(2)), settings=settings
        )
        session.rollback()  # the crash: its files are in place, its row never committed
    assert (_steps_on_disk(settings, run_id), _steps_in_db(settings, run_id)) == ([1, 2], [1])
    assert _reconcile(factory, settings, at=utcnow()).run_files == 1
    assert _steps_on_disk(settings, run_id) == [1]


def test_a_publish_under_way_keeps_its_staging_and_leftovers_go_after_the_grace(
    settings: Settings, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publish stopped with its body unpacked into its staging directory (no lock is held there): the
    pass leaves the directory alone, and the publish completes. What crashes left (a staging
    directory, a step's replaced copy, an archive's temporary) goes once untouched past the grace."""
    run_id = _new_run(settings)
    _publish(factory, settings, run_id, 1)
    broadcast, cache = _broadcast(settings, run_id), _cache(settings, run_id)
    crashed = [
        _leftover(broadcast / ".step_2.0badf00d.tmp"),
        _leftover(broadcast / ".step_1.0badf00d.old"),
    ]
    cache.mkdir()
    temporary = cache / ".adapter_step_1_0123456789abcdef.tar.gz.0badf00d.tmp"
    temporary.write_bytes(b"half an archive")
    crashed.append(temporary)
    others = [_leftover(broadcast / "notes"), _leftover(broadcast / ".step_x.tmp")]  # not names of ours

    pause = _Pause(extract_adapter_tar)
    monkeypatch.setattr(service, "extract_adapter_tar", pause)
    publishing = _Thread(lambda: _publish(factory, settings, run_id, 3))
    publishing.start()
    assert pause.reached.wait(WAIT_S)
    [staging] = [p for p in broadcast.iterdir() if p.name.startswith(".step_3.")]
    assert sorted(os.listdir(staging)) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]

    done = _reconcile(factory, settings, at=utcnow())
    assert (done.run_files, done.failed) == (0, [])
    assert staging.is_dir() and all(path.exists() for path in crashed)
    pause.release.set()
    publishing.finish()
    assert _steps_on_disk(settings, run_id) == _steps_in_db(settings, run_id) == [1, 3]

    done = _reconcile(factory, settings, at=utcnow() + LATER)
    assert (done.run_files, done.failed) == (3, [])
    assert not any(path.exists() for path in crashed)
    assert all(path.exists() for path in others)
    assert _steps_on_disk(settings, run_id) == [1, 3]  # rows: kept however old


@pytest.mark.postgres_only
def test_a_step_moved_into_place_before_its_commit_is_kept(
    settings: Settings, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publish stopped after its files moved into place, before its row committed (it holds the run's
    row lock): the pass finds the step without a row, waits for the lock, reads the row committed
    meanwhile, and keeps the step. Without the read under the lock, it removed a published step."""
    run_id = _new_run(settings)
    pause = _Pause(atomic_replace_dir)
    monkeypatch.setattr(service, "atomic_replace_dir", pause)
    publishing = _Thread(lambda: _publish(factory, settings, run_id, 2))
    publishing.start()
    assert pause.reached.wait(WAIT_S)
    assert (_steps_on_disk(settings, run_id), _steps_in_db(settings, run_id)) == ([2], [])

    watcher = factory()
    try:
        reconciling = _Thread(lambda: _reconcile(factory, settings, at=utcnow() + LATER))
        reconciling.start()
        wait_for_a_lock_waiter(watcher, "the reconcile pass (the run's row lock)")
    finally:
        watcher.close()
        pause.release.set()
    publishing.finish()
    done = reconciling.finish()
    assert (done.run_files, done.failed) == (0, [])
    assert _steps_on_disk(settings, run_id) == _steps_in_db(settings, run_id) == [2]


def test_the_names_a_writer_makes_are_the_names_the_pass_reads() -> None:
    """Built and read from one definition (contracts/layout.py, service.archive_name): a writer's new
    name cannot silently stop the clean-up. Only those: `step_007` is not step 7's directory."""
    sha = "0123456789abcdef" * 4
    for step in (0, 7, INT32_MAX):
        assert step_of_dir_name(step_dir_name(step)) == step
        assert service.archive_of(service.archive_name(step, sha)) == (step, sha[:16])
    for name in ("step_007", "step_00", "step_", "step_-1", "step_+1", "step_1 ", "step_\u0661", "notes"):
        assert step_of_dir_name(name) is None
    for step in (INT32_MAX + 1, 10**20):
        assert step_of_dir_name(f"step_{step}") is None
        assert service.archive_of(f"adapter_step_{step}_{sha[:16]}.tar.gz") is None
    assert service.archive_of(f"adapter_step_007_{sha[:16]}.tar.gz") is None
    assert service.archive_of(f"adapter_step_7_{sha[:15]}.tar.gz") is None


def test_a_step_name_past_int32_max_is_left_alone_and_its_run_reconciled(
    settings: Settings, factory: sessionmaker[Session]
) -> None:
    """A step past INT32_MAX (a step's bound) made the run's row query overflow (SQLite's integers,
    Postgres's column): that run's pass failed on every pass, its real leftovers never went."""
    run_id = _new_run(settings)
    broadcast = _broadcast(settings, run_id)
    strangers = [_leftover(broadcast / f"step_{step}") for step in (10**20, INT32_MAX + 1)]
    orphans = [_leftover(broadcast / "step_3"), _leftover(broadcast / f"step_{INT32_MAX}")]

    done = _reconcile(factory, settings, at=utcnow() + LATER)
    assert (done.run_files, done.failed) == (2, [])
    assert not any(path.exists() for path in orphans) and all(path.exists() for path in strangers)


def test_a_step_name_with_leading_zeros_is_not_that_step_s(
    settings: Settings, factory: sessionmaker[Session]
) -> None:
    """`step_007` is no name the service writes (step 7's is `step_7`): read as step 7, a step
    without a row, its archive's namesake went, and the pruning's removal took the directory. Both
    are left alone, by the pass and by the pruning's removal; the run's leftovers go."""
    run_id = _new_run(settings)
    _publish(factory, settings, run_id, 8)
    broadcast, cache = _broadcast(settings, run_id), _cache(settings, run_id)
    strangers = [_leftover(broadcast / "step_007"), _leftover(broadcast / "step_00")]
    cache.mkdir()
    strangers.append(cache / "adapter_step_007_0123456789abcdef.tar.gz")
    strangers[-1].write_bytes(b"not ours")
    orphans = [_leftover(broadcast / "step_3"), _leftover(broadcast / "step_0")]

    done = _reconcile(factory, settings, at=utcnow() + LATER)
    assert (done.run_files, done.failed) == (2, [])
    with factory() as session:
        assert remove_pruned_files(session, run_id=run_id, settings=settings) == 0
        session.commit()
    assert not any(path.exists() for path in orphans) and all(path.exists() for path in strangers)
    assert _steps_in_db(settings, run_id) == [8] and (broadcast / "step_8").is_dir()


def test_a_run_whose_files_fail_is_passed_over_and_tried_again_at_the_next_pass(
    settings: Settings, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run failing (a directory the service may not delete) holds back neither the runs after it
    nor the other parts; the next pass tries it again."""
    runs = sorted(_new_run(settings) for _ in range(3))
    for run_id in runs:
        _leftover(_broadcast(settings, run_id) / "step_1")
    _leftover(_trash(settings) / "run_0123456789ab.step_1.0badf00d")
    real = reconcile.reconcile_run

    def failing_for_the_first(factory: sessionmaker[Session], *, run_id: str, **kwargs: Any) -> int:
        if run_id == runs[0]:
            raise PermissionError(f"{run_id}: not ours to delete")
        return real(factory, run_id=run_id, **kwargs)

    monkeypatch.setattr(reconcile, "reconcile_run", failing_for_the_first)
    scan, now = ReconcileScan(), utcnow() + LATER
    done = reconcile_adapter_files(factory, settings=settings, scan=scan, now=now)
    assert (done.run_files, done.trash_entries, done.failed) == (2, 1, [runs[0]])
    assert [_steps_on_disk(settings, run_id) for run_id in runs] == [[1], [], []]
    assert scan.caught_up  # passed over: the next pass, not the next sweep

    monkeypatch.setattr(reconcile, "reconcile_run", real)
    later = now + timedelta(seconds=RECONCILE_SECONDS)
    done = reconcile_adapter_files(factory, settings=settings, scan=scan, now=later)
    assert (done.run_files, done.failed) == (1, [])
    assert _steps_on_disk(settings, runs[0]) == []


# --------------------------------------------------------------------------- uploaded adapters


@pytest.fixture
def pool(client: TestClient) -> None:
    """A live pool of POOL_SPEC's base model: uploads are checked against it."""
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)


def _upload(factory: sessionmaker[Session], settings: Settings, tenant_id: str) -> str:
    """What POST /v1/adapters does, committed; returns the adapter's id."""
    with factory() as session:
        row = uploads.upload_adapter(
            session,
            tenant_id=tenant_id,
            name="mine",
            base_model=POOL_SPEC["base_model"],
            body=io.BytesIO(_adapter_tar(1)),
            settings=settings,
        )
        session.commit()
        return row.id


def _uploads_on_disk(settings: Settings) -> list[str]:
    return _names(uploads.uploads_dir(settings))


def test_upload_directories_without_a_row_go_unless_an_upload_holds_them(
    settings: Settings, factory: sessionmaker[Session], tenant: TenantHandle, pool: None
) -> None:
    kept = _upload(factory, settings, tenant.id)
    root = uploads.uploads_dir(settings)
    crashed = ["adp_0123456789ab", ".upload_crashed"]  # moved into place, never committed; a staging leftover
    held = ["adp_00000000000f", ".upload_busy"]  # an upload in another process: its commit, its unpacking
    for name in [*crashed, *held, "not-an-upload"]:
        _leftover(root / name)

    done = _reconcile(factory, settings, at=utcnow())
    assert (done.uploads, done.failed) == (0, [])  # within the grace
    with upload_lock_held(root / held[0]), upload_lock_held(root / held[1]):
        done = _reconcile(factory, settings, at=utcnow() + LATER)
        assert (done.uploads, done.failed) == (2, [])
        assert _uploads_on_disk(settings) == sorted([kept, *held, "not-an-upload"])
    done = _reconcile(factory, settings, at=utcnow() + LATER)  # their uploads ended, without a row
    assert (done.uploads, done.failed) == (2, [])
    assert _uploads_on_disk(settings) == sorted([kept, "not-an-upload"])
    assert (root / kept / uploads.ARCHIVE).is_file()


def test_an_upload_directory_is_asked_about_again_under_its_flock(
    settings: Settings, factory: sessionmaker[Session], tenant: TenantHandle, pool: None
) -> None:
    """Found without a row, its row committed before the flock was taken: it stays."""
    kept = _upload(factory, settings, tenant.id)
    with factory() as session:
        assert not uploads.remove_if_unheld(session, uploads.uploads_dir(settings) / kept)
    assert _uploads_on_disk(settings) == [kept]


def test_an_upload_being_unpacked_keeps_its_staging(
    settings: Settings,
    factory: sessionmaker[Session],
    tenant: TenantHandle,
    pool: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped with its body unpacked into its staging directory (its flock held, no transaction
    open): however old the pass takes it to be, it stays, and the upload completes."""
    pause = _Pause(extract_adapter_tar)
    monkeypatch.setattr(uploads, "extract_adapter_tar", pause)
    uploading = _Thread(lambda: _upload(factory, settings, tenant.id))
    uploading.start()
    assert pause.reached.wait(WAIT_S)
    [staging] = _uploads_on_disk(settings)
    assert staging.startswith(uploads.STAGING_PREFIX)

    done = _reconcile(factory, settings, at=utcnow() + LATER)
    assert (done.uploads, done.failed) == (0, [])
    assert _uploads_on_disk(settings) == [staging]
    pause.release.set()
    adapter_id = uploading.finish()
    assert _uploads_on_disk(settings) == [adapter_id]
    assert _reconcile(factory, settings, at=utcnow() + LATER).uploads == 0
    assert (uploads.uploads_dir(settings) / adapter_id / uploads.ARCHIVE).is_file()


@pytest.mark.postgres_only
def test_an_upload_moved_into_place_before_its_commit_is_kept(
    settings: Settings,
    factory: sessionmaker[Session],
    tenant: TenantHandle,
    pool: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped after its directory moved into place and its row was flushed, before the commit: no
    committed row names the directory, but the upload's flock keeps it."""
    reached, release = threading.Event(), threading.Event()

    def upload_then_pause() -> str:
        with factory() as session:
            row = uploads.upload_adapter(
                session,
                tenant_id=tenant.id,
                name="mine",
                base_model=POOL_SPEC["base_model"],
                body=io.BytesIO(_adapter_tar(1)),
                settings=settings,
            )
            reached.set()
            assert release.wait(WAIT_S)
            session.commit()
            return row.id

    uploading = _Thread(upload_then_pause)
    uploading.start()
    try:
        assert reached.wait(WAIT_S)
        [placed] = _uploads_on_disk(settings)
        with committed(settings) as session:
            assert session.get(TenantAdapter, placed) is None
        done = _reconcile(factory, settings, at=utcnow() + LATER)
        assert (done.uploads, done.failed) == (0, [])
    finally:
        release.set()
    assert uploading.finish() == placed
    assert _uploads_on_disk(settings) == [placed]


# --------------------------------------------------------------------------- the trash


def test_trash_a_removal_left_is_emptied_after_the_grace(
    settings: Settings, factory: sessionmaker[Session]
) -> None:
    """A run directory and a pruned step's files renamed into runs/.trash, their deletion cut short."""
    trash = _trash(settings)
    run_tree = trash / "run_0123456789ab.0badf00d"
    _leftover(run_tree / "broadcast" / "step_1")
    (run_tree / "control").mkdir()
    _leftover(trash / "run_0123456789ab.step_4.0badf00d")
    (trash / "run_0123456789ab.adapter_step_4_0123456789abcdef.tar.gz.0badf00d").write_bytes(b"archive")

    done = _reconcile(factory, settings, at=utcnow())
    assert done.trash_entries == 0 and len(_names(trash)) == 3  # maybe a removal under way: its owner's
    done = _reconcile(factory, settings, at=utcnow() + LATER)
    assert (done.trash_entries, done.failed) == (3, [])
    assert trash.is_dir() and _names(trash) == []


def test_an_entry_another_process_removed_meanwhile_is_not_counted(
    settings: Settings, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas empty the trash at once: the entry each finds idle, only one removes; the other
    counts nothing and fails nothing."""
    entries = [_leftover(_trash(settings) / f"run_0123456789ab.step_{n}.0badf00d") for n in (1, 2)]
    real = durable.untouched

    def the_other_replica_removes_the_first(path: Path, *, since: float) -> bool:
        idle = real(path, since=since)
        if path == entries[0]:
            assert remove_tree(path)  # the other replica's removal, between the look and this one's
        return idle

    monkeypatch.setattr(projection, "untouched", the_other_replica_removes_the_first)
    done = _reconcile(factory, settings, at=utcnow() + LATER)
    assert (done.trash_entries, done.failed) == (1, [])
    assert _names(_trash(settings)) == []


def test_remove_tree_says_whether_this_call_removed_it(tmp_path: Path) -> None:
    tree, file = _leftover(tmp_path / "tree"), tmp_path / "file"
    file.write_bytes(b"x")
    (tmp_path / "link").symlink_to(tree)
    assert remove_tree(tmp_path / "link") and tree.is_dir()  # the link, never what it points to
    assert remove_tree(tree) and remove_tree(file)
    assert not remove_tree(tree) and not remove_tree(file)
    assert _names(tmp_path) == []


# --------------------------------------------------------------------------- the sweeper


def test_the_sweeper_reconciles_a_page_a_sweep_and_begins_again_later(
    settings: Settings, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reconcile, "RUN_PAGE", 2)
    monkeypatch.setattr(reconcile, "PAGE", 2)
    monkeypatch.setattr(reconcile, "TRASH_PAGE", 2)
    runs = sorted(_new_run(settings) for _ in range(5))
    for run_id in runs:
        _leftover(_broadcast(settings, run_id) / "step_1")  # a publish's crash: no row
    for n in range(3):
        _leftover(_trash(settings) / f"run_0123456789ab.step_{n}.0badf00d")

    scan, now = ReconcileScan(), utcnow() + LATER
    sweeps = [sweeper.sweep_once(factory, settings=settings, now=now, reconcile_scan=scan) for _ in range(4)]
    assert [(s.reconciled_run_files, s.emptied_trash_entries, s.errors) for s in sweeps] == [
        (2, 2, []),
        (2, 1, []),
        (1, 0, []),
        (0, 0, []),  # caught up: the next pass begins RECONCILE_SECONDS after this one
    ]
    assert scan.caught_up and all(_steps_on_disk(settings, run_id) == [] for run_id in runs)

    _leftover(_broadcast(settings, runs[0]) / "step_2")
    soon = sweeper.sweep_once(
        factory, settings=settings, now=now + timedelta(seconds=60), reconcile_scan=scan
    )
    assert soon.reconciled_run_files == 0
    later = now + timedelta(seconds=RECONCILE_SECONDS)
    again = sweeper.sweep_once(factory, settings=settings, now=later, reconcile_scan=scan)
    assert (again.reconciled_run_files, again.errors) == (1, [])


class _Clock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_sweep_stops_the_pass_when_its_time_is_spent_and_the_next_goes_on(
    settings: Settings, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each run and each trash entry takes 0.4 s of the sweep's BUDGET_SECONDS (1 s): a sweep stops
    after the entry that spent it, and the next one goes on from there, nothing skipped."""
    clock = _Clock()
    real_run, real_trash = reconcile.reconcile_run, projection.empty_trash

    def slow_run(*args: Any, **kwargs: Any) -> int:
        clock.now += 0.4
        return real_run(*args, **kwargs)

    def slow_trash(*args: Any, **kwargs: Any) -> int:
        clock.now += 0.4
        return real_trash(*args, **kwargs)

    monkeypatch.setattr(reconcile, "reconcile_run", slow_run)
    monkeypatch.setattr(reconcile, "empty_trash", slow_trash)
    runs = sorted(_new_run(settings) for _ in range(4))
    for run_id in runs:
        _leftover(_broadcast(settings, run_id) / "step_1")
    for n in range(3):
        _leftover(_trash(settings) / f"run_0123456789ab.step_{n}.0badf00d")

    scan, now = ReconcileScan(), utcnow() + LATER
    sweeps = []
    for _ in range(4):
        done = reconcile_adapter_files(factory, settings=settings, scan=scan, now=now, clock=clock)
        sweeps.append((done.run_files, done.trash_entries, done.failed))
    assert sweeps == [(3, 0, []), (1, 2, []), (0, 1, []), (0, 0, [])]
    assert scan.caught_up and all(_steps_on_disk(settings, run_id) == [] for run_id in runs)
    assert _names(_trash(settings)) == []


def test_a_part_that_fails_holds_back_neither_the_others_nor_their_counts(
    settings: Settings, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The uploads' directory cannot be listed: the runs and the trash are reconciled all the same,
    and counted; the uploads' cursor stays, and the next sweep goes through them."""
    run_id = _new_run(settings)
    _leftover(_broadcast(settings, run_id) / "step_1")
    _leftover(_trash(settings) / "run_0123456789ab.step_1.0badf00d")
    crashed = _leftover(uploads.uploads_dir(settings) / ".upload_crashed")
    real = projection.names_in

    def unreadable_uploads(folder: Path) -> list[str]:
        if folder == uploads.uploads_dir(settings):
            raise PermissionError(f"{folder}: unreadable")
        return real(folder)

    monkeypatch.setattr(reconcile, "names_in", unreadable_uploads)
    scan, now = ReconcileScan(), utcnow() + LATER
    done = reconcile_adapter_files(factory, settings=settings, scan=scan, now=now)
    assert (done.run_files, done.uploads, done.trash_entries, done.failed) == (1, 0, 1, ["uploads"])
    assert (scan.runs.done, scan.uploads, scan.trash.done) == (True, reconcile.Cursor(), True)

    monkeypatch.setattr(reconcile, "names_in", real)
    done = reconcile_adapter_files(factory, settings=settings, scan=scan, now=now)
    assert (done.run_files, done.uploads, done.trash_entries, done.failed) == (0, 1, 0, [])
    assert not crashed.exists() and scan.caught_up


def test_the_first_sweep_after_a_start_reconciles(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash between the pruning's commit and the files' removal, then a restart: the service's own
    sweeper removes the files at its first sweep, and keeps the steps with a row."""
    engine = make_engine(settings.database_url)
    try:
        factory = make_session_factory(engine)
        run_id = _new_run(settings)
        for step in (1, 2):
            _publish(factory, settings, run_id, step)
        with factory() as session:
            assert prune_step_adapters(session, kept=1, after_id=0).rows == 1
            session.commit()
    finally:
        engine.dispose()
    assert _steps_on_disk(settings, run_id) == [1, 2]

    swept = threading.Event()
    real = sweeper.sweep_once

    def first_sweep(*args: Any, **kwargs: Any) -> sweeper.SweepResult:
        result = real(*args, **kwargs)
        swept.set()
        return result

    monkeypatch.setattr(sweeper, "sweep_once", first_sweep)
    with TestClient(create_app(settings)):
        assert swept.wait(WAIT_S)
    assert _steps_on_disk(settings, run_id) == _steps_in_db(settings, run_id) == [2]
