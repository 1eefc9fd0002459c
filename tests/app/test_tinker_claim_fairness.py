"""A pool's claim of Tinker work is dealt round-robin across runs: a tenant that keeps many requests
queued gets one turn per round like everyone else, and never fills a claim with requests past its
step boundary (review of 2026-11-23, H2: `ORDER BY run_id, seq_id LIMIT` gave every claim to the run
whose id sorted first)."""

import pytest

from tests.app.api import WORKER_HEADERS, register
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
