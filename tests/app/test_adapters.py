"""Adapter upload (trainer) and download (users): a real PEFT adapter goes through the
service and comes back loadable by peft."""

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load, load_file, save
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.adapters.models import Adapter
from app.config import Settings
from app.main import create_app
from tests.app.api import POOL_SPEC, WORKER_HEADERS, TenantHandle, create_run, new_tenant, register
from trainer_core.models.tiny import build_model

FILES = ("adapter_config.json", "adapter_model.safetensors")


def tiny_llama():
    return build_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=64, max_position_embeddings=64
    )


@pytest.fixture(scope="module")
def peft_dir(tmp_path_factory) -> Path:
    """A saved PEFT LoRA adapter with non-zero B, so loading it changes the model."""
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param))
    out = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(out)
    return out


def tar_bytes(members: dict[str, bytes], *, compress: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if compress else "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def adapter_tar(directory: Path) -> bytes:
    return tar_bytes({name: (directory / name).read_bytes() for name in FILES})


def upload(client: TestClient, run_id: str, step: int, body: bytes):
    return client.put(
        f"/v1/pool/runs/{run_id}/adapters/{step}",
        content=body,
        headers=WORKER_HEADERS | {"Content-Type": "application/x-tar"},
    )


def test_upload_list_download_and_load_with_peft(
    client: TestClient, tenant: TenantHandle, settings: Settings, peft_dir: Path, tmp_path: Path
) -> None:
    run = create_run(client, tenant)
    weights_sha = hashlib.sha256((peft_dir / FILES[1]).read_bytes()).hexdigest()

    r = upload(client, run["id"], 1, adapter_tar(peft_dir))
    assert r.status_code == 201, r.text
    assert r.json()["sha256"] == weights_sha
    assert r.json()["step"] == 1
    assert r.json()["size_bytes"] == sum((peft_dir / n).stat().st_size for n in FILES)
    stored = settings.runs_dir / run["id"] / "broadcast" / "step_1"
    assert sorted(p.name for p in stored.iterdir()) == sorted(FILES)
    assert (stored / FILES[1]).read_bytes() == (peft_dir / FILES[1]).read_bytes()

    r = client.get(f"/v1/runs/{run['id']}/adapters", headers=tenant.headers)
    assert r.status_code == 200
    [item] = r.json()["items"]
    assert (item["step"], item["sha256"]) == (1, weights_sha)
    assert item["created_at"]

    for step in ("1", "latest"):
        r = client.get(f"/v1/runs/{run['id']}/adapters/{step}", headers=tenant.headers)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/gzip"
        assert r.headers["etag"] == f'"{weights_sha}"'
        assert r.headers["x-adapter-step"] == "1"
    out = tmp_path / "downloaded"
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == sorted(FILES)
        tar.extractall(out, filter="data")

    loaded = PeftModel.from_pretrained(tiny_llama(), out)
    expected = load_file(peft_dir / FILES[1])
    got = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert len(got) == len(expected) > 0
    for key, tensor in expected.items():
        [match] = [v for k, v in got.items() if k.startswith(key.removesuffix(".weight"))]
        torch.testing.assert_close(match, tensor)


def test_etag_and_not_modified(client: TestClient, tenant: TenantHandle, peft_dir: Path) -> None:
    run = create_run(client, tenant)
    assert upload(client, run["id"], 1, adapter_tar(peft_dir)).status_code == 201
    etag = client.get(f"/v1/runs/{run['id']}/adapters/latest", headers=tenant.headers).headers["etag"]

    for value in (etag, f"W/{etag}", f'"other", {etag}', "*"):
        r = client.get(
            f"/v1/runs/{run['id']}/adapters/latest", headers=tenant.headers | {"If-None-Match": value}
        )
        assert r.status_code == 304, value
        assert r.content == b""
        assert r.headers["etag"] == etag
    r = client.get(
        f"/v1/runs/{run['id']}/adapters/latest", headers=tenant.headers | {"If-None-Match": '"stale"'}
    )
    assert r.status_code == 200

    # A newer step changes what "latest" is, so the old ETag no longer matches.
    other = json.loads((peft_dir / FILES[0]).read_text())
    weights = (peft_dir / FILES[1]).read_bytes()
    changed = _reencode_safetensors(weights)
    body = tar_bytes({FILES[0]: json.dumps(other).encode(), FILES[1]: changed})
    assert upload(client, run["id"], 2, body).status_code == 201
    r = client.get(f"/v1/runs/{run['id']}/adapters/latest", headers=tenant.headers | {"If-None-Match": etag})
    assert r.status_code == 200
    assert r.headers["x-adapter-step"] == "2"
    assert r.headers["etag"] == f'"{hashlib.sha256(changed).hexdigest()}"'


def _reencode_safetensors(data: bytes) -> bytes:
    """The same tensors, scaled: a different but valid safetensors file."""
    return save({k: v * 2 for k, v in load(data).items()})


def test_single_files(client: TestClient, tenant: TenantHandle, peft_dir: Path) -> None:
    run = create_run(client, tenant)
    assert upload(client, run["id"], 3, adapter_tar(peft_dir)).status_code == 201
    base = f"/v1/runs/{run['id']}/adapters"

    r = client.get(f"{base}/3/files/adapter_config.json", headers=tenant.headers)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == json.loads((peft_dir / FILES[0]).read_text())
    assert r.headers["x-adapter-step"] == "3"

    r = client.get(f"{base}/latest/files/adapter_model.safetensors", headers=tenant.headers)
    assert r.status_code == 200
    assert r.content == (peft_dir / FILES[1]).read_bytes()
    etag = r.headers["etag"]
    assert etag == f'"{hashlib.sha256(r.content).hexdigest()}"'
    r = client.get(
        f"{base}/latest/files/adapter_model.safetensors", headers=tenant.headers | {"If-None-Match": etag}
    )
    assert r.status_code == 304

    assert client.get(f"{base}/3/files/README.md", headers=tenant.headers).status_code == 404
    assert (
        client.get(f"{base}/3/files/..%2F..%2Fcontrol%2Forch.toml", headers=tenant.headers).status_code == 404
    )


def test_unknown_and_bad_steps_and_other_tenants(
    client: TestClient, tenant: TenantHandle, other_tenant: TenantHandle, peft_dir: Path
) -> None:
    run = create_run(client, tenant)
    base = f"/v1/runs/{run['id']}/adapters"
    r = client.get(f"{base}/latest", headers=tenant.headers)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "adapter_not_found"
    assert upload(client, run["id"], 1, adapter_tar(peft_dir)).status_code == 201

    assert client.get(f"{base}/7", headers=tenant.headers).status_code == 404
    assert client.get(f"{base}/7/files/adapter_config.json", headers=tenant.headers).status_code == 404
    for bad in ("abc", "-1", "1.5", "newest"):
        r = client.get(f"{base}/{bad}", headers=tenant.headers)
        assert r.status_code == 422, bad
        assert r.json()["error"]["code"] == "validation_error"
    for path in (
        base,
        f"{base}/1",
        f"{base}/latest/files/adapter_config.json",
        f"/v1/runs/{run['id']}/metrics",
    ):
        r = client.get(path, headers=other_tenant.headers)
        assert r.status_code == 404, path
    assert client.get(base).status_code == 401
    assert client.get("/v1/runs/run_000000000000/adapters", headers=tenant.headers).status_code == 404


def test_reupload_replaces_the_step(
    client: TestClient, tenant: TenantHandle, peft_dir: Path, db: Session, settings: Settings
) -> None:
    run = create_run(client, tenant)
    assert upload(client, run["id"], 1, adapter_tar(peft_dir)).status_code == 201
    first = client.get(f"/v1/runs/{run['id']}/adapters/1", headers=tenant.headers)

    changed = _reencode_safetensors((peft_dir / FILES[1]).read_bytes())
    body = tar_bytes({FILES[0]: (peft_dir / FILES[0]).read_bytes(), FILES[1]: changed})
    r = upload(client, run["id"], 1, body)  # a restarted trainer trains step 1 again
    assert r.status_code == 201
    assert r.json()["sha256"] == hashlib.sha256(changed).hexdigest()

    assert (
        db.scalars(select(Adapter).where(Adapter.run_id == run["id"])).all()[0].sha256 == r.json()["sha256"]
    )
    db.commit()  # end the read: on SQLite an open transaction holds the write lock
    second = client.get(f"/v1/runs/{run['id']}/adapters/1", headers=tenant.headers)
    assert second.headers["etag"] != first.headers["etag"]
    with tarfile.open(fileobj=io.BytesIO(second.content), mode="r:gz") as tar:
        member = tar.extractfile(FILES[1])
        assert member is not None
        assert member.read() == changed
    assert len(client.get(f"/v1/runs/{run['id']}/adapters", headers=tenant.headers).json()["items"]) == 1
    broadcast = settings.runs_dir / run["id"] / "broadcast"
    assert [p.name for p in broadcast.iterdir()] == ["step_1"]  # no staging or replaced leftovers


def _chained_headers(kind: bytes, count: int = 1000) -> bytes:
    """A tar of `count` GNU longname (L) or pax (x) headers in a row: tarfile reads each by recursing
    into the next member, so this many raise RecursionError (about 400 already do)."""
    payload = (
        b"adapter_config.json\0" if kind == tarfile.GNUTYPE_LONGNAME else b"28 path=adapter_config.json\n"
    )
    info = tarfile.TarInfo("././@LongLink")
    info.type, info.size = kind, len(payload)
    return (info.tobuf(tarfile.USTAR_FORMAT) + payload + b"\0" * (-len(payload) % 512)) * count


def _bad_bodies(peft_dir: Path) -> dict[str, bytes]:
    config = (peft_dir / FILES[0]).read_bytes()
    weights = (peft_dir / FILES[1]).read_bytes()
    good = {FILES[0]: config, FILES[1]: weights}

    symlink = io.BytesIO()
    with tarfile.open(fileobj=symlink, mode="w") as tar:
        info = tarfile.TarInfo(FILES[0])
        info.type = tarfile.SYMTYPE
        info.linkname = "/etc/passwd"
        tar.addfile(info)
        data = tarfile.TarInfo(FILES[1])
        data.size = len(weights)
        tar.addfile(data, io.BytesIO(weights))

    with_dir = io.BytesIO()
    with tarfile.open(fileobj=with_dir, mode="w") as tar:
        d = tarfile.TarInfo("sub")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)

    header_lie = bytearray(weights)
    header_lie[:8] = (10**9).to_bytes(8, "little")
    deep = b"[" * 100_000  # the JSON parser recurses once per level
    return {
        "traversal": tar_bytes({"../" + FILES[0]: config, FILES[1]: weights}),
        "absolute": tar_bytes({"/tmp/" + FILES[0]: config, FILES[1]: weights}),
        "nested": tar_bytes({"x/" + FILES[0]: config, FILES[1]: weights}),
        "extra member": tar_bytes(good | {"README.md": b"hi"}),
        "missing weights": tar_bytes({FILES[0]: config}),
        "duplicate": tar_bytes({FILES[0]: config, "./" + FILES[0]: config, FILES[1]: weights}),
        "bad json": tar_bytes({FILES[0]: b"{not json", FILES[1]: weights}),
        "json not an object": tar_bytes({FILES[0]: b"[1, 2]", FILES[1]: weights}),
        "truncated safetensors": tar_bytes({FILES[0]: config, FILES[1]: weights[:-10]}),
        "safetensors header lies": tar_bytes({FILES[0]: config, FILES[1]: bytes(header_lie)}),
        "not safetensors": tar_bytes({FILES[0]: config, FILES[1]: b"hello world, definitely not tensors"}),
        # Each of these was a 500: RecursionError, or int()'s ValueError past 4300 digits.
        "json nested 100000 deep": tar_bytes({FILES[0]: deep, FILES[1]: weights}),
        "json int of 5000 digits": tar_bytes({FILES[0]: b'{"r": ' + b"1" * 5000 + b"}", FILES[1]: weights}),
        "safetensors header nested 100000 deep": tar_bytes(
            {FILES[0]: config, FILES[1]: len(deep).to_bytes(8, "little") + deep}
        ),
        "chained longname headers": _chained_headers(tarfile.GNUTYPE_LONGNAME),
        "chained pax headers": _chained_headers(tarfile.XHDTYPE),
        "symlink": symlink.getvalue(),
        "directory": with_dir.getvalue(),
        "gzip": tar_bytes(good, compress=True),
        "not a tar": b"just some bytes" * 100,
        "empty": b"",
    }


