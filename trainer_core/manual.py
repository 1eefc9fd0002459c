"""Manual-mode work on the pool (the Tinker API, DESIGN §11): forward, forward_backward, optim_step.

    claim         the pending work of every active manual run (per run in seq_id order, up to and
                  including its next optim_step: the service cuts each run's list at that boundary)
    passes        every datum of every claimed forward / forward_backward, of every tenant, packed
                  into rows of at most seq_len tokens in ascending slot order: one forward per row
                  through the multi-LoRA layers (each run's tokens through its own adapter), then
                  one backward of the row's summed forward_backward losses
    optim_steps   per run, AdamW with the request's parameters on the gradients accumulated since
                  its previous step (no batch_size accounting, no normalisation: Tinker's losses
                  are sums over tokens), then the adapter and the step's metrics are published
                  like any other run's step
    samples       every claimed `sample` request decoded together, with a KV cache, each sequence
                  through its own weights (trainer_core.sample_server, trainer_core.sampling)
    results       logprobs of every target token, the elementwise loss and "loss:sum" per request

The losses, with lp the current logprob of each target token and w, old_lp, A the datum's
weights, sampler logprobs and advantages (elementwise, summed over tokens and datums):
cross_entropy −w·lp; importance_sampling −exp(lp − old_lp)·A; ppo −min(r·A, clip(r, lo, hi)·A)
with r = exp(lp − old_lp) and lo/hi = loss_fn_config clip_low_threshold / clip_high_threshold
(default 0.8 / 1.2); cispo −sg(clip(r, lo, hi))·A·lp (sg: no gradient through the weight).

Isolation holds as for rollout batches: a row's attention never crosses samples, each token goes
through its own run's adapter only, and the row's loss is a plain sum, so each run's gradients
are exactly those of its own loss. Master-only: a pool with several ranks does not serve manual
runs yet (their requests fail with that reason).
"""

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from contracts.tinker_work import ManualDatum, ManualResult, ManualWorkItem
from trainer_core.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer_core.lora import MultiLoRA
from trainer_core.modeling import forward_packed
from trainer_core.optim import MultiRunOptimizer
from trainer_core.packing import MicroBatch
from trainer_core.publish import Publisher
from trainer_core.sample_server import SampleServer, save_sampler_weights
from trainer_core.sampling import PassLimits, TextDecoder
from trainer_core.slots import RunSlot

log = logging.getLogger("loraloom.worker")

MAX_CLAIM = 64
SAMPLING_CACHE_ROWS = 16
PPO_CLIP = (0.8, 1.2)

__all__ = ["ManualExecutor", "ManualWorkClient"]


@runtime_checkable
class ManualWorkClient(Protocol):
    """The service side of manual work (`PoolServiceClient` implements it)."""

    def claim_manual(self, max_items: int) -> list[ManualWorkItem]: ...

    def report_manual(self, results: list[ManualResult]) -> None: ...


@dataclass
class _Sample:
    slot: int
    item: int
    """Index of the request in the claim."""
    datum: int
    tokens: list[int]


@dataclass
class _Outputs:
    logprobs: list[list[float]]
    losses: list[list[float]]
    loss_sum: float = 0.0
    weighted_tokens: int = 0


