"""Loose ends of the Tinker API (issue 16), with the unmodified `tinker` SDK against the real service
and a real pool (in a thread of this process, tests.e2e.test_tinker_pool.running_pool):

- a run that loads older saved weights (`load_state`) and trains on comes back after a pool
  restart with the weights it really holds, not those of the higher-numbered checkpoints of the
  history it left.
"""

from typing import Any

import numpy as np
import pytest
import tinker

from tests.e2e.test_tinker_pool import BASE_MODEL, _data, _key, _train, running_pool

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only, pytest.mark.timeout(300)]


def _logprobs(training: Any, data: list[Any]) -> list[np.ndarray]:
    out = training.forward(data, "cross_entropy").result()
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def _same(got: list[np.ndarray], want: list[np.ndarray]) -> bool:
    return all(np.allclose(g, w, atol=1e-5) for g, w in zip(got, want, strict=True))


@pytest.mark.filterwarnings("ignore:DEPRECATED.*load_state:FutureWarning")  # the call under test
def test_a_run_that_loaded_older_weights_restores_them_after_a_pool_restart(live_service, tmp_path):
    key, http = _key(live_service, "tinker-load-restart")
    data = _data()
    service = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key)
    try:
        with running_pool(live_service.url, tmp_path):
            training = service.create_lora_training_client(
                BASE_MODEL, rank=4, seed=7, train_unembed=False, train_mlp=False
            ).result()
            _train(training, data, steps=2)
            saved = training.save_state("at-2").result()
            at_2 = _logprobs(training, data)
            _train(training, data, steps=2)  # checkpoints of steps 3 and 4 on the pool
            assert not _same(_logprobs(training, data), at_2)
            training.load_state(saved.path).result()
            assert _same(_logprobs(training, data), at_2)

        # A new pool: the load is replayed on top of the newest checkpoint (step 4).
        with running_pool(live_service.url, tmp_path):
            assert _same(_logprobs(training, data), at_2)
            # One step from the loaded weights: step 3 again, checkpointed; the load's request
            # is no longer kept (nothing to replay), so the checkpoint alone must hold it.
            _train(training, data, steps=1)
            after = _logprobs(training, data)
            assert not _same(after, at_2)

        with running_pool(live_service.url, tmp_path):
            assert _same(_logprobs(training, data), after)
    finally:
        service.close("success").result()
        http.close()
