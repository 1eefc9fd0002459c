"""The rollout-step stats row read inside the reserve-and-insert statement (app/batches/one_statement.py)
is used only when the statement's snapshot is current; a submission that waited for the run row lock
while another one committed its stats reads the row again, so no batch's rewards are lost."""

import threading
import time
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from app.batches.one_statement import Reserved, reserve_and_insert
from app.db import make_engine, make_session_factory, utcnow
from app.rollouts.models import RolloutStats
from app.rollouts.service import add_batch
from contracts.status import BatchState
from contracts.wire import TrainingBatch, TrainingSample
from tests.app.factories import seed_run

pytestmark = pytest.mark.postgres_only


def _batch(reward: float, samples: int) -> TrainingBatch:
    sample = TrainingSample(
        prompt_ids=[1], prompt_mask=[False], completion_ids=[2], completion_mask=[True],
        completion_logprobs=[-0.5], advantage=0.0, reward=reward,
    )  # fmt: skip
    return TrainingBatch(examples=[sample] * samples, temperature=1.0, step=0, env="test")


def _reserve(session: Session, run_id: str, key: str, samples: int) -> Reserved:
    values: dict[str, object] = {
        "run_id": run_id,
        "idempotency_key": key,
        "request_hash": key,
        "rollout_step": 0,
        "num_samples": samples,
        "num_tokens": 2 * samples,
        "payload_path": f"{key}.msgpack",
        "payload_bytes": 10,
        "payload_sha256": key,
        "state": BatchState.PENDING.value,
        "created_at": utcnow(),
        # The batch's own reward summary (app/batches/service._add_row): none here, as a batch stored
        # before migration 0019; this test is about the rollout step's row.
        **dict.fromkeys(("reward_count", "reward_mean", "reward_m2", "reward_min", "reward_max")),
    }
    return reserve_and_insert(
        session.connection(), values=values, max_async_level=10, max_pending_batches=100,
        max_pending_bytes=10**9,
    )  # fmt: skip


def _store(session: Session, run_id: str, tenant_id: str, reserved: Reserved, batch: TrainingBatch) -> None:
    assert reserved.inserted is not None
    known = (reserved.step_stats.row,) if reserved.step_stats.current else None
    add_batch(
        session,
        run_id=run_id,
        tenant_id=tenant_id,
        batch_id=reserved.inserted[0],
        batch=batch,
        step_stats=known,
    )
    session.commit()


def _wait_until_blocked_on_a_lock(session: Session, pid: int) -> None:
    """Until backend `pid` waits for a lock (a condition, not a guess at how long it takes)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        waiting = session.execute(
            text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
        ).scalar()
        session.rollback()  # a new snapshot for the next look
        if waiting == "Lock":
            return
        time.sleep(0.01)
    raise AssertionError("the second submission never waited for the run row lock")


def test_the_stats_read_with_the_reservation_is_trusted_only_when_current(settings):
    seeded = seed_run(settings)
    engine = make_engine(settings.database_url)
    sessions = make_session_factory(engine)
    try:
        # Alone: the statement's snapshot is current, and its row is the step's row.
        with sessions() as first:
            reserved = _reserve(first, seeded.run_id, "a", 2)
            assert reserved.step_stats.current and reserved.step_stats.row is None
            _store(first, seeded.run_id, seeded.tenant_id, reserved, _batch(1.0, 2))
        with sessions() as second:
            reserved = _reserve(second, seeded.run_id, "b", 3)
            assert reserved.step_stats.current
            assert reserved.step_stats.row is not None and reserved.step_stats.row.samples == 2
            assert reserved.step_stats.row.metrics == {}
            _store(second, seeded.run_id, seeded.tenant_id, reserved, _batch(2.0, 3))

        # Contended: C holds the run row lock with its stats written, D's statement waits for the
        # lock with a snapshot that misses C's stats; C commits, then D must not trust its read.
        holder, waiter, watcher = sessions(), sessions(), sessions()
        held = _reserve(holder, seeded.run_id, "c", 4)
        add_batch(
            holder, run_id=seeded.run_id, tenant_id=seeded.tenant_id, batch_id=held.inserted[0],
            batch=_batch(3.0, 4),
        )  # fmt: skip
        waiter_pid = waiter.execute(text("SELECT pg_backend_pid()")).scalar_one()
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.update(r=_reserve(waiter, seeded.run_id, "d", 5)))
        thread.start()
        _wait_until_blocked_on_a_lock(watcher, waiter_pid)
        holder.commit()
        thread.join(timeout=30)
        contended: Reserved = result["r"]
        assert not contended.step_stats.current
        _store(waiter, seeded.run_id, seeded.tenant_id, contended, _batch(4.0, 5))
        for session in (holder, waiter, watcher):
            session.close()

        with sessions() as check:
            row = check.scalars(select(RolloutStats).where(RolloutStats.run_id == seeded.run_id)).one()
            assert row.samples == 2 + 3 + 4 + 5  # every batch merged, the contended one included
            assert row.reward_count == 14
            assert row.reward_mean == pytest.approx((2 * 1.0 + 3 * 2.0 + 4 * 3.0 + 5 * 4.0) / 14)
    finally:
        engine.dispose()
