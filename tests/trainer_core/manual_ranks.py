"""Helpers of the manual-work failure tests (test_manual_grad_rollback.py, test_manual_fatal_errors.py):
the tiny pool of test_manual_isolation on any rank of a world, requests, and two real processes in a
gloo group (as test_runs_distributed.py) that each run a scenario and write what they saw."""

import json
import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from contracts.tinker_work import AdamStep, ManualDatum, ManualWorkItem
from tests.trainer_core.gloo_ranks import spawn_ranks
from tests.trainer_core.test_manual_isolation import InMemoryService, Pool
from tests.trainer_core.test_sampling import VOCAB
from trainer_core import manual
from trainer_core.dist import World
from trainer_core.manual import ManualExecutor

SEQ_LEN = 64
LONG = 40
"""Tokens of a long datum: two do not fit one SEQ_LEN row, so each runs in a row of its own."""
WORLD_SIZE = 2


class RankPool(Pool):
    """`Pool` on rank `world.rank`: the master claims from an in-memory service, the others follow."""

    def __init__(self, tmp_path: Path, world: World | None = None) -> None:
        super().__init__(tmp_path)
        self.world = world or World()

    def serve(self, items: list[ManualWorkItem]) -> dict[str, dict[str, Any]]:
        service = InMemoryService(items) if self.world.is_master else None
        executor = ManualExecutor(
            service, seq_len=SEQ_LEN, checkpoint_dir=self.tmp_path, world=self.world, vocab_size=VOCAB
        )
        executor.serve(
            model=self.model, lora=self.lora, optimizer=self.optimizer, slots=self.slots, publisher=None
        )
        return {} if service is None else service.results

    def params(self, slot: int) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.lora.slot_parameters(slot)]


def datum(n: int, first: int = 5) -> ManualDatum:
    tokens = [(first + i) % (VOCAB - 1) + 1 for i in range(n)]
    return ManualDatum(tokens=tokens, target_tokens=tokens[1:] + tokens[:1], weights=[1.0] * n)


def forward_backward(request_id: str, run_id: str, seq_id: int, *lengths: int) -> ManualWorkItem:
    """One datum per length; each long datum (LONG tokens) lands in a row of its own."""
    return ManualWorkItem(
        request_id=request_id,
        run_id=run_id,
        seq_id=seq_id,
        kind="forward_backward",
        loss_fn="cross_entropy",
        data=[datum(n, first=7 * d + 3) for d, n in enumerate(lengths)],
    )


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bit for bit."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


Scenario = Callable[[World, Path, Path], dict[str, Any]]
"""(world, shared tmp dir, out dir) → what the rank reports, as JSON."""


def _rank_main(rank: int, init_method: str, scenario: Scenario, tmp_path: Path, out_dir: Path) -> None:
    try:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # stay on loopback whatever the hostname resolves to
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=60)
        )
        try:
            seen = scenario(World(rank=rank, world_size=WORLD_SIZE), tmp_path, out_dir)
        finally:
            dist.destroy_process_group()
        (out_dir / f"rank{rank}.json").write_text(json.dumps(seen))
    except BaseException:
        (out_dir / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def on_two_ranks(scenario: Scenario, tmp_path: Path) -> list[dict[str, Any]]:
    """Run `scenario` (a module-level function: the ranks are spawned) on two gloo ranks; each
    rank's report, in rank order. Fails with a rank's traceback if one raised or hung."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    return spawn_ranks(_rank_main, (scenario, tmp_path), out_dir, world_size=WORLD_SIZE, timeout=100)


class RaisingBackward(torch.autograd.Function):
    """The identity, whose backward raises the error given to its forward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, error: BaseException) -> torch.Tensor:
        ctx.error = error
        return x.clone()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise ctx.error


@contextmanager
def failing(
    request_id: str, datum_index: int, error: BaseException, *, in_backward: bool = False
) -> Iterator[None]:
    """The loss of one datum of one request raises `error` (before the row's backward), or with
    `in_backward` its row's backward does, half-way through (after this datum's loss, the row's
    other losses' gradients flow first or not: either way part of the row's gradient may be in).
    Set on the module, so that a spawned rank can use it too (no monkeypatch fixture there)."""
    real = manual._loss

    def loss(item: ManualWorkItem, datum: ManualDatum, lp: torch.Tensor) -> torch.Tensor:
        out = real(item, datum, lp)
        if item.request_id == request_id and datum is item.data[datum_index]:
            if in_backward:
                raising: torch.Tensor = RaisingBackward.apply(out, error)
                return raising
            raise error
        return out

    manual._loss = loss
    try:
        yield
    finally:
        manual._loss = real


def same_state(a: Any, b: Any) -> bool:
    """Nested dicts / lists of tensors and plain values, equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(same_state, a, b))
    return bool(a == b)


def optim_step(request_id: str, run_id: str, seq_id: int) -> ManualWorkItem:
    adam = AdamStep(learning_rate=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
    return ManualWorkItem(request_id=request_id, run_id=run_id, seq_id=seq_id, kind="optim_step", adam=adam)
