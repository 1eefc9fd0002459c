"""The compact row contract (issue 15): a `MicroBatch` stores per token only what differs token by token
(int32 ids, bool loss mask, float32 logprobs, and optional per-token fields only when a sample of the row
has them); per-sample facts are per-segment tensors, and the per-token views are expanded on use, cached,
never pickled. That the expanded views equal the old Packer's per-token tensors bit for bit is
`test_packing_reference.py`'s job; here: what is stored, what travels, and that the cache cannot go stale.
"""

import dataclasses
import pickle

import msgspec
import torch

from contracts.wire import TrainingBatch, TrainingSample
from trainer_core.packing import MicroBatch, Packer
from trainer_core.packing.rows import EXPANDED_VIEWS

torch.set_num_threads(1)

_PER_TOKEN_VIEWS = ("input_ids", "position_ids", "advantages", "temperatures", "token_slots", "sample_ids")


def _sample(prompt: int, completion: int, *, advantage: float | list[float] = 0.5) -> TrainingSample:
    return TrainingSample(
        prompt_ids=[3] * prompt,
        prompt_mask=[True] * prompt,
        completion_ids=[4] * completion,
        completion_mask=[True] * completion,
        completion_logprobs=[-0.25] * completion,
        advantage=advantage,
    )


def _row(*batches: tuple[int, TrainingBatch]) -> MicroBatch:
    """The single row of one forced pack, runs in slots 0..2."""
    packer = Packer(n_slots=3, seq_len=64, dp_world_size=1, pad_to_multiple_of=16, pad_token_id=9)
    for slot, b in batches:
        packer.add_run(slot, batch_size=len(b.examples))
        packer.add_batch(slot, b, batch_id=slot)
    result = packer.pack(force=True)
    assert result is not None
    (mb,) = result.micro_batches[0]
    return mb


def _stored_bytes(mb: MicroBatch) -> dict[str, int]:
    return {
        f.name: v.numel() * v.element_size()
        for f in dataclasses.fields(mb)
        if isinstance(v := getattr(mb, f.name), torch.Tensor)
    }


def test_a_plain_row_stores_nine_bytes_per_token_and_per_segment_facts() -> None:
    mb = _row(
        (0, TrainingBatch(examples=[_sample(3, 4), _sample(2, 5, advantage=-1.5)], temperature=0.7)),
        (2, TrainingBatch(examples=[_sample(4, 4, advantage=2.0)])),
    )
    assert mb.seq_lens == [7, 7, 8, 10] and mb.n_samples == 3  # 22 tokens padded to 32
    per_token = {
        name: n
        for name, n in _stored_bytes(mb).items()
        if name in ("token_ids", "loss_mask", "inference_logprobs")
    }
    assert per_token == {"token_ids": 4 * 32, "loss_mask": 32, "inference_logprobs": 4 * 32}
    assert mb.token_ids.dtype == torch.int32
    assert (
        mb.token_advantages is None
        and mb.teacher_logprobs is None
        and mb.weights is None
        and mb.rewards is None
    )
    assert mb.segment_slots == [0, 0, 2, 2]
    assert mb.segment_temperatures == [0.7, 0.7, 1.0, 1.0]
    assert mb.segment_prompt_lens == [3, 2, 4, 10]
    assert mb.segment_advantages == [0.5, -1.5, 2.0, 0.0]
    # Nothing per token beyond those three is stored: the views are not built until asked for.
    assert not EXPANDED_VIEWS & mb.__dict__.keys()
    assert (
        mb.advantages.tolist()
        == [0.0] * 3 + [0.5] * 4 + [0.0] * 2 + [-1.5] * 5 + [0.0] * 4 + [2.0] * 4 + [0.0] * 10
    )
    assert mb.position_ids.tolist() == list(range(7)) + list(range(7)) + list(range(8)) + list(range(10))
    assert mb.sample_ids.tolist() == [0] * 7 + [1] * 7 + [2] * 8 + [-1] * 10
    assert mb.token_slots.tolist() == [0] * 14 + [2] * 18
    assert mb.temperatures.dtype == torch.float32
    assert mb.temperatures.tolist() == [0.699999988079071] * 14 + [1.0] * 18
    assert mb.input_ids.dtype == torch.long and mb.input_ids[-1] == 9


