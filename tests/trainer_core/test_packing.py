"""The Packer's behaviours one by one: selection, fairness, step accounting, timeout, skip, runs,
validation, layout of a row, rank balancing. Property tests live in test_packing_properties.py."""

import pytest
import torch

from contracts.wire import TrainingBatch, TrainingSample
from tests.common import FakeClock
from trainer_core.packing import (
    InvalidSampleError,
    MicroBatch,
    Packer,
    SampleRef,
    assign_to_ranks,
    bin_cost,
    pack_ffd,
)

torch.set_num_threads(1)


def sample(
    prompt: int,
    completion: int,
    *,
    token: int = 1,
    advantage: float | list[float] = 1.0,
    teacher: list[float] | None = None,
    completion_mask: list[bool] | None = None,
) -> TrainingSample:
    return TrainingSample(
        prompt_ids=[token] * prompt,
        prompt_mask=[True] * prompt,
        completion_ids=[token + 1] * completion,
        completion_mask=completion_mask if completion_mask is not None else [True] * completion,
        completion_logprobs=[-0.25] * completion,
        advantage=advantage,
        teacher_logprobs=teacher,
    )


def batch(*samples: TrainingSample, temperature: float = 1.0) -> TrainingBatch:
    return TrainingBatch(examples=list(samples), temperature=temperature)


def slots_in(result) -> list[int]:
    """Slots of every real sample in a pack, row by row."""
    out = []
    for rank in result.micro_batches:
        for mb in rank:
            for k in range(mb.num_samples):
                out.append(int(mb.token_slots[mb.sample_ids == k][0]))
    return out


# ---- pack_ffd ---------------------------------------------------------------------------------


def test_pack_ffd_small_cases():
    assert pack_ffd([], 10) == []
    assert pack_ffd([10], 10) == [[0]]
    # Decreasing: 6, 5, 4, 3, 2 → [6, 4], [5, 3, 2]
    assert pack_ffd([2, 6, 3, 5, 4], 10) == [[1, 4], [3, 2, 0]]
    # Equal lengths keep input order.
    assert pack_ffd([3, 3, 3, 3], 6) == [[0, 1], [2, 3]]


def test_pack_ffd_rejects_bad_lengths():
    with pytest.raises(ValueError, match=r"\[1, 8\]"):
        pack_ffd([3, 9], 8)
    with pytest.raises(ValueError):
        pack_ffd([0], 8)


def test_bin_cost_counts_padding_and_quadratic_attention():
    assert bin_cost([3, 4], 8, 0.0) == 8
    assert bin_cost([3, 4], 8, 1.0) == 8 + 9 + 16


# ---- selection, fairness, round-robin ---------------------------------------------------------


def test_flooding_run_cannot_starve_another():
    """Run X pushes 50 batches, then run Y pushes 1 → Y's samples are all in the first packed step."""
    packer = Packer(n_slots=4, seq_len=256, dp_world_size=2)
    packer.add_run(0, batch_size=8)
    packer.add_run(3, batch_size=8)
    for b in range(50):
        packer.add_batch(0, batch(*[sample(10, 10)] * 8), batch_id=b)
    packer.add_batch(3, batch(*[sample(10, 10, token=50)] * 8), batch_id=1000)
    assert packer.is_ready()

    first = packer.pack()
    assert first is not None
    assert first.runs[3].consumed == [SampleRef(1000, i) for i in range(8)]
    assert first.runs[3].step_completed and first.runs[3].step == 1
    # X gets one step's worth too, never more: a pack completes at most one step per run.
    assert first.runs[0].samples == 8 and first.runs[0].step == 1
    assert packer.ready_to_update[0] and packer.ready_to_update[3]


