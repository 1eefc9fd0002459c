"""Packed attention (`trainer_core.models.attention`): a packed row's logits and LoRA gradients equal its
samples' run alone, for every architecture the pool serves, without any L×L mask."""

import copy
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from contracts.wire import TrainingBatch, TrainingSample
from trainer_core import modeling
from trainer_core.lora import apply_multi_lora
from trainer_core.models import attention
from trainer_core.models.attention import (
    CALL_COST_TOKENS,
    PACKED_ATTENTION,
    PackedSegments,
    segment_attention,
)
from trainer_core.models.tiny import ARCHS, Arch, build_model, tiny_config
from trainer_core.packing import MicroBatch, Packer

torch.set_num_threads(1)

VOCAB = 256
N_SLOTS = 3


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
    packer = Packer(n_slots=N_SLOTS, seq_len=seq_len, dp_world_size=1, pad_to_multiple_of=multiple)
    for slot, samples in samples_by_slot.items():
        packer.add_run(slot, batch_size=len(samples))
        packer.add_batch(slot, TrainingBatch(examples=samples), batch_id=slot)
    result = packer.pack(force=True)
    assert result is not None
    ((row,),) = result.micro_batches
    return row


def mixed_row(seed: int) -> MicroBatch:
    """Five samples of three runs, 40 tokens, padded to 48."""
    g = torch.Generator().manual_seed(seed)
    samples = {
        0: [random_sample(g, 3, 6), random_sample(g, 0, 5)],
        1: [random_sample(g, 7, 4)],
        2: [random_sample(g, 1, 1), random_sample(g, 4, 9)],
    }
    row = pack_one_row(samples, seq_len=64, multiple=16)
    assert row.seq_lens[-1] == 8 and row.num_samples == 5
    return row


def single_sample_row(seed: int) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    row = pack_one_row({1: [random_sample(g, 5, 11)]}, seq_len=16)
    assert row.seq_lens == [16] and row.num_samples == 1
    return row


ROWS = {"mixed_with_padding": mixed_row, "single_sample": single_sample_row}


def sample_spans(row: MicroBatch) -> list[tuple[int, int]]:
    """(start, end) of every real sample of the row."""
    spans, start = [], 0
    for n in row.seq_lens[: row.num_samples]:
        spans.append((start, start + n))
        start += n
    return spans


def reference_model(arch: Arch, **overrides) -> PreTrainedModel:
    """The same weights with transformers' own SDPA attention: the "run alone" side never touches ours."""
    return build_model(arch, seed=0, vocab_size=VOCAB, attn_implementation="sdpa", **overrides)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("make_row", ROWS.values(), ids=list(ROWS))
@torch.no_grad()
def test_packed_logits_equal_logits_alone(arch, make_row):
    model = build_model(arch, seed=0, vocab_size=VOCAB)
    assert model.config._attn_implementation == PACKED_ATTENTION
    reference = reference_model(arch)
    row = make_row(7)
    logits = modeling.forward_packed(model, row)
    assert logits.shape == (row.num_tokens, VOCAB)
    for start, end in sample_spans(row):
        alone = reference(input_ids=row.input_ids[None, start:end]).logits[0]
        torch.testing.assert_close(logits[start:end], alone, rtol=0, atol=1e-5)
    assert torch.isfinite(logits).all()  # the padding segment too


@torch.no_grad()
def test_packed_path_agrees_with_the_dense_mask_path():
    model = build_model("qwen2", seed=0, vocab_size=VOCAB)
    dense = reference_model("qwen2")
    row = mixed_row(8)
    torch.testing.assert_close(
        modeling.forward_packed(model, row), modeling.forward_packed(dense, row), rtol=0, atol=1e-5
    )


def test_every_layer_attends_per_segment_and_no_mask_is_built(monkeypatch):
    """The layout reaches each attention layer as segment lengths, and no (L, L) mask is built."""
    calls: list[tuple[int, ...]] = []
    real = attention.segment_attention

    def spy(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: PackedSegments, **kwargs: Any
    ) -> torch.Tensor:
        calls.append(segments.seq_lens)
        return real(query, key, value, segments, **kwargs)

    def no_dense_mask(*args, **kwargs):
        raise AssertionError("the packed path built the dense mask")

    monkeypatch.setattr(attention, "segment_attention", spy)
    monkeypatch.setattr(modeling, "packed_attention_mask", no_dense_mask)
    model = build_model("llama", seed=0, vocab_size=VOCAB, num_layers=3)
    row = mixed_row(9)
    with torch.no_grad():
        modeling.forward_packed(model, row)
    assert calls == [tuple(row.seq_lens)] * 3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_packed_lora_gradients_equal_the_sum_of_gradients_alone(arch):
    """Each run's LoRA gradients from one packed row equal those of its samples run alone, summed."""
    row = mixed_row(10)
    spans = sample_spans(row)
    weights = torch.randn(row.num_tokens, VOCAB, generator=torch.Generator().manual_seed(11))

    def lora_model(attn: str):
        model = build_model(arch, seed=0, vocab_size=VOCAB, attn_implementation=attn)
        handle = apply_multi_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"], N_SLOTS, 4)
        for slot in range(N_SLOTS):
            handle.reset_slot(slot, seed=slot)
            for p in handle.slot_parameters(slot):  # B = 0 would make A's gradient vacuous
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(p.numel() + slot))
        return model, handle

    packed_model, packed = lora_model(PACKED_ATTENTION)
    with packed.segments(row.slot_token_counts):
        logits = modeling.forward_packed(packed_model, row)
    sample_tokens = torch.zeros(row.num_tokens, dtype=torch.bool)
    for start, end in spans:
        sample_tokens[start:end] = True
    (logits * weights)[sample_tokens].sum().backward()

    alone_model, alone = lora_model("sdpa")
    for start, end in spans:
        slot = int(row.token_slots[start])
        counts = [0] * N_SLOTS
        counts[slot] = end - start
        with alone.segments(counts):
            out = alone_model(input_ids=row.input_ids[None, start:end]).logits[0]
        (out * weights[start:end]).sum().backward()

    for slot in range(N_SLOTS):
        for (name, got), want in zip(
            packed.slot_named_parameters(slot), alone.slot_parameters(slot), strict=True
        ):
            assert got.grad is not None and want.grad is not None, name
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5, msg=name)


