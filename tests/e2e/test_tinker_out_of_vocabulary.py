"""A token id outside the base model's vocabulary, stored while no pool is live (the service knows no
vocabulary then, so it cannot refuse it), fails that request alone when a pool claims it; the pool
trains another tenant's requests in the same minute. Before, the id reached the model's embedding
and the pool's training thread died: every tenant stopped (review of 2026-11-23, H1)."""

import pytest
import tinker
from tinker import types

from contracts.run_config import RunConfig
from tests.e2e.tinker_harness import BASE_MODEL, datums, running_pool, tenant_key, train_steps

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only, pytest.mark.timeout(300)]

OUT_OF_VOCABULARY = 50_000  # a valid int32; the tiny model's vocabulary is far smaller


def test_an_out_of_vocabulary_request_fails_alone_and_the_pool_serves_the_others(live_service, tmp_path):
    bad_key, _ = tenant_key(live_service, "oov-sender")
    good_key, _ = tenant_key(live_service, "oov-neighbour")
    bad_service = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + bad_key)
    good_service = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + good_key)
    try:
        bad = bad_service.create_lora_training_client(  # no pool yet: the run waits for one
            BASE_MODEL, rank=4, train_unembed=False, train_mlp=False
        ).result()
        poison = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, OUT_OF_VOCABULARY]),
            loss_fn_inputs={"target_tokens": [2, OUT_OF_VOCABULARY, 3], "weights": [1.0, 1.0, 1.0]},
        )
        refused = bad.forward_backward([poison], "cross_entropy")  # stored: no vocabulary to check
        # The run was made without a pool, so with the default seq_len: the pool serves that length.
        with running_pool(live_service.url, tmp_path, seq_len=RunConfig.model_fields["seq_len"].default):
            with pytest.raises(Exception, match="outside the vocabulary") as failure:
                refused.result()
            good = good_service.create_lora_training_client(
                BASE_MODEL, rank=4, train_unembed=False, train_mlp=False
            ).result()
            losses = train_steps(good, datums(), steps=2)
            assert all(loss > 0 for loss in losses)
            # The sender's model still works with ids in range (only the one request failed).
            assert train_steps(bad, datums(), steps=1)[0] > 0
        assert "datum 0" in str(failure.value)
    finally:
        bad_service.close("success").result()
        good_service.close("success").result()
