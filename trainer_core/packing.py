"""The Packer: per-run rollout buffers → fair selection → packed, rank-balanced micro-batches.

Source document 002 and DESIGN §6, with the step semantics of docs/contracts.md.

Flow of one `Packer.pack()`:

1. **Wait** (`is_ready`): buffered tokens reach ``seq_len × dp_world_size``, or something has waited
   ``timeout_s`` (measured from the later of the oldest buffered sample's arrival and the last pack,
   so leftovers of a pack do not trigger an immediate tiny pack, and a lone sample is never stuck).
2. **Select** round-robin across runs with buffered work, one sample per turn, within a budget of
   ``dp_world_size`` rows of ``seq_len`` tokens (a ``seq_len × dp_world_size`` token budget, checked by
   first-fit placement rather than a plain sum — see `Packer._select_round_robin`). A run never gets
   more samples than its current step still needs (``batch_size − samples_consumed_this_step``), so one
   pack completes at most one step per run and a step is exactly ``batch_size`` samples. The round-robin
   position survives across calls: the next pack starts at the first run that was denied a turn for
   lack of room (so a run with long samples cannot be passed over forever), else just after the last
   run served.
3. **Account** per run: progress (step, total_tokens, total_samples), ``samples_consumed_this_step``, and
   ``ready_to_update[slot]`` set only when a step completes (the source documents' accounting).
4. **Pack** First-Fit-Decreasing into ``seq_len`` bins (`pack_ffd`); inside a bin, samples are ordered by
   ascending slot, so each run's tokens form one contiguous segment (what the multi-LoRA layers need:
   per-slot token counts). A bin may mix runs — that is the point of multi-tenant packing.
5. **Pad** each bin to ``min(ceil(len / pad_to_multiple_of) × pad_to_multiple_of, seq_len)``: never above
   ``seq_len``, so a full bin stays unpadded when ``seq_len`` is not a multiple (choose ``seq_len`` as a
   multiple to keep every row aligned).
6. **Balance** bins across data-parallel ranks: longest-processing-time greedy on a cost model (see
   `bin_cost`, `assign_to_ranks`), each rank capped at ``ceil(n_bins / dp_world_size)`` bins so that at
   most ``dp_world_size − 1`` filler micro-batches are needed; then every rank is topped up with fillers
   (minimal length, no loss, ``is_filler=True``) to the same count, because every rank must run the same
   number of forward/backward passes for the collective gradient reduction. With the row budget of
   step 2 a pack has at most ``dp_world_size`` bins, so in practice every rank gets exactly one
   micro-batch (ranks without a bin get one filler).

Sample boundaries survive packing: ``position_ids`` restart at 0 for every sample (and for the padding
pseudo-sequence), ``seq_lens`` lists the segment lengths, and `trainer_core.modeling.forward_packed`
makes attention block-diagonal so no token attends across samples. The first token of every sample
never carries loss even if it is a completion token (empty prompt): the loss predicts token ``t`` from
``logits[t − 1]``, which would belong to the previous sample.

The Packer only checks structure (lengths, sizes); the service validates values (vocabulary, finite
floats) before a batch is ever stored.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from trainer_core.wire import TrainingBatch, TrainingSample

__all__ = [
    "InvalidSampleError",
    "MicroBatch",
    "PackResult",
    "Packer",
    "RunPackStats",
    "RunProgress",
    "SampleRef",
    "assign_to_ranks",
    "bin_cost",
    "pack_ffd",
]


# --------------------------------------------------------------------------------------------------
# Data types
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SampleRef:
    """Identifies one consumed sample, so the trainer can acknowledge whole batches."""

    batch_id: int
    """The service's id of the rollout batch."""
    index: int
    """The sample's index inside that batch (counting the skipped leading samples too)."""


@dataclass
class RunProgress:
    """A run's training progress as the Packer accounts it."""

    step: int = 0
    """Completed steps (each exactly ``batch_size`` samples)."""
    total_tokens: int = 0
    """Prompt + completion tokens packed so far (no padding)."""
    total_samples: int = 0
    """Samples packed so far (including the current, partial step)."""


