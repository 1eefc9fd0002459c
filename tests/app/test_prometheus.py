"""GET /metrics: parses as Prometheus text, has every family, its counters follow a scripted
workload; labels stay bounded; the optional token; several uvicorn workers (multiprocess mode)."""

import os
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from app.config import Settings
from app.main import create_app
from loraloom.launch import start_service_process
from tests.app.api import (
    WORKER_HEADERS,
    TenantHandle,
    claim,
    create_run,
    post_batch,
    register,
    rewarded_batch,
)
from tests.app.factories import Seeded

FAMILIES = {
    "loraloom_http_requests",
    "loraloom_http_request_duration_seconds",
    "loraloom_database_up",
    "loraloom_runs",
    "loraloom_runs_created",
    "loraloom_batches_ingested",
    "loraloom_batch_bytes_ingested",
    "loraloom_steps_trained",
    "loraloom_batches_queued",
    "loraloom_pool_slots_used",
    "loraloom_pool_slots_free",
    "loraloom_pool_up",
    "loraloom_pool_heartbeat_age_seconds",
    "loraloom_pool_tokens_per_second",
    "loraloom_pool_step_seconds",
    "loraloom_pool_pack_efficiency",
    "loraloom_pool_mfu",
}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(
    client: TestClient | httpx.Client, headers: dict[str, str] | None = None
) -> tuple[set[str], Samples]:
    r = client.get("/metrics", headers=headers or {})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    families = list(text_string_to_metric_families(r.text))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    return {f.name for f in families}, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_families_and_counters_follow_a_workload(client: TestClient, tenant: TenantHandle) -> None:
    names, before = scrape(client)
    assert names >= FAMILIES, FAMILIES - names
    pool_id = register(client)
    run = create_run(client, tenant, max_steps=10)
    seeded = Seeded(tenant_id=tenant.id, secret=tenant.key, run_id=run["id"])
    for _ in range(3):
        r = post_batch(client, seeded, rewarded_batch([1.0, 0.0], step=0))
        assert r.status_code == 201, r.text
    claim(client, pool_id, max_batches=1)
    report = {
        "step": 1,
        "total_tokens": 20,
        "total_samples": 2,
        "metrics": {"loss": 0.5, "step_time_s": 0.25, "tokens_per_s": 80.0, "pack_efficiency": 0.75},
    }
    assert (
        client.post(f"/v1/pool/runs/{run['id']}/steps", json=report, headers=WORKER_HEADERS).status_code
        == 200
    )

    _, after = scrape(client)
    assert value(after, "loraloom_runs_created_total") == value(before, "loraloom_runs_created_total") + 1
    assert (
        value(after, "loraloom_batches_ingested_total")
        == value(before, "loraloom_batches_ingested_total") + 3
    )
    assert value(after, "loraloom_batch_bytes_ingested_total") > value(
        before, "loraloom_batch_bytes_ingested_total"
    )
    assert value(after, "loraloom_steps_trained_total") == value(before, "loraloom_steps_trained_total") + 1
    assert value(after, "loraloom_runs", state="active") == 1
    model = "loraloom-tiny"
    assert value(after, "loraloom_batches_queued", base_model=model, state="pending") == 2
    assert value(after, "loraloom_batches_queued", base_model=model, state="claimed") == 1
    assert value(after, "loraloom_pool_slots_used", base_model=model, pool=pool_id) == 1
    assert value(after, "loraloom_pool_slots_free", base_model=model, pool=pool_id) == 1
    assert value(after, "loraloom_pool_up", base_model=model) == 1
    assert value(after, "loraloom_pool_tokens_per_second", base_model=model) == 80.0
    assert value(after, "loraloom_pool_pack_efficiency", base_model=model) == 0.75
    assert value(after, "loraloom_pool_step_seconds", base_model=model) == 0.25
    route = "/v1/runs/{run_id}/batches"
    sent = value(after, "loraloom_http_requests_total", method="POST", route=route, status="201")
    assert sent == value(before, "loraloom_http_requests_total", method="POST", route=route, status="201") + 3
    assert value(after, "loraloom_http_request_duration_seconds_count", method="POST", route=route) >= 3
    assert value(after, "loraloom_database_up") == 1


def test_labels_stay_bounded(client: TestClient, tenant: TenantHandle) -> None:
    """Every path a scanner tries is one `<unmatched>` series; a run id never becomes a label, nor
    does a base model no pool registered."""
    for i in range(20):
        client.get(f"/nothing/{i}")
    for i in range(3):
        create_run(client, tenant, name=f"r{i}", base_model=f"made-up-{i}")
    _, samples = scrape(client)
    unmatched = [
        k for k in samples if k[0] == "loraloom_http_requests_total" and ("route", "<unmatched>") in k[1]
    ]
    assert len(unmatched) == 1 and samples[unmatched[0]] == 20
    labels = {v for (_, lbls) in samples for (_, v) in lbls}
    assert not any(v.startswith("run_") or v.startswith("made-up-") for v in labels)


def test_optional_token(settings: Settings) -> None:
    guarded = settings.model_copy(update={"metrics_token": SecretStr("scrape-secret")})
    with TestClient(create_app(guarded)) as client:
        r = client.get("/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        wrong = client.get("/metrics", headers={"Authorization": "Bearer wrong"})
        assert (wrong.status_code, wrong.headers["www-authenticate"]) == (401, 'Bearer error="invalid_token"')
        scrape(client, {"Authorization": "Bearer scrape-secret"})


@pytest.mark.slow
def test_several_uvicorn_workers_sum_their_requests(settings: Settings, tmp_path: Path) -> None:
    """Two uvicorn worker processes with PROMETHEUS_MULTIPROC_DIR: whichever answers the scrape,
    the request counts are the sum over both workers."""
    prom_dir = tmp_path / "prom"
    prom_dir.mkdir()
    env = os.environ | {
        "PROMETHEUS_MULTIPROC_DIR": str(prom_dir),
        "LORALOOM_DATABASE_URL": settings.database_url,
        "LORALOOM_DATA_DIR": str(settings.data_dir),
    }
    # On a port bound before the service starts (a port picked free and closed for uvicorn to bind
    # could be taken by the other xdist worker first); returns once the service is ready.
    proc, url = start_service_process(env=env, workers=2, log_path=tmp_path / "service.log")
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            answered = 0
            # Fresh connections until both workers have answered some (each keeps its own file).
            while len(list(prom_dir.glob("counter_*.db"))) < 2 and answered < 500:
                with httpx.Client(base_url=url, timeout=10) as one:
                    assert one.get("/healthz").status_code == 200
                    answered += 1
            assert len(list(prom_dir.glob("counter_*.db"))) == 2, "one worker took every connection"
            _, samples = scrape(c)
            healthz = value(
                samples, "loraloom_http_requests_total", method="GET", route="/healthz", status="200"
            )
            assert healthz == answered  # the sum over both workers, whichever answered the scrape
            assert value(samples, "loraloom_database_up") == 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