def test_per_token_advantages_are_stored_per_token_only_when_a_sample_has_them() -> None:
    mb = _row((0, TrainingBatch(examples=[_sample(2, 3), _sample(1, 3, advantage=[1.0, 2.0, 3.0])])))
    assert mb.token_advantages is not None and mb.token_advantages.dtype == torch.float32
    assert mb.advantages.tolist() == [0.0, 0.0, 0.5, 0.5, 0.5, 0.0, 1.0, 2.0, 3.0] + [0.0] * 7


def test_rewards_are_buffered_only_for_runs_that_train_on_them() -> None:
    """The SDK sends every sample's reward (the service aggregates it); a run whose advantages come
    from the client keeps the plain row (no per-token rewards), a GAE run gets them."""
    rewarded = TrainingBatch(examples=[msgspec.structs.replace(_sample(2, 3), reward=1.5)])
    for trains_on_rewards, expected in ((False, None), (True, [0.0] * 4 + [1.5] + [0.0] * 11)):
        packer = Packer(n_slots=1, seq_len=64, dp_world_size=1, pad_to_multiple_of=16)
        packer.add_run(0, batch_size=1, trains_on_rewards=trains_on_rewards)
        packer.add_batch(0, rewarded, batch_id=1)
        result = packer.pack(force=True)
        assert result is not None
        (mb,) = result.micro_batches[0]
        assert (None if mb.rewards is None else mb.rewards.tolist()) == expected
        if not trains_on_rewards:
            assert set(_stored_bytes(mb)) == {
                "token_ids",
                "loss_mask",
                "inference_logprobs",
                "slot_token_counts",
            }


def test_a_pickled_row_carries_only_the_compact_fields_and_expands_the_same() -> None:
    mb = _row((1, TrainingBatch(examples=[_sample(30, 20), _sample(5, 9)])))
    compact = len(pickle.dumps(mb))
    views = {name: getattr(mb, name).clone() for name in _PER_TOKEN_VIEWS}
    assert EXPANDED_VIEWS & mb.__dict__.keys()  # the views are cached now
    assert len(pickle.dumps(mb)) == compact  # ... but never sent
    received = pickle.loads(pickle.dumps(mb))
    assert not EXPANDED_VIEWS & received.__dict__.keys()
    for name, expected in views.items():
        assert torch.equal(getattr(received, name), expected), name


def test_a_replaced_row_expands_from_its_own_fields() -> None:
    """`trainer_core.step` moves rows with `dataclasses.replace` (and the isolation retry replaces the
    loss mask): the copy must not keep views of the original."""
    mb = _row((0, TrainingBatch(examples=[_sample(2, 2)])), (1, TrainingBatch(examples=[_sample(1, 3)])))
    assert mb.token_slots.tolist()[:8] == [0] * 4 + [1] * 4
    moved = dataclasses.replace(mb, segment_slots=[2, 2, 2])
    assert moved.token_slots.tolist() == [2] * mb.num_tokens
    assert mb.token_slots.tolist()[:8] == [0] * 4 + [1] * 4


def test_a_filler_has_no_sample_and_counts_its_padding_in_slot_0() -> None:
    packer = Packer(n_slots=3, seq_len=64, dp_world_size=1, pad_to_multiple_of=16, pad_token_id=9)
    mb = packer.filler_micro_batch()
    assert mb.is_filler and mb.num_samples == 0 and mb.real_tokens == 0
    assert mb.sample_ids.tolist() == [-1] * 16
    assert mb.position_ids.tolist() == list(range(16))
    assert mb.slot_token_counts.tolist() == [16, 0, 0]
    assert mb.temperatures.tolist() == [1.0] * 16 and mb.advantages.tolist() == [0.0] * 16