@dataclass
class MicroBatch:
    """One packed row: several samples (possibly of several runs) laid end to end, then padding.

    All tensors are on CPU and have length ``L`` = the padded row length (≤ ``seq_len``).
    """

    input_ids: torch.Tensor
    """(L,) long. Prompt then completion of each sample, then ``pad_token_id``."""
    position_ids: torch.Tensor
    """(L,) long. Restart at 0 for every sample and for the padding pseudo-sequence."""
    loss_mask: torch.Tensor
    """(L,) bool. True on completion tokens whose ``completion_mask`` is True, except a sample's first
    token (the loss predicts token t from ``logits[t-1]``, which must lie in the same sample)."""
    advantages: torch.Tensor
    """(L,) float32. The sample's advantage on its completion tokens (scalar broadcast, or per token); 0
    elsewhere."""
    inference_logprobs: torch.Tensor
    """(L,) float32. The inference policy's logprob on completion tokens; 0 elsewhere."""
    temperatures: torch.Tensor
    """(L,) float32. The sampling temperature of each token's batch; 1.0 on padding (safe to divide by)."""
    teacher_logprobs: torch.Tensor | None
    """(L,) float32 teacher logprobs on completion tokens (0 elsewhere), or None when no sample in the row
    has any."""
    token_slots: torch.Tensor
    """(L,) long. The slot (run) of each token; non-decreasing. Padding takes the last slot present."""
    sample_ids: torch.Tensor
    """(L,) long. Index of the token's sample in ``seq_lens`` order; -1 on padding."""
    seq_lens: list[int]
    """Lengths of the samples in order, then the padding as a final pseudo-sequence (if any)."""
    slot_token_counts: torch.Tensor
    """(n_slots,) long. Tokens per slot in ascending slot order; padding is counted in the last slot
    present (slot 0 for an empty row), so the counts sum to L."""
    is_filler: bool = False
    """True for a filler row that only keeps ranks in step (no loss, no samples)."""

    @property
    def num_tokens(self) -> int:
        """L, padding included."""
        return int(self.input_ids.shape[0])

    @property
    def num_samples(self) -> int:
        """Real samples in the row (``seq_lens`` minus the padding pseudo-sequence, if any)."""
        return len(self.seq_lens) - int(self.sample_ids[-1].item() < 0)


@dataclass
class RunPackStats:
    """What one pack took from one run."""

    samples: int
    """Samples of the run in this pack."""
    tokens: int
    """Their prompt + completion tokens."""
    loss_tokens: int
    """Their tokens with ``loss_mask`` True (the run's loss normaliser accumulates these)."""
    step_completed: bool
    """True if this pack completed the run's step (its optimizer should step after this pack)."""
    step: int
    """The run's completed-step count after this pack."""
    consumed: list[SampleRef] = field(default_factory=list)
    """The samples taken, in selection order."""


@dataclass
class PackResult:
    """The output of one pack."""

    micro_batches: list[list[MicroBatch]]
    """One list per data-parallel rank; every list has the same length."""
    runs: dict[int, RunPackStats]
    """Per slot that contributed samples."""


class InvalidSampleError(ValueError):
    """A sample the Packer cannot train; names the slot, the batch and the sample index."""

    def __init__(self, *, slot: int, batch_id: int, index: int, reason: str) -> None:
        super().__init__(f"slot {slot}, batch {batch_id}, sample {index}: {reason}")
        self.slot = slot
        self.batch_id = batch_id
        self.index = index
        self.reason = reason


# --------------------------------------------------------------------------------------------------
# First-Fit-Decreasing
# --------------------------------------------------------------------------------------------------


