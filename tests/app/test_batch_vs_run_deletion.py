"""A batch submitted while its run is deleted: a 409, and the deleted run's directory really gone.

The windows are made deterministic by running the deletion (the row's status, then the directory's
removal, as `DELETE /v1/runs/{id}` does after its commit) at a pause point inside the request:
before its payload file is written, and between the file's creation and its rename. Found by a
hostile-tenant probe: 500s (the rename's FileNotFoundError) and directories of deleted runs left
behind (the write recreated them; or rmtree met a file made meanwhile: "Directory not empty")."""

import os
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from app.batches import service, storage
from app.config import Settings
from app.main import create_app
from app.projection import TRASH_DIR, project_run, remove_run_dir, run_dir
from app.runs.models import Run
from tests.app.api import batch_body, post_batch
from tests.app.factories import Seeded, batch_count, committed, seed_run


def _projected_run(settings: Settings) -> Seeded:
    seeded = seed_run(settings)
    with committed(settings) as session:
        run = session.get(Run, seeded.run_id)
        assert run is not None
        project_run(run, settings)
    assert run_dir(settings, seeded.run_id).is_dir()
    return seeded


def _delete_run(settings: Settings, run_id: str) -> None:
    """What the delete route does: the row deleted and committed, then the directory removed."""
    with committed(settings) as session:
        session.execute(update(Run).where(Run.id == run_id).values(status="deleted", slot=None))
    remove_run_dir(run_id, settings)


def _assert_deleted_cleanly(settings: Settings, seeded: Seeded, response: Any) -> None:
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["code"] == "run_not_active" and error["details"]["status"] == "deleted"
    assert not run_dir(settings, seeded.run_id).exists()
    trash = settings.runs_dir / TRASH_DIR
    assert not trash.exists() or not any(trash.iterdir())
    assert batch_count(settings) == 0


def test_deleted_before_the_payload_is_written(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The route read the run active, then the run is deleted: the write made the run's path again."""
    seeded = _projected_run(settings)
    real = storage.write_payload

    def deleted_first(settings: Settings, **kwargs: Any) -> storage.StoredPayload:
        _delete_run(settings, seeded.run_id)
        return real(settings, **kwargs)

    monkeypatch.setattr(service, "write_payload", deleted_first)
    with TestClient(create_app(settings)) as client:
        response = post_batch(client, seeded, batch_body(2))
    _assert_deleted_cleanly(settings, seeded, response)


def test_deleted_while_the_payload_is_written(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory goes between the temporary file's creation and its rename (a 500 before)."""
    seeded = _projected_run(settings)
    real = storage._create
    made: list[Path] = []

    def deleted_after_create(tmp: Path) -> int:
        fd = real(tmp)
        if not made:  # the first attempt only: the run goes from under it
            _delete_run(settings, seeded.run_id)
        made.append(tmp)
        return fd

    monkeypatch.setattr(storage, "_create", deleted_after_create)
    with TestClient(create_app(settings)) as client:
        response = post_batch(client, seeded, batch_body(2))
    assert len(made) == 2  # written again under the recreated path, then refused
    _assert_deleted_cleanly(settings, seeded, response)


def test_a_removal_cut_short_is_finished_at_start_up(settings: Settings) -> None:
    """A crash between the rename into .trash and the rmtree leaves the tree there: the start-up
    rebuild (create_app's lifespan) empties it."""
    leftover = settings.runs_dir / TRASH_DIR / "run_0123456789ab.deadbeef" / "rollouts"
    leftover.mkdir(parents=True)
    (leftover / "batch.msgpack").write_bytes(b"x")
    with TestClient(create_app(settings)):
        pass
    assert list((settings.runs_dir / TRASH_DIR).iterdir()) == []


def test_a_trash_emptied_by_another_process_mid_removal(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process's start-up empties the trash between this removal's mkdir of it and its
    rename (review: the removal took the rename's FileNotFoundError for "removed already" and left
    the deleted run's directory). It makes the trash again and removes the run."""
    seeded = _projected_run(settings)
    real_rename = os.rename
    calls: list[str] = []

    def trash_gone_first(src: Any, dst: Any) -> None:
        if not calls:
            (settings.runs_dir / TRASH_DIR).rmdir()  # as if another process had just removed it
        calls.append(str(dst))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", trash_gone_first)
    remove_run_dir(seeded.run_id, settings)
    assert len(calls) == 2
    assert not run_dir(settings, seeded.run_id).exists()
    assert list((settings.runs_dir / TRASH_DIR).iterdir()) == []
