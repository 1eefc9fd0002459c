"""Uploaded adapters (POST /v1/adapters) a hostile tenant could use to fill the disk or poison a run:
the bytes a tenant's uploads take on disk are bounded (`Settings.tenant_max_adapter_bytes`), and
weights holding NaN or ±inf, or a layer with one LoRA factor and not the other, are refused up front
(the pool refused the latter only when a run started from the adapter). Nothing of a refused upload
is kept."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from sqlalchemy import text

from app import migrate
from app.adapters import upload as upload_module
from app.adapters import uploads
from app.adapters.upload import nonfinite_tensors
from app.config import Settings
from app.db import make_engine
from app.main import create_app
from contracts.peft import FLOAT_DTYPES
from tests import common
from tests.app.api import POOL_SPEC, TenantHandle, new_tenant, register
from tests.app.test_adapters import FILES, _tenant_upload
from trainer_core.export import export_peft_adapter, import_peft_adapter
from trainer_core.init_from import module_shapes
from trainer_core.lora import apply_multi_lora
from trainer_core.models.tiny import build_model

MIB = 1024 * 1024
CONFIG: dict[str, Any] = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
Q_PROJ = "base_model.model.model.layers.{layer}.self_attn.q_proj"


def _upload(client: TestClient, tenant: TenantHandle, tensors: dict[str, torch.Tensor], config=CONFIG) -> Any:
    return _tenant_upload(client, tenant, config, {name: t.clone() for name, t in tensors.items()})


def _pair(layer: int = 0, *, rank: int = 4, dims: int = 32, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """q_proj's lora_A (r x in) and lora_B (out x r) in `layer`, random (so their tar.gz barely shrinks)."""
    module = Q_PROJ.format(layer=layer)
    return {
        f"{module}.lora_A.weight": torch.randn(rank, dims).to(dtype),
        f"{module}.lora_B.weight": torch.randn(dims, rank).to(dtype),
    }


def _kept_on_disk(settings: Settings) -> dict[str, int]:
    """Adapter directory → the bytes of its files; staging leftovers included (named `.upload_…`)."""
    root = settings.data_dir / "adapters"
    return (
        {d.name: sum(f.stat().st_size for f in d.iterdir()) for d in root.iterdir()} if root.exists() else {}
    )


@pytest.fixture
def pool_of_32(client: TestClient) -> None:
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)


# --- bytes on disk -----------------------------------------------------------------------------------


def test_a_tenants_uploads_are_bounded_in_bytes_on_disk(settings: Settings) -> None:
    bounded = settings.model_copy(update={"tenant_max_adapter_bytes": MIB})
    with TestClient(create_app(bounded)) as client:
        tenant, other = new_tenant(client), new_tenant(client)
        register(client, module_shapes={m: [768, 768] for m in POOL_SPEC["target_modules"]}, num_layers=2)
        config = CONFIG | {"r": 16}
        big = _pair(0, rank=16, dims=768) | _pair(1, rank=16, dims=768)  # ~190 KB of files, ~380 KB kept
        kept = [_upload(client, tenant, big, config) for _ in range(2)]
        assert [r.status_code for r in kept] == [201, 201], kept[-1].text
        on_disk = _kept_on_disk(bounded)
        assert set(on_disk) == {r.json()["id"] for r in kept}

        refused = _upload(client, tenant, big, config)
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "adapter_quota"
        assert error["details"]["bytes"] == sum(on_disk.values())  # what the kept uploads take, measured
        assert error["details"]["limit_bytes"] == MIB
        assert error["details"]["bytes"] + error["details"]["upload_bytes"] > MIB
        assert str(MIB) in error["message"] and str(sum(on_disk.values())) in error["message"]
        assert _kept_on_disk(bounded) == on_disk  # nothing of it kept, no staging left behind
        assert len(client.get("/v1/adapters", headers=tenant.headers).json()["items"]) == 2

        small = _upload(client, tenant, _pair(rank=1, dims=768), CONFIG | {"r": 1})
        assert small.status_code == 201, small.text  # a small one still fits
        assert _upload(client, other, big, config).status_code == 201  # per tenant
        assert (
            client.delete(f"/v1/adapters/{kept[0].json()['id']}", headers=tenant.headers).status_code == 204
        )
        assert _upload(client, tenant, big, config).status_code == 201


