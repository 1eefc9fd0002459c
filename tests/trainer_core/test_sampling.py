"""Sampling with a KV cache through the multi-LoRA layers (trainer_core.sampling): several adapters
and the base model in one call, and every sampled token's logprob is what a full forward (no cache,
each sequence alone through its own weights) gives."""

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from contracts.tinker_work import SamplingSpec
from trainer_core.lora import MultiLoRA, apply_multi_lora
from trainer_core.models.attention import PACKED_ATTENTION
from trainer_core.sampling import Decoding, PassLimits, generate

# The cache goes in under the name the model's forward takes: transformers warned on every decode step.
pytestmark = pytest.mark.filterwarnings("error::FutureWarning")

VOCAB = 96
EOS = 2


def tiny_model(attn_implementation: str) -> tuple[LlamaForCausalLM, MultiLoRA]:
    torch.manual_seed(0)
    attention: dict[str, Any] = {"attn_implementation": attn_implementation}
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=EOS,
        **attention,
    )
    model = LlamaForCausalLM(config)
    for p in model.parameters():
        p.requires_grad_(False)
    lora = apply_multi_lora(model, ["q_proj", "v_proj", "down_proj"], n_slots=4, max_rank=4)
    with torch.no_grad():
        for slot in range(4):
            lora.configure_slot(slot, rank=4, alpha=8.0)
            lora.reset_slot(slot, seed=slot)
            for p in lora.slot_parameters(slot):  # B is zero after reset: make every adapter count
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + slot)))
    model.train()  # as on the pool: generate switches to eval and back
    return model, lora


def spec(**overrides: Any) -> SamplingSpec:
    values: dict[str, Any] = {
        "prompt": [5, 6, 7],
        "num_samples": 1,
        "max_tokens": 6,
        "temperature": 1.0,
        "top_k": -1,
        "top_p": 1.0,
    }
    return SamplingSpec(**{**values, **overrides})


def decoding(slot: int | None, prompt: list[int], seed: int, **overrides: Any) -> Decoding:
    s = spec(prompt=prompt, **overrides)
    return Decoding(
        slot=slot,
        prompt=prompt,
        spec=s,
        generator=torch.Generator().manual_seed(seed),
        stop_tokens=frozenset(s.stop_tokens),
    )


@torch.no_grad()
def full_forward_logprobs(model, lora: MultiLoRA, slot: int | None, tokens: list[int]) -> torch.Tensor:
    """(n,) logprob of every token after the first, from one forward of the whole sequence alone."""
    model.eval()
    ids = torch.tensor([tokens])
    counts = torch.zeros(lora.n_slots, dtype=torch.long)
    if slot is None:
        logits = model(input_ids=ids, use_cache=False).logits[0]
    else:
        counts[slot] = len(tokens)
        with lora.segments(counts):
            logits = model(input_ids=ids, use_cache=False).logits[0]
    model.train()
    logprobs = torch.log_softmax(logits.float(), -1)[:-1]  # (n-1, V)
    return logprobs.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


@pytest.mark.parametrize("attention", [PACKED_ATTENTION, "eager"])
def test_cached_batched_sampling_logprobs_equal_a_full_forward_per_adapter(attention):
    model, lora = tiny_model(attention)
    # Two tenants' slots (3 before 1 on purpose: generate sorts), prompts of different lengths (left
    # padding), and the base model, all in one call.
    rows = [
        decoding(3, [5, 6, 7, 8, 9, 10, 11], seed=1, max_tokens=9),
        decoding(1, [12, 13], seed=2, max_tokens=4),
        decoding(1, [20, 21, 22, 23], seed=3, max_tokens=7),
        decoding(None, [30, 31, 32], seed=4, max_tokens=5),
    ]
    passes = generate(model, lora, rows)
    assert passes == 2  # the routed rows together, the base model's apart
    assert model.training
    for row in rows:
        assert len(row.generated) == row.spec.max_tokens and row.stop_reason == "length"
        expected = full_forward_logprobs(model, lora, row.slot, row.prompt + row.generated)
        got = torch.tensor(row.logprobs)
        torch.testing.assert_close(got, expected[-len(row.generated) :], atol=1e-4, rtol=0)
        if row.slot is not None:  # the adapter matters: the base model's logprobs are far off
            base = full_forward_logprobs(model, lora, None, row.prompt + row.generated)
            assert (got - base[-len(row.generated) :]).abs().max() > 1e-2


def test_each_row_uses_its_own_adapter():
    """Greedy continuations of one prompt differ per slot, and each is the argmax of its own
    adapter's full forward (a routing mistake would give another slot's tokens)."""
    model, lora = tiny_model(PACKED_ATTENTION)
    rows = [decoding(s, [5, 6, 7], seed=0, temperature=0.0, max_tokens=8) for s in (0, 2, 3)]
    generate(model, lora, rows)
    assert len({tuple(r.generated) for r in rows}) > 1
    for row in rows:
        model.eval()
        tokens = list(row.prompt)
        for _ in range(row.spec.max_tokens):
            counts = torch.zeros(lora.n_slots, dtype=torch.long)
            counts[row.slot] = len(tokens)
            with torch.no_grad(), lora.segments(counts):
                logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1]
            tokens.append(int(torch.argmax(logits)))
        model.train()
        assert row.generated == tokens[len(row.prompt) :]


