"""A pool that is stopping does not evict a run whose `init_from` weights it failed to fetch.

Stopping, the pool's service client gives up a failed request at once (`RetryStopped`, instead of
a minute of retries), so such a failure may be the stop's own: the run must not be stopped for good
(an eviction is final). It takes no work in this pool, and the next pool fetches its weights again.
A pool that is not stopping still stops it for good: failed, with the reason. The real PoolTrainer, fed from memory.
"""

from pathlib import Path

import pytest

from contracts.http import RetryStopped, ServerError
from contracts.pool_api import InitFrom, PoolRunState
from contracts.run_config import RunConfig
from tests.e2e.helpers import run_config, synthetic_batch
from tests.trainer_core.memory_pool import memory_trainer
from trainer_core.memory_client import MemoryPoolClient

RUN = "run_000000000000"


class InitFetchFails(MemoryPoolClient):
    """The run starts from an uploaded adapter, whose download fails as a stopping pool's does."""

    def state(self) -> list[PoolRunState]:
        return [
            r.model_copy(update={"init_from": InitFrom(adapter_id="adp_0123456789ab")})
            for r in super().state()
        ]

    def init_adapter(self, run_id: str) -> bytes:
        down = ServerError("service unavailable", status=503)
        raise RetryStopped(
            f"GET /v1/pool/runs/{run_id}/init-adapter: not retried after attempt 1, stopping: {down}",
            attempts=1,
            last_error=down,
        )


@pytest.mark.parametrize("stopping", [True, False], ids=["stopping", "not stopping"])
def test_an_init_from_fetch_failed_while_stopping_evicts_nothing(tmp_path: Path, stopping: bool) -> None:
    config = RunConfig.model_validate(run_config(max_steps=3, seed=5)).model_dump(mode="json")
    client = InitFetchFails([[synthetic_batch(1, n_samples=4)]], config)
    trainer = memory_trainer(client, tmp_path)
    trainer.stop_requested = stopping  # as the signal handler sets it, before the run is admitted
    try:
        trainer.run()
    finally:
        trainer.close()
    if stopping:
        assert client.evictions == {} and client.failures == {}
        assert client.runs[RUN].step == 0  # nothing trained on weights it was not given
        [run] = trainer.slots.values()
        assert run.leaving is not None and run.leaving.startswith(
            "its init_from weights were not loaded while stopping: RetryStopped: "
        ), run.leaving
    else:
        # Failed (not evicted): the run cannot start, and its failure_reason says why.
        assert client.evictions == {}
        assert client.failures[RUN].startswith("its init_from weights could not be loaded: RetryStopped: ")
