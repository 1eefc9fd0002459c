"""The pool's adapter upload (PUT /v1/pool/runs/{run_id}/adapters/{step}) takes what its OpenAPI
document declares, an uncompressed tar as `application/x-tar` (what the pool's client sends:
trainer_core/service_client.py), and answers another type with the tenants' upload's 415
(tests/app/test_hst_adapter_upload_media.py): a body of any type was read as a tar, so a gzip got a
422 about a tar and the right bytes under a wrong type were stored (201). The 415 comes after the
worker token (401/403 first), before the run is looked up; nothing is stored."""

import json

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save

from app.config import Settings
from app.main import create_app
from app.openapi import build_documents
from tests.app.api import POOL_SPEC, WORKER_HEADERS, TenantHandle, create_run, register
from tests.app.test_adapters import FILES, tar_bytes
from tests.app.test_hst_adapter_upload_media import assert_tar_415

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
TENSORS = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 32),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(32, 4),
}
BODY = tar_bytes({FILES[0]: json.dumps(CONFIG).encode(), FILES[1]: save(TENSORS)})
PATH = "/v1/pool/runs/{run_id}/adapters/{step}"


@pytest.fixture
def run_id(client: TestClient, tenant: TenantHandle) -> str:
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)
    run = create_run(client, tenant)
    assert run["status"] == "active", run
    return str(run["id"])


def _steps_stored(client: TestClient, tenant: TenantHandle, settings: Settings, run_id: str) -> list[int]:
    listed = client.get(f"/v1/runs/{run_id}/adapters", headers=tenant.headers).json()["items"]
    assert (listed == []) == (list(settings.data_dir.rglob("*step_*")) == []), listed  # rows and files agree
    return [a["step"] for a in listed]


@pytest.mark.parametrize(
    ("content_type", "body", "tar"),
    [
        ("application/octet-stream", BODY, "application/x-tar"),
        ("application/gzip", BODY, "Application/X-Tar"),
        ("text/plain", BODY, "application/x-tar; q=1"),
        ("application/x-www-form-urlencoded", BODY, "application/x-tar"),
        ("multipart/form-data; boundary=x", BODY, "application/x-tar"),
        ("application/x-tar-but-not", BODY, "application/x-tar"),
        # The request guard does not read a pool upload as JSON (a tar under a JSON type, or under
        # none, was its 422 "not UTF-8"): they reach the route's 415 too.
        ("application/json", b"{}", "application/x-tar"),
        ("application/json", BODY, "application/x-tar"),
        (None, BODY, "application/x-tar"),
        (None, b"", "application/x-tar"),
    ],
)
def test_a_body_of_another_type_is_a_415_naming_the_tar(
    client: TestClient,
    tenant: TenantHandle,
    settings: Settings,
    run_id: str,
    content_type: str | None,
    body: bytes,
    tar: str,
) -> None:
    typed = {"Content-Type": content_type} if content_type is not None else {}
    url = PATH.format(run_id=run_id, step=1)
    assert client.put(url, content=body, headers=typed).status_code == 401
    assert client.put(url, content=body, headers=tenant.headers | typed).status_code == 403
    assert_tar_415(client.put(url, content=body, headers=WORKER_HEADERS | typed), content_type)
    assert _steps_stored(client, tenant, settings, run_id) == []
    r = client.put(url, content=BODY, headers=WORKER_HEADERS | {"Content-Type": tar})
    assert r.status_code == 201, r.text
    assert _steps_stored(client, tenant, settings, run_id) == [1]


def test_the_415_comes_before_the_run_is_looked_up(client: TestClient) -> None:
    """As on the tenants' upload: the request's own form first, then what it names."""
    url = PATH.format(run_id="run_000000000000", step=1)
    typed = {"Content-Type": "application/octet-stream"}
    assert client.put(url, content=BODY, headers=WORKER_HEADERS | typed).status_code == 415
    tar = {"Content-Type": "application/x-tar"}
    assert client.put(url, content=BODY, headers=WORKER_HEADERS | tar).status_code == 404


def test_the_pool_document_lists_the_415() -> None:
    _, pool = build_documents(create_app(Settings(database_url="sqlite:///:memory:")))
    operation = pool["paths"][PATH]["put"]
    assert "415" in operation["responses"], sorted(operation["responses"])
    assert operation["responses"]["415"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"
    }
    assert list(operation["requestBody"]["content"]) == ["application/x-tar"]