@dataclass
class ManualExecutor:
    client: ManualWorkClient
    seq_len: int
    checkpoint_dir: Path
    """The pool's checkpoint home: saved Tinker states live in `{run_id}/tinker_states/{name}`."""
    passes: int = 0
    """Forward passes (rows) run for manual work."""
    mixed_passes: int = 0
    """Rows that held the tokens of more than one run: requests of several tenants in one pass."""
    text_decoder: Callable[[], TextDecoder] | None = None
    """Loads the base model's tokenizer, for stop strings (trainer_core.sample_server)."""
    samples: SampleServer = field(init=False)

    def __post_init__(self) -> None:
        # A pass's KV cache up to SAMPLING_CACHE_ROWS training rows of tokens; its prompt-scoring
        # prefill logits no more than one training row's forward keeps.
        limits = PassLimits(cache_tokens=SAMPLING_CACHE_ROWS * self.seq_len, prompt_logit_tokens=self.seq_len)
        self.samples = SampleServer(self.checkpoint_dir, self.text_decoder, limits)

    def serve(
        self,
        *,
        model: nn.Module,
        lora: MultiLoRA,
        optimizer: MultiRunOptimizer,
        slots: Mapping[int, RunSlot],
        publisher: Publisher,
        multi_rank: bool,
    ) -> bool:
        """Claim and execute one round of manual work; False when none ran."""
        items = self.client.claim_manual(MAX_CLAIM)
        if not items:
            return False
        slot_of = {run.run_id: slot for slot, run in slots.items() if run.leaving is None}
        results: list[ManualResult] = []
        runnable: list[tuple[int, ManualWorkItem]] = []
        for index, item in enumerate(items):
            if multi_rank:
                results.append(
                    _failed(item, "not supported by loraloom yet: Tinker models on a multi-rank pool")
                )
            elif item.run_id not in slot_of and not _samples_base_model(item):
                # Not admitted here yet (active at the service since this loop's look), or leaving:
                # the service hands it out again, or fails it if the run has left. (Sampling the
                # base model needs no run.)
                results.append(ManualResult(request_id=item.request_id, release=True))
            else:
                runnable.append((index, item))
        outputs = self._passes(
            model,
            lora,
            [(i, it, slot_of[it.run_id]) for i, it in runnable if it.kind in ("forward", "forward_backward")],
        )
        sampled = self.samples.serve(
            model, lora, [(i, it, slot_of.get(it.run_id)) for i, it in runnable if it.kind == "sample"], slots
        )
        for index, item in runnable:
            if item.kind == "sample":
                results.append(sampled[index])
                continue
            slot = slot_of[item.run_id]
            if item.kind == "optim_step":
                results.append(_optim_step(item, slots[slot], optimizer, publisher))
                continue
            if item.kind == "save_weights_for_sampler":
                results.append(_saved(item, slots[slot], lora, self.checkpoint_dir))
                continue
            if item.kind == "save_weights":
                results.append(_save_state(item, slots[slot], lora, optimizer, self.checkpoint_dir))
                continue
            if item.kind == "load_weights":
                results.append(_load_state(item, slots[slot], lora, optimizer, self.checkpoint_dir))
                continue
            out = outputs[index]
            run = slots[slot]
            if item.kind == "forward_backward":
                acc = run.step_metrics
                acc.loss_sum += out.loss_sum
                acc.loss_tokens += out.weighted_tokens
                acc.tokens += sum(len(d.tokens) for d in item.data)
                acc.samples += len(item.data)
            results.append(
                ManualResult(
                    request_id=item.request_id,
                    logprobs=out.logprobs,
                    elementwise_loss=out.losses,
                    metrics={"loss:sum": out.loss_sum},
                )
            )
        self.client.report_manual(results)
        # Only released items: nothing ran, so the loop may sleep as when idle.
        return any(not r.release for r in results)

    # -- passes ------------------------------------------------------------------------------------

    def _passes(
        self, model: nn.Module, lora: MultiLoRA, work: Sequence[tuple[int, ManualWorkItem, int]]
    ) -> dict[int, _Outputs]:
        outputs = {
            index: _Outputs(logprobs=[[] for _ in item.data], losses=[[] for _ in item.data])
            for index, item, _ in work
        }
        items = {index: item for index, item, _ in work}
        samples = sorted(
            (
                _Sample(slot=slot, item=index, datum=d, tokens=datum.tokens)
                for index, item, slot in work
                for d, datum in enumerate(item.data)
            ),
            key=lambda s: s.slot,
        )
        for row in _rows(samples, self.seq_len):
            self._row(model, lora, row, items, outputs)
        return outputs

    def _row(
        self,
        model: nn.Module,
        lora: MultiLoRA,
        row: list[_Sample],
        items: Mapping[int, ManualWorkItem],
        outputs: dict[int, _Outputs],
    ) -> None:
        mb = _micro_batch(row, lora.n_slots)
        self.passes += 1
        if len({s.slot for s in row}) > 1:
            self.mixed_passes += 1
        with lora.segments(mb.slot_token_counts):
            logits = forward_packed(model, mb)  # (L, V)
        logprobs_all = torch.log_softmax(logits.float(), dim=-1)  # (L, V)
        total: Tensor | None = None
        start = 0
        for sample in row:
            n = len(sample.tokens)
            item = items[sample.item]
            datum = item.data[sample.datum]
            targets = torch.tensor(datum.target_tokens, dtype=torch.long, device=logits.device)  # (n,)
            lp = logprobs_all[start : start + n].gather(-1, targets[:, None])[:, 0]  # (n,)
            start += n
            elementwise = _loss(item, datum, lp)  # (n,)
            out = outputs[sample.item]
            out.logprobs[sample.datum] = lp.detach().cpu().tolist()
            out.losses[sample.datum] = elementwise.detach().cpu().tolist()
            out.loss_sum += float(elementwise.detach().sum())
            out.weighted_tokens += sum(1 for w in datum.weights if w != 0)
            if item.kind == "forward_backward":
                total = elementwise.sum() if total is None else total + elementwise.sum()
        if total is not None:
            total.backward()


