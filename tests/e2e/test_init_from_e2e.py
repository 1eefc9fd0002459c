"""`init_from {run_id, step}` through the real service (uvicorn, Postgres) and a 2-rank gloo pool: the new
run starts from the source run's adapter; a foreign or missing source is a 404 and an adapter that does not
fit the new run's config a 422 naming each field, both storing nothing."""

import pytest

from tests.e2e.helpers import (
    download_adapter_tensors,
    kill_pool,
    run_config,
    run_status,
    start_pool,
    synthetic_batch,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only]


def _push(client, run_id: str, seed: int, **kwargs) -> None:
    response = client.post(f"/v1/runs/{run_id}/batches", json=synthetic_batch(seed, n_samples=4, **kwargs))
    assert response.status_code in (200, 201), response.text


def _wait_completed(client, run_id: str) -> None:
    wait_for(
        lambda: run_status(client, run_id)["status"] == "completed",
        timeout=240,
        what=f"{run_id} to complete",
    )


def _runs(client) -> list[str]:
    return [r["id"] for r in client.get("/v1/runs").json()["items"]]


@pytest.mark.timeout(600)
def test_init_from_a_run_adapter(live_service, tmp_path):
    alice = live_service.tenant_client("alice")
    bob = live_service.tenant_client("bob")
    source = alice.post("/v1/runs", json={"name": "sft", "config": run_config(max_steps=2, seed=3)})
    assert source.status_code == 201, source.text
    src = source.json()["id"]
    _push(alice, src, 1)
    _push(alice, src, 2)

    pool = start_pool(live_service.url, data_dir=live_service.data_dir, log_path=tmp_path / "pool.log")
    try:
        _wait_completed(alice, src)

        # A foreign run, a missing step, a run id that does not exist: 404, and no run is stored.
        before_alice, before_bob = _runs(alice), _runs(bob)
        for client, init in (
            (bob, {"run_id": src}),
            (alice, {"run_id": src, "step": 99}),
            (alice, {"run_id": "run_000000000000"}),
        ):
            r = client.post("/v1/runs", json={"name": "x", "config": run_config(), "init_from": init})
            assert r.status_code == 404, r.text
            assert r.json()["error"]["message"]
        # Shapes that differ from the adapter's: a 422 naming each field, nothing stored.
        r = alice.post(
            "/v1/runs",
            json={
                "name": "bad",
                "config": run_config(lora={"rank": 8, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}),
                "init_from": {"run_id": src},
            },
        )
        assert r.status_code == 422, r.text
        message = r.json()["error"]["message"]
        assert "lora.rank is 8" in message and "has 4" in message
        assert "lora.target_modules" in message and "lora.alpha" not in message
        assert _runs(alice) == before_alice and _runs(bob) == before_bob

        # The new run starts from the source's newest adapter. Its one step trains on advantages of
        # 0 (no gradient, so AdamW leaves the weights as they are): its step-1 adapter is its start.
        created = alice.post(
            "/v1/runs",
            json={"name": "rl", "config": run_config(max_steps=1, seed=99), "init_from": {"run_id": src}},
        )
        assert created.status_code == 201, created.text
        new = created.json()
        assert new["init_from"] == {
            "run_id": src,
            "step": 2,
            "checkpoint": None,
            "with_optimizer": False,
            "adapter_id": None,
        }
        _push(alice, new["id"], 7, advantage_scale=0.0)
        _wait_completed(alice, new["id"])

        # Fork from the checkpoint of step 1 with its optimizer and schedule, and train on the batch the
        # source trained at step 2: the fork's step 1 is the source's step 2.
        for init, status, text in (
            ({"run_id": src, "checkpoint": 99, "with_optimizer": True}, 404, "no checkpoint of step 99"),
            ({"run_id": src, "step": 1, "with_optimizer": True}, 422, "with_optimizer needs checkpoint"),
        ):
            r = alice.post("/v1/runs", json={"name": "x", "config": run_config(), "init_from": init})
            assert r.status_code == status and text in r.text, r.text
        r = alice.post(
            "/v1/runs",
            json={
                "name": "x",
                "config": run_config(optim={"lr": 1e-3}),
                "init_from": {"run_id": src, "checkpoint": 1, "with_optimizer": True},
            },
        )
        assert r.status_code == 422 and "optim is" in r.json()["error"]["message"], r.text
        fork = alice.post(
            "/v1/runs",
            json={
                "name": "fork",
                "config": run_config(max_steps=1, seed=42),
                "init_from": {"run_id": src, "checkpoint": 1, "with_optimizer": True},
            },
        )
        assert fork.status_code == 201, fork.text
        fork_id = fork.json()["id"]
        _push(alice, fork_id, 2)
        _wait_completed(alice, fork_id)
    finally:
        kill_pool(pool)

    forked = download_adapter_tensors(alice, fork_id, 1)
    source_step2 = download_adapter_tensors(alice, src, 2)
    source_step1 = download_adapter_tensors(alice, src, 1)
    assert max(float((forked[k] - source_step2[k]).abs().max()) for k in forked) <= 1e-5
    assert max(float((forked[k] - source_step1[k]).abs().max()) for k in forked) > 1e-4  # it did train

    want = download_adapter_tensors(alice, src, 2)
    got = download_adapter_tensors(alice, new["id"], 1)
    assert got.keys() == want.keys()
    assert max(float((got[k] - want[k]).abs().max()) for k in got) <= 1e-6
    # Not vacuous: the source moved away from a fresh adapter (B = 0 at init).
    assert max(float(v.abs().max()) for k, v in want.items() if "lora_B" in k) > 1e-4
