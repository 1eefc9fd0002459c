"""Step reports (metrics + progress + completion), checkpoints and trainer evictions."""

import json
import math

import httpx
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.adapters.models import Checkpoint
from app.config import Settings
from tests.app.api import (
    WORKER_HEADERS,
    Client,
    TenantHandle,
    ack,
    claim,
    create_run,
    new_tenant,
    register,
    rewarded_batch,
)


def metrics(step: int) -> dict:
    return {
        "loss": 1.0 / step,
        "entropy": 2.5,
        "mismatch_kl": 0.01,
        "masked_fraction": 0.1,
        "grad_norm": 0.7,
        "lr": 1e-4,
        "tokens": 100 * step,
        "samples": 8,
        "step_time_s": 0.25,
    }


def report(client: Client, run_id: str, step: int, **extra):
    body = {
        "step": step,
        "total_tokens": 100 * step,
        "total_samples": 8 * step,
        "metrics": metrics(step),
    } | extra
    return client.post(f"/v1/pool/runs/{run_id}/steps", json=body, headers=WORKER_HEADERS)


def test_steps_are_listed_as_metrics(client: TestClient, tenant: TenantHandle) -> None:
    run = create_run(client, tenant, max_steps=10)
    for step in (2, 1, 3):  # out of order on purpose: the listing is by step
        r = report(client, run["id"], step)
        assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == run["id"]
    assert out["progress"] == {"step": 3, "total_tokens": 300, "total_samples": 24}
    assert out["status"] == "active"

    r = client.get(f"/v1/runs/{run['id']}/metrics", headers=tenant.headers)
    assert r.status_code == 200
    items = r.json()["items"]
    assert [i["step"] for i in items] == [1, 2, 3]
    for item in items:
        expected = metrics(item["step"])
        assert {k: item[k] for k in expected} == expected
        assert item["created_at"]
    # A late duplicate updates the metrics, never moves progress back.
    assert report(client, run["id"], 2, metrics={"loss": 9.0}).status_code == 200
    items = client.get(f"/v1/runs/{run['id']}/metrics", headers=tenant.headers).json()["items"]
    assert items[1]["loss"] == 9.0 and items[1]["grad_norm"] is None
    assert client.get(f"/v1/runs/{run['id']}", headers=tenant.headers).json()["progress"]["step"] == 3


def test_bad_step_reports(client: TestClient, tenant: TenantHandle) -> None:
    run = create_run(client, tenant)
    bad = [
        {"step": 0, "total_tokens": 0, "total_samples": 0},
        {"step": 1, "total_tokens": -1, "total_samples": 0},
        {"step": 1, "total_tokens": 1, "total_samples": 1, "metrics": {"loss": math.nan}},
        {"step": 1, "total_tokens": 1, "total_samples": 1, "metrics": {"grad_norm": math.inf}},
        {"step": 1, "total_tokens": 1, "total_samples": 1, "metrics": {"accuracy": 1.0}},
    ]
    for body in bad:
        # Python's json writes NaN/Infinity (as a careless trainer would); httpx's json= refuses to.
        r = client.post(
            f"/v1/pool/runs/{run['id']}/steps",
            content=json.dumps(body),
            headers=WORKER_HEADERS | {"Content-Type": "application/json"},
        )
        assert r.status_code == 422, body
    assert client.get(f"/v1/runs/{run['id']}/metrics", headers=tenant.headers).json()["items"] == []
    assert report(client, "run_000000000000", 1).status_code == 404


def test_max_steps_completes_the_run_and_frees_its_slot(client: TestClient, settings: Settings) -> None:
    tenant = new_tenant(client, quota=5)
    first = create_run(client, tenant, name="a", max_steps=2)
    create_run(client, tenant, name="b")
    waiting = create_run(client, tenant, name="c")
    assert waiting["status"] == "queued"

    assert report(client, first["id"], 1).json()["status"] == "active"
    r = report(client, first["id"], 2)
    assert r.status_code == 200
    done = r.json()
    assert done["status"] == "completed"
    assert done["slot"] is None
    assert done["progress"]["step"] == 2
    assert done["finished_at"]
    now_active = client.get(f"/v1/runs/{waiting['id']}", headers=tenant.headers).json()
    assert (now_active["status"], now_active["slot"]) == ("active", first["slot"])

    # A retry of the completing report (its response was lost) is answered, not refused...
    again = report(client, first["id"], 2)
    assert again.status_code == 200
    assert again.json()["status"] == "completed"
    # ...but a new step for a finished run is a conflict.
    r = report(client, first["id"], 3)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "run_not_active"