def test_bad_uploads_are_rejected_and_nothing_is_stored(
    client: TestClient, tenant: TenantHandle, peft_dir: Path, db: Session, settings: Settings
) -> None:
    run = create_run(client, tenant)
    for what, body in _bad_bodies(peft_dir).items():
        r = upload(client, run["id"], 5, body)
        assert r.status_code == 422, (what, r.text)
        assert r.json()["error"]["code"] == "invalid_adapter", what
    assert db.scalars(select(Adapter)).all() == []
    db.commit()  # end the read: on SQLite an open transaction holds the write lock
    broadcast = settings.runs_dir / run["id"] / "broadcast"
    assert list(broadcast.iterdir()) == []  # no step_5, no staging leftovers
    assert client.get(f"/v1/runs/{run['id']}/adapters", headers=tenant.headers).json() == {
        "items": [],
        "next_cursor": None,
    }
    # A "./" prefix, as `tar -C dir .` writes it, is fine.
    ok = tar_bytes({"./" + n: (peft_dir / n).read_bytes() for n in FILES})
    assert upload(client, run["id"], 5, ok).status_code == 201


def _tenant_upload(
    client: TestClient, tenant: TenantHandle, config: dict[str, Any], tensors: dict[str, torch.Tensor]
):
    """POST /v1/adapters: an adapter a tenant uploads, checked against the live pool's model."""
    body = tar_bytes({FILES[0]: json.dumps(config).encode(), FILES[1]: save(tensors)})
    return client.post(
        "/v1/adapters",
        params={"name": "mine"},
        content=body,
        headers=tenant.headers | {"Content-Type": "application/x-tar"},
    )


