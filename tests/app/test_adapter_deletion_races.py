"""Adapters against deletions and against each other (a hostile-tenant probe's findings 5, 7 and 8).

- A run deleted while its adapter is downloaded, or published by the trainer: a 404, or the whole file; never a 500 (the cache's
  rename found its directory gone), never a body cut short after its Content-Length (the file was
  opened by path after the headers were sent), never the deleted run's directory made again (the
  cache directory was made with its parents). The archive is the same bytes on every build.
- A deleted tenant's uploaded adapter files are removed after the commit; an upload whose
  transaction does not commit leaves no files; upload directories without a row are removed by the
  start-up clean-up, but never one an upload in progress holds.
- Uploads at once cannot together take a tenant past its adapter quotas (62 kept + 16 at once kept 72
  of 64): the check and the insert are serialised per tenant.

The windows are made deterministic by pause points at the exact places (a deletion run inside the
request, or a thread held between the quota check and the insert), never by sleeping."""

import fcntl
import io
import json
import os
import tarfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save
from sqlalchemy import func, select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.adapters import service, uploads
from app.adapters.models import Adapter, TenantAdapter
from app.adapters.upload import extract_adapter_tar
from app.config import Settings
from app.main import create_app
from app.projection import TRASH_DIR, remove_run_dir, run_dir
from app.runs.models import Run
from app.tenants import removal
from contracts.ids import new_id
from tests.app.api import (
    ADMIN_HEADERS,
    POOL_SPEC,
    WORKER_HEADERS,
    TenantHandle,
    create_run,
    new_tenant,
    register,
)
from tests.app.factories import committed
from tests.app.test_adapters import FILES, tar_bytes

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj"
WAIT_S = 30
"""How long a pause point waits for the other side (a safety net: each wait ends at an event)."""


def _adapter_files() -> dict[str, bytes]:
    tensors = {f"{Q_PROJ}.lora_A.weight": torch.ones(4, 32), f"{Q_PROJ}.lora_B.weight": torch.ones(32, 4)}
    return {FILES[0]: json.dumps(CONFIG).encode(), FILES[1]: save(tensors)}


def _archive_of(directory: Path) -> bytes:
    out = io.BytesIO()
    service._write_archive(directory, out)
    return out.getvalue()


def _delete_run(settings: Settings, run_id: str) -> None:
    """What DELETE /v1/runs/{id} does: the row marked deleted and committed, then the directory removed."""
    with committed(settings) as session:
        session.execute(update(Run).where(Run.id == run_id).values(status="deleted", slot=None))
    remove_run_dir(run_id, settings)


def _assert_run_dir_gone(settings: Settings, run_id: str) -> None:
    assert not run_dir(settings, run_id).exists()
    trash = settings.runs_dir / TRASH_DIR
    assert not trash.exists() or not any(trash.iterdir())


@pytest.fixture
def published(client: TestClient, tenant: TenantHandle) -> str:
    """A run with the adapter of step 1; returns the run's id."""
    run_id: str = create_run(client, tenant)["id"]
    r = client.put(
        f"/v1/pool/runs/{run_id}/adapters/1",
        content=tar_bytes(_adapter_files()),
        headers=WORKER_HEADERS | {"Content-Type": "application/x-tar"},
    )
    assert r.status_code == 201, r.text
    return run_id


# --------------------------------------------------------------------------- finding 5: downloads


