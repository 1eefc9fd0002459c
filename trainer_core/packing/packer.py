"""The Packer: per-run rollout buffers → fair selection → packed, rank-balanced micro-batches.

Source document 002 and DESIGN §6, with the step semantics of docs/contracts.md.

Flow of one `Packer.pack()`:

1. **Wait** (`is_ready`): buffered tokens reach ``seq_len × dp_world_size``; or every run with buffered
   samples has its whole step's worth (waiting could not add a sample to this pack: each run gives
   at most what its step still needs — with on-policy RL the next batch comes only after this step's
   adapter, so waiting is pure idle time); or, as the fallback, something has waited ``timeout_s``
   (measured from the later of the oldest buffered sample's arrival and the last pack, so leftovers
   of a pack do not trigger an immediate tiny pack, and a lone sample is never stuck).
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
   step 2 a pack has at most ``dp_world_size`` bins; when it has fewer, the heaviest bins are split
   first (`split_to_align`, samples kept whole), so a filler is left only for a rank that no split
   can feed (fewer samples than ranks).

Row layout (sample boundaries, padding, fillers) is `trainer_core.packing.rows`; bin packing and rank
balancing are `trainer_core.packing.bins`.

The Packer checks what training needs to be safe and exact (`contracts.wire.sample_problems` with
``full=False``: lengths, sizes, vocabulary, a finite advantage); the service checks every rule before a
batch is ever stored.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from contracts.arrays import ArrayBatch, array_batch_problems, to_arrays
from contracts.progress import Progress
from contracts.wire import TrainingBatch, TrainingSample, sample_problems
from trainer_core.packing.bins import assign_to_ranks, bin_cost, pack_ffd, split_to_align
from trainer_core.packing.buffer import RunBuffer, SampleChunk
from trainer_core.packing.rows import Member, MicroBatch, RowFormat, SampleRef

__all__ = ["InvalidSampleError", "PackResult", "Packer", "RunPackStats"]


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
    taken: list[tuple[int, int, int]] = field(default_factory=list)
    """The samples taken, in selection order, as runs of consecutive samples of one batch:
    ``(batch id, index in the batch of the first, how many)``."""

    @property
    def consumed(self) -> list[SampleRef]:
        """The samples taken, one `SampleRef` each, in selection order."""
        return [SampleRef(batch_id, first + i) for batch_id, first, n in self.taken for i in range(n)]

    def samples_per_batch(self) -> list[tuple[int, int]]:
        """``(batch id, samples taken of it)`` in selection order."""
        return [(batch_id, n) for batch_id, _, n in self.taken]


@dataclass
class PackResult:
    """The output of one pack."""

    micro_batches: list[list[MicroBatch]]
    """One list per data-parallel rank; every list has the same length."""
    runs: dict[int, RunPackStats]
    """Per slot that contributed samples."""

    def fill(self) -> tuple[int, int]:
        """(real tokens, row capacity) over every rank's micro-batches: the pack's efficiency."""
        real = sum(mb.real_tokens for rank in self.micro_batches for mb in rank)
        capacity = sum(mb.num_tokens for rank in self.micro_batches for mb in rank)
        return real, capacity


class InvalidSampleError(ValueError):
    """A sample the Packer cannot train; names the slot, the batch and the sample index."""

    def __init__(self, *, slot: int, batch_id: int, index: int, reason: str) -> None:
        super().__init__(f"slot {slot}, batch {batch_id}, sample {index}: {reason}")
        self.slot = slot
        self.batch_id = batch_id
        self.index = index
        self.reason = reason


@dataclass
class _RunState:
    """The Packer's view of one run."""

    batch_size: int
    """Samples per optimizer step."""
    buffer: RunBuffer = field(default_factory=RunBuffer)
    """Samples waiting, oldest first (batches in the order added, samples in batch order)."""
    progress: Progress = field(default_factory=Progress)
    samples_consumed_this_step: int = 0
    """Samples packed towards the current (incomplete) step; always < batch_size between packs."""
    trains_on_rewards: bool = True
    """False: the run's `reward` / `token_rewards` are metrics only (its advantages come from the
    client), so they are not buffered and its rows stay on the plain path."""


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
        vocab_size: token ids must lie in [0, vocab_size) (None: only non-negative).
        pack_on_full_steps: pack as soon as every run with buffered samples has its step's worth
            (False: only on a full budget or the timeout, the behaviour before; for comparisons).

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
        vocab_size: int | None = None,
        pack_on_full_steps: bool = True,
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
        self.vocab_size = vocab_size
        self.pack_on_full_steps = pack_on_full_steps
        self._rows = RowFormat(
            n_slots=n_slots, seq_len=seq_len, pad_to_multiple_of=pad_to_multiple_of, pad_token_id=pad_token_id
        )
        self._clock = clock
        self._runs: dict[int, _RunState] = {}
        self._rr_next = 0  # the slot whose turn comes first in the next pack (or the next one above it)
        self._last_pack_at = -math.inf
        self.ready_to_update: list[bool] = [False] * n_slots
        """Per slot: a step completed since the trainer last cleared the flag (see `take_ready`)."""

    # ---- runs ----------------------------------------------------------------------------------

    def add_run(
        self, slot: int, *, batch_size: int, progress: Progress | None = None, trains_on_rewards: bool = True
    ) -> None:
        """Start accounting for a run in ``slot``, at a step boundary.

        ``progress``: the run's progress object, which the Packer then advances in place as it packs
        (the trainer passes its own, so that the run's progress exists once); None starts a new one
        at zero. See `set_progress` to move it to a checkpoint later. ``trains_on_rewards``: the run's
        loss reads the samples' rewards (GAE); otherwise they are metrics only (the service
        aggregates them) and are not buffered.
        """
        self._check_slot_range(slot)
        if slot in self._runs:
            raise ValueError(f"slot {slot} already has a run")
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        self._runs[slot] = _RunState(
            batch_size=batch_size,
            progress=progress if progress is not None else Progress(),
            trains_on_rewards=trains_on_rewards,
        )
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
        # In place: whoever passed the object to `add_run` sees the change.
        state.progress.step, state.progress.total_tokens = step, total_tokens
        state.progress.total_samples = total_samples
        state.samples_consumed_this_step = 0

    def progress(self, slot: int) -> Progress:
        """A copy of the run's progress."""
        p = self._state(slot).progress
        return Progress(step=p.step, total_tokens=p.total_tokens, total_samples=p.total_samples)

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

    def add_batch(self, slot: int, batch: TrainingBatch | ArrayBatch, *, batch_id: int, skip: int = 0) -> int:
        """Buffer the samples of ``batch`` from index ``skip`` on; returns how many were buffered.

        ``batch``: the binary form (contracts/arrays.py: what a claim carries; its arrays are joined
        once per field and read in place) or the list form (converted once). ``skip`` is the number of leading samples already
        trained (docs/contracts.md, exactly-once: ``max(0, checkpoint total_samples − sample_offset)``).
        A batch with any malformed sample is rejected whole (`InvalidSampleError`, a ValueError naming
        slot, batch and sample) and nothing of it is buffered. A return of 0 means the batch was already
        fully trained: ack it directly.
        """
        state = self._state(slot)
        if skip < 0:
            raise ValueError(f"skip must be ≥ 0, got {skip}")
        temperature = float(batch.temperature)
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(
                f"slot {slot}, batch {batch_id}: temperature must be finite and > 0, got {temperature}"
            )
        checked = isinstance(batch, TrainingBatch)
        if isinstance(batch, TrainingBatch):
            for index, sample in enumerate(batch.examples):
                self._check(slot, batch_id, index, sample)
            try:
                batch = to_arrays(batch)
            except ValueError as exc:  # ids travel as int32; only a pool without a vocabulary sees this
                raise ValueError(f"slot {slot}, batch {batch_id}: {exc}") from None
        if not batch.examples[skip:]:
            if not checked:
                self._check_arrays(slot, batch_id, batch)
            return 0
        chunk = SampleChunk.from_arrays(
            batch.examples,
            skip=skip,
            batch_id=batch_id,
            temperature=temperature,
            arrived_at=self._clock(),
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
            rewards=state.trains_on_rewards,
        )
        if chunk is None:  # a rule is broken: the one wording of the rules names it (raises)
            self._check_arrays(slot, batch_id, batch)
            # Only reachable when array_batch_problems stops at a batch-level fault (too many
            # examples) before the samples: refuse the batch (a ValueError: the worker evicts the run).
            raise ValueError(
                f"slot {slot}, batch {batch_id}: a sample breaks a rule of a trainable sample; "
                "array_batch_problems names no sample (a batch-level fault stopped it)"
            )
        state.buffer.append(chunk)
        return len(chunk)

    def _check_arrays(self, slot: int, batch_id: int, batch: ArrayBatch) -> None:
        """`_check` for a binary batch: vectorised over the batch (contracts.arrays)."""
        problems = array_batch_problems(batch, seq_len=self.seq_len, vocab_size=self.vocab_size, full=False)
        for p in problems:
            if p.sample is not None:
                raise InvalidSampleError(slot=slot, batch_id=batch_id, index=p.sample, reason=p.problem)

    def _check(self, slot: int, batch_id: int, index: int, sample: TrainingSample) -> None:
        """What training needs to be safe and exact (contracts.wire.sample_problems, full=False)."""
        problems = sample_problems(sample, seq_len=self.seq_len, vocab_size=self.vocab_size, full=False)
        if problems:
            raise InvalidSampleError(slot=slot, batch_id=batch_id, index=index, reason=problems[0][1])

    def buffered_tokens(self, slot: int | None = None) -> int:
        """Tokens waiting in one run's buffer, or in all of them."""
        if slot is not None:
            return self._state(slot).buffer.tokens
        return sum(state.buffer.tokens for state in self._runs.values())

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
        """Enough tokens buffered for every rank, every run with work has its step's worth, or something
        waited ``timeout_s`` (module docstring)."""
        if self.buffered_tokens() >= self.token_budget:
            return True
        with_work = [state for state in self._runs.values() if state.buffer]
        if not with_work:
            return False
        if self.pack_on_full_steps and all(
            len(state.buffer) >= state.batch_size - state.samples_consumed_this_step for state in with_work
        ):
            return True
        heads = [state.buffer.head_arrived_at() for state in with_work]
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
        runs = {slot: self._update_run_progress(slot, taken) for slot, (taken, _) in selected.items()}

        # Slot-ascending flat lists: sorting a bin's indices then yields ascending slots.
        flat: list[Member] = []
        lengths: list[int] = []
        first_fit_rows: list[int] = []
        for slot in sorted(selected):
            taken, rows = selected[slot]
            for chunk, k0, k1 in taken:
                flat.extend(zip(itertools.repeat(slot), itertools.repeat(chunk), range(k0, k1)))
                lengths.extend(chunk.lengths[k0:k1])
            first_fit_rows.extend(rows)
        bins = pack_ffd(lengths, self.seq_len)
        if len(bins) > self.dp_world_size:
            # FFD is not monotone: rarely it needs a row more than the first-fit placement that admitted
            # the samples. Keep that placement then (one row per rank is what the budget promised).
            by_row: dict[int, list[int]] = {}
            for i, row in enumerate(first_fit_rows):
                by_row.setdefault(row, []).append(i)
            bins = list(by_row.values())
        # Ranks without a row would run a filler: split the heaviest rows instead (samples whole).
        bins = split_to_align(bins, lengths, self.dp_world_size, self.attention_cost_weight)
        members = [[flat[i] for i in sorted(b)] for b in bins]
        costs = [
            bin_cost(
                [lengths[i] for i in b],
                self._rows.padded_length(sum([lengths[i] for i in b])),
                self.attention_cost_weight,
            )
            for b in bins
        ]
        return PackResult(micro_batches=self._distribute(members, costs), runs=runs)

    def _select_round_robin(self) -> dict[int, tuple[list[tuple[SampleChunk, int, int]], list[int]]]:
        """One sample per turn across runs with work, within each run's step quota and the budget.

        The budget is ``dp_world_size`` rows of ``seq_len`` tokens, checked by first-fit placement
        (not just a token sum): a plain ``seq_len × dp_world_size`` token budget routinely needs
        ``dp_world_size + 1`` rows after packing, i.e. a second pass on one rank for a small leftover while
        the others run fillers. A run's picks are always its oldest samples, so the turns only read
        lengths and each run's picks leave its buffer at the end in one `RunBuffer.take`. Returns, per
        slot, (the samples taken as ``(chunk, first, end)``, each sample's first-fit row in selection
        order).
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
        n_rows = len(room)
        heads = {slot: self._runs[slot].buffer.lengths() for slot in turn_order}
        rows_of: dict[int, list[int]] = {}
        first_denied: int | None = None
        last_served: int | None = None
        contenders = [slot for slot in turn_order if quota[slot] > 0]
        while contenders:
            still: list[int] = []
            for slot in contenders:
                size = next(heads[slot])
                row = 0
                while row < n_rows and room[row] < size:
                    row += 1
                if row == n_rows:
                    # Out of this pack; it opens the next one so it is not passed over again.
                    if first_denied is None:
                        first_denied = slot
                    continue
                room[row] -= size
                rows = rows_of.setdefault(slot, [])
                rows.append(row)
                last_served = slot
                if len(rows) < quota[slot]:
                    still.append(slot)
            contenders = still
        if first_denied is not None:
            self._rr_next = first_denied
        elif last_served is not None:
            self._rr_next = last_served + 1
        return {slot: (self._runs[slot].buffer.take(len(rows)), rows) for slot, rows in rows_of.items()}

    def _update_run_progress(self, slot: int, taken: list[tuple[SampleChunk, int, int]]) -> RunPackStats:
        state = self._runs[slot]
        samples = sum(k1 - k0 for _, k0, k1 in taken)
        tokens = sum(sum(chunk.lengths[k0:k1]) for chunk, k0, k1 in taken)
        state.progress.total_tokens += tokens
        state.progress.total_samples += samples
        state.samples_consumed_this_step += samples
        # Selection never exceeds the step's remaining quota, so this completes at most one step.
        completed = state.samples_consumed_this_step >= state.batch_size
        if completed:
            state.progress.step += 1
            state.samples_consumed_this_step -= state.batch_size
            self.ready_to_update[slot] = True
        return RunPackStats(
            samples=samples,
            tokens=tokens,
            loss_tokens=sum(sum(chunk.loss_tokens[k0:k1]) for chunk, k0, k1 in taken),
            step_completed=completed,
            step=state.progress.step,
            taken=[(chunk.batch_id, chunk.first_index + k0, k1 - k0) for chunk, k0, k1 in taken],
        )

    def _distribute(self, rows: list[list[Member]], costs: list[float]) -> list[list[MicroBatch]]:
        """Rows to ranks by `assign_to_ranks` on their `bin_cost`, then fillers so every rank has as
        many."""
        grid = [
            [self._rows.build(rows[i]) for i in assigned]
            for assigned in assign_to_ranks(costs, self.dp_world_size)
        ]
        depth = max(len(g) for g in grid)
        for g in grid:
            g.extend(self._rows.filler() for _ in range(depth - len(g)))
        return grid

    def filler_micro_batch(self) -> MicroBatch:
        """A minimal row of padding (no samples, no loss) that keeps a rank's pass count in step."""
        return self._rows.filler()

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
