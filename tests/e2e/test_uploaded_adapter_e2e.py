"""Uploaded adapters (POST /v1/adapters) through the real service and a 2-rank pool: checked against the
pool's base model (rank limit, target modules, tensor shapes: a 422 naming what is wrong, nothing
stored), tenant-scoped (another tenant's is a 404, also as init_from), listable, deletable, and a run
with `init_from {adapter_id}` starts from it (1e-6)."""

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from orchestrator import LoraloomClient
from tests.e2e.helpers import (
    download_adapter_tensors,
    extract_adapter,
    kill_pool,
    run_config,
    run_status,
    start_pool,
    synthetic_batch,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only]


def _tar(config: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    files = {"adapter_config.json": json.dumps(config).encode()}
    buf = io.BytesIO()
    path = Path("/tmp") / f"w13-upload-{id(tensors)}.safetensors"
    save_file(tensors, str(path))
    files["adapter_model.safetensors"] = path.read_bytes()
    path.unlink()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _upload(client, body: bytes, name: str = "mine"):
    return client.post(
        "/v1/adapters", params={"name": name}, content=body, headers={"Content-Type": "application/x-tar"}
    )


@pytest.mark.timeout(600)
def test_uploaded_adapter_checked_scoped_and_used_by_init_from(live_service, tmp_path):
    alice = live_service.tenant_client("alice")
    bob = live_service.tenant_client("bob")
    pool = start_pool(live_service.url, data_dir=live_service.data_dir, log_path=tmp_path / "pool.log")
    try:
        # An adapter to upload: a trained run's, exported by the pool (PEFT files).
        src = alice.post("/v1/runs", json={"name": "src", "config": run_config(max_steps=1, seed=5)}).json()[
            "id"
        ]
        alice.post(f"/v1/runs/{src}/batches", json=synthetic_batch(3, n_samples=4)).raise_for_status()
        wait_for(lambda: run_status(alice, src)["status"] == "completed", timeout=240, what="source run")
        peft = extract_adapter(alice, src, 1, tmp_path / "peft")
        config = json.loads((peft / "adapter_config.json").read_text())
        tensors = load_file(str(peft / "adapter_model.safetensors"))

        # Wrong rank, unknown target module, wrong shape: 422 naming it; nothing stored.
        big = {
            k: torch.zeros(16, v.shape[1]) if "lora_A" in k else torch.zeros(v.shape[0], 16)
            for k, v in tensors.items()
        }
        wrong_shape = dict(tensors)
        victim = next(k for k in tensors if "lora_A" in k)
        wrong_shape[victim] = torch.zeros(tensors[victim].shape[0], tensors[victim].shape[1] + 1)
        for body, field, text in (
            (_tar({**config, "r": 16}, big), "r", "rank r=16 is outside [1, 8]"),
            (
                _tar({**config, "target_modules": ["q_proj", "gate_proj"]}, tensors),
                "target_modules",
                "gate_proj",
            ),
            (_tar(config, wrong_shape), "adapter_model.safetensors", victim),
        ):
            r = _upload(alice, body)
            assert r.status_code == 422, r.text
            error = r.json()["error"]
            assert text in error["message"] and any(d["loc"][-1] == field for d in error["details"]), error
        assert alice.get("/v1/adapters").json()["items"] == []
        assert [
            p.name for p in (live_service.data_dir / "adapters").iterdir() if not p.name.startswith(".")
        ] == []

        # A good one, through the SDK: stored once, tenant-scoped.
        key = alice.headers["Authorization"].removeprefix("Bearer ")
        with LoraloomClient(live_service.url, api_key=key) as sdk:
            adapter = sdk.upload_adapter(peft, name="mine")
        assert (adapter["rank"], adapter["target_modules"]) == (config["r"], sorted(config["target_modules"]))
        assert [a["id"] for a in alice.get("/v1/adapters").json()["items"]] == [adapter["id"]]
        assert bob.get(f"/v1/adapters/{adapter['id']}").status_code == 404
        assert bob.delete(f"/v1/adapters/{adapter['id']}").status_code == 404
        assert bob.get("/v1/adapters").json()["items"] == []
        r = bob.post(
            "/v1/runs", json={"name": "x", "config": run_config(), "init_from": {"adapter_id": adapter["id"]}}
        )
        assert r.status_code == 404, r.text

        # A run from it; one step on advantages of 0 leaves it as it started.
        with LoraloomClient(live_service.url, api_key=key) as sdk:
            run_id = sdk.create_run(
                "from-upload", run_config(max_steps=1, seed=77), init_from={"adapter_id": adapter["id"]}
            ).id
        alice.post(
            f"/v1/runs/{run_id}/batches", json=synthetic_batch(9, n_samples=4, advantage_scale=0.0)
        ).raise_for_status()
        wait_for(
            lambda: run_status(alice, run_id)["status"] == "completed", timeout=240, what="run from upload"
        )
    finally:
        kill_pool(pool)
    got = download_adapter_tensors(alice, run_id, 1)
    want = download_adapter_tensors(alice, src, 1)
    assert max(float((got[k] - want[k]).abs().max()) for k in got) <= 1e-6
    assert max(float(v.abs().max()) for k, v in want.items() if "lora_B" in k) > 1e-4

    assert alice.delete(f"/v1/adapters/{adapter['id']}").status_code == 204
    assert alice.get("/v1/adapters").json()["items"] == []
    assert alice.get(f"/v1/adapters/{adapter['id']}").status_code == 404