@pytest.mark.parametrize("when", ["before_the_build", "after_the_write"])
def test_a_run_deleted_while_its_archive_is_built_is_a_404_and_stays_gone(
    client: TestClient,
    tenant: TenantHandle,
    published: str,
    settings: Settings,
    when: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Deleted after the adapter's files were found and before the cache directory was made (which made
    the run's directory again, then a 500 reading the files), or after the archive was written to its
    temporary file (its rename was a 500)."""
    if when == "before_the_build":
        real_dir = service.adapter_dir

        def found_then_deleted(adapter: Any, *, settings: Settings) -> Path:
            directory = real_dir(adapter, settings=settings)
            _delete_run(settings, published)
            return directory

        monkeypatch.setattr(service, "adapter_dir", found_then_deleted)
    else:
        real_write = service._write_archive

        def written_then_deleted(directory: Path, out: Any) -> None:
            real_write(directory, out)
            _delete_run(settings, published)

        monkeypatch.setattr(service, "_write_archive", written_then_deleted)

    r = client.get(f"/v1/runs/{published}/adapters/1", headers=tenant.headers)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "not_found"
    _assert_run_dir_gone(settings, published)


@pytest.mark.parametrize("when", ["before_the_files", "while_unpacking"])
def test_an_adapter_published_for_a_run_deleted_meanwhile_is_refused_and_leaves_no_directory(
    client: TestClient, tenant: TenantHandle, settings: Settings, when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer publishes an adapter while the run is deleted: after the run was read, before its
    broadcast directory was made (which made the run's directory again, kept with the adapter's row:
    a 201), or while the files were unpacked into the directory then removed (a 500)."""
    run_id: str = create_run(client, tenant)["id"]
    if when == "before_the_files":
        real_dir = service.broadcast_dir

        def deleted_first(settings: Settings, run_id: str) -> Path:
            _delete_run(settings, run_id)
            return real_dir(settings, run_id)

        monkeypatch.setattr(service, "broadcast_dir", deleted_first)
    else:
        real_extract = extract_adapter_tar

        def deleted_while_unpacking(body: Any, staging: Path, *, max_bytes: int) -> tuple[int, str]:
            _delete_run(settings, run_id)
            return real_extract(body, staging, max_bytes=max_bytes)

        monkeypatch.setattr(service, "extract_adapter_tar", deleted_while_unpacking)

    r = client.put(
        f"/v1/pool/runs/{run_id}/adapters/1",
        content=tar_bytes(_adapter_files()),
        headers=WORKER_HEADERS | {"Content-Type": "application/x-tar"},
    )
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "run_not_trainable" and error["details"]["status"] == "deleted"
    _assert_run_dir_gone(settings, run_id)
    with committed(settings) as session:  # no row kept (the listing of a deleted run is a 404)
        assert session.scalar(select(func.count()).select_from(Adapter).where(Adapter.run_id == run_id)) == 0


def _deleting_after_headers(app: ASGIApp, *, path: str, delete: Callable[[], None]) -> ASGIApp:
    """`app`, with `delete` run once the response to `path` has sent its headers (Content-Length
    included) and before its body."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != path:
            await app(scope, receive, send)
            return

        async def send_then_delete(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                delete()

        await app(scope, receive, send_then_delete)

    return wrapped


@pytest.mark.parametrize(
    ("what", "cached"),
    [("1", False), ("1", True), (f"1/files/{FILES[1]}", False), (f"1/files/{FILES[0]}", False)],
)
def test_a_run_deleted_while_its_adapter_is_sent_is_sent_whole(
    settings: Settings, what: str, cached: bool
) -> None:
    """The response had sent its Content-Length when the file went: it closed with no body."""
    with TestClient(create_app(settings)) as setup:
        tenant = new_tenant(setup)
        run_id = create_run(setup, tenant)["id"]
        r = setup.put(
            f"/v1/pool/runs/{run_id}/adapters/1",
            content=tar_bytes(_adapter_files()),
            headers=WORKER_HEADERS | {"Content-Type": "application/x-tar"},
        )
        assert r.status_code == 201, r.text
        stored = run_dir(settings, run_id) / "broadcast" / "step_1"
        expected = _archive_of(stored) if what == "1" else (stored / what.rsplit("/", 1)[1]).read_bytes()
        if cached:
            assert setup.get(f"/v1/runs/{run_id}/adapters/1", headers=tenant.headers).content == expected

    path = f"/v1/runs/{run_id}/adapters/{what}"
    app = _deleting_after_headers(
        create_app(settings), path=path, delete=lambda: _delete_run(settings, run_id)
    )
    with TestClient(app) as client:
        r = client.get(path, headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert int(r.headers["content-length"]) == len(expected)
    assert r.content == expected
    _assert_run_dir_gone(settings, run_id)


def test_the_archive_is_the_same_bytes_on_every_build(
    client: TestClient, tenant: TenantHandle, published: str, settings: Settings
) -> None:
    """The gzip header held the name of the temporary file it was written to: every build differed."""
    url = f"/v1/runs/{published}/adapters/1"
    first = client.get(url, headers=tenant.headers)
    assert first.status_code == 200
    cache = run_dir(settings, published) / "cache"
    [archive] = cache.iterdir()
    archive.unlink()
    second = client.get(url, headers=tenant.headers)
    assert [p.name for p in cache.iterdir()] == [archive.name]  # built again
    assert second.content == first.content
    assert first.content[3] & 0x08 == 0  # gzip FLG: no FNAME
    with tarfile.open(fileobj=io.BytesIO(first.content), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == sorted(FILES)


# --------------------------------------------------------------------------- finding 7: uploaded files


@pytest.fixture
def pool(client: TestClient) -> None:
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)


def _upload(client: TestClient, tenant: TenantHandle) -> Any:
    return client.post(
        "/v1/adapters",
        params={"name": "mine"},
        content=tar_bytes(_adapter_files()),
        headers=tenant.headers | {"Content-Type": "application/x-tar"},
    )


def _on_disk(settings: Settings) -> list[str]:
    root = uploads.uploads_dir(settings)
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def _stored(settings: Settings, tenant_id: str | None = None) -> list[str]:
    with committed(settings) as session:
        query = select(TenantAdapter.id).order_by(TenantAdapter.id)
        if tenant_id is not None:
            query = query.where(TenantAdapter.tenant_id == tenant_id)
        return list(session.scalars(query))


def test_deleting_a_tenant_removes_its_uploaded_adapters(
    client: TestClient, tenant: TenantHandle, other_tenant: TenantHandle, settings: Settings, pool: None
) -> None:
    mine = [_upload(client, tenant).json()["id"] for _ in range(2)]
    theirs = _upload(client, other_tenant).json()["id"]
    assert _on_disk(settings) == sorted([*mine, theirs])
    assert client.delete(f"/v1/tenants/{tenant.id}", headers=ADMIN_HEADERS).status_code == 204
    assert _on_disk(settings) == [theirs]
    assert _stored(settings) == [theirs]


def test_an_upload_whose_commit_fails_leaves_no_files(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upload moved its files into place before the commit, which then failed: files without a row."""
    real = uploads.upload_adapter

    def then_the_commit_fails(session: Session, **kwargs: Any) -> TenantAdapter:
        row = real(session, **kwargs)

        def failing_commit() -> None:
            raise OperationalError("COMMIT", {}, Exception("disk I/O error"))

        monkeypatch.setattr(session, "commit", failing_commit)
        return row

    with TestClient(create_app(settings)) as client:
        tenant = new_tenant(client)
        register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)
        monkeypatch.setattr(uploads, "upload_adapter", then_the_commit_fails)
        r = _upload(client, tenant)
    assert r.status_code == 503, r.text
    assert _stored(settings) == []
    assert _on_disk(settings) == []


