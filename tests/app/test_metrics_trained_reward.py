"""A trainer step's `trained_reward` merges the reward summaries of exactly the batches it trained
(each batch keeps its own since migration 0019), not the whole rollout steps they came from; batches
stored before the migration (no summary) fall back to their rollout step's stats, counted once."""

from typing import Any

import httpx
import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.batches.models import Batch
from app.rollouts.service import Summary
from tests.app.api import TenantHandle, create_run, new_tenant, rewarded_batch
from tests.app.test_metrics import Pool, agg, metrics_by_step, submit


def exactly(values: list[float]) -> dict[str, Any]:
    """The aggregate of `values`: count, min and max exact; mean and std to rounding (merge order)."""
    public = Summary.of(values).public()
    return public | {"mean": pytest.approx(public["mean"]), "std": pytest.approx(public["std"])}


def trained(http: httpx.Client, tenant: TenantHandle, run_id: str) -> dict[int, tuple[Any, Any]]:
    items = metrics_by_step(http, tenant, run_id)
    return {s: (i["trained_rollout_steps"], i["trained_reward"]) for s, i in items.items()}


def test_a_rollout_step_trained_in_two_steps_counts_in_each_with_its_batches(http: httpx.Client) -> None:
    """Rollout step 0's two batches are trained in steps 1 and 2: each step's reward is its batch's,
    not rollout step 0's whole (which both steps showed before). Step 3 then trains the rest of
    rollout step 0 with a batch of rollout step 1: their summaries merge exactly."""
    tenant = new_tenant(http)
    pool = Pool(http)
    run_id = create_run(http, tenant, batch_size=2, max_steps=10)["id"]
    submit(http, tenant, run_id, [0.0, 0.5], step=0)
    submit(http, tenant, run_id, [1.0, 0.75], step=0)
    submit(http, tenant, run_id, [0.25, 0.25, 0.5], step=0)
    pool.claim()
    pool.train_step(run_id, 1, batches=1)
    pool.train_step(run_id, 2, batches=1)
    submit(http, tenant, run_id, [1.0, 0.0, 0.125], step=1)
    pool.claim()
    pool.train_step(run_id, 3, batches=2)

    got = trained(http, tenant, run_id)
    assert got[1] == ([0], agg(0.25, 0.25, 0.0, 0.5, 2))
    assert got[2] == ([0], agg(0.875, 0.125, 0.75, 1.0, 2))
    assert got[3] == ([0, 1], exactly([0.25, 0.25, 0.5, 1.0, 0.0, 0.125]))
    # The rollout side still pools every batch of a rollout step.
    items = metrics_by_step(http, tenant, run_id)
    assert items[0]["reward"] == exactly([0.0, 0.5, 1.0, 0.75, 0.25, 0.25, 0.5])


def test_each_batch_row_keeps_its_reward_summary(http: httpx.Client, db: Session) -> None:
    """Samples without a reward are left out; a batch without any has count 0 and no min or max (a
    NULL count is what a batch stored before migration 0019 has)."""
    tenant = new_tenant(http)
    run_id = create_run(http, tenant, batch_size=2, max_steps=10)["id"]
    batches: list[list[float | None]] = [[None, 0.5, None, 0.25], [None, None]]
    for rewards in batches:
        r = http.post(
            f"/v1/runs/{run_id}/batches", json=rewarded_batch(rewards, step=0), headers=tenant.headers
        )
        assert r.status_code == 201, r.text
    rows = db.execute(
        select(Batch.reward_count, Batch.reward_mean, Batch.reward_m2, Batch.reward_min, Batch.reward_max)
        .where(Batch.run_id == run_id)
        .order_by(Batch.id)
    ).all()
    assert [tuple(r) for r in rows] == [(2, 0.375, 0.03125, 0.25, 0.5), (0, 0.0, 0.0, None, None)]


def test_batches_stored_before_the_summaries_count_their_rollout_step_whole(
    http: httpx.Client, db: Session
) -> None:
    """A batch without a summary (stored before migration 0019) gives its rollout step's stats, the
    figure of the metrics before it; a step that trained it and a batch with a summary of the same
    rollout step counts that rollout step once, not its stats plus the batch."""
    tenant = new_tenant(http)
    pool = Pool(http)
    run_id = create_run(http, tenant, batch_size=2, max_steps=10)["id"]
    for rewards in ([0.0, 0.5], [1.0, 1.0], [0.25, 0.75]):
        submit(http, tenant, run_id, rewards, step=0)
    pool.claim()
    first = pool.claimed[0]
    db.execute(
        update(Batch)
        .where(Batch.id == first)
        .values(reward_count=None, reward_mean=None, reward_m2=None, reward_min=None, reward_max=None)
    )
    db.commit()  # on SQLite an open transaction holds the write lock
    pool.train_step(run_id, 1, batches=2)  # the old batch and one with a summary, both of rollout step 0
    pool.train_step(run_id, 2, batches=1)

    whole = exactly([0.0, 0.5, 1.0, 1.0, 0.25, 0.75])
    got = trained(http, tenant, run_id)
    assert got[1] == ([0], whole)
    assert got[2] == ([0], agg(0.5, 0.25, 0.25, 0.75, 2))
