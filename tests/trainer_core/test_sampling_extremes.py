"""`pick_token` is total: for every temperature, top_k and top_p a `SamplingSpec` accepts, and for any
logits (huge, infinite, NaN), it returns a token and never raises (probe 2, finding 1: temperature
1e-40 made `torch.multinomial` raise, and the pool serving every tenant stopped). Temperatures below
GREEDY_TEMPERATURE are greedy; ordinary ones draw exactly what they drew before."""

from typing import Any

import pytest
import torch

from contracts.tinker_work import GREEDY_TEMPERATURE, SamplingSpec
from tests.trainer_core.test_sampling import decoding, tiny_model
from trainer_core.models.attention import PACKED_ATTENTION
from trainer_core.sampling import generate, pick_token

VOCAB = 96
F32_MAX = 3.4028234663852886e38


def _spec(temperature: float, **overrides: Any) -> SamplingSpec:
    values: dict[str, Any] = {"prompt": [1], "num_samples": 1, "max_tokens": 1, "top_k": -1, "top_p": 1.0}
    return SamplingSpec(**{**values, "temperature": temperature, **overrides})


def _pick(logits: torch.Tensor, temperature: float, seed: int = 0, **overrides: Any) -> int:
    return pick_token(logits, _spec(temperature, **overrides), torch.Generator().manual_seed(seed))


def _distinct_logits(scale: float, seed: int = 0) -> torch.Tensor:
    """(V,) distinct values in [-scale, scale] in a random order: one unique most likely token."""
    order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
    return (torch.linspace(-1.0, 1.0, VOCAB, dtype=torch.float64) * scale).float()[order]


def _before_the_fix(logits: torch.Tensor, spec: SamplingSpec, generator: torch.Generator) -> int:
    """`pick_token` as it was: what ordinary temperatures must still draw, draw for draw."""
    if spec.temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits / spec.temperature
    if spec.top_k > 0:
        kth = torch.topk(scaled, min(spec.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if spec.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < spec.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-300, 5e-324, 1e-6, 0.0])
@pytest.mark.parametrize("scale", [1.0, 30.0, 1e4, 1e30, F32_MAX])
@pytest.mark.parametrize("cut", [{}, {"top_k": 5}, {"top_p": 0.9}, {"top_k": 1, "top_p": 1e-300}])
def test_temperatures_below_the_greedy_threshold_take_the_most_likely_token(temperature, scale, cut):
    logits = _distinct_logits(scale, seed=int(scale) % 7)
    assert _pick(logits, temperature, **cut) == int(torch.argmax(logits))


def test_the_probe_s_temperature_raised_before_and_is_greedy_now():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 10
    with pytest.raises(RuntimeError, match="probability tensor"):
        _before_the_fix(logits, _spec(1e-40), torch.Generator().manual_seed(0))
    assert _pick(logits, 1e-40) == int(torch.argmax(logits))


@pytest.mark.parametrize("temperature", [GREEDY_TEMPERATURE, 1e-3, 1.0, 100.0])
@pytest.mark.parametrize("scale", [1e30, F32_MAX])
def test_huge_logits_do_not_overflow_at_any_accepted_temperature(temperature, scale):
    """1e30 / 1e-5 is infinite in float32: the logits are shifted by their maximum first. The gaps
    between these logits dwarf any temperature, so the draw is the most likely token."""
    logits = _distinct_logits(scale, seed=3)
    before_overflows = not torch.isfinite(logits / temperature).all()
    for seed in range(5):
        assert _pick(logits, temperature, seed=seed) == int(torch.argmax(logits))
        assert _pick(logits, temperature, seed=seed, top_k=3, top_p=0.5) == int(torch.argmax(logits))
    if before_overflows:
        with pytest.raises(RuntimeError):
            _before_the_fix(logits, _spec(temperature), torch.Generator().manual_seed(0))


@pytest.mark.parametrize("temperature", [0.0, 1e-40, 0.7, 1.0, 100.0])
def test_non_finite_logits_give_a_token_never_a_nan_one(temperature):
    finite = _distinct_logits(5.0, seed=4)
    best = int(torch.argmax(finite))
    with_nan = finite.clone()
    nan_at = (best + 1) % VOCAB
    with_nan[nan_at] = float("nan")
    assert _pick(with_nan, temperature) == best  # a NaN never wins; the best finite one does
    with_inf = finite.clone()
    with_inf[nan_at] = float("inf")
    assert _pick(with_inf, temperature) == nan_at  # +inf is the most likely token
    only_one = torch.full((VOCAB,), float("-inf"))
    only_one[17] = 0.0
    assert _pick(only_one, temperature) == 17
    for broken in (torch.full((VOCAB,), float("nan")), torch.full((VOCAB,), float("-inf"))):
        assert 0 <= _pick(broken, temperature) < VOCAB


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-50])
def test_a_top_p_below_float32_s_smallest_keeps_the_most_likely_token(top_p):
    """Such a top_p compares as 0 with float32 probabilities: the nucleus was empty, and multinomial
    raised; it keeps its first token now, as it does for any top_p > 0."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2))
    assert _pick(logits, 1.0, top_p=top_p) == int(torch.argmax(logits))
    with pytest.raises(RuntimeError):
        _before_the_fix(logits, _spec(1.0, top_p=top_p), torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.3},
        {"temperature": 2.5},
        {"temperature": GREEDY_TEMPERATURE * 10},
        {"temperature": 0.8, "top_k": 10},
        {"temperature": 1.2, "top_p": 0.7},
        {"temperature": 0.9, "top_k": 20, "top_p": 0.5},
        {"temperature": 1.0, "top_p": 1e-6},
    ],
)
def test_ordinary_temperatures_draw_exactly_what_they_drew_before(params):
    spec = _spec(**params)
    for seed in range(30):
        logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(100 + seed)) * 4
        new, old = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        drawn = [pick_token(logits, spec, new) for _ in range(5)]
        assert drawn == [_before_the_fix(logits, spec, old) for _ in range(5)]


def test_a_tiny_temperature_decodes_the_greedy_sequence_with_finite_logprobs():
    """Through `generate`, the model's real logits: 1e-40 and 1e-30 decode what temperature 0 does."""
    model, lora = tiny_model(PACKED_ATTENTION)
    rows = [
        decoding(slot, [5, 6, 7], seed=seed, temperature=t, max_tokens=8)
        for slot in (1, None)
        for seed, t in ((0, 0.0), (1, 1e-40), (2, 1e-30))
    ]
    generate(model, lora, rows)
    for group in (rows[:3], rows[3:]):
        greedy = group[0]
        for row in group[1:]:
            assert row.generated == greedy.generated
            assert torch.isfinite(torch.tensor(row.logprobs)).all()
            torch.testing.assert_close(torch.tensor(row.logprobs), torch.tensor(greedy.logprobs))
