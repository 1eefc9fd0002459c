"""Every 422 lists its problems in `details` as `{loc, msg, type}` items (README "Errors"). A probe found
items without `type` (an init_from that does not fit the run's config, refused adapter uploads) and an
upload's `no_pool` 422 with `details: null`. Each refusal here is walked through the API and its
details checked; a scan of app/ keeps new refusals to the shape."""

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save

from app.adapters.models import Adapter
from app.config import Settings
from tests.app.api import POOL_SPEC, TenantHandle, register
from tests.app.factories import committed
from tests.app.test_adapters import FILES, tar_bytes

APP_DIR = Path(__file__).resolve().parents[2] / "app"
TYPE = re.compile(r"[a-z][a-z0-9_]*")
CONFIG: dict[str, Any] = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj"
TENSORS = {f"{Q_PROJ}.lora_A.weight": torch.zeros(4, 32), f"{Q_PROJ}.lora_B.weight": torch.zeros(32, 4)}


def _assert_uniform(r: Any, code: str, kind: str) -> list[dict[str, Any]]:
    """A 422 `code` whose details are a non-empty list of `{loc, msg, type}` items, one of `kind`."""
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == code, error
    details = error["details"]
    assert isinstance(details, list) and details, error
    for item in details:
        assert isinstance(item["loc"], list) and all(isinstance(p, str) for p in item["loc"]), item
        assert item["loc"][0] in ("body", "query"), item
        assert isinstance(item["msg"], str) and item["msg"], item
        assert isinstance(item["type"], str) and TYPE.fullmatch(item["type"]), item
        assert item["msg"] in error["message"], (item, error["message"])
    assert kind in [item["type"] for item in details], details
    return list(details)


def _upload(client: TestClient, tenant: TenantHandle, body: bytes) -> Any:
    return client.post(
        "/v1/adapters",
        params={"name": "mine"},
        content=body,
        headers=tenant.headers | {"Content-Type": "application/x-tar"},
    )


def _adapter(config: dict[str, Any] = CONFIG, tensors: dict[str, torch.Tensor] = TENSORS) -> bytes:
    return tar_bytes({FILES[0]: json.dumps(config).encode(), FILES[1]: save(tensors)})


def _pool(client: TestClient) -> None:
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)


UPLOADS: list[tuple[str, bytes, str, list[str]]] = [
    ("empty-body", b"", "invalid_tar", ["body"]),
    ("not-a-tar", b"x" * 2048, "invalid_tar", ["body"]),
    ("extra-member", tar_bytes({"evil.sh": b"x"}), "invalid_tar", ["body"]),
    ("weights-missing", tar_bytes({FILES[0]: json.dumps(CONFIG).encode()}), "missing_adapter_file", ["body"]),
    (
        "config-not-json",
        tar_bytes({FILES[0]: b"{", FILES[1]: save(TENSORS)}),
        "invalid_json",
        ["body", FILES[0]],
    ),
    (
        "config-integer-too-long",
        tar_bytes({FILES[0]: b'{"r": ' + b"9" * 5000 + b"}", FILES[1]: save(TENSORS)}),
        "integer_too_long",
        ["body", FILES[0]],
    ),
    (
        "config-not-an-object",
        tar_bytes({FILES[0]: b"[]", FILES[1]: save(TENSORS)}),
        "adapter_config_not_object",
        ["body", FILES[0]],
    ),
    (
        "weights-not-safetensors",
        tar_bytes({FILES[0]: json.dumps(CONFIG).encode(), FILES[1]: b"\0" * 4}),
        "invalid_safetensors",
        ["body", FILES[1]],
    ),
    ("rank-over-the-pool", _adapter(CONFIG | {"r": 32}), "adapter_config_invalid", ["body", "r"]),
    (
        "wrong-shape",
        _adapter(tensors=TENSORS | {f"{Q_PROJ}.lora_A.weight": torch.zeros(4, 31)}),
        "adapter_weights_mismatch",
        ["body", FILES[1]],
    ),
    (
        "target-modules-not-the-weights",
        _adapter(CONFIG | {"target_modules": ["k_proj"]}),
        "target_modules_mismatch",
        ["body", "target_modules"],
    ),
    (
        "target-modules-not-adaptable",
        _adapter(CONFIG | {"target_modules": ["gate_proj"]}),
        "target_modules_not_adaptable",
        ["body", "target_modules"],
    ),
    (
        "nan-weights",
        _adapter(tensors=TENSORS | {f"{Q_PROJ}.lora_B.weight": torch.full((32, 4), float("nan"))}),
        "non_finite_tensor",
        ["body", FILES[1]],
    ),
]