def test_checkpoints(client: TestClient, tenant: TenantHandle, db: Session) -> None:
    run = create_run(client, tenant)
    url = f"/v1/pool/runs/{run['id']}/checkpoints"
    r = client.post(url, json={"step": 5, "total_samples": 40}, headers=WORKER_HEADERS)
    assert r.status_code == 201, r.text
    assert r.json()["run_id"] == run["id"]
    assert (r.json()["step"], r.json()["total_samples"]) == (5, 40)
    # Reported again (a trainer that restarted before its report was acknowledged): one row.
    assert client.post(url, json={"step": 5, "total_samples": 40}, headers=WORKER_HEADERS).status_code == 201
    assert client.post(url, json={"step": 10, "total_samples": 80}, headers=WORKER_HEADERS).status_code == 201
    rows = db.scalars(
        select(Checkpoint).where(Checkpoint.run_id == run["id"]).order_by(Checkpoint.step)
    ).all()
    assert [(c.step, c.total_samples) for c in rows] == [(5, 40), (10, 80)]
    db.commit()  # end the read: on SQLite an open transaction holds the write lock
    assert client.post(url, json={"step": -1, "total_samples": 0}, headers=WORKER_HEADERS).status_code == 422
    assert (
        client.post(
            "/v1/pool/runs/run_000000000000/checkpoints",
            json={"step": 1, "total_samples": 1},
            headers=WORKER_HEADERS,
        )
    ).status_code == 404


def test_trainer_evicts_a_run(client: TestClient, tenant: TenantHandle, settings: Settings) -> None:
    run = create_run(client, tenant)
    url = f"/v1/pool/runs/{run['id']}/evict"
    r = client.post(url, json={"reason": "loss is NaN at step 4"}, headers=WORKER_HEADERS)
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["status"], out["evicted_by"], out["eviction_reason"]) == (
        "evicted",
        "trainer",
        "loss is NaN at step 4",
    )
    assert (
        settings.runs_dir / run["id"] / "control" / "evicted.txt"
    ).read_text().strip() == "loss is NaN at step 4"
    assert client.post(url, json={"reason": "again"}, headers=WORKER_HEADERS).status_code == 409
    assert client.post(url, json={"reason": ""}, headers=WORKER_HEADERS).status_code == 422
    # The step in flight when the run was evicted is refused too.
    assert report(client, run["id"], 1).status_code == 409


# --------------------------------------------------------------------------- which batches a step trained


class Pool:
    """The worker pool's side over real HTTP: claims, step reports, acknowledgements."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http
        self.pool_id = register(http)
        self.claimed: list[int] = []

    def claim(self) -> None:
        self.claimed += [b["id"] for b in claim(self.http, self.pool_id)["batches"]]

    def train_step(self, run_id: str, step: int, batches: int) -> None:
        """Report `step` (loss 1 / step) and acknowledge the oldest `batches` claimed batches in it:
        the pool trains a run's batches in id order."""
        r = report(self.http, run_id, step)
        assert r.status_code == 200, r.text
        done, self.claimed = self.claimed[:batches], self.claimed[batches:]
        assert ack(self.http, self.pool_id, [(b, step) for b in done]).status_code == 200


def submit(http: httpx.Client, tenant: TenantHandle, run_id: str, rewards: list[float], *, step: int) -> None:
    r = http.post(
        f"/v1/runs/{run_id}/batches", json=rewarded_batch(list(rewards), step=step), headers=tenant.headers
    )
    assert r.status_code == 201, r.text


def metrics_by_step(http: httpx.Client, tenant: TenantHandle, run_id: str, **params: int) -> dict[int, dict]:
    r = http.get(f"/v1/runs/{run_id}/metrics", params=params, headers=tenant.headers)
    assert r.status_code == 200, r.text
    return {i["step"]: i for i in r.json()["items"]}


