"""A pool's claim of Tinker work is dealt round-robin across runs: a tenant that keeps many requests
queued gets one turn per round like everyone else, and never fills a claim with requests past its
step boundary (review of 2026-11-23, H2: `ORDER BY run_id, seq_id LIMIT` gave every claim to the run
whose id sorted first)."""

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.tinker import work
from tests.app.api import WORKER_HEADERS, new_tenant, register
from tests.app.test_tinker_sampling import _base_sampler, _headers, _sample_body
from tests.app.test_tinker_work import PROTOBUF, _datum, _fwdbwd_body, _model

pytestmark = pytest.mark.postgres_only


def _queue(client, model_id: str, headers: dict[str, str], passes: int) -> None:
    """`passes` forward_backwards then an optim_step (the step boundary)."""
    for seq_id in range(1, passes + 1):
        body = _fwdbwd_body(model_id, seq_id, [_datum([1, 2, 3])])
        assert (
            client.post("/api/v1/forward_backward", content=body, headers=headers | PROTOBUF).status_code
            == 200
        )
    step = {"model_id": model_id, "seq_id": passes + 1, "adam_params": {"learning_rate": 0.01}}
    assert client.post("/api/v1/optim_step", json=step, headers=headers).status_code == 200


def _claim(client, pool_id: str, max_items: int) -> list[tuple[str, str, int]]:
    r = client.post(
        "/v1/pool/manual/claim", json={"pool_id": pool_id, "max_items": max_items}, headers=WORKER_HEADERS
    )
    assert r.status_code == 200, r.text
    return [(i["run_id"], i["kind"], i["seq_id"]) for i in r.json()["items"]]


def test_every_run_gets_a_turn_in_each_claim(client, tenant, other_tenant):
    pool_id = register(client)
    busy, busy_headers = _model(client, tenant)
    quiet, quiet_headers = _model(client, other_tenant)
    _queue(client, busy, busy_headers, passes=5)  # whichever run id sorts first, both have ≥ 2 passes
    _queue(client, quiet, quiet_headers, passes=2)
    first = _claim(client, pool_id, max_items=2)
    assert sorted(kind for _, kind, _ in first) == ["forward_backward", "forward_backward"]
    assert len({run for run, _, _ in first}) == 2  # one pass of each run, not two of one
    assert all(seq == 1 for _, _, seq in first)

    # Later claims go on in each run's order, up to its boundary, and nothing past it.
    rest = _claim(client, pool_id, max_items=64)
    by_run: dict[str, list[tuple[str, int]]] = {}
    for run, kind, seq in rest:
        by_run.setdefault(run, []).append((kind, seq))
    assert sorted(len(items) for items in by_run.values()) == [2, 5]  # passes 2.. and the optim_step
    for items in by_run.values():
        assert [seq for _, seq in items] == list(range(2, len(items) + 2))
        assert items[-1][0] == "optim_step"


def test_base_model_samples_are_dealt_round_robin_across_tenants(client, tenant, other_tenant):
    pool_id = register(client)
    busy = _base_sampler(client, tenant)
    quiet = _base_sampler(client, other_tenant)
    for _ in range(5):  # queued first: oldest-first would serve all five before the quiet one
        r = client.post("/api/v1/asample", json=_sample_body(busy, [5, 6, 7]), headers=_headers(tenant))
        assert r.status_code == 200, r.text
    quiet_request = client.post(
        "/api/v1/asample", json=_sample_body(quiet, [5, 6]), headers=_headers(other_tenant)
    )
    items = client.post(
        "/v1/pool/manual/claim", json={"pool_id": pool_id, "max_items": 2}, headers=WORKER_HEADERS
    ).json()["items"]
    assert quiet_request.json()["request_id"] in [i["request_id"] for i in items]
    assert len(items) == 2


def test_a_tenants_waiting_requests_are_bounded_and_a_retry_still_finds_its_own(
    client, tenant, other_tenant, settings, monkeypatch
):
    monkeypatch.setattr(settings, "tinker_max_pending_per_tenant", 3)
    register(client)
    model_id, headers = _model(client, tenant)
    sampler = _base_sampler(client, tenant)
    bodies = [_fwdbwd_body(model_id, seq_id, [_datum([1, 2, 3])]) for seq_id in (1, 2, 3, 4)]
    for body in bodies[:3]:
        assert (
            client.post("/api/v1/forward_backward", content=body, headers=headers | PROTOBUF).status_code
            == 200
        )
    refused = client.post("/api/v1/forward_backward", content=bodies[3], headers=headers | PROTOBUF)
    assert refused.status_code == 429, refused.text
    assert refused.headers["Retry-After"] == str(work.PENDING_RETRY_AFTER_SECONDS)
    assert refused.json()["error"]["details"]["pending"] == 3
    sample = client.post("/api/v1/asample", json=_sample_body(sampler, [5, 6]), headers=headers)
    assert sample.status_code == 429  # samples count too
    retry = client.post("/api/v1/forward_backward", content=bodies[0], headers=headers | PROTOBUF)
    assert retry.status_code == 200  # a retried request finds its stored future
    other_model, other_headers = _model(client, other_tenant)  # other tenants are not affected
    body = _fwdbwd_body(other_model, 1, [_datum([1, 2, 3])])
    assert (
        client.post("/api/v1/forward_backward", content=body, headers=other_headers | PROTOBUF).status_code
        == 200
    )


def test_with_more_runs_than_a_claim_takes_the_ones_left_out_go_first_next(settings):
    """Three runs with work, claims of two: the run the first claim leaves out is in the second (with
    ties broken by run id, the same two lowest ids would win every claim)."""
    with TestClient(create_app(settings.model_copy(update={"max_concurrent_runs": 3}))) as client:
        pool_id = register(client, slots=3)
        models = [_model(client, new_tenant(client)) for _ in range(3)]
        for seq_id in (1, 2):  # every run's first pass, then every run's second
            for model_id, headers in models:
                body = _fwdbwd_body(model_id, seq_id, [_datum([1, 2, 3])])
                r = client.post("/api/v1/forward_backward", content=body, headers=headers | PROTOBUF)
                assert r.status_code == 200, r.text
        first = {run for run, _, _ in _claim(client, pool_id, max_items=2)}
        second = {run for run, _, _ in _claim(client, pool_id, max_items=2)}
        assert len(first) == 2 and len(first | second) == 3
