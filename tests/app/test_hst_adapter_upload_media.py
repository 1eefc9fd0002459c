"""POST /v1/adapters takes what its OpenAPI document declares, an uncompressed tar as
`application/x-tar` (what the SDK, the pool, generated clients and the README's curl send), and each of
its query parameters once (hostile probe, 2026-11-29): a body sent as JSON, text, a form or without a
Content-Type was read as a tar and stored (201), and `?name=a&name=b` stored "b". Both are refused
before the body is read; nothing is stored."""

import json
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save

from tests.app.api import POOL_SPEC, TenantHandle, register
from tests.app.test_adapters import FILES, tar_bytes

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
TENSORS = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 32),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(32, 4),
}
BODY = tar_bytes({FILES[0]: json.dumps(CONFIG).encode(), FILES[1]: save(TENSORS)})


@pytest.fixture(autouse=True)
def pool(client: TestClient) -> None:
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)


def _stored(client: TestClient, tenant: TenantHandle) -> list[str]:
    return [a["name"] for a in client.get("/v1/adapters", headers=tenant.headers).json()["items"]]


def assert_tar_415(r: Any, content_type: str | None) -> None:
    """`r` is the 415 of a tar upload sent as `content_type` (or without one): the uniform body
    naming the type sent and the tar's, and saying to send it uncompressed for a gzip."""
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_media_type", error
    assert error["details"] == {
        "content_type": content_type.split(";")[0] if content_type else None,
        "accepted": ["application/x-tar"],
    }, error
    assert "send " in error["message"] and "application/x-tar" in error["message"], error
    if content_type == "application/gzip":
        assert "uncompressed" in error["message"], error


@pytest.mark.parametrize(
    ("content_type", "tar"),
    [
        (None, "application/x-tar"),
        ("application/json", "Application/X-Tar"),
        ("text/plain", "application/x-tar; q=1"),
        ("application/x-www-form-urlencoded", "application/x-tar"),
        ("multipart/form-data; boundary=x", "application/x-tar"),
        ("application/octet-stream", "application/x-tar"),
        ("application/gzip", "application/x-tar"),
        ("application/x-tar-but-not", "application/x-tar"),
    ],
)
def test_a_body_of_another_type_is_a_415_naming_the_tar(
    client: TestClient, tenant: TenantHandle, content_type: str | None, tar: str
) -> None:
    """After the caller's credential (a 401 first, as on every route), before the body is read; the
    same body as a tar, in any spelling of its type, is kept."""
    typed = {"Content-Type": content_type} if content_type is not None else {}
    r = client.post("/v1/adapters", params={"name": "mine"}, content=BODY, headers=typed)
    assert r.status_code == 401, r.text
    r = client.post("/v1/adapters", params={"name": "mine"}, content=BODY, headers=tenant.headers | typed)
    assert_tar_415(r, content_type)
    assert _stored(client, tenant) == []
    r = client.post(
        "/v1/adapters", params={"name": "mine"}, content=BODY, headers=tenant.headers | {"Content-Type": tar}
    )
    assert r.status_code == 201, r.text
    assert _stored(client, tenant) == ["mine"]


@pytest.mark.parametrize("key", ["name", "base_model"])
def test_a_query_parameter_given_twice_is_refused_naming_it(
    client: TestClient, tenant: TenantHandle, key: str
) -> None:
    values = {"name": ["a", "b"], "base_model": ["loraloom-tiny", "loraloom-tiny"]}
    r = client.post(
        "/v1/adapters",
        params={key: values[key]},
        content=BODY,
        headers=tenant.headers | {"Content-Type": "application/x-tar"},
    )
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error", error
    assert error["details"] == [
        {"loc": ["query", key], "msg": error["details"][0]["msg"], "type": "repeated_query_parameter"}
    ], error
    assert repr(key) in error["message"], error
    assert _stored(client, tenant) == []


def test_the_document_lists_the_415(client: TestClient) -> None:
    operation = client.get("/openapi.json").json()["paths"]["/v1/adapters"]["post"]
    assert "415" in operation["responses"], sorted(operation["responses"])
    assert list(operation["requestBody"]["content"]) == ["application/x-tar"]