@pytest.mark.parametrize("case", UPLOADS, ids=lambda c: c[0])
def test_every_adapter_upload_refusal_lists_loc_msg_type(
    client: TestClient, tenant: TenantHandle, settings: Settings, case: tuple[str, bytes, str, list[str]]
) -> None:
    _, body, kind, loc = case
    _pool(client)
    details = _assert_uniform(_upload(client, tenant, body), "invalid_adapter", kind)
    assert loc in [d["loc"] for d in details if d["type"] == kind], details
    assert client.get("/v1/adapters", headers=tenant.headers).json()["items"] == []


def test_an_upload_without_a_pool_names_the_base_model(client: TestClient, tenant: TenantHandle) -> None:
    details = _assert_uniform(_upload(client, tenant, _adapter()), "no_pool", "no_pool")
    assert details == [{"loc": ["query", "base_model"], "msg": details[0]["msg"], "type": "no_pool"}]
    assert "'loraloom-tiny'" in details[0]["msg"]


def test_an_init_from_that_does_not_fit_lists_each_field(
    client: TestClient, tenant: TenantHandle, settings: Settings
) -> None:
    _pool(client)
    uploaded = _upload(client, tenant, _adapter())
    assert uploaded.status_code == 201, uploaded.text
    source = client.post(
        "/v1/runs", json={"name": "src", "config": {"lora": {"rank": 8}}}, headers=tenant.headers
    )
    assert source.status_code == 201, source.text
    with committed(settings) as db:
        db.add(
            Adapter(
                run_id=source.json()["id"],
                step=1,
                path=f"runs/{source.json()['id']}/broadcast/step_1",
                size_bytes=1,
                sha256="0" * 64,
            )
        )
    mine = {"lora": {"rank": 2, "alpha": 8.0, "target_modules": ["q_proj"]}}
    for init_from, fields in (
        ({"run_id": source.json()["id"]}, {("lora", "rank"), ("lora", "alpha"), ("lora", "target_modules")}),
        ({"adapter_id": uploaded.json()["id"]}, {("lora", "rank")}),
    ):
        r = client.post(
            "/v1/runs", json={"name": "child", "config": mine, "init_from": init_from}, headers=tenant.headers
        )
        details = _assert_uniform(r, "validation_error", "init_from_mismatch")
        assert {tuple(d["loc"]) for d in details} == {("body", "config", *f) for f in fields}, details
        assert all(d["type"] == "init_from_mismatch" for d in details)


# --------------------------------------------------------------------------- the source, scanned


def _calls_named(tree: ast.AST, name: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) == name or getattr(node.func, "attr", None) == name)
    ]


def test_every_problem_item_in_app_names_loc_msg_and_type() -> None:
    """A dict literal with a `loc` (a problem item) has `msg` and `type` too."""
    missing = []
    for path in sorted(APP_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                keys = {
                    k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)
                }
                if "loc" in keys and not {"msg", "type"} <= keys:
                    missing.append(f"{path.relative_to(APP_DIR.parent)}:{node.lineno} {sorted(keys)}")
    assert missing == []


def test_every_validation_failure_names_its_field() -> None:
    """Every `ValidationFailed(...)` passes `details` naming its field (the `no_pool` 422 had null,
    the Tinker API's had null too). `AppError` gives a 422 without details one item naming the body;
    this keeps each raise precise."""
    missing = []
    for path in sorted(APP_DIR.rglob("*.py")):
        for call in _calls_named(ast.parse(path.read_text()), "ValidationFailed"):
            if not any(kw.arg == "details" for kw in call.keywords):
                missing.append(f"{path.relative_to(APP_DIR.parent)}:{call.lineno}")
    assert missing == []
