"""Loose ends of the Tinker API (issue 16), with the unmodified `tinker` SDK against the real service
and a real pool (in a thread of this process, tests.e2e.test_tinker_pool.running_pool):

- a run that loads older saved weights (`load_state`) and trains on comes back after a pool
  restart with the weights it really holds, not those of the higher-numbered checkpoints of the
  history it left;
- a pool the service declared dead that learns it from a Tinker claim or report (not from its
  heartbeat) stops cleanly, dropping its Tinker state; a new pool serves its requests;
- the copies of sampler weights the pool keeps for a run's sampling clients go when the run is
  deleted (the pool's checkpoint directory is its own here, not the service's data directory);
- with `sampler_url`, `sample` is served by an external OpenAI-compatible server (a fake vLLM).
"""

import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
import torch
from sqlalchemy import create_engine, update
from sqlalchemy.orm import Session

from app.config import Settings
from app.db import utcnow
from app.pools.models import Pool
from app.pools.service import declare_dead_pools
from contracts.pool_api import PoolHeartbeatOut
from contracts.tinker_work import ManualResult, ManualWorkItem
from tests.common import WORKER_TOKEN
from tests.e2e.helpers import wait_for
from tests.e2e.tinker_harness import BASE_MODEL, datums, pool_args, running_pool, tenant_key, train_steps
from tests.trainer_core.test_external_sampler import serving_fake_vllm
from trainer_core.dist import World
from trainer_core.http_source import HttpRunSource
from trainer_core.service_client import PoolServiceClient
from trainer_core.worker import PoolTrainer

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only, pytest.mark.timeout(300)]


def _logprobs(training: Any, data: list[Any]) -> list[np.ndarray]:
    out = training.forward(data, "cross_entropy").result()
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def _same(got: list[np.ndarray], want: list[np.ndarray]) -> bool:
    return all(np.allclose(g, w, atol=1e-5) for g, w in zip(got, want, strict=True))


@pytest.mark.filterwarnings("ignore:DEPRECATED.*load_state:FutureWarning")  # the call under test
def test_a_run_that_loaded_older_weights_restores_them_after_a_pool_restart(live_service, tmp_path):
    key, http = tenant_key(live_service, "tinker-load-restart")
    data = datums()
    service = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key)
    try:
        with running_pool(live_service.url, tmp_path):
            training = service.create_lora_training_client(
                BASE_MODEL, rank=4, seed=7, train_unembed=False, train_mlp=False
            ).result()
            train_steps(training, data, steps=2)
            saved = training.save_state("at-2").result()
            at_2 = _logprobs(training, data)
            train_steps(training, data, steps=2)  # checkpoints of steps 3 and 4 on the pool
            assert not _same(_logprobs(training, data), at_2)
            training.load_state(saved.path).result()
            assert _same(_logprobs(training, data), at_2)

        # A new pool: the load is replayed on top of the newest checkpoint (step 4).
        with running_pool(live_service.url, tmp_path):
            assert _same(_logprobs(training, data), at_2)
            # One step from the loaded weights: step 3 again, checkpointed; the load's request
            # is no longer kept (nothing to replay), so the checkpoint alone must hold it.
            train_steps(training, data, steps=1)
            after = _logprobs(training, data)
            assert not _same(after, at_2)

        with running_pool(live_service.url, tmp_path):
            assert _same(_logprobs(training, data), after)
    finally:
        service.close("success").result()
        http.close()


class DyingClient(PoolServiceClient):
    """The pool's service client; once `die_at` is set, the pool is declared dead (as the sweeper
    does) right before its next Tinker claim or report, and its heartbeats no longer reach the
    service, so only that claim or report can tell the pool."""

    def __init__(self, url: str, token: str, database_url: str) -> None:
        super().__init__(url, token)
        self.database_url = database_url
        self.die_at: str | None = None
        self.dead = threading.Event()

    def _die_if(self, point: str) -> None:
        if self.die_at != point or self.dead.is_set():
            return
        engine = create_engine(self.database_url)
        try:
            with Session(engine) as session:
                long_ago = utcnow() - timedelta(hours=1)
                session.execute(
                    update(Pool).where(Pool.id == self.pool_id).values(last_heartbeat_at=long_ago)
                )
                settings = Settings(database_url=self.database_url)
                assert declare_dead_pools(session, now=utcnow(), settings=settings) == [self.pool_id]
                session.commit()
        finally:
            engine.dispose()
        self.dead.set()

    def heartbeat(self) -> PoolHeartbeatOut:
        if self.dead.is_set():
            raise ConnectionError("held back by the test")  # transient to the pool: it beats on
        return super().heartbeat()

    def claim_manual(self, max_items: int) -> list[ManualWorkItem]:
        self._die_if("claim")
        return super().claim_manual(max_items)

    def report_manual(self, results: list[ManualResult]) -> None:
        self._die_if("report")
        super().report_manual(results)


@dataclass
class PoolThread:
    trainer: PoolTrainer
    thread: threading.Thread
    errors: list[BaseException] = field(default_factory=list)


def _start_dying_pool(live_service, tmp_path, client: DyingClient) -> PoolThread:
    trainer = PoolTrainer(
        pool_args(live_service.url, tmp_path),
        world=World(),
        device=torch.device("cpu"),
        source=HttpRunSource(client),
    )
    errors: list[BaseException] = []

    def run() -> None:
        try:
            trainer.run()
        except BaseException as exc:  # what the test asserts never happens
            errors.append(exc)
        finally:
            trainer.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return PoolThread(trainer, thread, errors)


