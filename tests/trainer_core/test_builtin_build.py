"""The built-in model's build is the same whatever its caller's thread count, and leaves the caller's
torch RNG and thread count as they were (trainer_core.models.builtin.BUILD_THREADS).

A pool builds it on its cores split between its ranks, the tests and the example on one thread:
before, the weights (and the base model's validation reward in examples/sft_then_rl.py) depended on
which process built the cache first. Two warm-up steps already round differently on 2 threads."""

from collections.abc import Iterator

import pytest
import torch

from trainer_core.models import builtin


@pytest.fixture
def caller_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _short_build() -> dict[str, torch.Tensor]:
    return builtin.build(clean_steps=2, noisy_steps=1).state_dict()


def test_the_weights_do_not_depend_on_the_callers_threads(caller_threads: None) -> None:
    torch.set_num_threads(1)
    one = _short_build()
    torch.set_num_threads(2)
    two = _short_build()
    assert torch.get_num_threads() == 2  # the caller's setting, back
    assert one.keys() == two.keys()
    assert all(torch.equal(one[name], two[name]) for name in one)


def test_the_callers_rng_is_left_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    builtin.build(clean_steps=1, noisy_steps=1)
    assert torch.equal(torch.rand(4), expected)