def test_round_robin_shares_a_tight_budget_evenly():
    # Budget 240 tokens = 12 samples of 20: X and Y alternate → 6 each, whatever X has buffered.
    packer = Packer(n_slots=2, seq_len=120, dp_world_size=2)
    packer.add_run(0, batch_size=64)
    packer.add_run(1, batch_size=64)
    for b in range(20):
        packer.add_batch(0, batch(*[sample(10, 10)] * 8), batch_id=b)
    packer.add_batch(1, batch(*[sample(10, 10)] * 8), batch_id=99)
    result = packer.pack()
    assert result is not None
    assert result.runs[0].samples == 6 and result.runs[1].samples == 6


def test_round_robin_position_persists_across_packs():
    # One sample per pack (each fills the whole budget): turns go 0, 1, 2, 0, 1, 2, ...
    packer = Packer(n_slots=3, seq_len=8, dp_world_size=1)
    for slot in range(3):
        packer.add_run(slot, batch_size=100)
        packer.add_batch(slot, batch(*[sample(4, 4)] * 4), batch_id=slot)
    order = []
    for _ in range(7):
        result = packer.pack(force=True)
        assert result is not None
        (slot,) = result.runs
        order.append(slot)
    assert order == [0, 1, 2, 0, 1, 2, 0]


def test_position_survives_a_run_leaving_and_slots_with_no_work_are_skipped():
    packer = Packer(n_slots=4, seq_len=8, dp_world_size=1)
    for slot in (0, 1, 3):
        packer.add_run(slot, batch_size=100)
        packer.add_batch(slot, batch(*[sample(4, 4)] * 3), batch_id=slot)
    assert list(packer.pack(force=True).runs) == [0]
    packer.remove_run(1)
    assert list(packer.pack(force=True).runs) == [3]
    assert list(packer.pack(force=True).runs) == [0]


def test_a_run_with_long_samples_is_not_passed_over():
    # Slot 0's samples need a whole budget; slot 1's tiny samples would fill any leftover. The run denied
    # a turn opens the next pack, so slot 0 is served every other pack at worst.
    packer = Packer(n_slots=2, seq_len=10, dp_world_size=1)
    packer.add_run(0, batch_size=100)
    packer.add_run(1, batch_size=100)
    packer.add_batch(0, batch(*[sample(5, 5)] * 3), batch_id=0)
    packer.add_batch(1, batch(*[sample(1, 1)] * 50), batch_id=1)
    served = [set(packer.pack(force=True).runs) for _ in range(6)]
    assert sum(0 in s for s in served) == 3


def test_step_accounting_by_batch_size():
    packer = Packer(n_slots=1, seq_len=64, dp_world_size=1)
    packer.add_run(0, batch_size=3)
    packer.add_batch(0, batch(*[sample(2, 2)] * 7), batch_id=0)
    steps, completed = [], []
    while (result := packer.pack(force=True)) is not None:
        steps.append(result.runs[0].samples)
        completed.append(result.runs[0].step_completed)
    # Each pack takes at most what the step still needs: 3, 3, then the partial 1.
    assert steps == [3, 3, 1] and completed == [True, True, False]
    progress = packer.progress(0)
    assert (progress.step, progress.total_samples, progress.total_tokens) == (2, 7, 28)
    assert packer.samples_consumed_this_step(0) == 1
    assert packer.take_ready() == [0] and packer.take_ready() == []

    packer.add_batch(0, batch(*[sample(2, 2)] * 5), batch_id=1)
    result = packer.pack(force=True)
    assert result.runs[0].samples == 2 and result.runs[0].step_completed and result.runs[0].step == 3


def test_set_progress_resumes_from_a_checkpoint():
    packer = Packer(n_slots=2, seq_len=64, dp_world_size=1)
    packer.add_run(1, batch_size=2)
    packer.add_batch(1, batch(sample(1, 1)), batch_id=0)
    packer.pack(force=True)
    assert packer.samples_consumed_this_step(1) == 1
    packer.set_progress(1, 5, 500, 10)
    assert packer.samples_consumed_this_step(1) == 0
    packer.add_batch(1, batch(sample(1, 1), sample(1, 1)), batch_id=1)
    result = packer.pack(force=True)
    assert result.runs[1].step == 6
    assert packer.progress(1).total_samples == 12 and packer.progress(1).total_tokens == 504


