"""An uploaded adapter's config (POST /v1/adapters) within RunConfig's own bounds: an adapter no run
could start from (init_from needs the run's lora.rank and lora.alpha, bounded in
contracts/run_config.py) was stored and counted against the tenant's adapter quota. Its messages
name the field and the bound: a rank of 8.0 is not an integer (it was "outside [1, 16]"), and an
integer of 5,000 digits is too long (the message was Python's, about sys.set_int_max_str_digits())."""

import json
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save

from app.adapters.upload import MAX_JSON_INT_DIGITS
from app.config import Settings
from contracts.peft import ALPHA_BOUNDS, RANK_BOUNDS, Bounds, config_problems, run_config_bounds
from contracts.run_config import LoraSettings
from tests.app.api import POOL_SPEC, TenantHandle, register
from tests.app.test_adapters import FILES, _tenant_upload, tar_bytes

CONFIG: dict[str, Any] = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
TENSORS = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, 4),
}


@pytest.fixture
def pool(client: TestClient) -> None:
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)


def _refused(client: TestClient, tenant: TenantHandle, config: dict[str, Any]) -> dict[str, Any]:
    r = _tenant_upload(client, tenant, config, TENSORS)
    assert r.status_code == 422, r.text
    error: dict[str, Any] = r.json()["error"]
    assert error["code"] == "invalid_adapter"
    return error


def _nothing_kept(client: TestClient, tenant: TenantHandle, settings: Settings) -> None:
    assert client.get("/v1/adapters", headers=tenant.headers).json()["items"] == []
    assert list((settings.data_dir / "adapters").iterdir()) == []


def test_the_bounds_are_run_configs_own() -> None:
    """Read from LoraSettings' fields, not repeated: a change there moves the upload's check with it."""
    assert run_config_bounds("alpha") == ALPHA_BOUNDS == Bounds(0, False, 4096, True)
    assert run_config_bounds("rank") == RANK_BOUNDS == Bounds(1, True, 256, True)
    for field, bounds in (("alpha", ALPHA_BOUNDS), ("rank", RANK_BOUNDS)):
        limits = {type(m).__name__.lower(): m for m in LoraSettings.model_fields[field].metadata}
        assert bounds.high == next(getattr(m, k) for k, m in limits.items() if k in ("le", "lt"))
    assert str(ALPHA_BOUNDS) == "(0, 4096]" and str(run_config_bounds("dropout")) == "[0, 1)"


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"lora_alpha": 1e300}, "lora_alpha", "lora_alpha=1e+300 is outside (0, 4096]"),
        ({"lora_alpha": 4096.5}, "lora_alpha", "lora_alpha=4096.5 is outside (0, 4096]"),
        ({"lora_alpha": 10**400}, "lora_alpha", "lora_alpha (an integer of 401 digits) is outside (0, 4096]"),
        ({"r": 8.0}, "r", "rank r=8.0 must be an integer"),
        ({"r": "8"}, "r", "rank r='8' must be an integer"),
        ({"r": 300}, "r", "rank r=300 is outside [1, 256]"),
        ({"r": 32}, "r", "rank r=32 is outside [1, 16] (the pool's max_rank)"),
    ],
)
def test_a_config_outside_run_configs_bounds_is_refused_naming_field_and_bound(
    client: TestClient,
    tenant: TenantHandle,
    settings: Settings,
    pool: None,
    change: dict[str, Any],
    field: str,
    words: str,
) -> None:
    error = _refused(client, tenant, CONFIG | change)
    details = [d for d in error["details"] if d["loc"] == ["body", field]]
    assert details and words in details[0]["msg"], error
    assert words in error["message"]
    assert "outside [1, 16]" not in details[0]["msg"] or change == {"r": 32}  # 8.0's fault is its type
    _nothing_kept(client, tenant, settings)


def test_an_adapter_at_the_bounds_is_kept_and_a_run_starts_from_it(
    client: TestClient, tenant: TenantHandle, pool: None
) -> None:
    r = _tenant_upload(client, tenant, CONFIG | {"lora_alpha": 4096}, TENSORS)
    assert r.status_code == 201, r.text
    lora = {"rank": 4, "alpha": 4096.0, "target_modules": ["q_proj"]}
    run = client.post(
        "/v1/runs",
        json={"name": "from-upload", "config": {"lora": lora}, "init_from": {"adapter_id": r.json()["id"]}},
        headers=tenant.headers,
    )
    assert run.status_code == 201, run.text


def test_an_integer_of_thousands_of_digits_is_a_bound_not_pythons_internals(
    client: TestClient, tenant: TenantHandle, settings: Settings, pool: None
) -> None:
    for digits in (5000, MAX_JSON_INT_DIGITS + 1):
        # Written out by hand: Python itself cannot turn 5,000 digits into an int or back.
        config = json.dumps(CONFIG | {"lora_alpha": 0}).replace(
            '"lora_alpha": 0', '"lora_alpha": ' + "9" * digits
        )
        body = tar_bytes({FILES[0]: config.encode(), FILES[1]: save(TENSORS)})
        r = client.post(
            "/v1/adapters",
            params={"name": "long"},
            content=body,
            headers=tenant.headers | {"Content-Type": "application/x-tar"},
        )
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert "set_int_max_str_digits" not in error["message"], error
        assert f"an integer of {digits} digits (at most {MAX_JSON_INT_DIGITS}" in error["message"], error
        assert error["details"][0]["loc"] == ["body", FILES[0]]
        assert "not valid JSON" not in error["message"]  # it is valid JSON
    _nothing_kept(client, tenant, settings)


def test_the_pool_import_shares_the_bounds() -> None:
    """contracts/peft.py is the pool's rule too (trainer_core/export.py import_peft_adapter)."""
    problems = config_problems(CONFIG | {"lora_alpha": 5000}, max_rank=16)
    assert [p.field for p in problems] == ["lora_alpha"]
    assert config_problems(CONFIG | {"lora_alpha": 4096, "r": 16}, max_rank=16) == []
