"""One tenant's request cannot stop the pool that serves every tenant (probe 2, finding 1). Real
processes: Postgres, the service under uvicorn, a torchrun pool (one rank, and two: the master samples
alone while the other rank waits), the tiny model, the unmodified `tinker` SDK.

The attacker sends what stopped the pool before: a `sample` at temperature 1e-40 (its softmax was
NaN, and `torch.multinomial` raised out of the pool's loop), and a forward_backward whose loss is
infinite in float32 (its report could not be encoded as JSON, which raised out of the loop too). The
first is answered greedily, the second fails alone with a clear error; the pool process stays up, and
the victim's training and sampling go on."""

import pytest
import tinker
from tinker import types

from tests.e2e.helpers import kill_pool, start_pool
from tests.e2e.tinker_harness import BASE_MODEL, datums, tenant_key, train_steps, wait_until_served

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only, pytest.mark.timeout(400)]

PROMPT = types.ModelInput.from_ints([1, 20, 21, 22])


def _new_model(service: tinker.ServiceClient):
    return service.create_lora_training_client(
        BASE_MODEL, rank=4, seed=1, train_unembed=False, train_mlp=False
    ).result()


@pytest.mark.parametrize("nproc", [1, 2])
def test_poison_requests_fail_alone_and_the_pool_serves_everyone_after(live_service, tmp_path, nproc):
    victim_key, _ = tenant_key(live_service, "poison-victim")
    attacker_key, _ = tenant_key(live_service, "poison-attacker")
    pool = start_pool(
        live_service.url, data_dir=live_service.data_dir, nproc=nproc, log_path=tmp_path / "pool.log"
    )
    victim = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + victim_key)
    attacker = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + attacker_key)
    try:
        wait_until_served(live_service.url, victim_key, timeout=120)
        training = _new_model(victim)
        train_steps(training, datums(), steps=1)

        # The probe's request: a base-model sample at temperature 1e-40. It is the greedy sequence.
        sampler = attacker.create_sampling_client(base_model=BASE_MODEL).result()
        greedy = sampler.sample(
            PROMPT, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
        ).result()
        poison = sampler.sample(
            PROMPT, 2, types.SamplingParams(max_tokens=6, temperature=1e-40, stop=[])
        ).result(timeout=120)  # before the fix: the pool died, and this waited forever
        assert [list(s.tokens) for s in poison.sequences] == [list(greedy.sequences[0].tokens)] * 2
        assert pool.poll() is None, "the pool stopped on a temperature-1e-40 sample"

        # A forward_backward whose loss is ~1e39: infinite in float32. It fails alone.
        attacking = _new_model(attacker)
        huge = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
            loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [3e38] * 4},
        )
        with pytest.raises(tinker.RequestFailedError, match="not finite"):
            attacking.forward_backward([huge], "cross_entropy").result(timeout=120)
        assert pool.poll() is None, "the pool stopped on an infinite loss"

        # The victim trains on and samples its new weights; so does the attacker's sampler.
        assert all(loss > 0 for loss in train_steps(training, datums(), steps=2))
        path = training.save_weights_for_sampler("after").result().path
        own = victim.create_sampling_client(model_path=path).result()
        sampled = own.sample(PROMPT, 2, types.SamplingParams(max_tokens=4, seed=3, stop=[])).result()
        assert [len(s.tokens) for s in sampled.sequences] == [4, 4]
        again = sampler.sample(
            PROMPT, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
        ).result()
        assert list(again.sequences[0].tokens) == list(greedy.sequences[0].tokens)
        assert pool.poll() is None
    finally:
        victim.close("success").result()
        attacker.close("success").result()
        kill_pool(pool)