@pytest.mark.parametrize("dies_at", ["claim", "report"])
def test_a_pool_declared_dead_stops_its_tinker_work_cleanly_and_a_new_pool_serves_it(
    live_service, tmp_path, caplog, dies_at
):
    caplog.set_level(logging.ERROR, logger="loraloom.worker")
    key, http = tenant_key(live_service, "tinker-dead-pool")
    data = datums()
    client = DyingClient(live_service.url, WORKER_TOKEN, live_service.env["LORALOOM_DATABASE_URL"])
    pool = _start_dying_pool(live_service, tmp_path, client)
    service = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key)
    try:
        training = service.create_lora_training_client(
            BASE_MODEL, rank=4, seed=9, train_unembed=False, train_mlp=False
        ).result()
        train_steps(training, data, steps=1)
        # Gradients accumulated on the pool, not stepped yet.
        training.forward_backward(data, "cross_entropy").result()
        slot = next(iter(pool.trainer.slots))
        assert any(p.grad is not None for p in pool.trainer.lora.slot_parameters(slot))

        client.die_at = dies_at
        # "claim": the pool's next claim learns it; "report": the results of this request.
        pending = training.forward_backward(data, "cross_entropy")
        pool.thread.join(timeout=60)
        assert not pool.thread.is_alive() and pool.errors == []
        assert client.dead.is_set()
        assert f"(pool_dead, answering its Tinker {dies_at})" in caplog.text
        assert "declared dead: no heartbeat reached the service" in caplog.text  # what it means
        assert pool.trainer.manual is not None and pool.trainer.manual.lost
        # Its Tinker state is dropped: the gradients it held are gone.
        assert all(p.grad is None for p in pool.trainer.lora.slot_parameters(slot))

        # A new pool rebuilds the step (the delivered forward_backward replayed) and serves the rest.
        with running_pool(live_service.url, tmp_path):
            result = pending.result(timeout=60)
            assert len(result.loss_fn_outputs) == len(data)
            training.optim_step(tinker.types.AdamParams(learning_rate=2e-2)).result(timeout=60)
    finally:
        service.close("success").result()
        http.close()


def test_the_sampler_weights_kept_for_a_run_go_when_it_is_deleted(live_service, tmp_path):
    key, http = tenant_key(live_service, "tinker-sampler-cleanup")
    data = datums()
    service = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key)
    try:
        with running_pool(live_service.url, tmp_path):
            kept, other = [
                service.create_lora_training_client(
                    BASE_MODEL, rank=4, seed=seed, train_unembed=False, train_mlp=False
                ).result()
                for seed in (1, 2)
            ]
            for training in (kept, other):
                train_steps(training, data, steps=1)
                training.save_weights_for_sampler("s1").result()
            runs = {r["config"]["seed"]: r["id"] for r in http.get("/v1/runs").json()["items"]}
            copies = {seed: tmp_path / "ckpt" / run_id / "sampler_weights" for seed, run_id in runs.items()}
            assert (copies[1] / "step_1").is_dir() and (copies[2] / "step_1").is_dir()

            assert http.delete(f"/v1/runs/{runs[2]}").status_code in (200, 204)
            wait_for(
                lambda: not copies[2].exists(), timeout=30, what="the deleted run's sampler weights removed"
            )
            assert (copies[1] / "step_1").is_dir()  # another run's stay
            # and the deleted run's checkpoints go too (the pool asks which runs were deleted)
            wait_for(
                lambda: not (tmp_path / "ckpt" / runs[2]).exists(),
                timeout=30,
                what="the deleted run's checkpoint directory removed",
            )
            assert (tmp_path / "ckpt" / runs[1] / "checkpoints").is_dir()
    finally:
        service.close("success").result()
        http.close()


def test_with_a_sampler_url_the_sdks_samples_come_from_the_external_server(live_service, tmp_path):
    key, http = tenant_key(live_service, "tinker-external-sampler")
    service = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key)
    try:
        with serving_fake_vllm() as (url, fake), running_pool(live_service.url, tmp_path, sampler_url=url):
            training = service.create_lora_training_client(
                BASE_MODEL, rank=4, seed=4, train_unembed=False, train_mlp=False
            ).result()
            train_steps(training, datums(), steps=1)
            path = training.save_weights_for_sampler("s1").result().path
            sampler = service.create_sampling_client(model_path=path).result()
            prompt = tinker.types.ModelInput.from_ints([5, 6, 7])
            params = tinker.types.SamplingParams(max_tokens=3, temperature=0.5, seed=2)
            out = sampler.sample(prompt=prompt, num_samples=2, sampling_params=params).result(timeout=60)
            # The fake's answer (prompt[-1] + 1, ...; logprob -0.25), with the run's adapter loaded.
            assert [list(s.tokens) for s in out.sequences] == [[8, 9, 10], [9, 10, 11]]
            assert all(list(s.logprobs or []) == [-0.25] * 3 for s in out.sequences)
            assert len(fake.loads) == 1 and Path(fake.loads[0]["lora_path"]).parts[-3:] == (
                "sampler_weights",
                "step_1",
                "peft",
            )
            assert fake.completions[0]["model"] == fake.loads[0]["lora_name"]
            assert fake.completions[0]["seed"] == 2 and fake.completions[0]["temperature"] == 0.5
    finally:
        service.close("success").result()
        http.close()
