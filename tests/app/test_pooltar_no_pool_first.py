"""A tenant's adapter upload (POST /v1/adapters) is refused for want of a live pool of its base model
(422 `no_pool`) before its tar is unpacked or its safetensors header parsed: the pool was looked up
only after both, work (up to `max_body_bytes`) for an upload no body could make succeed. The spies
count the calls; nothing is timed. The refusals that need nothing of the body keep their order
(the quota's 409 first), and a malformed tar with no pool now gets `no_pool`."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save

from app.adapters import upload as upload_module
from app.adapters import uploads
from app.config import Settings
from app.main import create_app
from tests.app.api import POOL_SPEC, TenantHandle, new_tenant, register
from tests.app.test_adapters import FILES, tar_bytes

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
TENSORS = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 32),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(32, 4),
}
BODY = tar_bytes({FILES[0]: json.dumps(CONFIG).encode(), FILES[1]: save(TENSORS)})
TAR = {"Content-Type": "application/x-tar"}


@pytest.fixture
def header_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The safetensors files whose header was read (both modules' names for the parser: upload.py's
    own check and uploads.py's import of it), and every JSON the upload parsed (config or header)."""
    seen: list[Path] = []
    real_read, real_parse = upload_module._read_safetensors_header, upload_module._parse_json

    def read(path: Path) -> tuple[dict[str, Any], int]:
        seen.append(path)
        return real_read(path)

    def parse(raw: bytes) -> Any:
        seen.append(Path("<json>"))
        return real_parse(raw)

    monkeypatch.setattr(upload_module, "_read_safetensors_header", read)
    monkeypatch.setattr(uploads, "_read_safetensors_header", read)
    monkeypatch.setattr(upload_module, "_parse_json", parse)
    return seen


def _upload(client: TestClient, tenant: TenantHandle, body: bytes = BODY, **params: str) -> Any:
    return client.post(
        "/v1/adapters", params={"name": "mine", **params}, content=body, headers=tenant.headers | TAR
    )


def _nothing_kept(client: TestClient, tenant: TenantHandle, settings: Settings) -> None:
    assert client.get("/v1/adapters", headers=tenant.headers).json()["items"] == []
    root = settings.data_dir / "adapters"
    assert (list(root.iterdir()) if root.exists() else []) == []  # no staging leftover either


def _no_pool(response: Any) -> None:
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "no_pool", error
    assert [d["loc"] for d in error["details"]] == [["query", "base_model"]], error


def test_no_pool_is_refused_before_the_header_is_parsed(
    client: TestClient, tenant: TenantHandle, settings: Settings, header_reads: list[Path]
) -> None:
    _no_pool(_upload(client, tenant))
    assert header_reads == []
    _nothing_kept(client, tenant, settings)
    # The spies see the parse once a pool serves the model: the same upload is read and kept.
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)
    r = _upload(client, tenant)
    assert r.status_code == 201, r.text
    assert any(p.name == FILES[1] for p in header_reads), header_reads


def test_a_malformed_tar_with_no_pool_is_refused_for_the_pool(
    client: TestClient, tenant: TenantHandle, settings: Settings, header_reads: list[Path]
) -> None:
    """No body could make the upload succeed without a pool: that is the answer, whatever the tar."""
    _no_pool(_upload(client, tenant, b"not a tar"))
    _no_pool(_upload(client, tenant, tar_bytes({FILES[0]: b"{}", FILES[1]: b"\0" * 8})))
    assert header_reads == []
    _nothing_kept(client, tenant, settings)


def test_the_quota_still_comes_before_the_pool(settings: Settings) -> None:
    """The order of the refusals that need nothing of the body is kept: the tenant's quota first."""
    with TestClient(create_app(settings.model_copy(update={"tenant_max_adapters": 1}))) as client:
        tenant = new_tenant(client)
        register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)
        assert _upload(client, tenant).status_code == 201
        refused = _upload(client, tenant, base_model="no-pool-serves-this")
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "adapter_quota"
