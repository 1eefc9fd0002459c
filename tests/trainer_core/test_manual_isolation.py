"""One Tinker request's failure on the pool is its own (probe 2, finding 1): the pool serves every
tenant in one process, and an exception out of a round stopped it for all of them. Here the real
ManualExecutor and SampleServer on a tiny model, fed by an in-memory service side that encodes each
report as the pool's HTTP client does (strict JSON: no NaN, no infinity):

- a sample with temperature 1e-40 (what stopped the pool) is answered, greedily, beside a good one;
- a sample whose decoding raises fails alone; the others are answered as if it had not been there;
- a forward_backward whose row raises fails alone: the other tenant's request in the same row gets
  the same logprobs and gradients as without it (its row ran again without the failing request);
- a row whose backward raises fails its requests, not the pool, and none of their gradients stays;
- a forward_backward whose loss is infinite fails alone instead of making the round's report
  unencodable (which raised out of the round too).

Failures are injected where a test needs one that the fixed code no longer produces by itself."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from contracts.progress import Progress
from contracts.run_config import LoraSettings, RunConfig
from contracts.tinker_work import ManualDatum, ManualResult, ManualResultsIn, ManualWorkItem, SamplingSpec
from tests.trainer_core.test_sampling import VOCAB, tiny_model
from trainer_core import manual, sampling
from trainer_core.lora import MultiLoRA
from trainer_core.manual import ManualExecutor
from trainer_core.models.attention import PACKED_ATTENTION
from trainer_core.optim import MultiRunOptimizer
from trainer_core.sample_server import SampleServer
from trainer_core.slots import RunSlot

CONFIG = RunConfig(
    mode="manual", lora=LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
)
POISON_SEED = 13


class InMemoryService:
    """The service side of manual work: hands out one claim, keeps the reports as the service
    receives them (each encoded like httpx's `json=`, which refuses NaN and infinity)."""

    def __init__(self, items: list[ManualWorkItem]) -> None:
        self.items = items
        self.results: dict[str, dict[str, Any]] = {}

    def claim_manual(self, max_items: int) -> list[ManualWorkItem]:
        items, self.items = self.items[:max_items], self.items[max_items:]
        return items

    def report_manual(self, results: list[ManualResult]) -> None:
        body = ManualResultsIn(pool_id="pool_test", results=results).model_dump(mode="json")
        for result in json.loads(json.dumps(body, allow_nan=False))["results"]:
            self.results[result["request_id"]] = result


def _sample(request_id: str, temperature: float, seed: int, run_id: str = "", step: int | None = None):
    spec = SamplingSpec(
        prompt=[5, 6, 7],
        num_samples=2,
        max_tokens=6,
        temperature=temperature,
        top_k=-1,
        top_p=1.0,
        seed=seed,
        step=step,
        base_model=None if step is not None else "tiny",
    )
    return ManualWorkItem(request_id=request_id, run_id=run_id, seq_id=0, kind="sample", sampling=spec)


def _forward_backward(request_id: str, run_id: str, seq_id: int, weight: float = 1.0) -> ManualWorkItem:
    datum = ManualDatum(tokens=[5, 6, 7, 8, 9], target_tokens=[6, 7, 8, 9, 10], weights=[weight] * 5)
    return ManualWorkItem(
        request_id=request_id,
        run_id=run_id,
        seq_id=seq_id,
        kind="forward_backward",
        loss_fn="cross_entropy",
        data=[datum],
    )


class Pool:
    """A one-rank pool's manual side: the tiny model with two manual runs in slots 0 and 1."""

    def __init__(self, tmp_path: Path) -> None:
        self.model, self.lora = tiny_model(PACKED_ATTENTION)
        self.optimizer = MultiRunOptimizer(self.lora.n_slots)
        self.slots = {s: RunSlot(s, f"run_{s}", CONFIG, Progress(step=1)) for s in (0, 1)}
        for s in self.slots:
            self.optimizer.create(
                s,
                self.lora.slot_parameters(s),
                optim=CONFIG.optim,
                scheduler=CONFIG.scheduler,
                max_steps=CONFIG.max_steps,
            )
        self.tmp_path = tmp_path

    def serve(self, items: list[ManualWorkItem]) -> dict[str, dict[str, Any]]:
        service = InMemoryService(items)
        executor = ManualExecutor(service, seq_len=64, checkpoint_dir=self.tmp_path, vocab_size=VOCAB)
        executor.serve(
            model=self.model, lora=self.lora, optimizer=self.optimizer, slots=self.slots, publisher=None
        )
        assert not service.items
        return service.results

    def grads(self, slot: int) -> list[torch.Tensor]:
        return [
            torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in self.lora.slot_parameters(slot)
        ]


def _poison_pick_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding raises for the requests seeded POISON_SEED (and for those only)."""
    real = sampling.pick_token

    def pick_token(logits: torch.Tensor, spec: SamplingSpec, generator: torch.Generator) -> int:
        if spec.seed == POISON_SEED:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real(logits, spec, generator)

    monkeypatch.setattr(sampling, "pick_token", pick_token)


def test_the_probe_s_sample_is_answered_greedily_beside_another_tenant_s(tmp_path):
    pool = Pool(tmp_path)
    results = pool.serve(
        [_sample("poison", 1e-40, seed=1), _sample("greedy", 0.0, seed=2), _sample("good", 1.0, seed=3)]
    )
    assert {r: results[r]["error"] for r in results} == {"poison": None, "greedy": None, "good": None}
    poison = [s["tokens"] for s in results["poison"]["sequences"]]
    assert poison == [s["tokens"] for s in results["greedy"]["sequences"]]
    assert len(results["good"]["sequences"]) == 2


def test_a_sample_that_raises_fails_alone_and_the_others_are_answered_as_without_it(tmp_path, monkeypatch):
    pool = Pool(tmp_path)
    good = [_sample("good_base", 1.0, seed=3), _sample("good_run", 0.9, seed=4, run_id="run_1", step=1)]
    alone = pool.serve(good)
    _poison_pick_token(monkeypatch)
    together = pool.serve([_sample("bad", 1.0, seed=POISON_SEED), *good])

    assert together["bad"]["sequences"] is None
    assert together["bad"]["error"].startswith("the pool could not sample this request: RuntimeError")
    for request_id in ("good_base", "good_run"):
        assert together[request_id] == alone[request_id]


def test_the_sample_server_fails_only_the_request_that_raises(tmp_path, monkeypatch):
    model, lora = tiny_model(PACKED_ATTENTION)
    _poison_pick_token(monkeypatch)
    server = SampleServer(tmp_path)
    results = server.serve(
        model,
        lora,
        [(0, _sample("bad", 1.0, seed=POISON_SEED), None), (1, _sample("ok", 1.0, seed=1), None)],
        {},
    )
    assert (
        results[0].error is not None and "RuntimeError" in results[0].error and results[0].sequences is None
    )
    assert results[1].error is None and results[1].sequences is not None and len(results[1].sequences) == 2
    assert server.passes == 1  # only the good request's own pass ran to its end


def _lose_on(monkeypatch: pytest.MonkeyPatch, request_id: str) -> None:
    """The loss of `request_id` raises (a request whose pass fails on the pool)."""
    real = manual._loss

    def loss(item: ManualWorkItem, datum: ManualDatum, lp: torch.Tensor) -> torch.Tensor:
        if item.request_id == request_id:
            # Not a device error (those stop the pool: test_manual_fatal_errors.py).
            raise RuntimeError("the loss of this request raised")
        return real(item, datum, lp)

    monkeypatch.setattr(manual, "_loss", loss)


def test_a_forward_backward_that_raises_fails_alone_and_its_row_neighbour_is_untouched(tmp_path, monkeypatch):
    clean = Pool(tmp_path / "clean")
    expected = clean.serve([_forward_backward("good", "run_0", 1)])
    expected_grads = clean.grads(0)

    pool = Pool(tmp_path / "poisoned")
    _lose_on(monkeypatch, "bad")
    # One row: both requests' five tokens fit the 64-token rows, slot 0 then slot 1.
    results = pool.serve([_forward_backward("good", "run_0", 1), _forward_backward("bad", "run_1", 1)])

    assert results["bad"]["error"].startswith("the pool could not run this forward_backward: RuntimeError")
    assert results["good"]["error"] is None
    assert results["good"]["logprobs"] == expected["good"]["logprobs"]
    assert results["good"]["metrics"] == expected["good"]["metrics"]
    # Its gradient was added once: the failed row added nothing, the row run again added it.
    for got, want in zip(pool.grads(0), expected_grads, strict=True):
        torch.testing.assert_close(got, want)
    assert all(torch.all(g == 0) for g in pool.grads(1))  # the failed request added nothing
    assert pool.slots[1].step_metrics.samples == 0 and pool.slots[0].step_metrics.samples == 1


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("CUDA out of memory during the backward")


def test_a_row_whose_backward_raises_fails_its_requests_and_does_not_run_again(tmp_path, monkeypatch):
    """Part of the row's gradients may be accumulated: running it again would add them twice. Every
    request of the row fails, its gradients rolled back; the pool goes on (the next round trains as
    usual)."""
    pool = Pool(tmp_path)
    real = manual._loss

    def loss(item: ManualWorkItem, datum: ManualDatum, lp: torch.Tensor) -> torch.Tensor:
        out = real(item, datum, lp)
        return _FailingBackward.apply(out) if item.request_id == "bad" else out

    monkeypatch.setattr(manual, "_loss", loss)
    results = pool.serve([_forward_backward("good", "run_0", 1), _forward_backward("bad", "run_1", 1)])
    for request_id in ("good", "bad"):
        error = results[request_id]["error"]
        assert error.startswith("the pool's backward pass of this request failed: RuntimeError"), error
        assert "nothing of its gradient was kept" in error
    assert all(torch.all(g == 0) for slot in (0, 1) for g in pool.grads(slot))
    monkeypatch.undo()
    after = pool.serve([_forward_backward("next", "run_0", 2)])
    assert after["next"]["error"] is None and after["next"]["logprobs"]


def test_a_forward_backward_with_an_infinite_loss_fails_alone_and_the_report_encodes(tmp_path):
    """Weights of 3e38 make a cross-entropy loss of ~1e39: infinite in float32. Its report could not
    be encoded as JSON, which raised out of the round and stopped the pool."""
    pool = Pool(tmp_path)
    results = pool.serve(
        [_forward_backward("huge", "run_1", 1, weight=3e38), _forward_backward("ok", "run_0", 1)]
    )
    assert results["huge"]["error"] is not None and "not finite" in results["huge"]["error"]
    assert results["huge"]["logprobs"] is None
    assert results["ok"]["error"] is None and len(results["ok"]["logprobs"][0]) == 5


def test_a_round_whose_sampling_raises_outside_the_sample_server_fails_its_samples_only(
    tmp_path, monkeypatch
):
    pool = Pool(tmp_path)

    def broken(self: SampleServer, *args: Any) -> dict[int, ManualResult]:
        raise OSError("No space left on device")

    monkeypatch.setattr(SampleServer, "serve", broken)
    results = pool.serve([_sample("s", 1.0, seed=1), _forward_backward("fb", "run_0", 1)])
    assert results["s"]["error"] == "the pool could not sample this request: OSError: No space left on device"
    assert results["fb"]["error"] is None and results["fb"]["logprobs"]


def test_lora_slots_stay_routable_after_a_failed_pass(tmp_path, monkeypatch):
    """A pass that raised inside the multi-LoRA routing left it usable: the next round's requests
    go through their own adapters as before."""
    pool = Pool(tmp_path)
    before = pool.serve([_sample("a", 0.0, seed=1, run_id="run_0", step=1)])
    _poison_pick_token(monkeypatch)
    pool.serve([_sample("bad", 1.0, seed=POISON_SEED, run_id="run_0", step=1)])
    monkeypatch.undo()
    after = pool.serve([_sample("a", 0.0, seed=1, run_id="run_0", step=1)])
    assert after == before
    assert isinstance(pool.lora, MultiLoRA)
