"""Chaos, bounded (issue 10): 3 tenants, 6 runs over 2 slots, and at seeded random moments an evict,
a delete, creates, `kill -9` of the pool (restarted) and `kill -9` of the service (restarted).

At the end, from the service's records: every run that was not evicted or deleted completed; every
batch of it was trained exactly once (one trained_step per batch, each step's batch once); each step's
metrics count exactly its own batch's samples and tokens (no run's metrics show another's steps); and
the pool never exited except when killed. Real processes throughout (Postgres, uvicorn, torchrun).
"""

import os
import random
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import LiveService, start_service
from tests.e2e.helpers import kill_pool, run_config, start_pool, synthetic_batch, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only]

SEED = 20261122
MAX_STEPS = 4
SAMPLES = 16
"""One batch of SAMPLES samples per step: steps long enough (about a second) for the chaos to land
inside training."""
SERVICE_ENV = {
    "LORALOOM_MAX_CONCURRENT_RUNS": "2",
    "LORALOOM_LEASE_SECONDS": "60",
    # Longer than a service restart: the restarted service must not declare the live pool dead.
    "LORALOOM_POOL_TIMEOUT_SECONDS": "30",
    "LORALOOM_SWEEP_INTERVAL_SECONDS": "0.5",
}
ACTIONS = ["evict", "delete", "create", "create", "kill_pool", "kill_pool", "kill_service", "kill_service"]
FINAL = ("completed", "evicted", "failed", "deleted")


def _batch_seed(run_index: int, step: int) -> int:
    return 1000 * (run_index + 1) + step


def _tokens(run_index: int, step: int) -> int:
    batch = synthetic_batch(_batch_seed(run_index, step), n_samples=SAMPLES)
    return sum(len(e["prompt_ids"]) + len(e["completion_ids"]) for e in batch["examples"])