def pack_ffd(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """First-Fit-Decreasing bin packing: indices of ``lengths`` grouped into bins of capacity ``seq_len``.

    Items are taken longest first (ties in input order) and each goes into the lowest-numbered bin with
    room. Bins are returned in opening order; inside a bin, indices are in placement order.

    O(n log n): a max segment tree over bins' remaining capacities finds the first bin with room in
    O(log bins) by descending left whenever the left subtree can hold the item. Unopened bins hold full
    capacity, so "no open bin fits" naturally lands on the next new bin. First Fit leaves at most one
    bin at most half full, so there are at most ``2·⌈total/seq_len⌉ + 1`` bins (and at most n), which
    sizes the tree.
    """
    n = len(lengths)
    if seq_len < 1:
        raise ValueError(f"seq_len must be ≥ 1, got {seq_len}")
    if n == 0:
        return []
    longest, shortest = max(lengths), min(lengths)
    if longest > seq_len or shortest < 1:
        raise ValueError(f"every length must be in [1, {seq_len}]; got min {shortest}, max {longest}")
    # Python's sort is stable under reverse=True: equal lengths keep input order (deterministic output).
    order = sorted(range(n), key=lengths.__getitem__, reverse=True)
    max_bins = min(n, 2 * -(-sum(lengths) // seq_len) + 1)
    leaves = 1 << (max_bins - 1).bit_length()
    tree = [seq_len] * (2 * leaves)  # tree[1] is the root; leaves at [leaves, 2·leaves)
    bins: list[list[int]] = []
    for i in order:
        size = lengths[i]
        node = 1
        while node < leaves:
            node <<= 1
            if tree[node] < size:
                node += 1
        b = node - leaves
        if b == len(bins):
            bins.append([i])
        else:
            bins[b].append(i)
        tree[node] -= size
        node >>= 1
        while node:
            left, right = tree[2 * node], tree[2 * node + 1]
            best = left if left > right else right
            if tree[node] == best:  # ancestors are unchanged too
                break
            tree[node] = best
            node >>= 1
    return bins


def bin_cost(seq_lens: Sequence[int], padded_len: int, attention_cost_weight: float) -> float:
    """Relative compute of one packed row, for balancing ranks.

    ``padded_len + w · Σ len_i²``: the dense layers cost ∝ every token (padding included); block-diagonal
    attention costs ∝ Σ len_i² over the samples. For a dense transformer with hidden size d, attention
    FLOPs per layer ≈ 2·len²·d (causal) against ≈ 24·d²·len for the matmuls, so w ≈ 1 / (12·d).
    """
    return padded_len + attention_cost_weight * sum(s * s for s in seq_lens)


def assign_to_ranks(costs: Sequence[float], n_ranks: int) -> list[list[int]]:
    """Longest-processing-time greedy: indices of ``costs``, most expensive first, each to the least
    loaded rank (ties → lower rank), with at most ``⌈len(costs) / n_ranks⌉`` per rank.

    The cap keeps the pass counts even, so padding every rank to the same count needs at most
    ``n_ranks − 1`` fillers; without it LPT may give one rank a single huge row and another many small
    ones. Inside a rank, indices are in assignment order (most expensive first).
    """
    cap = max(1, -(-len(costs) // n_ranks))
    grid: list[list[int]] = [[] for _ in range(n_ranks)]
    heap = [(0.0, rank) for rank in range(n_ranks)]  # (load, rank)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        load, rank = heapq.heappop(heap)
        grid[rank].append(i)
        if len(grid[rank]) < cap:  # a full rank leaves the heap for good
            heapq.heappush(heap, (load + costs[i], rank))
    return grid


# --------------------------------------------------------------------------------------------------
# The Packer
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Buffered:
    """One buffered sample, already as arrays: converted once per batch at arrival (list → array is the
    per-token cost; doing it in `Packer.add_batch` keeps `Packer.pack` to copies, and arrays hold a
    token in 1–8 bytes where a Python list holds ~32)."""

    ids: np.ndarray
    """(n,) int64: prompt then completion token ids."""
    n_prompt: int
    completion_mask: np.ndarray
    """(C,) bool."""
    completion_logprobs: np.ndarray
    """(C,) float32."""
    advantage: float | np.ndarray
    """A scalar, or (C,) float32."""
    teacher_logprobs: np.ndarray | None
    """(C,) float32, or None."""
    temperature: float
    """The sampling temperature of the sample's batch."""
    ref: SampleRef
    loss_tokens: int
    """Tokens that will carry loss in a row (completion_mask, minus a sample-initial token)."""
    arrived_at: float
    """Packer clock when its batch was added (for the timeout)."""

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]


@dataclass
class _RunState:
    """The Packer's view of one run."""

    batch_size: int
    """Samples per optimizer step."""
    buffer: deque[_Buffered] = field(default_factory=deque)
    """Samples waiting, oldest first (batches in the order added, samples in batch order)."""
    buffered_tokens: int = 0
    """Sum of ``num_tokens`` over ``buffer``."""
    progress: RunProgress = field(default_factory=RunProgress)
    samples_consumed_this_step: int = 0
    """Samples packed towards the current (incomplete) step; always < batch_size between packs."""


@dataclass
class _RowLayout:
    """Per-token layout of one row, derived from per-sample lengths."""

    seq_lens: list[int]
    """Sample lengths, then the padding length if any."""
    lens: np.ndarray
    """(S+1,) int64: the samples' lengths, then the padding's (possibly 0)."""
    starts: np.ndarray
    """(S,) int64: the first token of each real sample."""
    positions: np.ndarray
    """(L,) int64: position inside the token's segment."""
    sample_ids: np.ndarray
    """(L,) int64: sample index, -1 on padding."""
    token_slots: np.ndarray
    """(L,) int64."""
    temperatures: np.ndarray
    """(L,) float32."""


def _scatter(is_completion: np.ndarray, values: list[np.ndarray]) -> np.ndarray:
    """(L,) float32: the samples' completion ``values`` on the completion tokens in order, 0 elsewhere."""
    out = np.zeros(is_completion.shape[0], dtype=np.float32)
    out[is_completion] = np.concatenate(values)
    return out


class Packer:
    """Buffers rollouts per run and packs them into balanced micro-batches (see the module docstring).

    Args (keyword-only):
        n_slots: slots (concurrent runs) of the pool; ``slot_token_counts`` has this length.
        seq_len: the row length; no sample may be longer.
        dp_world_size: data-parallel ranks; a pack is at most one ``seq_len`` row per rank.
        pad_to_multiple_of: rows are padded to a multiple of this (capped at ``seq_len``).
        timeout_s: how long buffered work may wait for a full budget before it is packed anyway.
        pad_token_id: the token id of padding.
        clock: monotonic seconds; injectable for tests.
        attention_cost_weight: w in `bin_cost`, ≈ 1 / (12 · hidden_size) of the base model.

    Not thread-safe: the master rank owns it and calls it from its loop.
    """

    def __init__(
        self,
        *,
        n_slots: int,
        seq_len: int,
        dp_world_size: int,
        pad_to_multiple_of: int = 1,
        timeout_s: float = 10.0,
        pad_token_id: int = 0,
        clock: Callable[[], float] = time.monotonic,
        attention_cost_weight: float = 1.0 / (12 * 1024),
    ) -> None:
        for name, value in (
            ("n_slots", n_slots),
            ("seq_len", seq_len),
            ("dp_world_size", dp_world_size),
            ("pad_to_multiple_of", pad_to_multiple_of),
        ):
            if value < 1:
                raise ValueError(f"{name} must be ≥ 1, got {value}")
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be ≥ 0, got {timeout_s}")
        self.n_slots = n_slots
        self.seq_len = seq_len
        self.dp_world_size = dp_world_size
        self.pad_to_multiple_of = pad_to_multiple_of
        self.timeout_s = timeout_s
        self.pad_token_id = pad_token_id
        self.attention_cost_weight = attention_cost_weight
        self._clock = clock
        self._runs: dict[int, _RunState] = {}
        self._rr_next = 0  # the slot whose turn comes first in the next pack (or the next one above it)
        self._last_pack_at = -math.inf
        self.ready_to_update: list[bool] = [False] * n_slots
        """Per slot: a step completed since the trainer last cleared the flag (see `take_ready`)."""

    # ---- runs ----------------------------------------------------------------------------------

    def add_run(self, slot: int, *, batch_size: int) -> None:
        """Start accounting for a run in ``slot`` (progress from zero; see `set_progress` to resume)."""
        self._check_slot_range(slot)
        if slot in self._runs:
            raise ValueError(f"slot {slot} already has a run")
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        self._runs[slot] = _RunState(batch_size=batch_size)
        self.ready_to_update[slot] = False

    def remove_run(self, slot: int) -> None:
        """Forget the run in ``slot``: its buffered samples and its accounting are dropped."""
        self._state(slot)
        del self._runs[slot]
        self.ready_to_update[slot] = False

    def active_slots(self) -> list[int]:
        return sorted(self._runs)

    def set_progress(self, slot: int, step: int, total_tokens: int, total_samples: int) -> None:
        """Resume a run from a checkpoint (taken at a step boundary): no partial step is in progress."""
        state = self._state(slot)
        state.progress = RunProgress(step=step, total_tokens=total_tokens, total_samples=total_samples)
        state.samples_consumed_this_step = 0

    def progress(self, slot: int) -> RunProgress:
        """A copy of the run's progress."""
        p = self._state(slot).progress
        return RunProgress(step=p.step, total_tokens=p.total_tokens, total_samples=p.total_samples)

    def samples_consumed_this_step(self, slot: int) -> int:
        return self._state(slot).samples_consumed_this_step

    def batch_size(self, slot: int) -> int:
        return self._state(slot).batch_size

    def take_ready(self) -> list[int]:
        """Slots whose step completed since the last call; clears their `ready_to_update` flags."""
        ready = [slot for slot, flag in enumerate(self.ready_to_update) if flag]
        for slot in ready:
            self.ready_to_update[slot] = False
        return ready

    # ---- buffering -----------------------------------------------------------------------------

    def add_batch(self, slot: int, batch: TrainingBatch, *, batch_id: int, skip: int = 0) -> int:
        """Buffer the samples of ``batch`` from index ``skip`` on; returns how many were buffered.

        ``skip`` is the number of leading samples already trained (docs/contracts.md, exactly-once:
        ``max(0, checkpoint total_samples − sample_offset)``). A batch with any malformed sample is
        rejected whole (`InvalidSampleError`, a ValueError naming slot, batch and sample) and nothing of
        it is buffered. A return of 0 means the batch was already fully trained: ack it directly.
        """
        state = self._state(slot)
        if skip < 0:
            raise ValueError(f"skip must be ≥ 0, got {skip}")
        temperature = float(batch.temperature)
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(
                f"slot {slot}, batch {batch_id}: temperature must be finite and > 0, got {temperature}"
            )
        for index, sample in enumerate(batch.examples):
            self._check(slot, batch_id, index, sample)
        kept = batch.examples[skip:]
        if not kept:
            return 0

        # One list → array conversion per field for the whole batch; samples keep views into it.
        ids: list[int] = []
        mask: list[bool] = []
        logprobs: list[float] = []
        for s in kept:
            ids.extend(s.prompt_ids)
            ids.extend(s.completion_ids)
            mask.extend(s.completion_mask)
            logprobs.extend(s.completion_logprobs)
        ids_all = np.fromiter(ids, dtype=np.int64, count=len(ids))  # (T,)
        mask_all = np.frombuffer(bytes(mask), dtype=np.uint8) != 0  # (C_total,); bytes() is the fast path
        logprobs_all = np.asarray(logprobs, dtype=np.float32)  # (C_total,)
        loss_cumsum = np.concatenate(([0], np.cumsum(mask_all)))  # (C_total + 1,)

        now = self._clock()
        token_at = completion_at = 0
        for index, s in enumerate(kept, start=skip):
            n_prompt, n_completion = len(s.prompt_ids), len(s.completion_ids)
            c0, c1 = completion_at, completion_at + n_completion
            loss_tokens = int(loss_cumsum[c1] - loss_cumsum[c0])
            if n_prompt == 0 and mask_all[c0]:
                loss_tokens -= 1  # the first token of a sample has no in-sample predecessor
            assert s.advantage is not None  # checked above
            advantage = (
                np.asarray(s.advantage, dtype=np.float32)
                if isinstance(s.advantage, list)
                else float(s.advantage)
            )
            teacher = None if s.teacher_logprobs is None else np.asarray(s.teacher_logprobs, dtype=np.float32)
            state.buffer.append(
                _Buffered(
                    ids=ids_all[token_at : token_at + n_prompt + n_completion],
                    n_prompt=n_prompt,
                    completion_mask=mask_all[c0:c1],
                    completion_logprobs=logprobs_all[c0:c1],
                    advantage=advantage,
                    teacher_logprobs=teacher,
                    temperature=temperature,
                    ref=SampleRef(batch_id=batch_id, index=index),
                    loss_tokens=loss_tokens,
                    arrived_at=now,
                )
            )
            token_at += n_prompt + n_completion
            completion_at = c1
        state.buffered_tokens += len(ids)
        return len(kept)

    def _check(self, slot: int, batch_id: int, index: int, sample: TrainingSample) -> None:
        """Structure only (the service validates values before a batch is stored)."""

        def bad(reason: str) -> InvalidSampleError:
            return InvalidSampleError(slot=slot, batch_id=batch_id, index=index, reason=reason)

        n_prompt, n_completion = len(sample.prompt_ids), len(sample.completion_ids)
        num_tokens = n_prompt + n_completion
        if num_tokens > self.seq_len:
            raise bad(
                f"{num_tokens} tokens (prompt {n_prompt} + completion {n_completion}) > seq_len {self.seq_len}"
            )
        if num_tokens == 0:
            raise bad("empty sample (no prompt and no completion tokens)")
        if len(sample.prompt_mask) != n_prompt:
            raise bad(f"prompt_mask has {len(sample.prompt_mask)} entries, prompt_ids {n_prompt}")
        for name in ("completion_mask", "completion_logprobs"):
            if len(getattr(sample, name)) != n_completion:
                raise bad(f"{name} has {len(getattr(sample, name))} entries, completion_ids {n_completion}")
        if sample.teacher_logprobs is not None and len(sample.teacher_logprobs) != n_completion:
            raise bad(
                f"teacher_logprobs has {len(sample.teacher_logprobs)} entries, completion_ids {n_completion}"
            )
        advantage = sample.advantage
        if advantage is None:
            raise bad("advantage is missing")
        if isinstance(advantage, list):
            if len(advantage) != n_completion:
                raise bad(f"advantage has {len(advantage)} entries, completion_ids {n_completion}")
        elif not math.isfinite(advantage):
            raise bad(f"advantage is {advantage}")

    def buffered_tokens(self) -> int:
        """Tokens waiting in all runs' buffers."""
        return sum(state.buffered_tokens for state in self._runs.values())

    def buffered_samples(self, slot: int | None = None) -> int:
        """Samples waiting in one run's buffer, or in all of them."""
        if slot is not None:
            return len(self._state(slot).buffer)
        return sum(len(state.buffer) for state in self._runs.values())

    @property
    def token_budget(self) -> int:
        """Tokens one pack may take: one ``seq_len`` row per data-parallel rank."""
        return self.seq_len * self.dp_world_size

    def is_ready(self) -> bool:
        """Enough tokens buffered for every rank, or something waited ``timeout_s`` (module docstring)."""
        if self.buffered_tokens() >= self.token_budget:
            return True
        heads = [state.buffer[0].arrived_at for state in self._runs.values() if state.buffer]
        if not heads:
            return False
        waiting_since = max(min(heads), self._last_pack_at)
        return self._clock() - waiting_since >= self.timeout_s

    # ---- packing -------------------------------------------------------------------------------

    def pack(self, force: bool = False) -> PackResult | None:
        """Select, account and pack one trainer step's worth of samples.

        Returns None when not ready (unless ``force``) or when nothing is buffered.
        """
        if not force and not self.is_ready():
            return None
        selected = self._select_round_robin()
        if not selected:
            return None
        self._last_pack_at = self._clock()
        runs = {
            slot: self._update_run_progress(slot, [item for item, _ in picks])
            for slot, picks in selected.items()
        }

        # Slot-ascending flat list: sorting a bin's indices then yields ascending slots.
        flat = [(slot, item, row) for slot in sorted(selected) for item, row in selected[slot]]
        bins = pack_ffd([item.num_tokens for _, item, _ in flat], self.seq_len)
        if len(bins) > self.dp_world_size:
            # FFD is not monotone: rarely it needs a row more than the first-fit placement that admitted
            # the samples. Keep that placement then (one row per rank is what the budget promised).
            by_row: dict[int, list[int]] = {}
            for i, (_, _, row) in enumerate(flat):
                by_row.setdefault(row, []).append(i)
            bins = list(by_row.values())
        rows = [self._build_micro_batch([flat[i][:2] for i in sorted(b)]) for b in bins]
        return PackResult(micro_batches=self._distribute(rows), runs=runs)

    def _select_round_robin(self) -> dict[int, list[tuple[_Buffered, int]]]:
        """One sample per turn across runs with work, within each run's step quota and the budget.

        The budget is ``dp_world_size`` rows of ``seq_len`` tokens, checked by first-fit placement
        (not just a token sum): a plain ``seq_len × dp_world_size`` token budget routinely needs
        ``dp_world_size + 1`` rows after packing, i.e. a second pass on one rank for a small leftover while
        the others run fillers. Returns, per slot, (sample, first-fit row) in selection order.
        """
        slots = sorted(slot for slot, state in self._runs.items() if state.buffer)
        if not slots:
            return {}
        start = next((k for k, slot in enumerate(slots) if slot >= self._rr_next), 0)
        turn_order = slots[start:] + slots[:start]
        quota = {
            slot: min(
                self._runs[slot].batch_size - self._runs[slot].samples_consumed_this_step,
                len(self._runs[slot].buffer),
            )
            for slot in turn_order
        }
        room = [self.seq_len] * self.dp_world_size  # free tokens per row
        selected: dict[int, list[tuple[_Buffered, int]]] = {}
        first_denied: int | None = None
        last_served: int | None = None
        contenders = [slot for slot in turn_order if quota[slot] > 0]
        while contenders:
            still: list[int] = []
            for slot in contenders:
                state = self._runs[slot]
                head = state.buffer[0]
                size = head.num_tokens
                row = next((r for r, free in enumerate(room) if free >= size), -1)
                if row < 0:
                    # Out of this pack; it opens the next one so it is not passed over again.
                    if first_denied is None:
                        first_denied = slot
                    continue
                room[row] -= size
                state.buffer.popleft()
                state.buffered_tokens -= size
                taken = selected.setdefault(slot, [])
                taken.append((head, row))
                last_served = slot
                if len(taken) < quota[slot]:
                    still.append(slot)
            contenders = still
        if first_denied is not None:
            self._rr_next = first_denied
        elif last_served is not None:
            self._rr_next = last_served + 1
        return selected

    def _update_run_progress(self, slot: int, items: list[_Buffered]) -> RunPackStats:
        state = self._runs[slot]
        tokens = sum(item.num_tokens for item in items)
        state.progress.total_tokens += tokens
        state.progress.total_samples += len(items)
        state.samples_consumed_this_step += len(items)
        # Selection never exceeds the step's remaining quota, so this completes at most one step.
        completed = state.samples_consumed_this_step >= state.batch_size
        if completed:
            state.progress.step += 1
            state.samples_consumed_this_step -= state.batch_size
            self.ready_to_update[slot] = True
        return RunPackStats(
            samples=len(items),
            tokens=tokens,
            loss_tokens=sum(item.loss_tokens for item in items),
            step_completed=completed,
            step=state.progress.step,
            consumed=[item.ref for item in items],
        )

    def _padded_length(self, length: int) -> int:
        m = self.pad_to_multiple_of
        return min(-(-length // m) * m, self.seq_len)

    def _build_micro_batch(self, members: list[tuple[int, _Buffered]]) -> MicroBatch:
        """Lay out one bin (members in ascending slot order) as a padded row: array copies and
        vectorised index arithmetic, no per-token Python."""
        seq_lens = [item.num_tokens for _, item in members]
        used = sum(seq_lens)
        length = self._padded_length(used)
        pad = length - used
        layout = self._layout(
            seq_lens,
            [slot for slot, _ in members],
            [item.temperature for _, item in members],
            pad=pad,
            pad_slot=members[-1][0],
        )
        input_ids = np.full(length, self.pad_token_id, dtype=np.int64)  # (L,)
        input_ids[:used] = np.concatenate([item.ids for _, item in members])
        # Completion tokens: a token is one when its position in its sample is past the prompt.
        prompt_lens = [item.n_prompt for _, item in members] + [length]  # padding: never completion
        is_completion = layout.positions >= np.repeat(
            np.asarray(prompt_lens, dtype=np.int64), layout.lens
        )  # (L,)
        loss_mask = np.zeros(length, dtype=np.bool_)
        loss_mask[is_completion] = np.concatenate([item.completion_mask for _, item in members])
        loss_mask[layout.starts] = False  # a sample's first token has no in-sample predecessor
        completion_lens = [item.completion_mask.shape[0] for _, item in members]
        if all(isinstance(item.advantage, float) for _, item in members):  # the usual case: one call
            advantages = [
                np.repeat(np.asarray([item.advantage for _, item in members], np.float32), completion_lens)
            ]
        else:
            advantages = [
                item.advantage
                if isinstance(item.advantage, np.ndarray)
                else np.full(n, item.advantage, np.float32)
                for (_, item), n in zip(members, completion_lens, strict=True)
            ]
        teacher = None
        if any(item.teacher_logprobs is not None for _, item in members):
            teacher = [
                item.teacher_logprobs if item.teacher_logprobs is not None else np.zeros(n, np.float32)
                for (_, item), n in zip(members, completion_lens, strict=True)
            ]
        logprobs = [item.completion_logprobs for _, item in members]
        return MicroBatch(
            input_ids=torch.from_numpy(input_ids),
            position_ids=torch.from_numpy(layout.positions),
            loss_mask=torch.from_numpy(loss_mask),
            advantages=torch.from_numpy(_scatter(is_completion, advantages)),
            inference_logprobs=torch.from_numpy(_scatter(is_completion, logprobs)),
            temperatures=torch.from_numpy(layout.temperatures),
            teacher_logprobs=torch.from_numpy(_scatter(is_completion, teacher))
            if teacher is not None
            else None,
            token_slots=torch.from_numpy(layout.token_slots),
            sample_ids=torch.from_numpy(layout.sample_ids),
            seq_lens=layout.seq_lens,
            slot_token_counts=torch.from_numpy(np.bincount(layout.token_slots, minlength=self.n_slots)),
            is_filler=False,
        )

    def _layout(
        self, sample_lens: list[int], slots: list[int], temperatures: list[float], *, pad: int, pad_slot: int
    ) -> _RowLayout:
        """Per-token layout arrays from per-sample lengths (the padding pseudo-sequence appended)."""
        seq_lens = sample_lens + [pad] if pad else list(sample_lens)
        lens = np.asarray(
            seq_lens + ([] if pad else [0]), dtype=np.int64
        )  # (S+1,): a 0-length tail if no pad
        ends = np.cumsum(lens)
        starts = ends - lens  # (S+1,)
        length = int(ends[-1])
        n = len(sample_lens)
        return _RowLayout(
            seq_lens=seq_lens,
            lens=lens,
            starts=starts[:n],
            positions=np.arange(length, dtype=np.int64) - np.repeat(starts, lens),
            sample_ids=np.repeat(np.append(np.arange(n, dtype=np.int64), -1), lens),
            token_slots=np.repeat(np.asarray(slots + [pad_slot], dtype=np.int64), lens),
            temperatures=np.repeat(np.asarray(temperatures + [1.0], dtype=np.float32), lens),
        )

    def filler_micro_batch(self) -> MicroBatch:
        """A minimal row of padding (no samples, no loss) that keeps a rank's pass count in step."""
        length = self._padded_length(1)
        layout = self._layout([], [], [], pad=length, pad_slot=0)
        zeros = torch.zeros(length, dtype=torch.float32)
        return MicroBatch(
            input_ids=torch.full((length,), self.pad_token_id, dtype=torch.long),
            position_ids=torch.from_numpy(layout.positions),
            loss_mask=torch.zeros(length, dtype=torch.bool),
            advantages=zeros,
            inference_logprobs=zeros.clone(),
            temperatures=torch.from_numpy(layout.temperatures),
            teacher_logprobs=None,
            token_slots=torch.from_numpy(layout.token_slots),
            sample_ids=torch.from_numpy(layout.sample_ids),
            seq_lens=layout.seq_lens,
            slot_token_counts=torch.from_numpy(np.bincount(layout.token_slots, minlength=self.n_slots)),
            is_filler=True,
        )

    def _distribute(self, rows: list[MicroBatch]) -> list[list[MicroBatch]]:
        """Rows to ranks by `assign_to_ranks` on `bin_cost`, then fillers so every rank has as many."""
        costs = [
            bin_cost(row.seq_lens[: row.num_samples], row.num_tokens, self.attention_cost_weight)
            for row in rows
        ]
        grid = [[rows[i] for i in assigned] for assigned in assign_to_ranks(costs, self.dp_world_size)]
        depth = max(len(g) for g in grid)
        for g in grid:
            g.extend(self.filler_micro_batch() for _ in range(depth - len(g)))
        return grid

    # ---- helpers -------------------------------------------------------------------------------

    def _check_slot_range(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} is outside 0..{self.n_slots - 1}")

    def _state(self, slot: int) -> _RunState:
        self._check_slot_range(slot)
        try:
            return self._runs[slot]
        except KeyError:
            raise ValueError(f"slot {slot} has no run") from None
