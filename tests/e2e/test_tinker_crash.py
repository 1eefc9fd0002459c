"""A pool killed with SIGKILL in the middle of a Tinker step loses nothing and applies nothing twice
(issue 16). Real processes: Postgres, the service under uvicorn, a one-rank torchrun pool, the tiny
model, the unmodified `tinker` SDK. The pool holds at a named pause point (trainer_core.pause_point)
and is killed there; a new pool takes over: it restores the run from its last optim_step's
checkpoint, replays the step's delivered forward_backwards (their results unchanged) and runs or
re-reports the rest; the SDK's futures complete; the final adapter equals the same calls made on a
pool that was never interrupted. One case runs a two-rank pool.

    manual:before-claim         between two forward_backwards of a step (the first delivered)
    manual:before-optim         the step's passes delivered, its optim_step not applied yet
    manual:before-optim-report  the optim_step applied, published and checkpointed, not reported
"""

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.helpers import download_adapter_tensors, kill_pool, start_pool, wait_for
from tests.e2e.tinker_harness import BASE_MODEL, datums, tenant_key, train_steps, wait_until_served
from trainer_core.pause_point import (
    MANUAL_BEFORE_CLAIM,
    MANUAL_BEFORE_OPTIM,
    MANUAL_BEFORE_OPTIM_REPORT,
    PAUSE_ENV,
    paused_marker,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only, pytest.mark.timeout(400)]

LR = 2e-2


def _pause_on(pause: Path, point: str) -> None:
    tmp = pause.with_name(pause.name + ".tmp")
    tmp.write_text(point)
    tmp.replace(pause)  # atomic: the pool never reads half a name


def _new_model(service: tinker.ServiceClient) -> Any:
    return service.create_lora_training_client(
        BASE_MODEL, rank=4, seed=3, train_unembed=False, train_mlp=False
    )


def _adapter(training: Any, http, live_service, key: str) -> dict:
    saved = training.save_weights_for_sampler("final").result()
    resolved = httpx.get(
        f"{live_service.url}/api/v1/loraloom/resolve",
        params={"path": saved.path},
        headers={"X-API-Key": "tml-" + key},
    ).json()
    return {
        "run_id": resolved["run_id"],
        "tensors": download_adapter_tensors(http, resolved["run_id"], resolved["step"]),
    }


def _logprobs(output: Any) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in output.loss_fn_outputs]


@pytest.mark.parametrize(
    ("point", "nproc"),
    [
        (MANUAL_BEFORE_CLAIM, 1),
        (MANUAL_BEFORE_OPTIM, 1),
        (MANUAL_BEFORE_OPTIM_REPORT, 1),
        # Two ranks: the master holds, the other rank waits in the broadcast; both die together.
        (MANUAL_BEFORE_OPTIM_REPORT, 2),
    ],
)
def test_a_pool_killed_mid_step_loses_nothing_and_applies_the_step_once(live_service, tmp_path, point, nproc):
    key, http = tenant_key(live_service, "tinker-crash")
    pause = tmp_path / "pause"
    data = datums()
    first, second = data[:2], data[2:]
    pool = start_pool(
        live_service.url,
        data_dir=live_service.data_dir,
        nproc=nproc,
        log_path=tmp_path / "pool-a.log",
        env={PAUSE_ENV: str(pause)},
    )
    service = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key)
    try:
        wait_until_served(live_service.url, key, timeout=120)
        crashed = _new_model(service).result()
        train_steps(crashed, data, steps=1, lr=LR)  # step 1, checkpointed: the crash step starts from it
        fb1 = crashed.forward_backward(
            first, "cross_entropy"
        ).result()  # delivered; its gradient lives in pool A

        _pause_on(pause, point)
        if point == MANUAL_BEFORE_CLAIM:
            # The pool holds before its next claim: fb2 and the step are never handed to it.
            wait_for(paused_marker(pause).exists, timeout=60, what="the pool to hold before its claim")
        fb2_future = crashed.forward_backward(second, "cross_entropy")
        step_future = crashed.optim_step(types.AdamParams(learning_rate=LR))
        wait_for(paused_marker(pause).exists, timeout=60, what=f"the pool to hold at {point}")
        kill_pool(pool)
        pause.unlink()

        pool = start_pool(
            live_service.url, data_dir=live_service.data_dir, nproc=nproc, log_path=tmp_path / "pool-b.log"
        )
        fb2 = fb2_future.result(timeout=180)
        step2 = step_future.result(timeout=60)
        train_steps(crashed, data, steps=1, lr=LR)  # step 3, from the rebuilt state
        after_crash = _adapter(crashed, http, live_service, key)

        # The same calls on a pool that was never interrupted.
        alone = _new_model(service).result()
        train_steps(alone, data, steps=1, lr=LR)
        fb1_alone = alone.forward_backward(first, "cross_entropy").result()
        fb2_alone = alone.forward_backward(second, "cross_entropy").result()
        step2_alone = alone.optim_step(types.AdamParams(learning_rate=LR)).result()
        train_steps(alone, data, steps=1, lr=LR)
        uninterrupted = _adapter(alone, http, live_service, key)
    finally:
        service.close("success").result()
        kill_pool(pool)

    # The delivered results are the uninterrupted ones, the step's report too (applied once).
    for got, want in ((fb1, fb1_alone), (fb2, fb2_alone)):
        for a, b in zip(_logprobs(got), _logprobs(want), strict=True):
            assert np.allclose(a, b, atol=1e-5)
    assert step2.metrics["grad_norm"] == pytest.approx(step2_alone.metrics["grad_norm"], rel=1e-4)
    tensors, expected = after_crash["tensors"], uninterrupted["tensors"]
    assert tensors.keys() == expected.keys() and tensors
    for name in tensors:
        assert np.allclose(tensors[name].numpy(), expected[name].numpy(), atol=1e-5), name
    metrics = http.get(f"/v1/runs/{after_crash['run_id']}/metrics").json()["items"]
    assert [m["step"] for m in metrics] == [1, 2, 3]