def test_a_tenant_at_its_byte_bound_is_refused_before_the_body_is_read(settings: Settings) -> None:
    """Kept bytes at or past the bound (the operator lowered it): 409 before the tar is unpacked, so
    even a malformed body gets the quota answer, not a 422."""
    with TestClient(create_app(settings)) as client:
        tenant = new_tenant(client)
        register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)
        stored = _upload(client, tenant, _pair())
        assert stored.status_code == 201, stored.text
    used = sum(_kept_on_disk(settings).values())
    lowered = settings.model_copy(update={"tenant_max_adapter_bytes": used})
    with TestClient(create_app(lowered)) as client:
        refused = client.post(
            "/v1/adapters",
            content=b"not a tar",
            headers=tenant.headers | {"Content-Type": "application/x-tar"},
        )
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["details"] == {"bytes": used, "limit_bytes": used}


# --- weights -----------------------------------------------------------------------------------------


NONFINITE = [
    pytest.param(dtype, bad, id=f"{str(dtype).removeprefix('torch.')}-{bad}")
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e5m2)
    for bad in (float("nan"), float("inf"), float("-inf"))
] + [pytest.param(torch.float8_e4m3fn, float("nan"), id="float8_e4m3fn-nan")]
"""Every float dtype's NaN and infinities; e4m3fn has no infinity (torch saturates ±inf to ±448)."""


@pytest.mark.parametrize(("dtype", "bad"), NONFINITE)
def test_weights_holding_nan_or_infinity_are_refused_naming_the_tensor(
    client: TestClient, tenant: TenantHandle, settings: Settings, pool_of_32: None, dtype, bad: float
) -> None:
    tensors = _pair() | _pair(1)
    poisoned = f"{Q_PROJ.format(layer=1)}.lora_B.weight"
    tensors = {name: t.to(dtype) for name, t in tensors.items()}
    tensors[poisoned][17, 2] = bad
    r = _upload(client, tenant, tensors)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_adapter" and poisoned in error["message"], error
    assert [d["loc"] for d in error["details"]] == [["body", FILES[1]]], error
    assert _kept_on_disk(settings) == {}


