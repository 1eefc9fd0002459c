"""RunLedger: batches are acknowledged exactly when the step that trained their last sample completes."""

import pytest

from trainer_core.ledger import RunLedger


def test_a_batch_waits_for_its_last_sample_then_for_the_step() -> None:
    ledger = RunLedger()
    assert ledger.add(batch_id=1, sample_offset=0, num_samples=4) == 4
    assert ledger.add(batch_id=2, sample_offset=4, num_samples=3) == 3
    ledger.consumed([(1, 3)])
    assert ledger.step_completed(1) == []  # batch 1 still has a sample in the packer
    ledger.consumed([(1, 1), (2, 2)])
    assert [a.batch_id for a in ledger.step_completed(2)] == [1]
    ledger.consumed([(2, 1)])
    acks = ledger.step_completed(3)
    assert [(a.batch_id, a.trained_step) for a in acks] == [(2, 3)]


def test_a_batch_trained_before_the_checkpoint_is_acknowledged_with_the_next_step() -> None:
    ledger = RunLedger(next_sample=6)
    assert ledger.add(batch_id=9, sample_offset=0, num_samples=4) == 0
    assert ledger.add(batch_id=10, sample_offset=4, num_samples=4) == 2  # two already trained
    ledger.consumed([(10, 2)])
    assert [a.batch_id for a in ledger.step_completed(5)] == [9, 10]


def test_samples_of_an_unknown_batch_or_more_than_it_has_are_refused() -> None:
    ledger = RunLedger()
    ledger.add(batch_id=1, sample_offset=0, num_samples=2)
    with pytest.raises(KeyError, match="unknown batch 7"):
        ledger.consumed([(7, 1)])
    with pytest.raises(KeyError, match="3 samples of batch 1, which has 2 left"):
        ledger.consumed([(1, 3)])