# ---- readiness and timeout --------------------------------------------------------------------


def test_ready_on_tokens_or_after_timeout():
    clock = FakeClock()
    # The timeout fallback alone (test_no_idle_wait_once_every_run_has_its_step covers the rule before it).
    packer = Packer(
        n_slots=1, seq_len=16, dp_world_size=2, timeout_s=10.0, clock=clock, pack_on_full_steps=False
    )
    packer.add_run(0, batch_size=2)
    assert not packer.is_ready() and packer.pack() is None  # nothing buffered
    packer.add_batch(0, batch(*[sample(4, 4)] * 3), batch_id=0)  # 24 < 32 tokens
    assert packer.buffered_tokens() == 24
    clock.now = 9.9
    assert not packer.is_ready() and packer.pack() is None
    clock.now = 10.0
    assert packer.is_ready()
    result = packer.pack()
    assert result is not None and result.runs[0].samples == 2  # the step's quota
    # The leftover waits a full timeout after the pack, not from its (old) arrival.
    clock.now = 19.9
    assert not packer.is_ready()
    clock.now = 20.0
    assert packer.is_ready()
    assert packer.pack().runs[0].samples == 1

    # A sample arriving long after the last pack waits its own timeout.
    clock.now = 100.0
    packer.add_batch(0, batch(sample(4, 4)), batch_id=1)
    assert not packer.is_ready()
    clock.now = 110.0
    assert packer.is_ready()


def test_no_idle_wait_once_every_run_has_its_step():
    clock = FakeClock()
    packer = Packer(n_slots=3, seq_len=64, dp_world_size=2, timeout_s=10.0, clock=clock)
    packer.add_run(0, batch_size=2)
    packer.add_run(1, batch_size=3)
    packer.add_run(2, batch_size=2)  # no work buffered: does not hold the others back
    packer.add_batch(0, batch(*[sample(4, 4)] * 2), batch_id=0)  # run 0: its whole step
    packer.add_batch(1, batch(*[sample(4, 4)] * 2), batch_id=1)  # run 1: 2 of 3
    assert packer.buffered_tokens() == 32 < packer.token_budget
    assert not packer.is_ready()  # run 1 may still send its third sample: waiting can help
    packer.add_batch(1, batch(sample(4, 4)), batch_id=2)
    assert packer.is_ready()  # every run with work has its step: waiting cannot add to this pack
    result = packer.pack()
    assert result is not None and {s: r.step_completed for s, r in result.runs.items()} == {0: True, 1: True}
    assert clock.now == 0.0  # no timeout was needed
    # Mid-step: a run that already consumed part of its step needs only the rest.
    packer.add_batch(1, batch(sample(4, 4)), batch_id=3)
    packer.pack(force=True)
    assert packer.samples_consumed_this_step(1) == 1
    packer.add_batch(1, batch(*[sample(4, 4)] * 2), batch_id=4)
    assert packer.is_ready()
    # The rule can be switched off (the timeout then decides).
    packer.pack_on_full_steps = False
    assert not packer.is_ready()
    clock.now = 10.0
    assert packer.is_ready()


def test_ready_when_tokens_reach_the_threshold_and_force_packs_anyway():
    clock = FakeClock()
    packer = Packer(n_slots=2, seq_len=16, dp_world_size=2, clock=clock)
    packer.add_run(0, batch_size=10)
    packer.add_batch(0, batch(*[sample(4, 4)] * 3), batch_id=0)
    assert not packer.is_ready()
    assert packer.pack(force=True) is not None
    packer.add_batch(0, batch(*[sample(4, 4)] * 4), batch_id=1)  # 32 = 16 × 2
    assert packer.is_ready()


