"""contracts.arrays: the list → bytes conversion the SDK runs on every batch (struct / bytes for Python
lists) gives exactly numpy's bytes, and anything it cannot pack goes to numpy as before (same bytes,
same error)."""

import math
import random
from typing import Any

import httpx
import numpy as np
import pytest

from contracts import arrays
from contracts.arrays import FLOAT_DTYPE, IDS_DTYPE, MASK_DTYPE, to_arrays
from contracts.wire import TrainingBatch, TrainingSample


def _numpy(values: object, dtype: np.dtype) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


def test_floats_round_as_numpy_does() -> None:
    rng = random.Random(0)
    values = [rng.uniform(-40.0, 0.0) for _ in range(20_000)]
    values += [rng.uniform(-1e-38, 1e-38) for _ in range(2_000)]  # float32 subnormals
    # halfway and boundary cases of the double → float32 rounding, signed zeros, non-finite
    values += [1 + 2**-24, 1 + 3 * 2**-24, 1e-45, 7e-46, 5e-324, 3.4028235e38, -3.4028235e38, -0.0, 0.0]
    values += [math.inf, -math.inf]
    assert arrays._floats(values) == _numpy(values, FLOAT_DTYPE)
    nan = np.frombuffer(arrays._floats([math.nan]), dtype=FLOAT_DTYPE)
    assert np.isnan(nan).all()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_a_float_beyond_float32_is_infinite_as_before() -> None:
    # struct refuses to pack it; the numpy fallback gives inf, which the service refuses by name.
    assert arrays._floats([-1.0, 1e300]) == _numpy([-1.0, 1e300], FLOAT_DTYPE)
    assert np.isinf(np.frombuffer(arrays._floats([1e300]), dtype=FLOAT_DTYPE)).all()


def test_ints_and_masks_as_numpy() -> None:
    rng = random.Random(1)
    ids = [rng.randrange(-(2**31), 2**31) for _ in range(20_000)] + [0, 2**31 - 1, -(2**31)]
    assert arrays._ints(ids) == _numpy(ids, IDS_DTYPE)
    mask: Any = [rng.random() < 0.5 for _ in range(5_000)] + [0, 1, True, False]
    assert arrays._mask(mask) == _numpy(mask, MASK_DTYPE)
    assert arrays._ints([]) == b"" and arrays._mask([]) == b"" and arrays._floats([]) == b""


def test_what_has_no_binary_form_is_refused_by_sample_and_field_never_truncated() -> None:
    loose: Any = arrays  # the wrong types below are the point
    base: dict[str, Any] = {
        "prompt_ids": [5, 6],
        "prompt_mask": [False, True],
        "completion_ids": [7],
        "completion_mask": [True],
    }
    bad: dict[str, Any] = {
        "prompt_ids": [1.7, 5],  # numpy would have stored 1
        "completion_ids": [2**31],  # numpy would have raised a bare OverflowError
        "prompt_mask": [1, 300],
        "completion_mask": [0.5],
    }
    for field, values in bad.items():
        sample = TrainingSample(**(base | {field: values}), completion_logprobs=[-0.5])
        with pytest.raises(arrays.NoBinaryForm) as refused:
            to_arrays(TrainingBatch(examples=[TrainingSample(**base, completion_logprobs=[-0.5]), sample]))
        assert (refused.value.index, refused.value.field) == (1, field)
        assert str(refused.value).startswith(f"sample 1: {field} must hold")
    # Not a list (a numpy array, a tuple): whole numbers that fit, else refused (numpy would wrap 2**40).
    assert loose._ints(np.arange(5, dtype=np.int64)) == _numpy(np.arange(5), IDS_DTYPE)
    assert loose._ints((1, 2)) == _numpy([1, 2], IDS_DTYPE)
    for values in (np.array([2**40]), np.array([1.5]), [np.float32(2.0)], [1, 2**31]):
        with pytest.raises(ValueError, match="token ids"):
            loose._ints(values)
    # Lists of numpy scalars (ids and masks from arrays' elements) are integers all the same.
    assert loose._ints([np.int64(3), np.int32(4)]) == _numpy([3, 4], IDS_DTYPE)
    assert loose._mask([np.True_, np.False_]) == _numpy([1, 0], MASK_DTYPE)
    with pytest.raises(ValueError, match="booleans"):
        loose._mask(np.array([2, 300]))


def test_to_arrays_round_trips_a_batch() -> None:
    sample = TrainingSample(
        prompt_ids=[5, 6, 7],
        prompt_mask=[False, False, True],
        completion_ids=[8, 9],
        completion_mask=[True, False],
        completion_logprobs=[-0.25, -1.5],
        advantage=[0.5, -0.5],
        teacher_logprobs=[-0.1, -0.2],
        token_rewards=[0.0, 1.0],
        weights=[1.0, 0.5],
    )
    back = arrays.to_lists(to_arrays(TrainingBatch(examples=[sample]))).examples[0]
    assert back.prompt_ids == [5, 6, 7] and back.completion_ids == [8, 9]
    assert back.prompt_mask == [False, False, True] and back.completion_mask == [True, False]
    assert back.completion_logprobs == [-0.25, -1.5] and back.advantage == [0.5, -0.5]
    assert back.teacher_logprobs == pytest.approx([-0.1, -0.2]) and back.weights == [1.0, 0.5]


def test_the_sdk_refuses_such_a_batch_as_the_service_would_before_sending_it() -> None:
    from contracts.http import ValidationError
    from orchestrator.client import LoraloomClient

    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(500)

    transport = httpx.MockTransport(answer)
    sample = TrainingSample(
        prompt_ids=[1.7, 5],  # type: ignore[list-item]
        prompt_mask=[False, False],
        completion_ids=[7],
        completion_mask=[True],
        completion_logprobs=[-0.5],
    )
    with (
        LoraloomClient("http://loraloom.invalid", "llk_x", transport=transport) as client,
        pytest.raises(ValidationError) as refused,
    ):
        client.submit_batch("run_0123456789ab", TrainingBatch(examples=[sample]))
    problem = refused.value.details[0]["problem"]
    assert refused.value.details == [
        {
            "loc": ["body", "examples", "0", "prompt_ids"],
            "msg": problem,
            "type": "value_error",
            "sample": 0,
            "field": "prompt_ids",
            "problem": problem,
        }
    ]
    assert "sample 0: prompt_ids must hold token ids" in str(refused.value)
    assert not sent