@torch.no_grad()
def test_sliding_window_inside_a_sample():
    """A Mistral-style window shorter than a sample: within the sample the window applies, as alone."""
    config = tiny_config("mistral", vocab_size=VOCAB)
    config.sliding_window = 4
    models = {}
    for impl in (PACKED_ATTENTION, "sdpa"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            # A copy each: from_config records the implementation in the config it is given.
            models[impl] = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
            models[impl].eval()
    row = mixed_row(12)
    assert max(row.seq_lens) > config.sliding_window
    logits = modeling.forward_packed(models[PACKED_ATTENTION], row)
    for start, end in sample_spans(row):
        alone = models["sdpa"](input_ids=row.input_ids[None, start:end]).logits[0]
        torch.testing.assert_close(logits[start:end], alone, rtol=0, atol=1e-5)


@torch.no_grad()
def test_unpacked_calls_are_plain_sdpa_padding_included():
    """Outside forward_packed the packed implementation is SDPA: a padded batch gives the same logits."""
    model = build_model("qwen2", seed=0, vocab_size=VOCAB)
    reference = reference_model("qwen2")
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(13))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding: a mask that must not be dropped
    torch.testing.assert_close(
        model(input_ids=ids, attention_mask=mask).logits, reference(input_ids=ids, attention_mask=mask).logits
    )
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)


LENGTHS = {
    "long_and_short": [300, 290, 130, 64, 64, 7, 1],
    "one_segment": [37],
    "one_long_one_short": [200, 3],
    "equal": [48, 48, 48],
}


@pytest.mark.parametrize("lens", LENGTHS.values(), ids=list(LENGTHS))
def test_segment_attention_equals_sdpa_on_each_segment(lens):
    """Calls shared by padded short segments and sliced long ones: outputs and gradients as per segment."""
    g = torch.Generator().manual_seed(len(lens))
    length = sum(lens)
    q = torch.randn(1, 6, length, 16, generator=g).requires_grad_(True)
    k = torch.randn(1, 2, length, 16, generator=g).requires_grad_(True)
    v = torch.randn(1, 2, length, 16, generator=g).requires_grad_(True)
    upstream = torch.randn(length, 6, 16, generator=g)
    out = segment_attention(q, k, v, lens, scaling=0.3)  # (L, H, D)
    grads = torch.autograd.grad((out * upstream).sum(), (q, k, v))
    refs, start = [], 0
    for n in lens:
        s = slice(start, start + n)
        refs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, s], k[:, :, s], v[:, :, s], scale=0.3, is_causal=True, enable_gqa=True
            )[0].transpose(0, 1)
        )
        start += n
    ref = torch.cat(refs)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("lens", LENGTHS.values(), ids=list(LENGTHS))
def test_a_segment_shares_a_call_only_when_padding_costs_less_than_a_call(lens):
    budget = CALL_COST_TOKENS**2
    plan = PackedSegments(lens).plan(torch.device("cpu"), None)
    ordered = sorted(lens, reverse=True)
    assert [b.count for b in plan.buckets] and sum(b.count for b in plan.buckets) == len(lens)
    start = 0
    for bucket, following in zip(plan.buckets, [*plan.buckets[1:], None], strict=True):
        members = ordered[start : start + bucket.count]
        assert bucket.width == members[0]
        assert all(bucket.width**2 <= n**2 + budget for n in members)
        if following is not None:  # the next call's longest did not fit in this one
            assert bucket.width**2 > following.width**2 + budget
        start += bucket.count


def test_calls_in_practice():
    cpu = torch.device("cpu")
    lens = LENGTHS["long_and_short"]  # 300, 290, 130, 64, 64, 7, 1
    plan = PackedSegments(lens).plan(cpu, None)
    assert (plan.buckets[0].count, plan.buckets[0].width) == (1, 300)  # long: alone, sliced
    assert plan.buckets[0].gather is None
    assert (plan.buckets[-1].count, plan.buckets[-1].width) == (4, 64)  # short: together, padded
    assert plan.buckets[-1].gather is not None
    windowed = PackedSegments(lens).plan(cpu, 100)  # longer than the window: alone, whatever the cost
    assert [b.count for b in windowed.buckets if b.width > 100] == [1, 1, 1]
    assert PackedSegments([5]).plan(cpu, None).inverse is None  # one segment: no reordering
    equal = PackedSegments(LENGTHS["equal"]).plan(cpu, None)  # one call on a view of the row, in order
    assert [(b.count, b.gather) for b in equal.buckets] == [(3, None)] and equal.inverse is None


def test_segment_attention_rejects_a_layout_that_does_not_cover_the_row():
    q = torch.randn(1, 4, 10, 8)
    kv = torch.randn(1, 2, 10, 8)
    with pytest.raises(ValueError, match="sum to 9, not to the row length 10"):
        segment_attention(q, kv, kv, [4, 5])
    with pytest.raises(ValueError, match="must be positive"):
        segment_attention(q, kv, kv, [10, 0])
    with pytest.raises(ValueError, match="batch 1"):
        segment_attention(q.expand(2, -1, -1, -1), kv.expand(2, -1, -1, -1), kv.expand(2, -1, -1, -1), [10])
