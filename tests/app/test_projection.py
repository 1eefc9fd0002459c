"""Run directories are a projection of the database, rebuilt at start-up (DESIGN §1)."""

import shutil
import tomllib

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.projection import RUN_SUBDIRS, config_toml, run_dir
from contracts.run_config import RunConfig
from tests.app.api import create_run, new_tenant


def test_layout_and_orch_toml(client, tenant, settings):
    run = create_run(client, tenant, max_steps=9, metadata={"team": "rl"})
    root = settings.runs_dir / run["id"]
    assert sorted(p.name for p in root.iterdir()) == sorted(RUN_SUBDIRS)
    orch = tomllib.loads((root / "control" / "orch.toml").read_text())
    # The file is a complete RunConfig (unset optionals left out: TOML has no null).
    assert "heartbeat_timeout" not in orch
    assert RunConfig.model_validate(orch) == RunConfig.model_validate(run["config"])
    assert not (root / "control" / "evicted.txt").exists()


def test_evicted_txt(client, tenant, settings):
    run = create_run(client, tenant)
    client.post(f"/v1/runs/{run['id']}/evict", json={"reason": "loss diverged"}, headers=tenant.headers)
    assert (settings.runs_dir / run["id"] / "control" / "evicted.txt").read_text() == "loss diverged\n"


def test_rebuilt_at_start_up(settings):
    with TestClient(create_app(settings)) as client:
        tenant = new_tenant(client)
        kept = create_run(client, tenant)
        evicted = create_run(client, tenant)
        client.post(f"/v1/runs/{evicted['id']}/evict", json={"reason": "bye"}, headers=tenant.headers)
        deleted = create_run(client, tenant)
        client.delete(f"/v1/runs/{deleted['id']}", headers=tenant.headers)
    orch_before = (settings.runs_dir / kept["id"] / "control" / "orch.toml").read_text()

    # Lose a directory, lose a file, tamper with one, resurrect a deleted run's directory.
    shutil.rmtree(settings.runs_dir / kept["id"])
    (settings.runs_dir / evicted["id"] / "control" / "evicted.txt").unlink()
    (settings.runs_dir / evicted["id"] / "control" / "orch.toml").write_text("garbage")
    (settings.runs_dir / deleted["id"] / "control").mkdir(parents=True)

    with TestClient(create_app(settings)):
        pass
    assert (settings.runs_dir / kept["id"] / "control" / "orch.toml").read_text() == orch_before
    assert all((settings.runs_dir / kept["id"] / sub).is_dir() for sub in RUN_SUBDIRS)
    assert (settings.runs_dir / evicted["id"] / "control" / "evicted.txt").read_text() == "bye\n"
    assert tomllib.loads((settings.runs_dir / evicted["id"] / "control" / "orch.toml").read_text())
    assert not (settings.runs_dir / deleted["id"]).exists()


def test_rebuild_leaves_other_files_alone(client, tenant, settings):
    run = create_run(client, tenant)
    payload = settings.runs_dir / run["id"] / "rollouts" / "step_0" / "batch.msgpack"
    payload.parent.mkdir(parents=True)
    payload.write_bytes(b"data")
    with TestClient(create_app(settings)):
        pass
    assert payload.read_bytes() == b"data"


@pytest.mark.parametrize(
    "bad", ["../etc", "run_../../x", "RUN_0123456789AB", "run_0123", "", "run_0123456789ab/.."]
)
def test_run_dir_refuses_anything_but_a_run_id(settings, bad):
    with pytest.raises(ValueError):
        run_dir(settings, bad)


def test_config_toml_drops_nulls_everywhere():
    text = config_toml({"a": None, "b": {"c": None, "d": 1}, "e": [1, 2]})
    assert tomllib.loads(text) == {"b": {"d": 1}, "e": [1, 2]}


def test_stray_run_directories_are_removed_at_start_up(settings):
    """A directory without a row (a crash between a projection and a failed commit) goes at
    start-up; other entries of runs/ stay."""
    with TestClient(create_app(settings)) as client:
        kept = create_run(client, new_tenant(client))
    stray = settings.runs_dir / "run_0123456789ab"
    (stray / "control").mkdir(parents=True)
    (stray / "rollouts" / "step_0").mkdir(parents=True)
    other = settings.runs_dir / "README.txt"
    other.write_text("not a run")
    with TestClient(create_app(settings)):
        pass
    assert not stray.exists()
    assert (settings.runs_dir / kept["id"] / "control" / "orch.toml").exists()
    assert other.read_text() == "not a run"


def test_a_refused_create_leaves_no_directory(client, tenant, settings):
    before = sorted(p.name for p in settings.runs_dir.iterdir())
    r = client.post(
        "/v1/runs", json={"name": "x", "config": {"metadata": {"tags": ["a", None]}}}, headers=tenant.headers
    )
    assert r.status_code == 422
    assert sorted(p.name for p in settings.runs_dir.iterdir()) == before