def test_no_transaction_is_held_while_the_weights_are_scanned(
    app: FastAPI,
    client: TestClient,
    tenant: TenantHandle,
    pool_of_32: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scan reads every weight (up to max_body_bytes): the pool's read has ended before it, so
    no connection, and on SQLite no write lock, is held meanwhile (review: it was)."""
    real = nonfinite_tensors
    in_transaction: list[bool] = []

    def watched(weights: Path) -> list[str]:
        # The upload's session is the request's: find it through the pool of checked-out connections.
        in_transaction.append(app.state.engine.pool.checkedout() > 0)
        return real(weights)

    monkeypatch.setattr(uploads, "nonfinite_tensors", watched)
    assert _upload(client, tenant, _pair()).status_code == 201
    assert in_transaction == [False]


def test_weights_that_are_not_floats_are_refused_naming_the_tensor(
    client: TestClient, tenant: TenantHandle, settings: Settings, pool_of_32: None
) -> None:
    """Integer and boolean factors were kept (the pool loads floats only, and refused them later)."""
    for dtype in (torch.int32, torch.int8, torch.bool):
        tensors = _pair()
        cast = f"{Q_PROJ.format(layer=0)}.lora_A.weight"
        tensors[cast] = tensors[cast].to(dtype)
        r = _upload(client, tenant, tensors)
        assert r.status_code == 422, (dtype, r.text)
        error = r.json()["error"]
        assert (
            error["code"] == "invalid_adapter"
            and cast in error["message"]
            and "floating point" in error["message"]
        )
        assert _kept_on_disk(settings) == {}


def test_finite_extremes_are_kept(client: TestClient, tenant: TenantHandle, pool_of_32: None) -> None:
    """The largest finite values and the subnormals of each dtype are weights, not NaN or inf."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float8_e5m2, torch.float8_e4m3fn):
        info = torch.finfo(dtype)
        tensors = {name: torch.full(t.shape, info.max).to(dtype) for name, t in _pair().items()}
        next(iter(tensors.values()))[0, :3] = torch.tensor([-info.max, info.tiny, -info.smallest_normal / 2])
        r = _upload(client, tenant, tensors)
        assert r.status_code == 201, (dtype, r.text)


# --- LoRA factors ------------------------------------------------------------------------------------


def test_a_layer_with_one_factor_is_refused_naming_the_layer(
    client: TestClient, tenant: TenantHandle, settings: Settings, pool_of_32: None
) -> None:
    layer = Q_PROJ.format(layer=1)
    a_only = _pair() | {f"{layer}.lora_A.weight": torch.randn(4, 32)}
    b_only = _pair() | {f"{layer}.lora_B.weight": torch.randn(32, 4)}
    # (A factor with and without `.weight`, counted twice here once, is refused by its name now:
    # test_tensor_names_the_pool_refuses_are_refused_naming_them.)
    for tensors, named, found in (
        (a_only, layer, "['lora_A']"),
        (b_only, layer, "['lora_B']"),
    ):
        r = _upload(client, tenant, tensors)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_adapter", error
        assert f"layer {named!r} has {found}" in error["message"], error
    assert _kept_on_disk(settings) == {}
    assert _upload(client, tenant, _pair() | _pair(1)).status_code == 201


def test_factors_whose_shapes_disagree_are_refused_naming_them(
    client: TestClient, tenant: TenantHandle, settings: Settings, pool_of_32: None
) -> None:
    """A is r x in and B out x r, with the config's r: each is checked against r and the module's
    dimensions, so a pair that passes agrees with itself."""
    layer = Q_PROJ.format(layer=0)
    cases = {
        "B's rank is not A's": {
            f"{layer}.lora_A.weight": torch.randn(4, 32),
            f"{layer}.lora_B.weight": torch.randn(32, 2),
        },
        "both of another rank": {
            f"{layer}.lora_A.weight": torch.randn(2, 32),
            f"{layer}.lora_B.weight": torch.randn(32, 2),
        },
        "A transposed": {
            f"{layer}.lora_A.weight": torch.randn(32, 4),
            f"{layer}.lora_B.weight": torch.randn(32, 4),
        },
    }
    for what, tensors in cases.items():
        r = _upload(client, tenant, tensors)
        assert r.status_code == 422, (what, r.text)
        assert layer in r.json()["error"]["message"] and "(r=4)" in r.json()["error"]["message"], (
            what,
            r.text,
        )
    assert _kept_on_disk(settings) == {}


# --- the pool's import rules (contracts/peft.py) ----------------------------------------------------


def _renamed(tensors: dict[str, torch.Tensor], rename: Callable[[str], str]) -> dict[str, torch.Tensor]:
    return {rename(name): t for name, t in tensors.items()}


@pytest.mark.parametrize(
    "rename",
    [
        pytest.param(lambda n: n.removeprefix("base_model.model."), id="no-peft-prefix"),
        pytest.param(lambda n: "transformer." + n.removeprefix("base_model."), id="another-prefix"),
        pytest.param(lambda n: n.removesuffix(".weight"), id="no-weight-suffix"),
        pytest.param(lambda n: n.replace(".weight", ".default.weight"), id="peft-adapter-name-kept"),
    ],
)
def test_tensor_names_the_pool_refuses_are_refused_naming_them(
    client: TestClient,
    tenant: TenantHandle,
    settings: Settings,
    pool_of_32: None,
    rename: Callable[[str], str],
) -> None:
    """The upload took any prefix before `layers.N` and factors without `.weight`; the pool's import
    (trainer_core/export.py) refuses both, so a run started from such an adapter was evicted."""
    layer_1 = _pair(1)
    tensors = _pair() | _renamed(layer_1, rename)  # both factors renamed: they still pair
    r = _upload(client, tenant, tensors)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_adapter", error
    for name in layer_1:
        assert f"unexpected tensor {rename(name)!r}" in error["message"], error
    assert [d["loc"] for d in error["details"]] == [["body", FILES[1]]] * 2, error
    assert _kept_on_disk(settings) == {}
    assert client.get("/v1/adapters", headers=tenant.headers).json()["items"] == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"use_rslora": True}, "use_rslora"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "lora_only"}, "bias"),
        ({"lora_dropout": 1.5}, "lora_dropout"),
        ({"lora_dropout": "0.1"}, "lora_dropout"),
    ],
)
def test_config_features_the_pool_refuses_are_refused_by_field(
    client: TestClient,
    tenant: TenantHandle,
    settings: Settings,
    pool_of_32: None,
    change: dict[str, Any],
    field: str,
) -> None:
    """Settings a slot cannot represent (DoRA, per-module ranks, ...) were kept; the pool refused them."""
    r = _upload(client, tenant, _pair() | _pair(1), config=CONFIG | change)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_adapter" and [d["loc"] for d in error["details"]] == [["body", field]], (
        error
    )
    assert _kept_on_disk(settings) == {}
    # PEFT writes the defaults of those settings: they pass.
    defaults = {
        "use_dora": False,
        "rank_pattern": {},
        "modules_to_save": None,
        "bias": "none",
        "lora_dropout": 0.05,
    }
    assert _upload(client, tenant, _pair() | _pair(1), config=CONFIG | defaults).status_code == 201


