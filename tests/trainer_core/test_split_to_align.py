"""Split to align (trainer_core.packing.bins.split_to_align): when a pack's rows do not divide evenly
over the data-parallel ranks, the heaviest rows are split (samples kept whole) instead of giving the
idle ranks filler passes. The cases are prime-rl's own (`test_split_to_align_avoids_dummy_micro_batches`:
3 rows on 4 ranks; `test_flop_aware_split_to_align_splits_heaviest_flop_bin`: 2 rows → 2 + 2)."""

from collections import Counter

from tests.trainer_core.test_packing import batch, sample
from trainer_core.packing import Packer, pack_ffd, split_to_align


def _pack(lengths: list[int], *, seq_len: int, dp: int):
    packer = Packer(n_slots=1, seq_len=seq_len, dp_world_size=dp, attention_cost_weight=1.0 / (12 * 64))
    packer.add_run(0, batch_size=len(lengths))
    packer.add_batch(0, batch(*[sample(n // 2, n - n // 2) for n in lengths]), batch_id=0)
    result = packer.pack(force=True)
    assert result is not None and result.runs[0].samples == len(lengths)
    return [mb for rank in result.micro_batches for mb in rank]


def _sample_lengths(rows) -> Counter[int]:
    return Counter(n for mb in rows for n in mb.seq_lens[: mb.num_samples])


def test_three_rows_on_four_ranks_need_no_filler():
    lengths = [6, 6, 5, 5, 4, 4]
    assert len(pack_ffd(lengths, 12)) == 3  # before: 3 rows + 1 filler
    rows = _pack(lengths, seq_len=12, dp=4)
    assert len(rows) == 4 and not any(mb.is_filler for mb in rows)
    assert all(mb.loss_mask.any() for mb in rows)
    assert _sample_lengths(rows) == Counter(lengths)  # every sample whole, once


def test_two_rows_on_four_ranks_become_two_plus_two():
    lengths = [20, 18, 9, 9, 8, 8, 8]
    assert len(pack_ffd(lengths, 64)) == 2  # before: 2 rows + 2 fillers
    rows = _pack(lengths, seq_len=64, dp=4)
    assert len(rows) == 4 and not any(mb.is_filler for mb in rows)
    assert _sample_lengths(rows) == Counter(lengths)
    assert sum(mb.num_samples > 1 for mb in rows) == 3  # as in prime-rl's case


def test_the_heaviest_bin_is_split_and_halves_are_balanced():
    lengths = [10, 1, 1, 4, 4]
    bins = [[0, 1, 2], [3, 4]]  # costs 12 (+ attention) and 8
    out = split_to_align(bins, lengths, 3, 0.0)
    assert out == [[0], [1, 2], [3, 4]]
    assert bins == [[0, 1, 2], [3, 4]]  # not modified


def test_fillers_only_when_no_split_can_help():
    # One sample, four ranks: nothing to split, three fillers stay.
    assert split_to_align([[0]], [5], 4, 0.0) == [[0]]
    rows = _pack([5, 5], seq_len=16, dp=4)  # two samples: one row split in two, two fillers
    assert sum(not mb.is_filler for mb in rows) == 2 and sum(mb.is_filler for mb in rows) == 2
    # Already aligned: untouched.
    assert split_to_align([[0, 1], [2, 3]], [1, 1, 1, 1], 2, 0.0) == [[0, 1], [2, 3]]
    assert split_to_align([], [], 4, 0.0) == []