@contextmanager
def upload_lock_held(path: Path) -> Iterator[None]:
    """A shared flock on `path`, as an upload in progress (in another process) holds on its directory."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def test_start_up_removes_upload_directories_without_a_row(
    client: TestClient, tenant: TenantHandle, settings: Settings, pool: None, db: Session
) -> None:
    kept = _upload(client, tenant).json()["id"]
    root = uploads.uploads_dir(settings)
    made = {
        "adp_0123456789ab": "moved into place, never committed (a crash)",
        ".upload_crashed": "a staging leftover",
        "adp_00000000000f": "moved into place, its commit under way",
        ".upload_busy": "being unpacked",
        "not-an-upload": "not ours: left alone",
    }
    for name in made:
        (root / name).mkdir()
        for file, data in _adapter_files().items():
            (root / name / file).write_bytes(data)

    with upload_lock_held(root / "adp_00000000000f"), upload_lock_held(root / ".upload_busy"):
        assert uploads.remove_orphan_uploads(db, settings=settings) == 2
        db.commit()
        assert _on_disk(settings) == sorted([kept, "adp_00000000000f", ".upload_busy", "not-an-upload"])
    assert uploads.remove_orphan_uploads(db, settings=settings) == 2  # their uploads are gone now
    db.commit()
    assert _on_disk(settings) == sorted([kept, "not-an-upload"])
    assert (root / kept / uploads.ARCHIVE).is_file()


# --------------------------------------------------------------------------- pause points


class _PauseFirst:
    """Wraps `fn`: its first call signals `reached` and waits for `release` first; every call after it
    signals `later`."""

    def __init__(self, fn: Callable[..., Any], *, before: bool = True) -> None:
        self.fn = fn
        self.before = before
        self.calls = 0
        self.reached = threading.Event()
        self.release = threading.Event()
        self.later = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.calls += 1
            first = self.calls == 1
        if not first:
            self.later.set()
            return self.fn(*args, **kwargs)
        self.reached.set()
        assert self.release.wait(WAIT_S), "the pause point was never released"
        return self.fn(*args, **kwargs)


class _Signal:
    """Wraps `fn`: sets `event` when called for the `nth` time (before calling it), and on every call after."""

    def __init__(self, fn: Callable[..., Any], event: threading.Event, nth: int = 1) -> None:
        self.fn, self.event, self.nth, self.calls = fn, event, nth, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls >= self.nth:
            self.event.set()
        return self.fn(*args, **kwargs)


def _signal_on(
    monkeypatch: pytest.MonkeyPatch, module: Any, name: str, event: threading.Event, *, nth: int = 1
) -> None:
    """`module.name` wrapped in a `_Signal` (a module without it, as before the fix, calls nothing)."""
    real: Callable[..., Any] = getattr(module, name, lambda *_args, **_kwargs: None)
    monkeypatch.setattr(module, name, _Signal(real, event, nth), raising=False)


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def _is_sqlite(settings: Settings) -> bool:
    return settings.database_url.startswith("sqlite")


def test_a_tenant_deleted_while_it_uploads_keeps_no_files(
    client: TestClient, tenant: TenantHandle, settings: Settings, pool: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upload is held between its quota check and its insert while the admin deletes the tenant.
    The deletion waits for the tenant's row (the upload holds it), then takes the upload's row with the
    tenant and removes its files after the commit. (It did not wait: the upload's insert failed on
    the foreign key, a 500, and its files, moved into place before, stayed.)"""
    held = _PauseFirst(new_id)  # called once the quota passed, right before the row and files
    monkeypatch.setattr(uploads, "new_id", held)
    deletion_waits = threading.Event()
    _signal_on(monkeypatch, removal, "lock_tenant", deletion_waits)

    upload, uploaded = _in_thread(lambda: _upload(client, tenant))
    assert held.reached.wait(WAIT_S)
    deletion, deleted = _in_thread(lambda: client.delete(f"/v1/tenants/{tenant.id}", headers=ADMIN_HEADERS))
    # The deletion has reached the tenant's row lock (or, without one, finished).
    assert deletion_waits.wait(WAIT_S) or not deletion.is_alive()
    held.release.set()
    upload.join(WAIT_S)
    deletion.join(WAIT_S)
    assert not upload.is_alive() and not deletion.is_alive()

    assert uploaded[0].status_code == 201, uploaded[0].text
    assert deleted[0].status_code == 204, deleted[0].text
    assert _stored(settings) == []
    assert _on_disk(settings) == []