# ---- skip, runs, validation -------------------------------------------------------------------


def test_skip_drops_already_trained_leading_samples():
    packer = Packer(n_slots=1, seq_len=64, dp_world_size=1)
    packer.add_run(0, batch_size=10)
    samples = [sample(2, 2 + i) for i in range(5)]
    assert packer.add_batch(0, batch(*samples), batch_id=7, skip=3) == 2
    assert packer.buffered_tokens() == (2 + 5) + (2 + 6)
    result = packer.pack(force=True)
    assert result.runs[0].consumed == [SampleRef(7, 3), SampleRef(7, 4)]
    assert packer.add_batch(0, batch(*samples), batch_id=8, skip=5) == 0
    assert packer.add_batch(0, batch(*samples), batch_id=9, skip=99) == 0
    assert packer.buffered_samples() == 0
    with pytest.raises(ValueError, match="skip"):
        packer.add_batch(0, batch(*samples), batch_id=10, skip=-1)


def test_remove_run_drops_buffer_and_accounting():
    packer = Packer(n_slots=2, seq_len=64, dp_world_size=1)
    packer.add_run(0, batch_size=2)
    packer.add_run(1, batch_size=2)
    packer.add_batch(0, batch(sample(3, 3)), batch_id=0)
    packer.add_batch(1, batch(*[sample(2, 2)] * 3), batch_id=1)
    packer.pack(force=True)
    packer.add_batch(0, batch(*[sample(3, 3)] * 4), batch_id=2)
    packer.remove_run(0)
    assert packer.buffered_tokens() == 4 and packer.active_slots() == [1]
    assert set(packer.pack(force=True).runs) == {1}
    with pytest.raises(ValueError, match="slot 0 has no run"):
        packer.add_batch(0, batch(sample(1, 1)), batch_id=3)
    with pytest.raises(ValueError):
        packer.progress(0)
    # A new run in the slot starts from scratch.
    packer.add_run(0, batch_size=5)
    assert packer.progress(0).step == 0 and packer.samples_consumed_this_step(0) == 0


def test_run_management_errors():
    packer = Packer(n_slots=2, seq_len=8, dp_world_size=1)
    packer.add_run(0, batch_size=1)
    with pytest.raises(ValueError, match="already"):
        packer.add_run(0, batch_size=1)
    with pytest.raises(ValueError, match="outside"):
        packer.add_run(2, batch_size=1)
    with pytest.raises(ValueError, match="batch_size"):
        packer.add_run(1, batch_size=0)
    with pytest.raises(ValueError):
        Packer(n_slots=0, seq_len=8, dp_world_size=1)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (sample(5, 4), "9 tokens .* > seq_len 8"),
        (sample(0, 0), "empty sample"),
        (sample(2, 2, advantage=[1.0]), "advantage has 1 entries"),
        (sample(2, 2, teacher=[0.0] * 3), "teacher_logprobs has 3"),
        (sample(2, 2, completion_mask=[True]), "completion_mask has 1"),
        (TrainingSample([1], [True], [2], [True], [0.0], advantage=None), "advantage is missing"),
        (TrainingSample([1], [True], [2], [True], [0.0], advantage=float("nan")), "advantage is nan"),
    ],
)
def test_a_bad_sample_rejects_the_whole_batch_and_names_it(bad, message):
    packer = Packer(n_slots=3, seq_len=8, dp_world_size=1)
    packer.add_run(2, batch_size=4)
    with pytest.raises(InvalidSampleError, match=f"slot 2, batch 17, sample 1: {message}") as info:
        packer.add_batch(2, batch(sample(2, 2), bad, sample(1, 1)), batch_id=17)
    assert (info.value.slot, info.value.batch_id, info.value.index) == (2, 17, 1)
    assert packer.buffered_samples() == 0