def _samples_base_model(item: ManualWorkItem) -> bool:
    return item.kind == "sample" and item.sampling is not None and item.sampling.step is None


def _rows(samples: list[_Sample], seq_len: int) -> list[list[_Sample]]:
    """Consecutive samples (already in ascending slot order) filled into rows of ≤ seq_len tokens."""
    rows: list[list[_Sample]] = []
    used = seq_len
    for sample in samples:
        if used + len(sample.tokens) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(sample)
        used += len(sample.tokens)
    return rows


def _micro_batch(row: list[_Sample], n_slots: int) -> MicroBatch:
    lens = [len(s.tokens) for s in row]
    length = sum(lens)
    slots = torch.tensor([s.slot for s in row for _ in s.tokens], dtype=torch.long)  # (L,)
    zeros = torch.zeros(length, dtype=torch.float32)  # (L,)
    return MicroBatch(
        input_ids=torch.tensor([t for s in row for t in s.tokens], dtype=torch.long),
        position_ids=torch.cat([torch.arange(n) for n in lens]),
        loss_mask=torch.zeros(length, dtype=torch.bool),
        advantages=zeros,
        inference_logprobs=zeros,
        temperatures=torch.ones(length, dtype=torch.float32),
        teacher_logprobs=None,
        token_slots=slots,
        sample_ids=torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)),
        seq_lens=lens,
        slot_token_counts=torch.bincount(slots, minlength=n_slots),
    )


def _loss(item: ManualWorkItem, datum: ManualDatum, lp: Tensor) -> Tensor:
    """Elementwise loss (n,) of one datum; its sum is the datum's contribution to the request's loss."""
    if item.loss_fn == "cross_entropy":
        return -torch.tensor(datum.weights, dtype=lp.dtype, device=lp.device) * lp
    old = torch.tensor(datum.logprobs or [], dtype=lp.dtype, device=lp.device)  # (n,)
    adv = torch.tensor(datum.advantages or [], dtype=lp.dtype, device=lp.device)  # (n,)
    ratio = torch.exp(lp - old)
    if item.loss_fn == "importance_sampling":
        return -ratio * adv
    low = item.loss_fn_config.get("clip_low_threshold", PPO_CLIP[0])
    high = item.loss_fn_config.get("clip_high_threshold", PPO_CLIP[1])
    if item.loss_fn == "cispo":
        # The clipped ratio is a weight, not a path for gradients: every token keeps its gradient.
        return -(ratio.clamp(low, high).detach() * adv * lp)
    return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)


