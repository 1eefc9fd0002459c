"""contracts.arrays: the one-pass check of a good batch (`_trainable`) passes exactly the batches the one
definition of the rules passes (the byte rules of the binary form, then `sample_problems` on the list
form), so every refusal is still worded by the same path."""

import math

import msgspec
import pytest

from contracts import arrays
from contracts.arrays import ArrayBatch
from contracts.wire import sample_problems
from tests.trainer_core.test_packing_binary_checks import BAD, GOOD_EDGES, SEQ_LEN, VOCAB, _f32, _good

MORE: dict[str, dict[str, object]] = {
    "positive logprob": {"completion_logprobs": _f32(-0.5, 0.5, -0.5, -0.5)},
    "NaN teacher logprob": {"teacher_logprobs": _f32(-1.0, math.nan, -1.0, -1.0)},
    "misaligned weights": {"weights": _f32(1.0, 1.0, 1.0, 1.0) + b"\x00"},
    "NaN weight": {"weights": _f32(1.0, math.nan, 1.0, 1.0)},
    "prompt mask one long": {"prompt_mask": bytes([1, 1, 1, 1])},
    "too many metrics": {"metrics": {f"m{i}": 1.0 for i in range(1000)}},
    "unnamed metric": {"metrics": {"": 1.0}},
    "huge finite advantages": {"advantage": _f32(3e38, 3e38, 3e38, 3e38)},
    "reward and metrics": {"reward": 1.0, "metrics": {"score": 0.5}},
}
CASES = {**BAD, **GOOD_EDGES, **MORE}


def _by_the_rules(batch: ArrayBatch, *, full: bool, vocab_size: int | None) -> bool:
    if arrays._byte_problems(batch):
        return False
    limit = arrays.MAX_TOKEN_ID + 1 if vocab_size is None else vocab_size
    return not any(
        sample_problems(s, seq_len=SEQ_LEN, vocab_size=limit, full=full)
        for s in arrays.to_lists(batch).examples
    )


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("vocab_size", [VOCAB, None])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_one_pass_check_agrees_with_the_rules(case: str, full: bool, vocab_size: int | None) -> None:
    sample = msgspec.structs.replace(_good(), **CASES[case])
    batch = ArrayBatch(examples=[_good(), sample, _good(2, 5)])
    expected = _by_the_rules(batch, full=full, vocab_size=vocab_size)
    assert arrays._trainable(batch, seq_len=SEQ_LEN, vocab_size=vocab_size, full=full) == expected
    if not expected:  # refused, in the words of the slow path
        assert arrays.array_batch_problems(batch, seq_len=SEQ_LEN, vocab_size=vocab_size, full=full)