def agg(mean: float, std: float, lo: float, hi: float, count: int) -> dict:
    return {"mean": mean, "std": std, "min": lo, "max": hi, "count": count}


def test_a_trainer_step_names_the_rollout_steps_it_trained(http: httpx.Client) -> None:
    """The orchestrator samples rollout step s with adapter s; trainer step s + 1 trains it. Item N
    joined trainer step N's loss with rollout step N's rewards, which step N + 1 trained: two sets of
    samples. The trainer's side of an item now names its batches' rollout steps and their reward."""
    tenant = new_tenant(http)
    pool = Pool(http)
    run_id = create_run(http, tenant, batch_size=2, max_steps=10)["id"]
    submit(http, tenant, run_id, [0.0, 1.0], step=0)
    pool.claim()
    pool.train_step(run_id, 1, batches=1)
    submit(http, tenant, run_id, [1.0, 1.0], step=1)
    pool.claim()
    pool.train_step(run_id, 2, batches=1)
    submit(http, tenant, run_id, [0.0, 0.0], step=2)  # sampled with adapter 2: not trained yet

    items = metrics_by_step(http, tenant, run_id)
    assert sorted(items) == [0, 1, 2]
    trained = {s: (i["loss"], i["trained_rollout_steps"], i["trained_reward"]) for s, i in items.items()}
    assert trained == {
        0: (None, None, None),
        1: (1.0, [0], agg(0.5, 0.5, 0.0, 1.0, 2)),
        2: (0.5, [1], agg(1.0, 0.0, 1.0, 1.0, 2)),
    }
    # The rollout side keeps its key: rollout step N's batches, whichever step trains them.
    assert [items[s]["reward"]["mean"] for s in (0, 1, 2)] == [0.5, 1.0, 0.0]
    assert [items[s]["samples_received"] for s in (0, 1, 2)] == [2, 2, 2]


def test_a_batch_that_waited_is_paired_with_the_step_that_trained_it(http: httpx.Client) -> None:
    """An orchestrator running ahead (max_async_level 2) samples two batches with adapter 0; the
    batch it then samples with adapter 1 waits behind them and is trained in step 3, two steps after
    the adapter it was sampled with."""
    tenant = new_tenant(http)
    pool = Pool(http)
    run_id = create_run(http, tenant, batch_size=2, max_steps=10)["id"]
    submit(http, tenant, run_id, [0.0, 0.0], step=0)
    submit(http, tenant, run_id, [1.0, 1.0], step=0)
    pool.claim()
    pool.train_step(run_id, 1, batches=1)
    submit(http, tenant, run_id, [0.25, 0.25], step=1)
    pool.claim()
    pool.train_step(run_id, 2, batches=1)
    pool.train_step(run_id, 3, batches=1)

    items = metrics_by_step(http, tenant, run_id)
    assert sorted(items) == [0, 1, 2, 3]
    rollout_0 = agg(0.5, 0.5, 0.0, 1.0, 4)  # the rollout side: both batches of it
    expected = {
        0: (None, None),
        1: ([0], agg(0.0, 0.0, 0.0, 0.0, 2)),  # the trainer side: the batch each step trained
        2: ([0], agg(1.0, 0.0, 1.0, 1.0, 2)),
        3: ([1], agg(0.25, 0.0, 0.25, 0.25, 2)),
    }
    assert {s: (i["trained_rollout_steps"], i["trained_reward"]) for s, i in items.items()} == expected
    assert [items[s]["reward"] for s in (0, 1, 2, 3)] == [
        rollout_0,
        agg(0.25, 0.0, 0.25, 0.25, 2),
        None,
        None,
    ]
    # A page holds the rewards of the rollout steps its steps trained, wherever its own window starts.
    assert metrics_by_step(http, tenant, run_id, since_step=3) == {3: items[3]}
    # Page by page (one item each), the same items.
    paged: dict[int, dict] = {}
    since: int | None = 0
    while since is not None:
        r = http.get(
            f"/v1/runs/{run_id}/metrics", params={"since_step": since, "limit": 1}, headers=tenant.headers
        )
        paged |= {i["step"]: i for i in r.json()["items"]}
        since = r.json()["next_since_step"]
    assert paged == items