def _saved(item: ManualWorkItem, run: RunSlot, lora: MultiLoRA, checkpoint_dir: Path) -> ManualResult:
    """The run's adapter was published at its last optim_step: name that step, and keep a copy on
    the pool so that sampling clients of this step still sample it after the run trains on."""
    if run.progress.step == 0:
        return _failed(item, "no optim_step yet: there are no trained weights to save")
    save_sampler_weights(checkpoint_dir, run, lora)
    return ManualResult(request_id=item.request_id, metrics={"step": run.progress.step})


def state_root(checkpoint_dir: Path, run_id: str, name: str) -> Path:
    return checkpoint_dir / run_id / "tinker_states" / name


def _save_state(
    item: ManualWorkItem, run: RunSlot, lora: MultiLoRA, optimizer: MultiRunOptimizer, checkpoint_dir: Path
) -> ManualResult:
    """The adapter and the optimizer state (moments, step count, schedule) under the given name."""
    save_checkpoint(
        state_root(checkpoint_dir, run.run_id, item.name or "state"),
        run.progress.step,
        adapter=lora.slot_state_dict(run.slot),
        optimizer_state=optimizer.state_dict(run.slot),
        progress={
            "step": run.progress.step,
            "total_tokens": run.progress.total_tokens,
            "total_samples": run.progress.total_samples,
        },
        keep_last=1,
    )
    return ManualResult(request_id=item.request_id, metrics={"step": run.progress.step})


def _load_state(
    item: ManualWorkItem, run: RunSlot, lora: MultiLoRA, optimizer: MultiRunOptimizer, checkpoint_dir: Path
) -> ManualResult:
    """A saved state into this run's slot: the weights, and with_optimizer also the optimizer;
    gradients accumulated so far are dropped."""
    path = latest_checkpoint(state_root(checkpoint_dir, item.source_run_id or "", item.name or "state"))
    if path is None:
        return _failed(item, f"saved weights {item.name!r} not found on this pool")
    ckpt = load_checkpoint(path)
    try:
        lora.load_slot_state_dict(run.slot, ckpt.adapter)
    except (KeyError, ValueError, RuntimeError) as exc:
        return _failed(item, f"the saved weights do not fit this model: {exc}")
    optimizer.zero_grad(run.slot)
    if item.with_optimizer:
        optimizer.load_state_dict(run.slot, ckpt.optimizer_state)
    run.progress.step = ckpt.step
    return ManualResult(request_id=item.request_id, metrics={"step": ckpt.step})


def _failed(item: ManualWorkItem, error: str) -> ManualResult:
    return ManualResult(request_id=item.request_id, error=error)


# -- optimizer steps ---------------------------------------------------------------------------------


def _optim_step(
    item: ManualWorkItem, run: RunSlot, optimizer: MultiRunOptimizer, publisher: Publisher
) -> ManualResult:
    adam = item.adam
    if adam is None:
        return _failed(item, "optim_step without Adam parameters")
    optimizer.set_hyperparameters(
        run.slot,
        lr=adam.learning_rate,
        betas=(adam.beta1, adam.beta2),
        eps=adam.eps,
        weight_decay=adam.weight_decay,
        max_grad_norm=adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf,
    )
    stats = optimizer.step([run.slot])[run.slot]
    if stats.nonfinite:
        return _failed(item, "non-finite gradients: the step was not applied")
    acc = run.step_metrics
    run.progress.step += 1
    run.progress.total_tokens += acc.tokens
    run.progress.total_samples += acc.samples
    publisher.publish_step(run, run.progress.step, stats)
    return ManualResult(
        request_id=item.request_id,
        metrics={"grad_norm": stats.grad_norm, "lr": stats.lr, "step": run.progress.step},
    )