class Chaos:
    def __init__(self, database_url: str, tmp_path: Path) -> None:
        self.database_url, self.tmp_path = database_url, tmp_path
        self.port = 0  # the first start takes any free port; a restart, the one it got
        self.service = self._start_service()
        self.runs: list[tuple[httpx.Client, str, int]] = []  # (owner, run id, index)
        self.gone: dict[str, str] = {}  # run id -> evicted / deleted by the chaos
        self.fed: set[str] = set()
        self.pool = self._start_pool()
        self.kills = {"pool": 0, "service": 0}

    def _start_service(self) -> LiveService:
        service = start_service(
            database_url=self.database_url,
            data_dir=self.tmp_path / "data",
            port=self.port,
            extra_env=SERVICE_ENV,
        )
        # The pool keeps the service's URL: a restart must come back on the same port.
        self.port = httpx.URL(service.url).port or 0
        return service

    def _start_pool(self):
        return start_pool(
            self.service.url, data_dir=self.tmp_path / "data", log_path=self.tmp_path / "pool.log"
        )

    def pool_log(self) -> str:
        return (self.tmp_path / "pool.log").read_text(errors="replace")

    def create(self, client: httpx.Client) -> None:
        index = len(self.runs)
        config = run_config(max_steps=MAX_STEPS, seed=index, batch_size=SAMPLES)
        response = client.post("/v1/runs", json={"name": f"run-{index}", "config": config})
        assert response.status_code == 201, response.text
        run_id = response.json()["id"]
        self.runs.append((client, run_id, index))
        self.feed()

    def feed(self) -> None:
        """Push the batches of every run that became active (a queued run takes none yet)."""
        for client, run_id, index in self.runs:
            if run_id in self.fed or run_id in self.gone:
                continue
            status = self.status(client, run_id)["status"]
            if status != "active":
                if status in FINAL:
                    self.fed.add(run_id)
                continue
            for step in range(MAX_STEPS):
                body = synthetic_batch(_batch_seed(index, step), n_samples=SAMPLES, rollout_step=step)
                headers = {"Idempotency-Key": f"{run_id}-{step}"}
                r = client.post(f"/v1/runs/{run_id}/batches", json=body, headers=headers)
                if r.status_code == 409 and self.status(client, run_id)["status"] in FINAL:
                    break  # evicted or deleted meanwhile
                assert r.status_code in (200, 201), r.text
            self.fed.add(run_id)

    def pause(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.feed()
            time.sleep(0.3)

    def status(self, client: httpx.Client, run_id: str) -> dict:
        return client.get(f"/v1/runs/{run_id}").json()

    def act(self, action: str, rng: random.Random, tenants: list[httpx.Client]) -> str:
        assert self.pool.poll() is None, (
            f"the pool exited by itself before {action}:\n{self.pool_log()[-4000:]}"
        )
        if action in ("evict", "delete"):
            live = [
                (c, r)
                for c, r, _ in self.runs
                if r not in self.gone and self.status(c, r)["status"] not in FINAL
            ]
            if not live:
                return f"{action}: no live run"
            client, run_id = rng.choice(live)
            if action == "evict":
                response = client.post(f"/v1/runs/{run_id}/evict", json={"reason": "chaos"})
            else:
                response = client.delete(f"/v1/runs/{run_id}")
            if response.status_code == 200:
                self.gone[run_id] = action
            else:
                assert response.status_code == 409, response.text  # it completed in the meantime
            return f"{action} {run_id}: {response.status_code}"
        if action == "create":
            self.create(rng.choice(tenants))
            return f"create {self.runs[-1][1]}"
        if action == "kill_pool":
            kill_pool(self.pool)  # SIGKILL to torchrun; its ranks die with it
            self.kills["pool"] += 1
            registered = self.pool_log().count("registered pool")
            self.pool = self._start_pool()
            # Wait for the new pool to train, so that the next action lands on a working pool.
            wait_for(
                lambda: self.pool_log().count("registered pool") > registered, timeout=90, what="the pool"
            )
            return "kill -9 pool, restarted"
        os.killpg(self.service.process.pid, signal.SIGKILL)
        self.service.process.wait(timeout=30)
        self.kills["service"] += 1
        self.service = self._start_service()
        return "kill -9 service, restarted"


def test_chaos(database_url, tmp_path):
    started = time.monotonic()
    rng = random.Random(SEED)
    chaos = Chaos(database_url, tmp_path)
    done: list[str] = []
    try:
        _chaos(chaos, rng, done)
        _check(chaos, done)
    finally:
        kill_pool(chaos.pool)
        chaos.service.stop()
    elapsed = time.monotonic() - started
    log = chaos.pool_log()
    print(
        f"chaos: {len(chaos.runs)} runs, actions {done}, kills {chaos.kills}, "
        f"{len(chaos.gone)} runs evicted/deleted, {log.count('registered pool')} pool registrations, "
        f"{log.count('has left the pool')} runs left mid-step, {log.count(' step ')} step reports, "
        f"{elapsed:.0f} s"
    )
    # Bounded by its waits (each has a timeout), not asserted on the clock: about 2.5 minutes on the
    # shared 2-core machine.


def _chaos(chaos: Chaos, rng: random.Random, done: list[str]) -> None:
    tenants = [chaos.service.tenant_client(f"t{i}", quota=4) for i in range(3)]
    for i in range(6):
        chaos.create(tenants[i % 3])
    wait_for(lambda: " step 1:" in chaos.pool_log(), timeout=90, what="the first step")
    actions = ACTIONS[:]
    rng.shuffle(actions)
    for action in actions:
        chaos.pause(rng.uniform(0.5, 4.0))
        done.append(chaos.act(action, rng, tenants))

    def settled() -> bool:
        chaos.feed()
        return all(chaos.status(c, r)["status"] in FINAL for c, r, _ in chaos.runs if r not in chaos.gone)

    wait_for(settled, timeout=150, interval=1.0, what="every surviving run to finish")
    assert chaos.pool.poll() is None, f"the pool exited by itself:\n{chaos.pool_log()[-4000:]}"


def _check(chaos: Chaos, done: list[str]) -> None:
    for client, run_id, index in chaos.runs:
        if run_id in chaos.gone:
            continue
        run = chaos.status(client, run_id)
        assert run["status"] == "completed", (run_id, run, done)
        assert (
            run["progress"]["step"] == MAX_STEPS and run["progress"]["total_samples"] == SAMPLES * MAX_STEPS
        )
        batches = client.get(f"/v1/runs/{run_id}/batches").json()["items"]
        # Exactly once: each batch trained into exactly one step, each step from exactly its batch.
        assert [(b["state"], b["trained_step"]) for b in sorted(batches, key=lambda b: b["id"])] == [
            ("trained", step + 1) for step in range(MAX_STEPS)
        ], (run_id, batches)
        metrics = client.get(f"/v1/runs/{run_id}/metrics").json()["items"]
        assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1)), (run_id, metrics)
        for m in metrics:  # only its own samples and tokens: no other run's steps
            assert (m["samples"], m["tokens"]) == (SAMPLES, _tokens(index, m["step"] - 1)), (run_id, m)
