"""The adapter upload's body is a tar whatever Content-Type it is sent with (hostile probe,
2026-11-29): with none (a bare client) or application/json, the request guard checked it as JSON
and refused a valid tar with "422 body: not UTF-8", while curl's form-urlencoded or text/plain
were stored. Every declared type now gets the route's own checks."""

import json

import pytest
import torch
from fastapi.testclient import TestClient

from tests.app.api import POOL_SPEC, TenantHandle, register
from tests.app.test_adapters import FILES, save, tar_bytes

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
TENSORS = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 32),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(32, 4),
}


@pytest.mark.parametrize("content_type", [None, "application/json", "application/x-www-form-urlencoded"])
def test_a_tar_is_taken_whatever_type_it_declares(
    client: TestClient, tenant: TenantHandle, content_type: str | None
) -> None:
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)
    body = tar_bytes({FILES[0]: json.dumps(CONFIG).encode(), FILES[1]: save(TENSORS)})
    with pytest.raises(UnicodeDecodeError):
        body.decode("utf-8")  # what the JSON check refused
    headers = dict(tenant.headers)
    if content_type is not None:
        headers["Content-Type"] = content_type
    answer = client.post("/v1/adapters", params={"name": "mine"}, content=body, headers=headers)
    assert answer.status_code == 201, answer.text
    assert answer.json()["rank"] == 4


def test_a_json_body_on_the_upload_is_the_routes_refusal(client: TestClient, tenant: TenantHandle) -> None:
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)
    answer = client.post(
        "/v1/adapters", content=b'{"a": 1}', headers=tenant.headers | {"Content-Type": "application/json"}
    )
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "invalid_adapter"
    assert client.get("/v1/adapters", headers=tenant.headers).json()["items"] == []
