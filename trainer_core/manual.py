"""Manual-mode work on the pool (the Tinker API, DESIGN §11): forward, forward_backward, optim_step.

    claim         the pending work of every active manual run (per run in seq_id order, up to and
                  including its next optim_step or load_weights: the service cuts each run's list
                  there), and the work to replay after a pool crash (`ManualWorkItem.replay`)
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

A pool that the service no longer knows (declared dead, or replaced: a claim or report answered
409 pool_dead / pool_stopped) stops its Tinker work as its heartbeat stops its batches: it logs why,
drops what it held of its manual runs (accumulated gradients, step metrics) and sets `lost`, on
which the worker loop stops the pool. The service has returned that pool's Tinker requests to
pending already; the next pool runs or replays them.

After a pool crash the next pool restores each run from its last optim_step's checkpoint (every
manual step is checkpointed, with its seq_id: `ManualBoundary`), rebuilds the gradients of the
step's already-delivered forward_backwards from the replayed requests without reporting them again,
and answers from the checkpoint an optim_step that the dead pool applied but did not report.

The losses, with lp the current logprob of each target token and w, old_lp, A the datum's
weights, sampler logprobs and advantages (elementwise, summed over tokens and datums):
cross_entropy −w·lp; importance_sampling −exp(lp − old_lp)·A; ppo −min(r·A, clip(r, lo, hi)·A)
with r = exp(lp − old_lp) and lo/hi = loss_fn_config clip_low_threshold / clip_high_threshold
(default 0.8 / 1.2); cispo −sg(clip(r, lo, hi))·A·lp (sg: no gradient through the weight).

Isolation holds as for rollout batches: a row's attention never crosses samples, each token goes
through its own run's adapter only, and the row's loss is a plain sum, so each run's gradients
are exactly those of its own loss. On a multi-rank pool the master claims and broadcasts the work,
rank r runs rows r, r + world_size, ..., the master gathers their outputs and reports, and each
run's gradients are all-reduced (summed) at its optim_step; sampling runs on the master alone.

A request that raises fails alone. A forward_backward that fails leaves its run's gradients as they
were before it, on every rank (`_roll_back_failed`), so that it may be sent again; a load_weights
has one outcome on every rank (`_load_weights`); a fatal device error (trainer_core.device_errors)
stops the pool instead.
"""

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from contracts.arrays import MAX_TOKEN_ID
from contracts.http import ApiError
from contracts.pool_api import POOL_GONE
from contracts.tinker_work import ManualDatum, ManualResult, ManualWorkItem
from trainer_core.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer_core.device_errors import raise_if_fatal
from trainer_core.dist import World, all_reduce_grads_, broadcast_from_master, gather_to_master
from trainer_core.external_sampler import ExternalSampler
from trainer_core.grad_rollback import GradSnapshots, SlotSnapshot
from trainer_core.lora import MultiLoRA
from trainer_core.modeling import forward_packed
from trainer_core.optim import MultiRunOptimizer
from trainer_core.packing import MicroBatch
from trainer_core.pause_point import (
    MANUAL_BEFORE_CLAIM,
    MANUAL_BEFORE_OPTIM,
    MANUAL_BEFORE_OPTIM_REPORT,
    pause_at,
)
from trainer_core.policy_terms import tinker_loss
from trainer_core.publish import Publisher
from trainer_core.sample_server import SampleServer, save_sampler_weights
from trainer_core.sampling import PassLimits, TextDecoder
from trainer_core.slots import ManualBoundary, RunSlot, StepAccumulator

log = logging.getLogger("loraloom.worker")

MAX_CLAIM = 64
POOL_GONE_CODES = tuple(POOL_GONE)
"""The service's answers that are about this pool, not about a request: it no longer knows it."""
SAMPLING_CACHE_ROWS = 16

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
    error: str | None = None
    """Set when a row of the request raised on some rank (`_isolated_row`): the request fails with it."""
    touched: bool = False
    """A forward_backward a backward of which ran (or began) on some rank: its gradient is in, or
    partly in, its run's; if it fails, the run's gradients are rolled back (`_roll_back_failed`)."""


class _BackwardFailed(Exception):
    """A row's backward raised: part of its gradients may be accumulated, so it is not run again
    (its runs' gradients are rolled back)."""


MAX_RERUNS = 2
"""Passes that rebuild the gradients of a rolled-back run's other forward_backwards
(`_roll_back_failed`); past them, those that are left fail too."""