def _adapter_dir(path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    (path / FILES[0]).write_text(json.dumps(config))
    save_file({name: t.clone() for name, t in tensors.items()}, path / FILES[1])  # none share memory
    return path


def test_the_upload_and_the_pools_import_agree(
    client: TestClient, tenant: TenantHandle, settings: Settings, tmp_path: Path
) -> None:
    """Each adapter a real pool's import (trainer_core/export.py) refuses is refused at the upload,
    and each it loads is kept: the two share their rules (contracts/peft.py). Two kinds the service
    cannot know are left to the pool, named below."""
    targets = POOL_SPEC["target_modules"]
    handle = apply_multi_lora(build_model("llama", seed=0), targets, n_slots=2, max_rank=8)
    register(client, module_shapes=module_shapes(handle), num_layers=2, max_rank=8)
    handle.configure_slot(0, rank=4, alpha=8.0)
    exported = export_peft_adapter(handle, 0, tmp_path / "exported", base_model_name_or_path="tiny")
    config = json.loads((exported / FILES[0]).read_text())
    tensors = load_file(exported / FILES[1])
    q0 = "base_model.model.model.layers.0.self_attn.q_proj"

    def without(name: str) -> dict[str, torch.Tensor]:
        return {k: v for k, v in tensors.items() if k != name}

    cases: dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {
        "as exported": (config, tensors),
        "rank above max_rank": (config | {"r": 9}, tensors),
        "dora": (config | {"use_dora": True}, tensors),
        "dropout of 1": (config | {"lora_dropout": 1.0}, tensors),
        "no peft prefix": (config, {k.removeprefix("base_model.model."): v for k, v in tensors.items()}),
        "no .weight": (config, {k.removesuffix(".weight"): v for k, v in tensors.items()}),
        "one factor": (config, without(f"{q0}.lora_B.weight")),
        "a module the model lacks": (
            config,
            tensors | {k.replace("q_proj", "qkv_proj"): v for k, v in tensors.items() if "q_proj" in k},
        ),
        "a layer the model lacks": (
            config,
            tensors
            | {k.replace("layers.0.", "layers.2."): v for k, v in tensors.items() if "layers.0." in k},
        ),
        "integer factors": (config, tensors | {f"{q0}.lora_A.weight": tensors[f"{q0}.lora_A.weight"].int()}),
        "transposed": (
            config,
            tensors | {f"{q0}.lora_A.weight": tensors[f"{q0}.lora_A.weight"].T.contiguous()},
        ),
        "rank other than r": (config | {"r": 2}, tensors),
    }
    # What only the pool can tell: the full path of a module (the service knows the module types and
    # the number of layers the pool registered, not the parents of the layers) and, the pool's import
    # being strict, a wrapped module the adapter lacks.
    pool_only: dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {
        "layers under another parent": (
            config,
            {k.replace(".model.model.", ".model.decoder."): v for k, v in tensors.items()},
        ),
        "a wrapped module lacking": (
            config,
            {k: v for k, v in tensors.items() if "layers.1.self_attn.k_proj" not in k},
        ),
    }
    for what, (cfg, weights) in (cases | pool_only).items():
        directory = _adapter_dir(tmp_path / what.replace(" ", "-"), cfg, weights)
        try:
            import_peft_adapter(handle, 1, directory)
            pool_error = None
        except ValueError as exc:
            pool_error = str(exc)
        upload = _upload(client, tenant, weights, config=cfg)
        if what in pool_only:
            assert pool_error is not None and upload.status_code == 201, (what, upload.text)
        elif pool_error is None:
            assert upload.status_code == 201, (what, upload.text)
        else:
            assert upload.status_code == 422, (what, pool_error, upload.text)


def test_every_dtype_the_pool_loads_is_scanned_for_nan() -> None:
    assert frozenset(upload_module._NONFINITE_BITS) == FLOAT_DTYPES


# --- migration ---------------------------------------------------------------------------------------


def test_uploads_kept_before_the_upgrade_count_twice_their_files(tmp_path: Path) -> None:
    """Migration 0014 adds `stored_bytes`: an adapter uploaded before it counts its files twice (the files
    and their tar.gz, of weights that barely compress), not 0, which would exempt it from the bound."""
    url = (
        common.create_postgres_database()
        if common.backend_under_test() == "postgres"
        else f"sqlite:///{tmp_path / 'up.db'}"
    )
    try:
        migrate.upgrade(url, "0013")
        engine = make_engine(url)
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO tenants (id, name, max_concurrent_runs, created_at) "
                    "VALUES ('t', 't', 4, CURRENT_TIMESTAMP)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO tenant_adapters (id, tenant_id, name, base_model, rank, alpha, target_modules, "
                    "size_bytes, sha256, created_at) VALUES ('adp_1', 't', 'a', 'b', 4, 8.0, '[]', 1000, 'x', "
                    "CURRENT_TIMESTAMP)"
                )
            )
        migrate.upgrade(url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT stored_bytes FROM tenant_adapters")).scalar_one() == 2000
        engine.dispose()
    finally:
        if url.startswith("postgresql"):
            common.drop_postgres_database(url)


def test_the_byte_bound_is_read_from_the_environment_and_checked(monkeypatch, tmp_path) -> None:
    name = "LORALOOM_TENANT_MAX_ADAPTER_BYTES"
    assert Settings(data_dir=tmp_path).tenant_max_adapter_bytes == 4 * 1024**3
    monkeypatch.setenv(name, str(64 * MIB))
    assert Settings(data_dir=tmp_path).tenant_max_adapter_bytes == 64 * MIB
    monkeypatch.setenv(name, str(MIB - 1))
    with pytest.raises(ValidationError, match="tenant_max_adapter_bytes"):
        Settings(data_dir=tmp_path)
