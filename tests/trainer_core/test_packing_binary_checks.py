"""The Packer's vectorised check of a binary batch (`SampleChunk.from_arrays`) refuses exactly what
`contracts.arrays.array_batch_problems(full=False)` refuses, and the error names the sample and the
problem in the words of that one definition; nothing of a refused batch is buffered."""

import math

import msgspec
import numpy as np
import pytest

from contracts.arrays import ArrayBatch, ArraySample, array_batch_problems, decode_stored, encode, to_arrays
from contracts.wire import MAX_EXAMPLES_PER_BATCH, TrainingBatch, TrainingSample
from trainer_core.packing import InvalidSampleError, Packer

SEQ_LEN, VOCAB = 16, 100


def _good(n_prompt: int = 3, n_completion: int = 4, *, token: int = 5) -> ArraySample:
    sample = TrainingSample(
        prompt_ids=[token] * n_prompt,
        prompt_mask=[True] * n_prompt,
        completion_ids=[token + 1] * n_completion,
        completion_mask=[True] * n_completion,
        completion_logprobs=[-0.5] * n_completion,
        advantage=1.0,
    )
    return to_arrays(TrainingBatch(examples=[sample])).examples[0]


def _f32(*values: float) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def _i32(*values: int) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


BAD: dict[str, dict[str, object]] = {
    "misaligned prompt_ids": {"prompt_ids": _i32(5, 5, 5) + b"\x00"},
    "logprobs one short": {"completion_logprobs": _f32(-0.5, -0.5, -0.5)},
    "completion_mask value 2": {"completion_mask": bytes([1, 2, 1, 1])},
    "prompt_mask value 3": {"prompt_mask": bytes([1, 3, 1])},
    "id = vocab size": {"completion_ids": _i32(6, 6, VOCAB, 6)},
    "negative id": {"prompt_ids": _i32(5, -1, 5)},
    "NaN per-token advantage": {"advantage": _f32(1.0, math.nan, 1.0, 1.0)},
    "per-token advantage one short": {"advantage": _f32(1.0, 1.0, 1.0)},
    "infinite scalar advantage": {"advantage": math.inf},
    "missing advantage": {"advantage": None},
    "negative weight": {"weights": _f32(1.0, -0.5, 1.0, 1.0)},
    "infinite token reward": {"token_rewards": _f32(0.0, math.inf, 0.0, 0.0)},
    "NaN reward": {"reward": math.nan},
    "NaN metric": {"metrics": {"score": math.nan}},
    "teacher one long": {"teacher_logprobs": _f32(-1.0, -1.0, -1.0, -1.0, -1.0)},
    "empty sample": {
        "prompt_ids": b"",
        "prompt_mask": b"",
        "completion_ids": b"",
        "completion_mask": b"",
        "completion_logprobs": b"",
    },
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_binary_sample_is_refused_in_the_words_of_array_batch_problems(case: str) -> None:
    bad = msgspec.structs.replace(_good(), **BAD[case])
    batch = ArrayBatch(examples=[_good(), bad, _good()])
    expected = [
        p
        for p in array_batch_problems(batch, seq_len=SEQ_LEN, vocab_size=VOCAB, full=False)
        if p.sample is not None
    ]
    assert expected and expected[0].sample == 1, expected  # the case really breaks a rule, in sample 1
    packer = Packer(n_slots=2, seq_len=SEQ_LEN, dp_world_size=1, vocab_size=VOCAB)
    packer.add_run(1, batch_size=8)
    with pytest.raises(InvalidSampleError) as info:
        packer.add_batch(1, batch, batch_id=9)
    assert (info.value.index, info.value.reason) == (1, expected[0].problem)
    assert packer.buffered_samples() == 0


def test_a_too_long_binary_sample_is_refused() -> None:
    batch = ArrayBatch(examples=[_good(), _good(8, SEQ_LEN - 7)])
    packer = Packer(n_slots=1, seq_len=SEQ_LEN, dp_world_size=1)
    packer.add_run(0, batch_size=8)
    with pytest.raises(InvalidSampleError, match=f"sample 1: 17 tokens .* > seq_len {SEQ_LEN}"):
        packer.add_batch(0, batch, batch_id=1)


GOOD_EDGES: dict[str, dict[str, object]] = {
    "id = vocab size - 1": {"completion_ids": _i32(6, 6, VOCAB - 1, 6)},
    "huge finite weights": {"weights": _f32(3e38, 3e38, 3e38, 3e38)},
    "NaN logprobs (checked by the service, not the pool)": {
        "completion_logprobs": _f32(-0.5, math.nan, -0.5, -0.5)
    },
    "positive teacher logprobs": {"teacher_logprobs": _f32(1.0, 1.0, 1.0, 1.0)},
    "no completion": {"completion_ids": b"", "completion_mask": b"", "completion_logprobs": b""},
    "no prompt": {"prompt_ids": b"", "prompt_mask": b""},
}


@pytest.mark.parametrize("case", sorted(GOOD_EDGES))
def test_edge_cases_that_break_no_rule_are_buffered(case: str) -> None:
    edge = msgspec.structs.replace(_good(), **GOOD_EDGES[case])
    batch = decode_stored(encode(ArrayBatch(examples=[_good(), edge])))
    assert not array_batch_problems(batch, seq_len=SEQ_LEN, vocab_size=VOCAB, full=False)
    packer = Packer(n_slots=1, seq_len=SEQ_LEN, dp_world_size=1, vocab_size=VOCAB)
    packer.add_run(0, batch_size=2)
    assert packer.add_batch(0, batch, batch_id=3) == 2
    result = packer.pack(force=True)
    assert result is not None and result.runs[0].samples == 2


def test_a_bad_sample_in_a_batch_over_the_size_limit_is_still_refused() -> None:
    """`array_batch_problems` stops at the batch-level fault (more than MAX_EXAMPLES_PER_BATCH samples)
    and names no sample; the Packer refuses the batch anyway rather than buffer a bad sample."""
    bad = msgspec.structs.replace(_good(), completion_mask=bytes([1, 2, 1, 1]))
    batch = ArrayBatch(examples=[_good()] * MAX_EXAMPLES_PER_BATCH + [bad])
    assert all(
        p.sample is None for p in array_batch_problems(batch, seq_len=SEQ_LEN, vocab_size=VOCAB, full=False)
    )
    packer = Packer(n_slots=1, seq_len=SEQ_LEN, dp_world_size=1, vocab_size=VOCAB)
    packer.add_run(0, batch_size=8)
    with pytest.raises(ValueError, match="slot 0, batch 4: a sample breaks a rule"):
        packer.add_batch(0, batch, batch_id=4)
    assert packer.buffered_samples() == 0
