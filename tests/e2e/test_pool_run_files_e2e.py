"""A pool with its own checkpoint directory (not the service's data directory: a pool on another host,
`loraloom worker --checkpoint-dir`) removes a deleted run's checkpoints, and only a deleted run's.

Real processes: Postgres, the service under uvicorn, a torchrun pool, the tiny model. Three runs train
a step each. Then the victim is deleted while the pool trains it (its files go at the pool's next
sync), another is evicted (it leaves the pool too, but keeps its checkpoint: an init_from or an
evicted Tinker model may still read it) and the third completes. With the pool stopped, the completed
run is deleted: the next pool removes its files when it starts (trainer_core.run_files). A run
directory the service never saw (another service's, in a shared or default directory) stays throughout.
"""

import signal
from pathlib import Path

import pytest

from tests.e2e.helpers import kill_pool, run_config, run_status, start_pool, synthetic_batch, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only]


def _checkpoint(home: Path, run_id: str, step: int = 1) -> Path:
    return home / run_id / "checkpoints" / f"step_{step}" / "STABLE"


def test_deleted_runs_lose_their_checkpoints_on_a_pool_with_its_own_directory(live_service, tmp_path):
    client = live_service.tenant_client("files", quota=4)
    runs = {}
    for name, max_steps in [("victim", 3), ("evicted", 3), ("done", 1)]:
        r = client.post("/v1/runs", json={"name": name, "config": run_config(max_steps=max_steps, seed=3)})
        assert r.status_code == 201, r.text
        runs[name] = r.json()["id"]
    pool_dir = tmp_path / "pool"  # the pool's checkpoint home: pool_dir / "runs"
    home = pool_dir / "runs"
    log_path = tmp_path / "pool.log"
    foreign = "run_0000000f0e16"  # another service's run: this one holds no row for it
    _checkpoint(home, foreign).parent.mkdir(parents=True)
    _checkpoint(home, foreign).write_text("1\n")

    pool = start_pool(live_service.url, data_dir=pool_dir, nproc=1, slots=3, log_path=log_path)
    try:
        # The third run takes the third slot once the pool registers; only active runs take batches.
        wait_for(
            lambda: all(run_status(client, run_id)["status"] == "active" for run_id in runs.values()),
            timeout=180,
            what="every run active",
        )
        for seed, run_id in enumerate(runs.values()):
            r = client.post(f"/v1/runs/{run_id}/batches", json=synthetic_batch(seed, n_samples=4))
            assert r.status_code in (200, 201), r.text
        wait_for(
            lambda: all(_checkpoint(home, run_id).exists() for run_id in runs.values()),
            timeout=180,
            what="a checkpoint of every run on the pool's disk",
        )
        wait_for(lambda: run_status(client, runs["done"])["status"] == "completed", timeout=60, what="done")
        r = client.post(f"/v1/runs/{runs['evicted']}/evict", json={"reason": "enough"})
        assert r.status_code == 200, r.text
        wait_for(
            lambda: f"run {runs['evicted']} left slot" in log_path.read_text(errors="replace"),
            timeout=60,
            what="the pool to release the evicted run",
        )
        assert client.delete(f"/v1/runs/{runs['victim']}").status_code == 200
        # The pool asked about the evicted run no later than about the victim (released after it).
        wait_for(lambda: not (home / runs["victim"]).exists(), timeout=60, what="the victim's files to go")
        assert pool.poll() is None, log_path.read_text(errors="replace")[-4000:]
        assert _checkpoint(home, runs["evicted"]).exists()
        assert _checkpoint(home, runs["done"]).exists()
    finally:
        kill_pool(pool, signal.SIGTERM)

    # Deleted while no pool runs: the next one removes its files at start-up, before training anything.
    assert client.delete(f"/v1/runs/{runs['done']}").status_code == 200
    assert _checkpoint(home, runs["done"]).exists()
    log_path.write_text("")
    pool = start_pool(live_service.url, data_dir=pool_dir, nproc=1, slots=3, log_path=log_path)
    try:
        wait_for(
            lambda: not (home / runs["done"]).exists(), timeout=180, what="the deleted run's files to go"
        )
        assert _checkpoint(home, runs["evicted"]).exists()
        assert _checkpoint(home, foreign).exists()
        names = sorted(p.name for p in home.iterdir() if not p.name.startswith("."))
        assert names == sorted([runs["evicted"], foreign])
    finally:
        kill_pool(pool, signal.SIGTERM)
