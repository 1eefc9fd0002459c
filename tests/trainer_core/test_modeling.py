"""The packed forward: a sample's logits packed among others equal its logits alone."""

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from contracts.wire import TrainingBatch, TrainingSample
from trainer_core.modeling import forward_packed, packed_attention_mask
from trainer_core.models.attention import PACKED_ATTENTION
from trainer_core.packing import MicroBatch, Packer

torch.set_num_threads(1)

VOCAB = 128


def tiny_llama(attn_implementation: str, num_key_value_heads: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    attention: dict[str, Any] = {"attn_implementation": attn_implementation}  # undeclared in LlamaConfig
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=256,
        **attention,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module", params=["eager", "sdpa", PACKED_ATTENTION])
def model(request) -> LlamaForCausalLM:
    return tiny_llama(request.param)


def random_sample(generator: torch.Generator, prompt: int, completion: int) -> TrainingSample:
    ids = torch.randint(1, VOCAB, (prompt + completion,), generator=generator).tolist()
    return TrainingSample(
        prompt_ids=ids[:prompt],
        prompt_mask=[True] * prompt,
        completion_ids=ids[prompt:],
        completion_mask=[True] * completion,
        completion_logprobs=[0.0] * completion,
        advantage=1.0,
    )


def pack_one_row(
    samples_by_slot: dict[int, list[TrainingSample]], seq_len: int, multiple: int = 1
) -> MicroBatch:
    packer = Packer(n_slots=4, seq_len=seq_len, dp_world_size=1, pad_to_multiple_of=multiple)
    for slot, samples in samples_by_slot.items():
        packer.add_run(slot, batch_size=len(samples))
        packer.add_batch(slot, TrainingBatch(examples=samples), batch_id=slot)
    result = packer.pack(force=True)
    assert result is not None
    (rank,) = result.micro_batches
    (row,) = rank
    return row


@torch.no_grad()
def alone(model: LlamaForCausalLM, s: TrainingSample) -> torch.Tensor:
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    return model(input_ids=ids).logits[0]  # (n, V)


def test_mask_is_block_diagonal_causal():
    mask = packed_attention_mask([2, 3], dtype=torch.float32)
    assert mask.shape == (1, 1, 5, 5)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]
    assert (mask[0, 0][mask[0, 0] != 0] == torch.finfo(torch.float32).min).all()
    assert packed_attention_mask([4], dtype=torch.bfloat16).dtype == torch.bfloat16


@torch.no_grad()
def test_logits_packed_equal_logits_alone(model):
    g = torch.Generator().manual_seed(1)
    samples = {
        0: [random_sample(g, 3, 6), random_sample(g, 0, 5)],
        2: [random_sample(g, 7, 4)],
        3: [random_sample(g, 1, 1), random_sample(g, 4, 9)],
    }
    row = pack_one_row(samples, seq_len=64, multiple=16)  # 40 tokens + 8 padding
    assert row.seq_lens[-1] == 8 and row.num_samples == 5
    logits = forward_packed(model, row)
    assert logits.shape == (48, VOCAB)
    start = 0
    for n in row.seq_lens[: row.num_samples]:
        ids = row.input_ids[start : start + n].tolist()
        s = next(s for group in samples.values() for s in group if s.prompt_ids + s.completion_ids == ids)
        torch.testing.assert_close(logits[start : start + n], alone(model, s), rtol=0, atol=1e-5)
        start += n
    assert torch.isfinite(logits).all()  # padding rows too: no fully masked softmax row


@torch.no_grad()
def test_without_the_mask_samples_would_leak(model):
    """The equality above is not vacuous: plain causal attention over the row changes later samples."""
    g = torch.Generator().manual_seed(2)
    first, second = random_sample(g, 4, 4), random_sample(g, 3, 5)
    row = pack_one_row({0: [first, second]}, seq_len=32)
    leaky = model(input_ids=row.input_ids[None], position_ids=torch.arange(16)[None]).logits[0]
    assert not torch.allclose(leaky[8:], alone(model, second), atol=1e-3)


@torch.no_grad()
def test_matches_transformers_own_packed_sequence_detection():
    """With no mask and no cache, transformers 5.x infers packing from restarting position_ids; both
    routes agree. (With a cache — the eval-mode default — it does not: hence our explicit mask.)"""
    model = tiny_llama("sdpa", num_key_value_heads=2)
    g = torch.Generator().manual_seed(3)
    row = pack_one_row(
        {1: [random_sample(g, 5, 5), random_sample(g, 2, 7), random_sample(g, 6, 3)]}, seq_len=40
    )
    ours = forward_packed(model, row)
    theirs = model(
        input_ids=row.input_ids[None], position_ids=row.position_ids[None], use_cache=False
    ).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_gradients_of_one_sample_ignore_the_others():
    """A loss on one sample's tokens has zero gradient w.r.t. the other samples' input embeddings."""
    model = tiny_llama("eager")
    g = torch.Generator().manual_seed(4)
    row = pack_one_row({0: [random_sample(g, 3, 3)], 1: [random_sample(g, 2, 4)]}, seq_len=16)
    embeds = model.get_input_embeddings()(row.input_ids[None]).detach().requires_grad_(True)
    mask = packed_attention_mask(row.seq_lens)
    out = model(inputs_embeds=embeds, position_ids=row.position_ids[None], attention_mask=mask).logits[0]
    out[6:].sum().backward()  # the second sample only
    assert embeds.grad[0, :6].abs().max() == 0
    assert embeds.grad[0, 6:].abs().max() > 0


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_any_packing_leaves_every_sample_unchanged(lengths, seed):
    model = tiny_llama("sdpa")
    g = torch.Generator().manual_seed(seed)
    samples = [random_sample(g, n // 3, n - n // 3) for n in lengths]
    row = pack_one_row({0: samples}, seq_len=64, multiple=8)
    with torch.no_grad():
        logits = forward_packed(model, row)
        start = 0
        for k, n in enumerate(row.seq_lens[: row.num_samples]):
            ids = row.input_ids[start : start + n][None]
            torch.testing.assert_close(
                logits[start : start + n], model(input_ids=ids).logits[0], rtol=0, atol=1e-5
            )
            assert (row.sample_ids[start : start + n] == k).all()
            start += n
