"""A Python client generated with openapi-python-client from the live /openapi.json drives the tenant
lifecycle, as a user would meet it: typed models in, typed models out, every error a parsed `Error`.

Every client is made with `raise_on_unexpected_status=True`, so a status the document does not
declare for an operation fails the test (the generated code raises `UnexpectedStatus`). The pool's
side (claim, step report, adapter upload) is played over plain HTTP, as the other app tests do.
"""

import hashlib
import importlib
import io
import json
import os
import subprocess
import sys
import tarfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from safetensors.numpy import save

from app.config import Settings
from app.main import create_app
from tests.app.api import WORKER_HEADERS, LiveServer, claim, register
from tests.common import ADMIN_KEY

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "docs" / "clients" / "openapi-python-client.yaml"
MAX_BODY_BYTES = 64 * 1024

Generator = Callable[[dict[str, Any]], ModuleType]


@pytest.fixture(scope="session")
def generate_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Generator]:
    """Generates (once per document per test session) and imports `loraloom_client`."""
    made: dict[str, ModuleType] = {}
    bin_dir = Path(sys.executable).parent

    def generate(document: dict[str, Any]) -> ModuleType:
        key = hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()
        if key in made:
            return made[key]
        assert not made, "one document per session: the package name is fixed"
        out = tmp_path_factory.mktemp("client")
        spec = out / "openapi.json"
        spec.write_text(json.dumps(document))
        subprocess.run(
            [
                str(bin_dir / "openapi-python-client"),
                "generate",
                "--path",
                str(spec),
                "--config",
                str(CONFIG),
                "--meta",
                "none",
                "--output-path",
                str(out / "loraloom_client"),
            ],
            check=True,
            capture_output=True,
            env=os.environ | {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"},
            timeout=300,
        )
        sys.path.insert(0, str(out))
        made[key] = importlib.import_module("loraloom_client")
        return made[key]

    yield generate
    for name in [m for m in sys.modules if m == "loraloom_client" or m.startswith("loraloom_client.")]:
        del sys.modules[name]


@pytest.fixture
def small_body_app(settings: Settings) -> FastAPI:
    # A small body limit, so a 413 costs a small request.
    # And at most two unclaimed batches per run, so a 429 costs a third one.
    return create_app(
        settings.model_copy(update={"max_body_bytes": MAX_BODY_BYTES, "run_max_pending_batches": 2})
    )


@pytest.fixture
def server(small_body_app: FastAPI) -> Iterator[LiveServer]:
    with LiveServer(small_body_app) as live:
        yield live


def _imp(package: ModuleType, name: str) -> Any:
    return importlib.import_module(f"{package.__name__}.{name}")


def _adapter_tar() -> bytes:
    """A well-formed PEFT adapter directory as the pool uploads it (uncompressed tar)."""
    members = {
        "adapter_config.json": json.dumps({"peft_type": "LORA", "r": 4}).encode(),
        "adapter_model.safetensors": save({"lora_A.weight": np.zeros((4, 8), dtype=np.float32)}),
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_generated_client_drives_the_tenant_lifecycle(server: LiveServer, generate_client: Generator) -> None:
    document = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    lc = generate_client(document)
    m = _imp(lc, "models")
    names = ("tenants", "runs", "batches", "adapters", "metrics")
    tenants, runs, batches, adapters, metrics_api = (_imp(lc, f"api.{name}") for name in names)
    for mod, ops in (
        (tenants, ("create_tenant", "create_api_key", "list_tenants")),
        (runs, ("create_run", "list_runs", "get_run", "evict_run", "delete_run")),
        (batches, ("submit_batch", "list_batches")),
        (adapters, ("download_adapter", "list_adapters")),
        (metrics_api, ("get_metrics",)),
    ):
        for op in ops:
            setattr(mod, op, _imp(mod, op))

    def client(token: str) -> Any:
        return lc.AuthenticatedClient(base_url=server.url, token=token, raise_on_unexpected_status=True)

    def error(response: Any, status: int, code: str) -> None:
        assert response.status_code == status, response.content
        assert isinstance(response.parsed, m.Error), response.parsed
        assert response.parsed.error.code == m.ErrorCode(code)
        assert response.parsed.error.message

    # --- the admin makes a tenant and its key
    admin = client(ADMIN_KEY)
    r = tenants.create_tenant.sync_detailed(
        client=admin, body=m.TenantCreate(name=f"t-{uuid.uuid4().hex[:8]}", max_concurrent_runs=2)
    )
    assert r.status_code == 201 and isinstance(r.parsed, m.TenantOut)
    tenant_id = r.parsed.id
    r = tenants.create_api_key.sync_detailed(tenant_id, client=admin)
    assert r.status_code == 201 and isinstance(r.parsed, m.ApiKeyCreated)
    me = client(r.parsed.key)

    # --- runs, listed a page at a time
    config = m.RunConfig(max_steps=5, batch_size=2, lora=m.LoraSettings(rank=4))
    made = []
    for name in ("a", "b", "c"):
        r = runs.create_run.sync_detailed(client=me, body=m.RunCreate(name=name, config=config))
        assert r.status_code == 201 and isinstance(r.parsed, m.RunOut)
        made.append(r.parsed)
    assert [run.status for run in made] == [m.RunStatus.ACTIVE, m.RunStatus.ACTIVE, m.RunStatus.QUEUED]
    run_id = made[0].id
    first = runs.list_runs.sync(client=me, limit=2)
    assert isinstance(first, m.RunList) and len(first.items) == 2 and isinstance(first.next_cursor, str)
    rest = runs.list_runs.sync(client=me, limit=2, cursor=first.next_cursor)
    assert isinstance(rest, m.RunList) and rest.next_cursor is None
    assert {run.id for run in first.items + rest.items} == {run.id for run in made}

    # --- rollout batches (JSON), listed with an opaque cursor
    def sample(seed: int) -> Any:
        return m.TrainingSample(
            prompt_ids=[1, 2, 3],
            prompt_mask=[True, True, True],
            completion_ids=[4 + seed, 5],
            completion_mask=[True, True],
            completion_logprobs=[-0.5, -0.25],
            advantage=1.0 - seed,
        )

    for step in (0, 1):
        r = batches.submit_batch.sync_detailed(
            run_id, client=me, body=m.TrainingBatch(examples=[sample(0), sample(1)], step=step)
        )
        assert r.status_code == 201 and isinstance(r.parsed, m.BatchOut), r.content
    third = m.TrainingBatch(examples=[sample(0)], step=1)
    limited = batches.submit_batch.sync_detailed(run_id, client=me, body=third)
    error(limited, 429, "rate_limited")
    assert int(limited.headers["retry-after"]) >= 1
    page = batches.list_batches.sync(run_id, client=me, limit=1)
    assert isinstance(page, m.BatchPage) and isinstance(page.next_cursor, str)
    assert not page.next_cursor.isdigit()  # opaque, like the runs cursor
    page2 = batches.list_batches.sync(run_id, client=me, limit=1, cursor=page.next_cursor)
    assert isinstance(page2, m.BatchPage) and page2.items[0].id > page.items[0].id

    # --- one pool step (the pool's side over plain HTTP): claim, report, upload the adapter
    with httpx.Client(base_url=server.url, timeout=30) as pool:
        pool_id = register(pool)
        claimed = claim(pool, pool_id)
        assert {b["run_id"] for b in claimed["batches"]} == {run_id}
        step_report = {"step": 1, "total_tokens": 10, "total_samples": 2, "metrics": {"loss": 0.5}}
        r = pool.post(f"/v1/pool/runs/{run_id}/steps", json=step_report, headers=WORKER_HEADERS)
        assert r.status_code == 200, r.text
        r = pool.put(
            f"/v1/pool/runs/{run_id}/adapters/1",
            content=_adapter_tar(),
            headers=WORKER_HEADERS | {"Content-Type": "application/x-tar"},
        )
        assert r.status_code == 201, r.text

    metrics = metrics_api.get_metrics.sync(run_id, client=me)
    assert isinstance(metrics, m.MetricsList)
    # Rollout steps with no trained step yet (the batch's step 0) are listed too, without a loss.
    assert [(i.step, i.loss) for i in metrics.items if i.loss is not None] == [(1, 0.5)]
    r = adapters.download_adapter.sync_detailed(run_id, "latest", client=me)
    assert r.status_code == 200 and isinstance(r.parsed, lc.types.File)
    with tarfile.open(fileobj=io.BytesIO(r.parsed.payload.read()), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]
    etag = r.headers["ETag"]
    files = _imp(adapters, "download_adapter_file")
    for file_name in m.DownloadAdapterFileName:
        r = files.sync_detailed(run_id, "latest", file_name, client=me)
        assert r.status_code == 200 and isinstance(r.parsed, lc.types.File)
        assert r.parsed.payload.read()
    config_bytes = files.sync(run_id, "1", m.DownloadAdapterFileName("adapter_config.json"), client=me)
    assert json.loads(config_bytes.payload.read())["peft_type"] == "LORA"
    r = adapters.download_adapter.sync_detailed(run_id, "1", client=me, if_none_match=etag)
    assert r.status_code == 304 and r.content == b""

    # --- every error a parsed Error with its code
    error(runs.get_run.sync_detailed(run_id, client=client("llk_not-a-key")), 401, "unauthorized")
    error(tenants.list_tenants.sync_detailed(client=me), 403, "forbidden")
    error(runs.get_run.sync_detailed("run_000000000000", client=me), 404, "not_found")
    error(adapters.download_adapter.sync_detailed(run_id, "7", client=me), 404, "adapter_not_found")
    bad = m.RunCreate(name="bad", config=m.RunConfig(lora=m.LoraSettings(rank=0)))
    error(runs.create_run.sync_detailed(client=me, body=bad), 422, "validation_error")
    broken = m.TrainingBatch(examples=[sample(0)], temperature=-1.0)
    error(batches.submit_batch.sync_detailed(run_id, client=me, body=broken), 422, "validation_error")
    error(runs.list_runs.sync_detailed(client=me, cursor="not-a-cursor"), 422, "validation_error")
    big = m.RunCreate(
        name="big", config=m.RunConfig(metadata=m.RunConfigMetadata.from_dict({"x": "y" * MAX_BODY_BYTES}))
    )
    error(runs.create_run.sync_detailed(client=me, body=big), 413, "payload_too_large")

    # --- evict, then delete
    r = runs.evict_run.sync_detailed(run_id, client=me, body=m.EvictRequest(reason="done"))
    assert r.status_code == 200 and isinstance(r.parsed, m.RunOut) and r.parsed.status == m.RunStatus.EVICTED
    error(
        batches.submit_batch.sync_detailed(
            run_id, client=me, body=m.TrainingBatch(examples=[sample(0)], step=1)
        ),
        409,
        "run_evicted",
    )
    error(
        runs.evict_run.sync_detailed(run_id, client=me, body=m.EvictRequest(reason="again")),
        409,
        "invalid_transition",
    )
    r = runs.delete_run.sync_detailed(run_id, client=me)
    assert r.status_code == 200 and isinstance(r.parsed, m.RunOut) and r.parsed.status == m.RunStatus.DELETED
    gone = runs.get_run.sync(run_id, client=me)
    assert isinstance(gone, m.RunOut) and gone.status == m.RunStatus.DELETED