def test_bad_temperature_is_rejected():
    packer = Packer(n_slots=1, seq_len=8, dp_world_size=1)
    packer.add_run(0, batch_size=1)
    with pytest.raises(ValueError, match="temperature"):
        packer.add_batch(0, batch(sample(1, 1), temperature=0.0), batch_id=0)


# ---- the layout of one row --------------------------------------------------------------------


def only_row(result) -> MicroBatch:
    (rank,) = result.micro_batches
    (mb,) = rank
    return mb


def test_row_layout_with_two_runs_and_padding():
    packer = Packer(n_slots=4, seq_len=32, dp_world_size=1, pad_to_multiple_of=8, pad_token_id=99)
    packer.add_run(3, batch_size=4)
    packer.add_run(1, batch_size=4)
    packer.add_batch(3, batch(sample(2, 3, token=10, advantage=0.5), temperature=0.5), batch_id=0)
    packer.add_batch(
        1,
        batch(sample(1, 3, token=20, advantage=[1.0, 2.0, 3.0], completion_mask=[True, False, True])),
        batch_id=1,
    )
    mb = only_row(packer.pack(force=True))
    # Slot 1 first (ascending slots), then slot 3, then 3 padding tokens up to 12 → 16.
    assert mb.seq_lens == [4, 5, 7]
    assert mb.input_ids.tolist() == [20, 21, 21, 21, 10, 10, 11, 11, 11] + [99] * 7
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    assert mb.loss_mask.tolist() == [False, True, False, True, False, False, True, True, True] + [False] * 7
    assert mb.advantages.tolist() == [0, 1, 2, 3, 0, 0, 0.5, 0.5, 0.5] + [0] * 7
    assert mb.inference_logprobs.tolist() == [0, -0.25, -0.25, -0.25, 0, 0, -0.25, -0.25, -0.25] + [0] * 7
    assert mb.temperatures.tolist() == [1.0] * 4 + [0.5] * 5 + [1.0] * 7
    assert mb.token_slots.tolist() == [1] * 4 + [3] * 12
    assert mb.sample_ids.tolist() == [0] * 4 + [1] * 5 + [-1] * 7
    assert mb.slot_token_counts.tolist() == [0, 4, 0, 12]
    assert mb.teacher_logprobs is None and not mb.is_filler and mb.num_samples == 2
    assert mb.input_ids.dtype == torch.long and mb.loss_mask.dtype == torch.bool
    assert mb.advantages.dtype == torch.float32 and mb.slot_token_counts.dtype == torch.long


def test_first_token_of_a_sample_never_carries_loss():
    # No prompt: the first completion token has no in-sample predecessor to be predicted from.
    packer = Packer(n_slots=1, seq_len=16, dp_world_size=1)
    packer.add_run(0, batch_size=2)
    packer.add_batch(0, batch(sample(2, 2), sample(0, 3)), batch_id=0)
    result = packer.pack(force=True)
    mb = only_row(result)
    assert mb.loss_mask.tolist() == [False, False, True, True, False, True, True]
    assert result.runs[0].loss_tokens == int(mb.loss_mask.sum()) == 4


def test_teacher_logprobs_are_placed_when_any_sample_has_them():
    packer = Packer(n_slots=1, seq_len=16, dp_world_size=1)
    packer.add_run(0, batch_size=2)
    packer.add_batch(0, batch(sample(1, 2), sample(1, 2, teacher=[-1.0, -2.0])), batch_id=0)
    mb = only_row(packer.pack(force=True))
    assert mb.teacher_logprobs.tolist() == [0.0, 0.0, 0.0, 0.0, -1.0, -2.0]


def test_padding_never_exceeds_seq_len():
    packer = Packer(n_slots=1, seq_len=10, dp_world_size=1, pad_to_multiple_of=8)
    packer.add_run(0, batch_size=1)
    packer.add_batch(0, batch(sample(5, 4)), batch_id=0)
    mb = only_row(packer.pack(force=True))
    assert mb.num_tokens == 10 and mb.seq_lens == [9, 1]