def test_same_seed_same_tokens_and_another_seed_others():
    model, lora = tiny_model(PACKED_ATTENTION)

    def draw(seed: int) -> list[list[int]]:
        rows = [decoding(1, [5, 6, 7], seed=seed, max_tokens=12) for _ in range(1)]
        rows += [decoding(2, [8, 9], seed=seed + 1, max_tokens=12)]
        generate(model, lora, rows)
        return [r.generated for r in rows]

    assert draw(11) == draw(11)
    assert draw(11) != draw(12)


def test_stop_tokens_and_strings_end_a_sequence_with_reason_stop():
    model, lora = tiny_model(PACKED_ATTENTION)
    greedy = decoding(0, [5, 6, 7], seed=0, temperature=0.0, max_tokens=8)
    generate(model, lora, [greedy])
    third = greedy.generated[2]
    # A stop token: the sequence ends at its first occurrence, that token included.
    by_token = decoding(0, [5, 6, 7], seed=0, temperature=0.0, max_tokens=8, stop_tokens=[third])

    # A stop string, matched on the decoded text (here: one letter per token id).
    def decode(ids):
        return "".join(chr(65 + t % 26) for t in ids)

    target = decode(greedy.generated[1:3])
    by_string = decoding(0, [5, 6, 7], seed=0, temperature=0.0, max_tokens=8, stop_strings=[target])
    generate(model, lora, [by_token, by_string], decode=decode)
    first = greedy.generated.index(third)
    assert by_token.generated == greedy.generated[: first + 1] and by_token.stop_reason == "stop"
    end = decode(greedy.generated).index(target) + len(target)
    assert by_string.generated == greedy.generated[:end] and by_string.stop_reason == "stop"
    assert len(by_string.logprobs) == len(by_string.generated)


def test_top_k_one_is_greedy_and_top_p_keeps_only_the_nucleus():
    model, lora = tiny_model(PACKED_ATTENTION)
    greedy = decoding(1, [5, 6, 7], seed=0, temperature=0.0, max_tokens=6)
    top1 = decoding(1, [5, 6, 7], seed=5, temperature=1.0, top_k=1, max_tokens=6)
    tiny_nucleus = decoding(1, [5, 6, 7], seed=6, temperature=1.0, top_p=1e-6, max_tokens=6)
    generate(model, lora, [greedy, top1, tiny_nucleus])
    assert top1.generated == greedy.generated == tiny_nucleus.generated


def test_prompt_logprobs_are_a_forward_of_the_prompt_and_last_n_scores_only_the_suffix():
    model, lora = tiny_model(PACKED_ATTENTION)
    short = decoding(2, [5, 6, 7], seed=1, max_tokens=2, prompt_logprobs=True)
    long = decoding(2, [9, 10, 11, 12, 13, 14], seed=2, max_tokens=2, prompt_logprobs=True)
    suffix = decoding(
        0, [9, 10, 11, 12, 13, 14], seed=3, max_tokens=2, prompt_logprobs=True, prompt_logprobs_last_n=2
    )
    without = decoding(0, [5, 6], seed=4, max_tokens=2)
    generate(model, lora, [short, long, suffix, without])
    for row in (short, long):
        assert row.prompt_logprobs is not None and row.prompt_logprobs[0] is None
        expected = full_forward_logprobs(model, lora, row.slot, row.prompt)
        torch.testing.assert_close(torch.tensor(row.prompt_logprobs[1:]), expected, atol=1e-4, rtol=0)
    assert suffix.prompt_logprobs is not None and suffix.prompt_logprobs[:4] == [None] * 4
    expected = full_forward_logprobs(model, lora, 0, suffix.prompt)[-2:]
    torch.testing.assert_close(torch.tensor(suffix.prompt_logprobs[4:]), expected, atol=1e-4, rtol=0)
    assert without.prompt_logprobs is None


def test_pass_limits_split_a_group_into_passes_with_the_same_results():
    model, lora = tiny_model(PACKED_ATTENTION)

    def rows() -> list[Decoding]:
        return [
            decoding(0, [5, 6, 7], seed=1, max_tokens=5),  # 8 cache positions
            decoding(1, [8, 9], seed=2, max_tokens=6),  # 8
            decoding(2, [10, 11, 12, 13], seed=3, max_tokens=4, prompt_logprobs=True),  # 8
            decoding(None, [14, 15], seed=4, max_tokens=3),
        ]

    together, split, scored = rows(), rows(), rows()
    assert generate(model, lora, together) == 2
    # 16 cache positions: two rows of 8 per pass; the base model's row in its own pass anyway.
    assert generate(model, lora, split, limits=PassLimits(cache_tokens=16)) == 3
    # The prompt-scoring row's prefill alone: (rows × longest prompt) ≤ 4 positions of logits.
    assert generate(model, lora, scored, limits=PassLimits(prompt_logit_tokens=4)) == 3
    for a, b, c in zip(together, split, scored, strict=True):
        assert a.generated == b.generated == c.generated
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert together[2].prompt_logprobs is not None and scored[2].prompt_logprobs is not None
    torch.testing.assert_close(
        torch.tensor(together[2].prompt_logprobs[1:]),
        torch.tensor(scored[2].prompt_logprobs[1:]),
        atol=1e-5,
        rtol=0,
    )