# --------------------------------------------------------------------------- finding 8: quotas


@pytest.mark.parametrize("limit", ["count", "bytes"])
def test_uploads_at_once_cannot_pass_the_quota_together(
    settings: Settings, limit: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Room for one more adapter; two uploads at once, the first held between its quota check and its
    insert until the second has passed its own check (without the tenant row lock) or is waiting for
    the lock: one is kept, the other is a 409."""
    staged = tmp_path / "staged"
    staged.mkdir()
    for name, data in _adapter_files().items():
        (staged / name).write_bytes(data)
    (staged / uploads.ARCHIVE).write_bytes(_archive_of(staged))
    each = sum(p.stat().st_size for p in staged.iterdir())  # what one upload takes on disk
    bounds = (
        {"tenant_max_adapters": 2}
        if limit == "count"
        else {"tenant_max_adapters": 100, "tenant_max_adapter_bytes": 2 * each + each // 2}
    )
    bounded = settings.model_copy(update=bounds)
    with TestClient(create_app(bounded)) as client:
        tenant = new_tenant(client)
        register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)
        assert _upload(client, tenant).status_code == 201

        held = _PauseFirst(new_id)  # the first upload, its quota checked, before its insert
        monkeypatch.setattr(uploads, "new_id", held)
        second_checks = threading.Event()
        if _is_sqlite(bounded):
            # Every SQLite transaction holds the write lock from its first statement (BEGIN IMMEDIATE):
            # the second upload's first read waits for the first's commit, whatever this test does.
            _signal_on(monkeypatch, uploads, "upload_adapter", second_checks, nth=2)
        else:
            # The second upload has passed its check (no lock: it is about to insert too), or waits
            # for the tenant's row before its check.
            _signal_on(monkeypatch, uploads, "lock_tenant", second_checks, nth=2)
            held.later = second_checks

        first, first_out = _in_thread(lambda: _upload(client, tenant))
        assert held.reached.wait(WAIT_S)
        second, second_out = _in_thread(lambda: _upload(client, tenant))
        assert second_checks.wait(WAIT_S)
        held.release.set()
        first.join(WAIT_S)
        second.join(WAIT_S)
        assert not first.is_alive() and not second.is_alive()

    codes = sorted(r.status_code for r in (first_out[0], second_out[0]))
    assert codes == [201, 409], [r.text for r in (first_out[0], second_out[0])]
    refused = next(r for r in (first_out[0], second_out[0]) if r.status_code == 409)
    assert refused.json()["error"]["code"] == "adapter_quota"
    with committed(settings) as session:
        count = session.scalar(select(func.count()).select_from(TenantAdapter))
    assert count == 2
    assert len(_on_disk(settings)) == 2  # the refused upload's staging directory removed


def test_the_start_up_runs_the_upload_clean_up(settings: Settings) -> None:
    """app/lifecycle.py calls `remove_orphan_uploads`: a directory without a row and a staging
    leftover (an upload cut short by a crash) are gone once the app has started."""
    root = uploads.uploads_dir(settings)
    (root / "adp_0123456789ab").mkdir(parents=True)
    (root / ".upload_crashed").mkdir()
    with TestClient(create_app(settings)):
        pass
    assert _on_disk(settings) == []