@dataclass
class _Verdict:
    """The master's decision after a pass, which every rank applies alike."""

    failed: dict[int, str]
    """Claim index → error of the requests that failed in the pass (on any rank)."""
    dirty: set[int]
    """Slots whose gradients hold part of a failed forward_backward's: rolled back on every rank."""


_FIRST_KINDS = ("forward", "forward_backward", "sample")
"""Reported first, before any adapter changes."""


@dataclass
class _Round:
    """The master's claim, as every rank executes it."""

    work: list[tuple[int, ManualWorkItem, int | None]]
    """(index in the claim, item, slot) of the items that run here (slot None: a base-model sample)."""
    answered: bool
    """Some item was answered without running (failed, or already in the checkpoint)."""
    pool_lost: bool = False
    """The service no longer knows the pool: every rank drops its manual state, nothing runs."""


@dataclass
class ManualExecutor:
    client: ManualWorkClient | None
    """The service side: on the master only; the other ranks execute the claims it broadcasts."""
    seq_len: int
    checkpoint_dir: Path
    """The pool's checkpoint home: saved Tinker states live in `{run_id}/tinker_states/{name}`."""
    world: World = field(default_factory=World)
    vocab_size: int | None = None
    """The base model's vocabulary: a request with a token id outside it fails alone, before any
    pass (the service checks ids against it only once a pool has registered)."""
    passes: int = 0
    """Forward passes (rows) run for manual work."""
    mixed_passes: int = 0
    """Rows that held the tokens of more than one run: requests of several tenants in one pass."""
    text_decoder: Callable[[], TextDecoder] | None = None
    """Loads the base model's tokenizer, for stop strings (trainer_core.sample_server)."""
    external_sampler: ExternalSampler | None = None
    """Serves `sample` instead of the pool's own layers (WorkerSettings.sampler_url); the sampler
    weights kept at `save_weights_for_sampler` are then also written as PEFT adapters for it."""
    lost: bool = False
    """Master: the service answered that it no longer knows this pool (POOL_GONE_CODES); nothing is
    claimed or reported from then on, and the worker loop stops the pool."""
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
        publisher: Publisher | None,
    ) -> bool:
        """Claim (master) and execute (every rank) one round of manual work; False when none ran.
        Every rank calls it at the same point of the loop: the master's claim is broadcast.

        Results go back in three reports, so that a pool killed anywhere loses nothing the next
        pool cannot rebuild: the passes (and samples) first, before any adapter changes; then the
        saves and loads; then the optim_steps, each applied and checkpointed before its report.
        """
        master = self.client is not None
        answers: list[ManualResult] = []
        round_: _Round | None = None
        if self.client is not None:
            pause_at(MANUAL_BEFORE_CLAIM)
            items = self._claim(self.client)
            slot_of = {run.run_id: slot for slot, run in slots.items() if run.leaving is None}
            answers, runnable = _triage(
                items, slots, slot_of, seq_len=self.seq_len, vocab_size=self.vocab_size
            )
            round_ = _Round(
                work=[(i, it, slot_of.get(it.run_id)) for i, it in runnable],
                answered=any(not r.release for r in answers),
                pool_lost=self.lost,
            )
        round_ = broadcast_from_master(round_, self.world)
        if round_.pool_lost:
            _drop_manual_state(slots, optimizer)
            return False
        # Sampling needs no collective: the master decodes every sequence alone (slot None: the
        # base model's). Everything else belongs to an admitted run, so has its slot.
        sampled = (
            self._sample([w for w in round_.work if w[1].kind == "sample"], model, lora, slots)
            if master
            else {}
        )
        work = [(i, it, slot) for i, it, slot in round_.work if slot is not None and it.kind != "sample"]
        for _, item, slot in work:
            if item.kind == "forward_backward":
                # Its step starts with its first forward_backward's pass: the wait for that request
                # (after a pool start, the whole wait for the client) is no part of the step.
                slots[slot].step_metrics.begin()
        outputs = self._passes(model, lora, [w for w in work if w[1].kind in ("forward", "forward_backward")])
        states = [
            (item, slots[slot]) for _, item, slot in work if item.kind not in _FIRST_KINDS + ("optim_step",)
        ]
        steps = [(item, slots[slot]) for _, item, slot in work if item.kind == "optim_step"]
        answers += sampled.values()
        for index, item, slot in work:
            if item.kind in ("forward", "forward_backward") and master:
                answers.append(_pass_result(item, slots[slot], outputs[index]))
        self._report(answers)
        self._report([self._isolated_state(item, run, lora, optimizer) for item, run in states])
        if steps:
            if master:
                pause_at(MANUAL_BEFORE_OPTIM)
            stepped = [self._optim_step(item, run, lora, optimizer, publisher) for item, run in steps]
            if master:
                pause_at(MANUAL_BEFORE_OPTIM_REPORT)
            self._report(stepped)
        # Only released items: nothing ran, so the loop may sleep as when idle.
        return bool(round_.work) or round_.answered

    def _sample(
        self,
        work: Sequence[tuple[int, ManualWorkItem, int | None]],
        model: nn.Module,
        lora: MultiLoRA,
        slots: Mapping[int, RunSlot],
    ) -> dict[int, ManualResult]:
        """Every claimed sample answered, whatever happens: the sample server fails each request
        that raises alone, and anything that escapes it fails this round's samples, not the pool.
        Safe to catch on a multi-rank pool: the master samples alone, with no collective (the other
        ranks are already on their way to the round's next one, which the master still reaches).
        A fatal device error stops the pool instead (trainer_core.device_errors)."""
        if not work:
            return {}
        try:
            if self.external_sampler is not None:
                return self.external_sampler.serve(work)
            return self.samples.serve(model, lora, work, slots)
        except Exception as exc:
            raise_if_fatal(exc)
            log.exception("sampling %s request(s) failed", len(work))
            return {
                index: _failed(item, f"the pool could not sample this request: {_described(exc)}")
                for index, item, _ in work
            }

    def _claim(self, client: ManualWorkClient) -> list[ManualWorkItem]:
        if self.lost:
            return []
        try:
            return client.claim_manual(MAX_CLAIM)
        except ApiError as exc:
            self._lose_pool_or_raise(exc, "claim")
            return []

    def _report(self, results: list[ManualResult]) -> None:
        if self.client is None or not results or self.lost:
            return
        try:
            self.client.report_manual([_reportable(result) for result in results])
        except ApiError as exc:
            # The round goes on (every rank's collectives must stay matched); nothing more is reported.
            self._lose_pool_or_raise(exc, "report")

    def _optim_step(
        self,
        item: ManualWorkItem,
        run: RunSlot,
        lora: MultiLoRA,
        optimizer: MultiRunOptimizer,
        publisher: Publisher | None,
    ) -> ManualResult:
        """`_optim_step`; on the master, a publish the service refuses because it no longer knows
        the pool ends the pool's Tinker work like a refused report."""
        try:
            return _optim_step(item, run, lora, optimizer, None if self.lost else publisher, self.world)
        except ApiError as exc:
            self._lose_pool_or_raise(exc, f"publish of step {run.progress.step}")
            return ManualResult(request_id=item.request_id, release=True)  # not reported: lost

    def _lose_pool_or_raise(self, exc: ApiError, what: str) -> None:
        if exc.code not in POOL_GONE_CODES:
            raise exc
        if not self.lost:
            log.error(
                "the service no longer knows this pool: %s (%s, answering its Tinker %s). Stopping the "
                "pool; its work is pending again for the pool now registered",
                POOL_GONE[exc.code],
                exc.code,
                what,
            )
        self.lost = True

    def _isolated_state(
        self, item: ManualWorkItem, run: RunSlot, lora: MultiLoRA, optimizer: MultiRunOptimizer
    ) -> ManualResult:
        """`_state`, a request that raises failing alone (a full disk, an unreadable saved state);
        a fatal device error stops the pool. Safe to catch on every rank: no collective runs inside
        the catch (the saves are the master's alone; a load's ranks agree after it, `_load_weights`)."""
        if item.kind == "load_weights":
            return self._load_weights(item, run, lora, optimizer)
        try:
            return self._state(item, run, lora, optimizer)
        except Exception as exc:
            raise_if_fatal(exc)
            log.exception("Tinker %s %s of run %s failed", item.kind, item.request_id, run.run_id)
            return _failed(item, f"the pool could not run this {item.kind}: {_described(exc)}")

    def _load_weights(
        self, item: ManualWorkItem, run: RunSlot, lora: MultiLoRA, optimizer: MultiRunOptimizer
    ) -> ManualResult:
        """A load on every rank (each holds the run's weights), with one outcome on all of them: if it
        failed anywhere (a rank that cannot read the files, weights that do not fit, an optimizer
        state that fails half-way), every rank puts the run back as it was before the request and
        the request fails; otherwise every rank holds the loaded state. The ranks agree after the
        catch, so every one of them reaches the collectives; each rank runs the round's loads in the
        same order (the broadcast claim). A fatal device error stops the pool (and with it the
        other ranks, whose collective fails)."""
        before: SlotSnapshot | None = None  # None: the snapshot itself failed (out of memory), nothing loaded
        try:
            before = SlotSnapshot.take(run, lora, optimizer)
            result = _load_state(item, run, lora, optimizer, self.checkpoint_dir)
        except Exception as exc:
            raise_if_fatal(exc)
            log.exception("Tinker load_weights %s of run %s failed", item.request_id, run.run_id)
            result = _failed(item, f"the pool could not run this load_weights: {_described(exc)}")
        error = self._agreed_error(result.error)
        if error is not None and before is not None:
            before.restore(run, lora, optimizer)  # raises (the pool stops) if it cannot
        if error is not None:
            result = _failed(item, error)
        return ManualResult(request_id=item.request_id, replayed=True) if item.replay else result

    def _agreed_error(self, error: str | None) -> str | None:
        """The first rank's error (None: every rank succeeded), the same on every rank."""
        if self.world.world_size == 1:
            return error
        errors = gather_to_master(error, self.world)
        first: str | None = None
        if errors is not None:
            for rank, text in enumerate(errors):
                if text is not None:
                    first = text if rank == 0 else f"rank {rank} of the pool: {text} (no rank kept the load)"
                    break
        # Boxed: broadcast_from_master wants an object from the master, and None is an answer here.
        return broadcast_from_master((first,), self.world)[0]

    def _state(
        self, item: ManualWorkItem, run: RunSlot, lora: MultiLoRA, optimizer: MultiRunOptimizer
    ) -> ManualResult:
        """save_weights_for_sampler, save_weights (the master writes)."""
        if item.kind == "save_weights_for_sampler":
            if self.client is None:
                return ManualResult(request_id=item.request_id)  # not reported: the master keeps the copy
            peft_base_model = None if self.external_sampler is None else self.external_sampler.base_model
            return _saved(item, run, lora, self.checkpoint_dir, peft_base_model)
        if item.kind == "save_weights":
            if self.client is None:
                return ManualResult(request_id=item.request_id)  # not reported: the master saves
            return _save_state(item, run, lora, optimizer, self.checkpoint_dir)
        raise ValueError(f"not a state request: {item.kind}")

    # -- passes ------------------------------------------------------------------------------------

    def _passes(
        self, model: nn.Module, lora: MultiLoRA, work: Sequence[tuple[int, ManualWorkItem, int]]
    ) -> dict[int, _Outputs]:
        """The outputs of every request (on the master; {} on the other ranks of a multi-rank pool).
        A forward_backward that fails leaves its run's gradients as they were before it."""
        items = {index: item for index, item, _ in work}
        # Each rank runs its share of the rows (all of them on one rank); the master gathers the
        # outputs, and the gradients stay where they were computed until the run's optim_step.
        rows = _rows(_samples_of(work), self.seq_len)
        if not rows:
            return {index: _Outputs(logprobs=[], losses=[]) for index, _, _ in work}
        grads = GradSnapshots(lora)
        outputs = self._run_rows(model, lora, rows, items, grads)
        self._roll_back_failed(model, lora, work, outputs, grads)
        return outputs

    def _run_rows(
        self,
        model: nn.Module,
        lora: MultiLoRA,
        rows: list[list[_Sample]],
        items: Mapping[int, ManualWorkItem],
        grads: GradSnapshots,
    ) -> dict[int, _Outputs]:
        """This rank's share of `rows`; the outputs of every rank's merged on the master ({} elsewhere)."""
        outputs = {
            index: _Outputs(logprobs=[[] for _ in item.data], losses=[[] for _ in item.data])
            for index, item in items.items()
        }
        for row in rows[self.world.rank :: self.world.world_size]:
            self._isolated_row(model, lora, row, items, outputs, grads)
        if self.world.world_size == 1:
            return outputs
        gathered = gather_to_master(outputs, self.world)
        return {} if gathered is None else _merged(gathered)

    def _roll_back_failed(
        self,
        model: nn.Module,
        lora: MultiLoRA,
        work: Sequence[tuple[int, ManualWorkItem, int]],
        outputs: dict[int, _Outputs],
        grads: GradSnapshots,
    ) -> None:
        """Take a failed forward_backward's gradient out of its run's, on every rank that ran part of it.

        A request's rows run one after the other, on several ranks of a multi-rank pool, and each
        row's backward adds to the run's `.grad` (which the ranks sum only at its optim_step): a
        request that fails in its second row has the first one's gradient in, and one whose
        backward failed half-way part of it. The master, which alone sees every rank's outputs,
        names the runs whose gradients hold part of a failed request's (`touched`); every rank puts
        their gradients back as before the round's first backward on them (`GradSnapshots`), then
        runs those runs' other forward_backwards of the round again, each alone, to add their
        gradients back; their outputs are those of the first pass (isolation: the same values).
        One of them failing in turn means another round of the same, up to MAX_RERUNS; past it,
        the rolled-back run's remaining forward_backwards fail too, nothing of them kept.

        The verdict is a broadcast: every rank reaches it, since the rows' errors are caught (a
        fatal device error kills the rank, and the others' collective fails: the pool stops).
        It costs a multi-rank pool one small broadcast per round with passes; nothing is copied
        unless some gradient was already accumulated for the run (`GradSnapshots`)."""
        master = self.client is not None
        fb_slot = {index: slot for index, item, slot in work if item.kind == "forward_backward"}
        failed: set[int] = set()
        results = outputs
        for attempt in range(MAX_RERUNS + 1):
            verdict = broadcast_from_master(
                _verdict(results, fb_slot, failed) if master else None, self.world
            )
            for index, error in verdict.failed.items():
                failed.add(index)
                if master:
                    outputs[index].error = error
            if not verdict.dirty:
                return
            for slot in sorted(verdict.dirty):
                grads.restore(slot)
            again = [
                (i, it, s) for i, it, s in work if s in verdict.dirty and i in fb_slot and i not in failed
            ]
            if not again:
                return
            if attempt == MAX_RERUNS:
                log.error(
                    "gradients of slots %s rolled back; %s request(s) fail", sorted(verdict.dirty), len(again)
                )
                if master:
                    for index, _, _ in again:
                        outputs[index].error = (
                            "another forward_backward of this model failed in the same pool pass and "
                            "the model's gradients were rolled back; nothing of this request was "
                            "accumulated: it may be sent again"
                        )
                return
            log.warning(
                "gradients of slots %s rolled back after a failed forward_backward; running %s "
                "request(s) of theirs again",
                sorted(verdict.dirty),
                len(again),
            )
            # Each request in rows of its own: a row shared with another could fail with it again.
            rows = [row for entry in again for row in _rows(_samples_of([entry]), self.seq_len)]
            results = self._run_rows(model, lora, rows, {i: it for i, it, _ in again}, grads)

    def _isolated_row(
        self,
        model: nn.Module,
        lora: MultiLoRA,
        row: list[_Sample],
        items: Mapping[int, ManualWorkItem],
        outputs: dict[int, _Outputs],
        grads: GradSnapshots,
    ) -> None:
        """`_row`, a request that raises failing alone (its outputs carry the error) instead of
        stopping the pool for every tenant. A row that raises before its backward added nothing
        (`_row` writes its outputs only once the backward is done): its requests run again one by
        one, and only those that raise alone fail. One that raised in or after its backward may
        have added part of its gradients: every request of the row fails, none runs again here,
        and their runs' gradients are rolled back after the pass (`_roll_back_failed`), as are
        those of a request that fails after another of its rows added its part. A fatal device
        error is not caught: it stops the pool (trainer_core.device_errors).

        Safe to catch on a multi-rank pool: a row's forward and backward run on this rank alone, no
        collective inside (gradients are all-reduced only at a run's optim_step); every rank still
        reaches the gather that follows, which carries the errors to the master."""
        try:
            self._row(model, lora, row, items, outputs, grads)
            return
        except _BackwardFailed as exc:
            log.error("the backward of a row of %s request(s) failed", len(row), exc_info=exc.__cause__)
            for index in {s.item for s in row}:
                kept = (
                    "nothing of its gradient was kept"
                    if items[index].kind == "forward_backward"
                    else "nothing kept"
                )
                outputs[index].error = (
                    f"the pool's backward pass of this request failed: {_described(exc.__cause__)}; "
                    f"{kept}: it may be sent again"
                )
            return
        except Exception as exc:
            raise_if_fatal(exc)
            if len({s.item for s in row}) == 1:
                self._row_failed(row[0].item, exc, items, outputs)
                return
            log.warning("a row of %s requests failed (%s); running them one by one", len(row), exc)
        by_item: dict[int, list[_Sample]] = {}
        for sample in row:
            by_item.setdefault(sample.item, []).append(sample)
        for index, alone in by_item.items():
            try:
                self._row(model, lora, alone, items, outputs, grads)
            except _BackwardFailed as exc:
                self._row_failed(index, exc.__cause__ or exc, items, outputs)
            except Exception as exc:
                raise_if_fatal(exc)
                self._row_failed(index, exc, items, outputs)

    def _row_failed(
        self,
        index: int,
        exc: BaseException,
        items: Mapping[int, ManualWorkItem],
        outputs: dict[int, _Outputs],
    ) -> None:
        item = items[index]
        log.error("Tinker %s %s failed on this pool: %s", item.kind, item.request_id, exc, exc_info=exc)
        outputs[index].error = f"the pool could not run this {item.kind}: {_described(exc)}"

    def _row(
        self,
        model: nn.Module,
        lora: MultiLoRA,
        row: list[_Sample],
        items: Mapping[int, ManualWorkItem],
        outputs: dict[int, _Outputs],
        grads: GradSnapshots,
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
        done: list[tuple[_Sample, ManualDatum, Tensor, Tensor]] = []
        for sample in row:
            n = len(sample.tokens)
            item = items[sample.item]
            datum = item.data[sample.datum]
            targets = torch.tensor(datum.target_tokens, dtype=torch.long, device=logits.device)  # (n,)
            lp = logprobs_all[start : start + n].gather(-1, targets[:, None])[:, 0]  # (n,)
            start += n
            elementwise = _loss(item, datum, lp)  # (n,)
            done.append((sample, datum, lp, elementwise))
            if item.kind == "forward_backward":
                total = elementwise.sum() if total is None else total + elementwise.sum()
        if total is not None:
            # What the backward may change, kept first; and which requests it touches: a failure of
            # one of them, here or in another row, rolls their runs' gradients back.
            for slot in sorted({s.slot for s, *_ in done if items[s.item].kind == "forward_backward"}):
                grads.save(slot)
            for sample, *_ in done:
                if items[sample.item].kind == "forward_backward":
                    outputs[sample.item].touched = True
        try:
            if total is not None:
                total.backward()
            # Copied out after the backward: on a GPU an error of its kernels surfaces here.
            values = [
                (lp.detach().cpu().tolist(), loss.detach().cpu().tolist(), float(loss.detach().sum()))
                for _, _, lp, loss in done
            ]
        except Exception as exc:
            raise_if_fatal(exc)  # the device is gone: the pool stops, nothing to roll back
            if total is None:
                raise  # no backward: nothing was accumulated, the row may run again
            raise _BackwardFailed from exc
        # Written only now: a row that raised above left no trace in the outputs.
        for (sample, datum, _, _), (logprobs, losses, loss_sum) in zip(done, values, strict=True):
            out = outputs[sample.item]
            out.logprobs[sample.datum] = logprobs
            out.losses[sample.datum] = losses
            out.loss_sum += loss_sum
            out.weighted_tokens += sum(1 for w in datum.weights if w != 0)


def _drop_manual_state(slots: Mapping[int, RunSlot], optimizer: MultiRunOptimizer) -> None:
    """Forget what a lost pool held of its manual runs' current steps (the next pool rebuilds them
    from the service's requests): their accumulated gradients and step metrics."""
    for slot, run in slots.items():
        if run.config.mode == "manual":
            optimizer.zero_grad(slot)
            run.step_metrics = StepAccumulator()


def _samples_base_model(item: ManualWorkItem) -> bool:
    return item.kind == "sample" and item.sampling is not None and item.sampling.step is None


def _merged(per_rank: Sequence[Mapping[int, _Outputs]]) -> dict[int, _Outputs]:
    """The outputs of every rank's rows as one (each datum ran on exactly one rank)."""
    merged = dict(per_rank[0])
    for outputs in per_rank[1:]:
        for index, out in outputs.items():
            into = merged[index]
            for d, logprobs in enumerate(out.logprobs):
                if logprobs:
                    into.logprobs[d], into.losses[d] = logprobs, out.losses[d]
            into.loss_sum += out.loss_sum
            into.weighted_tokens += out.weighted_tokens
            into.error = into.error or out.error
            into.touched = into.touched or out.touched
    return merged


def _samples_of(work: Sequence[tuple[int, ManualWorkItem, int]]) -> list[_Sample]:
    """Every datum of the requests, in ascending slot order (the packing's), each request's in order."""
    return sorted(
        (
            _Sample(slot=slot, item=index, datum=d, tokens=datum.tokens)
            for index, item, slot in work
            for d, datum in enumerate(item.data)
        ),
        key=lambda s: s.slot,
    )


def _verdict(results: Mapping[int, _Outputs], fb_slot: Mapping[int, int], failed: set[int]) -> _Verdict:
    """The master's: the requests that failed in the pass just run, and the slots to roll back (those
    of the failed forward_backwards a backward of which ran, on any rank)."""
    newly: dict[int, str] = {}
    for index, out in results.items():
        if out.error is not None and index not in failed:
            newly[index] = out.error
    dirty = {fb_slot[index] for index in newly if index in fb_slot and results[index].touched}
    return _Verdict(failed=newly, dirty=dirty)


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
    return MicroBatch.without_loss(
        torch.tensor([t for s in row for t in s.tokens], dtype=torch.int32),  # (L,)
        seq_lens=[len(s.tokens) for s in row],
        slots=[s.slot for s in row],
        n_slots=n_slots,
    )


def _loss(item: ManualWorkItem, datum: ManualDatum, lp: Tensor) -> Tensor:
    """Elementwise loss (n,) of one datum; its sum is the datum's contribution to the request's loss."""
    return tinker_loss(
        item.loss_fn or "cross_entropy",
        lp,
        weights=datum.weights,
        sampler_logprobs=datum.logprobs,
        advantages=datum.advantages,
        config=item.loss_fn_config,
    )


def _unfit(item: ManualWorkItem, *, seq_len: int, vocab_size: int | None) -> str | None:
    """Why a forward/forward_backward cannot run on this pool (None: it can). Checked here as well as
    at the service: a request stored before any pool registered was checked without the vocabulary,
    and one bad id in a pass would stop the pool for every tenant."""
    limit = MAX_TOKEN_ID + 1 if vocab_size is None else vocab_size
    for i, datum in enumerate(item.data or ()):
        if len(datum.tokens) > seq_len:
            return f"datum {i}: {len(datum.tokens)} tokens; the pool's max_seq_len is {seq_len}"
        for name in ("tokens", "target_tokens"):
            ids = getattr(datum, name)
            if ids and (min(ids) < 0 or max(ids) >= limit):
                return f"datum {i}: a token id of {name} is outside the vocabulary [0, {limit})"
    return None


def _triage(
    items: Sequence[ManualWorkItem],
    slots: Mapping[int, RunSlot],
    slot_of: Mapping[str, int],
    *,
    seq_len: int,
    vocab_size: int | None,
) -> tuple[list[ManualResult], list[tuple[int, ManualWorkItem]]]:
    """(the answers of the items that do not run here, the (claim index, item) of those that do)."""
    answers: list[ManualResult] = []
    runnable: list[tuple[int, ManualWorkItem]] = []
    for index, item in enumerate(items):
        if item.kind in ("forward", "forward_backward") and (
            problem := _unfit(item, seq_len=seq_len, vocab_size=vocab_size)
        ):
            answers.append(_failed(item, problem))
        elif _samples_base_model(item):
            runnable.append((index, item))  # needs no run
        elif item.run_id not in slot_of:
            # Not admitted here yet (active at the service since this loop's look), or leaving:
            # the service hands it out again, or fails it if the run has left.
            answers.append(ManualResult(request_id=item.request_id, release=True))
        elif (answer := _in_checkpoint(item, slots[slot_of[item.run_id]])) is not None:
            answers.append(answer)
        else:
            runnable.append((index, item))
    return answers, runnable


def _pass_result(item: ManualWorkItem, run: RunSlot, out: _Outputs) -> ManualResult:
    """A forward / forward_backward's result; a replayed one adds to the step's metrics again (they
    were lost with the pool that ran it) and reports only that it was replayed. One that raised, or
    whose outputs are not finite (JSON cannot carry them), fails, and adds nothing to the metrics."""
    if out.error is not None:
        return _failed(item, out.error)
    if not (
        math.isfinite(out.loss_sum)
        and all(math.isfinite(v) for values in out.logprobs + out.losses for v in values)
    ):
        return _failed(
            item,
            "its loss or logprobs are not finite (weights, advantages or logprobs too large for float32?), "
            "so the pool cannot return them; its gradient still counts towards the model's next "
            "optim_step, which is not applied if that gradient is not finite",
        )
    if item.kind == "forward_backward":
        acc = run.step_metrics
        acc.loss_sum += out.loss_sum
        acc.loss_tokens += out.weighted_tokens
        acc.tokens += sum(len(d.tokens) for d in item.data)
        acc.samples += len(item.data)
    if item.replay:
        return ManualResult(request_id=item.request_id, replayed=True)
    return ManualResult(
        request_id=item.request_id,
        logprobs=out.logprobs,
        elementwise_loss=out.losses,
        metrics={"loss:sum": out.loss_sum},
    )


def _in_checkpoint(item: ManualWorkItem, run: RunSlot) -> ManualResult | None:
    """The answer to a re-delivered request that the run's restored checkpoint already holds (the
    pool that ran it died after checkpointing its step, before reporting the step); None for one
    still to run. The step is not applied twice: its lost report is sent from the checkpoint."""
    boundary = run.manual_boundary
    if boundary is None or item.kind == "sample" or item.seq_id > boundary.seq_id:
        return None
    if item.replay:
        return ManualResult(request_id=item.request_id, replayed=True)
    if item.kind == "optim_step" and item.seq_id == boundary.seq_id:
        return ManualResult(request_id=item.request_id, metrics=boundary.metrics)
    # The service hands out nothing of a step unreported after its optim_step ran (the passes are
    # reported first), so this is a broken invariant, not a user error: fail it loudly.
    return _failed(
        item, f"request {item.seq_id} came back after optim_step {boundary.seq_id} was checkpointed"
    )


def _saved(
    item: ManualWorkItem, run: RunSlot, lora: MultiLoRA, checkpoint_dir: Path, peft_base_model: str | None
) -> ManualResult:
    """The run's adapter was published at its last optim_step: name that step, and keep a copy on
    the pool so that sampling clients of this step still sample it after the run trains on."""
    if run.progress.step == 0:
        return _failed(item, "no optim_step yet: there are no trained weights to save")
    save_sampler_weights(checkpoint_dir, run, lora, peft_base_model=peft_base_model)
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
        raise_if_fatal(exc)
        return _failed(item, f"the saved weights do not fit this model: {exc}")
    optimizer.zero_grad(run.slot)
    if item.with_optimizer:
        optimizer.load_state_dict(run.slot, ckpt.optimizer_state)
    run.progress.step = ckpt.step
    return ManualResult(request_id=item.request_id, metrics={"step": ckpt.step})


def _failed(item: ManualWorkItem, error: str) -> ManualResult:
    return ManualResult(request_id=item.request_id, error=error)


MAX_ERROR_CHARS = 1000
"""The longest exception message a failed request's error repeats (the pool's log has the rest)."""


def _described(exc: BaseException | None) -> str:
    """An exception as a tenant reads it in its request's error: its type and (cut) message."""
    text = "unknown error" if exc is None else f"{type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


def _finite(values: Sequence[float | None]) -> bool:
    return all(v is None or math.isfinite(v) for v in values)


def _reportable(result: ManualResult) -> ManualResult:
    """`result`, or its failure if it holds a number JSON cannot carry (NaN, ±inf): the report of
    the whole round would fail to encode, and the pool would stop for every tenant."""
    sequences = result.sequences or []
    if (
        _finite([v for values in result.logprobs or () for v in values])
        and _finite([v for values in result.elementwise_loss or () for v in values])
        and _finite([v for seq in sequences for v in seq.logprobs])
        and _finite(result.prompt_logprobs or [])
        and _finite(list(result.metrics.values()))
    ):
        return result
    log.error("the result of Tinker request %s is not finite; it fails", result.request_id)
    return ManualResult(
        request_id=result.request_id,
        error="the pool's result for this request is not finite (NaN or infinity); nothing to return",
    )


# -- optimizer steps ---------------------------------------------------------------------------------


def _optim_step(
    item: ManualWorkItem,
    run: RunSlot,
    lora: MultiLoRA,
    optimizer: MultiRunOptimizer,
    publisher: Publisher | None,
    world: World,
) -> ManualResult:
    """On every rank (the master publishes): each rank holds the gradients of the rows it ran since
    the run's last step; their sum over ranks is the step's gradient, as for rollout runs."""
    adam = item.adam
    if adam is None:
        return _failed(item, "optim_step without Adam parameters")
    all_reduce_grads_(lora.slot_parameters(run.slot), world)
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
    metrics = {"grad_norm": stats.grad_norm, "lr": stats.lr, "step": float(run.progress.step)}
    # Checkpointed with the step (a manual run checkpoints every step): what a pool restoring the
    # run needs to skip this step's requests and answer its report if this pool dies before it.
    run.manual_boundary = ManualBoundary(seq_id=item.seq_id, metrics=metrics)
    if publisher is not None:
        publisher.publish_step(run, run.progress.step, stats)
    return ManualResult(request_id=item.request_id, metrics=metrics)