# ---- ranks -----------------------------------------------------------------------------------


def test_every_rank_gets_the_same_number_of_micro_batches_with_fillers():
    packer = Packer(n_slots=2, seq_len=16, dp_world_size=4, pad_to_multiple_of=4)
    packer.add_run(0, batch_size=3)
    packer.add_batch(0, batch(*[sample(6, 6)] * 3), batch_id=0)  # three rows of 12
    result = packer.pack(force=True)
    grid = result.micro_batches
    assert [len(rank) for rank in grid] == [1, 1, 1, 1]
    fillers = [mb for rank in grid for mb in rank if mb.is_filler]
    assert len(fillers) == 1
    for mb in fillers:
        assert mb.num_tokens == 4 and not mb.loss_mask.any() and mb.num_samples == 0
        assert mb.seq_lens == [4] and mb.slot_token_counts.tolist() == [4, 0]
        assert mb.sample_ids.tolist() == [-1] * 4 and mb.position_ids.tolist() == [0, 1, 2, 3]


def test_a_pack_never_needs_more_rows_than_ranks():
    # A plain token budget (32) would admit 10 + 10 + 10 → three rows of 16 for two ranks. The row budget
    # admits only what first-fits into two rows; the third sample waits for the next pack.
    packer = Packer(n_slots=1, seq_len=16, dp_world_size=2)
    packer.add_run(0, batch_size=3)
    packer.add_batch(0, batch(*[sample(5, 5)] * 3), batch_id=0)
    first = packer.pack(force=True)
    assert first.runs[0].samples == 2 and [len(rank) for rank in first.micro_batches] == [1, 1]
    assert packer.pack(force=True).runs[0].samples == 1


def test_assign_to_ranks_is_balanced_and_capped():
    # 16, 16, 12, 12, 9, 9, 9, 9 over 2 ranks: LPT gives each rank 46.
    costs = [9, 16, 12, 9, 16, 9, 12, 9]
    grid = assign_to_ranks(costs, 2)
    assert [sum(costs[i] for i in g) for g in grid] == [46, 46]
    assert sorted(i for g in grid for i in g) == list(range(8))
    # One huge row and many small ones: the cap (⌈5/2⌉ = 3) keeps the counts within one.
    grid = assign_to_ranks([100, 1, 1, 1, 1], 2)
    assert grid == [[0, 4], [1, 2, 3]]
    assert assign_to_ranks([], 3) == [[], [], []]


def test_packed_rows_are_spread_over_ranks_by_cost():
    packer = Packer(n_slots=1, seq_len=16, dp_world_size=2, attention_cost_weight=0.0)
    packer.add_run(0, batch_size=5)
    packer.add_batch(0, batch(*[sample(n // 2, n - n // 2) for n in (12, 6, 6, 4, 4)]), batch_id=0)
    result = packer.pack(force=True)  # FFD: [12, 4] and [6, 6, 4], one full row per rank
    assert [[mb.seq_lens for mb in rank] for rank in result.micro_batches] == [[[12, 4]], [[6, 6, 4]]]


def test_first_fit_rows_are_kept_when_ffd_would_need_more_rows_than_ranks():
    # In arrival order 2, 4, 3 | 4, 3, 2 first-fit fills two rows of 9 exactly; FFD (4+4, 3+3+2, 2) needs
    # three. The pack keeps the first-fit rows: one per rank.
    packer = Packer(n_slots=1, seq_len=9, dp_world_size=2)
    packer.add_run(0, batch_size=6)
    packer.add_batch(0, batch(*[sample(1, n - 1) for n in (2, 4, 3, 4, 3, 2)]), batch_id=0)
    result = packer.pack(force=True)
    assert result.runs[0].samples == 6
    assert [[mb.seq_lens for mb in rank] for rank in result.micro_batches] == [[[2, 4, 3]], [[4, 3, 2]]]
