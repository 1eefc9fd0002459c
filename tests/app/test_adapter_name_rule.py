"""An uploaded adapter's name follows the run names' rule (contracts/names.py): it is listed and
logged as a run's is. A newline, an escape or a bidirectional override in `?name=` was stored."""

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from orchestrator.client import LoraloomClient
from tests.app.api import POOL_SPEC, TenantHandle, register


def _upload(client: TestClient, tenant: TenantHandle, name: str, body: bytes = b"") -> dict[str, object]:
    r = client.post(
        "/v1/adapters",
        params={"name": name},
        content=body,
        headers=tenant.headers | {"Content-Type": "application/x-tar"},
    )
    assert r.status_code == 422, r.text
    error: dict[str, object] = r.json()["error"]
    return error


@pytest.mark.parametrize(
    ("name", "kind", "said"),
    [
        ("evil\nINFO forged", "run_name_character", "U+000A"),
        ("report\u202etxt.exe", "run_name_character", "U+202E RIGHT-TO-LEFT OVERRIDE"),
        ("a\x1b[2Jb", "run_name_character", "U+001B"),
        ("zero\u200bwidth", "run_name_character", "U+200B ZERO WIDTH SPACE"),
        ("trailing ", "run_name_whitespace", "must not end with whitespace"),
        ("   ", "run_name_whitespace", "only whitespace"),
    ],
)
def test_a_hostile_adapter_name_is_a_422_naming_the_query_field_and_nothing_is_stored(
    client: TestClient, tenant: TenantHandle, name: str, kind: str, said: str
) -> None:
    error = _upload(client, tenant, name)
    assert error["code"] == "validation_error"
    details = error["details"]
    assert isinstance(details, list)
    assert [(d["loc"], d["type"]) for d in details] == [(["query", "name"], kind)], details
    assert said in details[0]["msg"]
    assert name not in str(error)  # named by code point, never echoed
    assert client.get("/v1/adapters", headers=tenant.headers).json()["items"] == []


def test_a_name_with_inner_spaces_and_any_script_passes_the_rule(
    client: TestClient, tenant: TenantHandle
) -> None:
    """Refused for its empty body (not a tar), not for its name (a pool to check it against: without
    one, the upload is refused for that before its body is read)."""
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)
    error = _upload(client, tenant, "mon adaptateur — été 🚀")
    assert error["code"] == "invalid_adapter", error
    assert isinstance(error["details"], list) and error["details"][0]["loc"] == ["body"], error


def test_the_sdk_refuses_such_a_name_before_sending_anything(tmp_path: Path) -> None:
    """No request: the client points at a port nothing listens on, and the error is the rule's."""
    with (
        LoraloomClient("http://127.0.0.1:9", "llk_unused") as sdk,
        pytest.raises(ValueError, match=r"adapter name must not contain U\+202E"),
    ):
        sdk.upload_adapter(tmp_path, name="evil\u202egpj")
