"""What the Tinker end-to-end tests share: a one-rank pool in a thread of the test process (so a test
can pause its claims), a tenant's key, small training data, a few training steps, and waits."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import tinker
import torch
from tinker import types

from contracts.tinker_work import ManualWorkItem
from tests.common import WORKER_TOKEN
from tests.e2e.helpers import MODEL_CACHE, wait_for
from trainer_core.dist import World
from trainer_core.http_source import HttpRunSource
from trainer_core.service_client import PoolServiceClient
from trainer_core.worker import PoolTrainer, WorkerArgs

BASE_MODEL = "loraloom-tiny"


class GatedClient(PoolServiceClient):
    """The pool's service client with a pause point before each claim of manual work."""

    def __init__(self, url: str, token: str) -> None:
        super().__init__(url, token)
        self.open = threading.Event()
        self.open.set()

    def claim_manual(self, max_items: int) -> list[ManualWorkItem]:
        self.open.wait()
        return super().claim_manual(max_items)


@dataclass
class Pool:
    trainer: PoolTrainer
    client: GatedClient


def pool_args(url: str, tmp_path: Path, **overrides: Any) -> WorkerArgs:
    """The test pools' settings: 3 slots of 64 tokens, rank ≤ 8, quick polls; `overrides`: WorkerArgs
    fields (target_modules, max_rank, ...)."""
    args = WorkerArgs(
        url=url,
        token=WORKER_TOKEN,
        slots=3,
        seq_len=64,
        max_rank=8,
        checkpoint_dir=tmp_path / "ckpt",
        model_cache_dir=MODEL_CACHE,
        pack_timeout_s=0.05,
        poll_interval_s=0.02,
    )
    return replace(args, **overrides)


@contextmanager
def running_pool(url: str, tmp_path: Path, **overrides: Any) -> Iterator[Pool]:
    """A one-rank pool in a thread (`pool_args` with `overrides`)."""
    args = pool_args(url, tmp_path, **overrides)
    client = GatedClient(url, WORKER_TOKEN)
    trainer = PoolTrainer(args, world=World(), device=torch.device("cpu"), source=HttpRunSource(client))
    thread = threading.Thread(target=trainer.run, daemon=True)
    thread.start()
    try:
        yield Pool(trainer, client)
    finally:
        client.open.set()
        trainer.stop_requested = True
        thread.join(timeout=60)
        trainer.close()


def tenant_key(live_service, name: str) -> tuple[str, httpx.Client]:
    http = live_service.tenant_client(name)
    return http.headers["Authorization"].removeprefix("Bearer "), http


def datums(offset: int = 0) -> list[types.Datum]:
    rows = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5, 4], [2, 4, 6, 8, 10, 12, 14]]
    out = []
    for row in rows:
        seq = [t + offset for t in row]
        # The SDK converts plain lists to TensorData.
        inputs: dict[str, Any] = {"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)}
        out.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs))
    return out


def train_steps(training, data, steps: int, lr: float = 2e-2) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = training.forward_backward(data, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def pending_futures(live_service) -> int:
    from sqlalchemy import create_engine, text

    engine = create_engine(live_service.env["LORALOOM_DATABASE_URL"])
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    text("SELECT count(*) FROM tinker_futures WHERE status = 'pending'")
                ).scalar_one()
            )
    finally:
        engine.dispose()


def wait_until_served(url: str, key: str, *, timeout: float) -> None:
    """Until a pool has registered and the SDK's capabilities list a model."""
    wait_for(
        lambda: (
            tinker.RestClient(base_url=url, api_key="tml-" + key)
            .get_server_capabilities()
            .result()
            .supported_models
        ),
        timeout=timeout,
        what="the pool to register",
    )
