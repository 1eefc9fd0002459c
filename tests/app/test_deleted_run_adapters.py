"""A deleted run's adapters are gone, listed or downloaded alike. Their files go with the run's
directory when it is deleted, their rows stay until the run is purged: the listing still named
every step while each download was a 404. Now the listing, the downloads and the single files all
answer the same 404, whose details say the run is deleted (not unknown); GET /v1/runs/{id} still
shows the run, as `deleted`. Another tenant's deleted run is the plain 404 of an unknown run. Both
databases."""

import json
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save
from sqlalchemy import func, select

from app.adapters.models import Adapter
from app.config import Settings
from tests.app.api import WORKER_HEADERS, TenantHandle, create_run
from tests.app.factories import committed
from tests.app.test_adapters import FILES, tar_bytes

Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj"
CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}

READS = [
    "/adapters",
    "/adapters?limit=1",
    "/adapters?newest_first=true&limit=1",
    "/adapters/latest",
    "/adapters/1",
    f"/adapters/2/files/{FILES[0]}",
    f"/adapters/latest/files/{FILES[1]}",
]
"""Every read of a run's adapters: listed (each form of the list), downloaded, file by file."""


def _publish(client: TestClient, run_id: str, step: int) -> None:
    tensors = {
        f"{Q_PROJ}.lora_A.weight": torch.ones(4, 32),
        f"{Q_PROJ}.lora_B.weight": torch.ones(32, 4) * step,
    }
    body = tar_bytes({FILES[0]: json.dumps(CONFIG).encode(), FILES[1]: save(tensors)})
    r = client.put(
        f"/v1/pool/runs/{run_id}/adapters/{step}",
        content=body,
        headers=WORKER_HEADERS | {"Content-Type": "application/x-tar"},
    )
    assert r.status_code == 201, r.text


def _adapter_rows(settings: Settings, run_id: str) -> int:
    with committed(settings) as session:
        return int(
            session.scalar(select(func.count()).select_from(Adapter).where(Adapter.run_id == run_id)) or 0
        )


@pytest.fixture
def deleted(client: TestClient, tenant: TenantHandle, settings: Settings) -> str:
    """A run that published steps 1 and 2, every read of them answered, then deleted; its id."""
    run_id: str = create_run(client, tenant)["id"]
    _publish(client, run_id, 1)
    _publish(client, run_id, 2)
    for read in READS:
        assert client.get(f"/v1/runs/{run_id}{read}", headers=tenant.headers).status_code == 200, read
    assert client.delete(f"/v1/runs/{run_id}", headers=tenant.headers).status_code == 200
    assert _adapter_rows(settings, run_id) == 2  # the rows stay (until the purge): the listing's source
    return run_id


@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_every_read_of_a_deleted_runs_adapters_is_the_same_404(
    client: TestClient, tenant: TenantHandle, deleted: str, read: str, method: str
) -> None:
    r = client.request(method, f"/v1/runs/{deleted}{read}", headers=tenant.headers)
    assert r.status_code == 404, r.text
    if method == "GET":
        error: dict[str, Any] = r.json()["error"]
        assert error["code"] == "not_found", error
        assert error["message"] == f"run {deleted} was deleted, and its adapters with it", error
        assert error["details"] == {"run_id": deleted, "status": "deleted"}


def test_the_run_itself_is_still_shown_as_deleted(
    client: TestClient, tenant: TenantHandle, deleted: str
) -> None:
    r = client.get(f"/v1/runs/{deleted}", headers=tenant.headers)
    assert r.status_code == 200 and r.json()["status"] == "deleted", r.text


def test_another_tenants_deleted_run_is_the_404_of_an_unknown_run(
    client: TestClient, other_tenant: TenantHandle, deleted: str
) -> None:
    for read in ("/adapters", "/adapters/1"):
        r = client.get(f"/v1/runs/{deleted}{read}", headers=other_tenant.headers)
        assert r.status_code == 404, r.text
        assert r.json()["error"] == {
            "code": "not_found",
            "message": f"run {deleted} not found",
            "details": None,
        }


def test_the_dashboard_shows_no_download_of_a_deleted_runs_adapters(
    client: TestClient, tenant: TenantHandle, deleted: str
) -> None:
    """The dashboard's run page listed them and its downloads were a "files are missing" 404."""
    from tests.app.test_ui import sign_in

    sign_in(client, tenant.key)
    page = client.get(f"/ui/runs/{deleted}")
    assert page.status_code == 200
    assert f"/ui/runs/{deleted}/adapters/" not in page.text
    for step in ("1", "latest"):
        r = client.get(f"/ui/runs/{deleted}/adapters/{step}")
        assert r.status_code == 404
        assert r.json()["error"]["details"] == {"run_id": deleted, "status": "deleted"}