def test_uploaded_adapter_configs_of_the_wrong_types_are_refused_by_field(
    client: TestClient, tenant: TenantHandle, settings: Settings
) -> None:
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)
    config: dict[str, Any] = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, 4),
    }
    # Some were a 500 (sorting or hashing target_modules, float() of the alpha, int() of the layer),
    # some stored (an alpha of Infinity, sent back as null, or of `true`).
    cases: list[tuple[dict[str, Any], str]] = [
        ({"target_modules": ["q_proj", 1]}, "target_modules"),
        ({"target_modules": [["q_proj"]]}, "target_modules"),
        ({"target_modules": "q_proj"}, "target_modules"),
        ({"lora_alpha": float("inf")}, "lora_alpha"),
        ({"lora_alpha": float("nan")}, "lora_alpha"),
        ({"lora_alpha": 10**400}, "lora_alpha"),
        ({"lora_alpha": True}, "lora_alpha"),
        ({"r": True}, "r"),
        ({"r": "4"}, "r"),
        ({"r": 4.0}, "r"),
    ]
    for change, field in cases:
        r = _tenant_upload(client, tenant, config | change, tensors)
        assert r.status_code == 422, (change, r.text)
        error = r.json()["error"]
        assert error["code"] == "invalid_adapter" and [field] in [d["loc"][1:] for d in error["details"]], (
            error
        )
    layer_of_5000_digits = {"x.layers." + "1" * 5000 + ".self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)}
    r = _tenant_upload(client, tenant, config, layer_of_5000_digits)
    assert r.status_code == 422 and r.json()["error"]["details"][0]["loc"] == ["body", FILES[1]], r.text

    assert client.get("/v1/adapters", headers=tenant.headers).json()["items"] == []
    assert [p.name for p in (settings.data_dir / "adapters").iterdir()] == []
    assert _tenant_upload(client, tenant, config, tensors).status_code == 201


def test_a_tenant_keeps_only_so_many_uploaded_adapters(settings: Settings) -> None:
    """Uploads had no quota (each is kept twice on disk, up to 64 MB): one tenant could fill the disk."""
    with TestClient(create_app(settings.model_copy(update={"tenant_max_adapters": 2}))) as client:
        tenant, other = new_tenant(client), new_tenant(client)
        register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)
        config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
        tensors = {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, 4),
        }
        kept = [_tenant_upload(client, tenant, config, tensors).json()["id"] for _ in range(2)]
        refused = _tenant_upload(client, tenant, config, tensors)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "adapter_quota"
        assert refused.json()["error"]["details"] == {"adapters": 2, "limit": 2}
        assert len(client.get("/v1/adapters", headers=tenant.headers).json()["items"]) == 2
        assert _tenant_upload(client, other, config, tensors).status_code == 201  # per tenant
        assert client.delete(f"/v1/adapters/{kept[0]}", headers=tenant.headers).status_code == 204
        assert _tenant_upload(client, tenant, config, tensors).status_code == 201


def test_oversize_upload(settings: Settings) -> None:
    small = settings.model_copy(update={"max_body_bytes": 4096})
    with TestClient(create_app(small)) as client:
        tenant = new_tenant(client)
        run = create_run(client, tenant)
        body = tar_bytes({FILES[0]: b"{}", FILES[1]: b"\0" * 10_000})
        r = upload(client, run["id"], 1, body)
        assert r.status_code == 413
        assert not (small.runs_dir / run["id"] / "broadcast" / "step_1").exists()


def test_upload_needs_a_trainable_run(client: TestClient, tenant: TenantHandle, peft_dir: Path) -> None:
    body = adapter_tar(peft_dir)
    assert upload(client, "run_000000000000", 1, body).status_code == 404
    assert upload(client, "not-a-run", 1, body).status_code == 404
    assert upload(client, "run_000000000000", -1, body).status_code == 422
    create_run(client, tenant, name="a")
    create_run(client, tenant, name="b")
    queued = create_run(client, tenant, name="c")
    assert queued["status"] == "queued"
    r = upload(client, queued["id"], 1, body)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "run_not_trainable"
