"""The pool's model path on a CUDA device: the loader's defaults there, packed rows equal samples alone,
the grouped LoRA kernel against the loop and the dense reference, a bf16 base training fp32 LoRA.

Skipped without CUDA (CI has none); run on a lent GPU with ``pytest tests/trainer_core/test_cuda.py``.
The CPU forms of these checks are in test_packed_attention.py, test_lora.py and test_precision.py.
"""

import pytest
import torch

from contracts.run_config import OptimSettings, SchedulerSettings
from tests.trainer_core.test_lora import (
    COUNTS,
    IN,
    OUT,
    assert_close_bf16,
    make_layer,
    reference_and_grads,
    run_and_grads,
)
from tests.trainer_core.test_packed_attention import VOCAB, mixed_row, sample_spans
from trainer_core.lora import SegmentLayout, apply_multi_lora
from trainer_core.modeling import forward_packed
from trainer_core.models.attention import PACKED_ATTENTION
from trainer_core.models.registry import load_base_model
from trainer_core.models.tiny import ARCHS, Arch, build_model
from trainer_core.optim import MultiRunOptimizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


def on_cuda(arch: Arch, dtype: torch.dtype, attn: str = PACKED_ATTENTION) -> torch.nn.Module:
    model = build_model(arch, seed=0, vocab_size=VOCAB, attn_implementation=attn)
    return torch.nn.Module.to(model, device=CUDA, dtype=dtype)


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 means fp32: TF32 matmuls (10-bit mantissa) would be compared at 1e-5 otherwise."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_packed_logits_equal_logits_alone_fp32(arch):
    model, alone = on_cuda(arch, torch.float32), on_cuda(arch, torch.float32, attn="sdpa")
    row = mixed_row(7)
    logits = forward_packed(model, row)
    assert logits.device.type == "cuda"
    for start, end in sample_spans(row):
        want = alone(input_ids=row.input_ids[None, start:end].to(CUDA)).logits[0]
        torch.testing.assert_close(logits[start:end], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_packed_logits_bf16_stay_within_bf16_rounding_of_alone(arch):
    """In bf16 the packed and the alone calls may take different kernels, so the logits differ by
    rounding; a sample that attended to another would differ by far more (order 1 on these logits)."""
    model, alone = on_cuda(arch, torch.bfloat16), on_cuda(arch, torch.bfloat16, attn="sdpa")
    row = mixed_row(7)
    logits = forward_packed(model, row).float()
    for start, end in sample_spans(row):
        want = alone(input_ids=row.input_ids[None, start:end].to(CUDA)).logits[0].float()
        assert_close_bf16(logits[start:end], want, f"sample at {start}")


def test_loader_defaults_on_cuda_are_bf16_and_packed_attention(tmp_path):
    build_model("qwen2", seed=0, vocab_size=VOCAB).save_pretrained(tmp_path)
    model = load_base_model(str(tmp_path), device="cuda")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    expected = "flash_attention_2" if _flash_attn_installed() else PACKED_ATTENTION
    assert model.config._attn_implementation == expected


def _flash_attn_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def test_auto_takes_the_grouped_kernel_for_bf16_on_cuda():
    layer = make_layer(torch.bfloat16).to(CUDA)
    layout = SegmentLayout((3, 0, 7, 1, 0))
    assert layer.resolve_path(CUDA, torch.bfloat16, layout) == "grouped"


@pytest.mark.parametrize("path", ["grouped", "loop"])
@pytest.mark.parametrize("counts", COUNTS[:3])
def test_lora_paths_match_reference_bf16_on_cuda(path: str, counts: tuple[int, ...]) -> None:
    layer = make_layer(torch.bfloat16).to(CUDA)
    ref_layer = make_layer(torch.bfloat16).float().to(CUDA)  # the same bf16 values, computed in fp32
    total = sum(counts)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, total, IN, generator=gen).to(device=CUDA, dtype=torch.bfloat16)
    upstream = torch.randn(1, total, OUT, generator=gen).to(device=CUDA, dtype=torch.bfloat16)
    y, gx, grads = run_and_grads(layer, x, counts, path, upstream)
    y_ref, gx_ref, grads_ref = reference_and_grads(ref_layer, x.float(), counts, upstream.float())
    assert y.dtype == torch.bfloat16
    assert_close_bf16(y, y_ref, "output")
    assert_close_bf16(gx, gx_ref, "grad x")
    for i, (g, w) in enumerate(zip(grads, grads_ref, strict=True)):
        assert_close_bf16(g, w, f"grad of parameter {i}")


def test_bf16_base_trains_fp32_lora_on_cuda(tmp_path):
    """The pool's defaults on CUDA (bf16 base, packed attention, grouped LoRA) learn a copy task."""
    build_model("llama", seed=0, vocab_size=VOCAB, hidden_size=64, num_layers=2).save_pretrained(tmp_path)
    model = load_base_model(str(tmp_path), device="cuda").to(CUDA)
    handle = apply_multi_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"], 3, 8)
    for slot in range(3):
        handle.reset_slot(slot, seed=slot)
    params = [p for slot in range(3) for p in handle.slot_parameters(slot)]
    assert {p.dtype for p in params} == {torch.float32} and {p.device.type for p in params} == {"cuda"}
    opt = MultiRunOptimizer(3)
    for slot in range(3):
        opt.create(
            slot,
            handle.slot_parameters(slot),
            optim=OptimSettings(lr=1e-2),
            scheduler=SchedulerSettings(),
            max_steps=20,
        )
    model.train()
    row = mixed_row(3)  # three runs' samples in one row
    targets, mask = row.input_ids[1:].to(CUDA), row.loss_mask[1:].to(CUDA)
    losses = []
    for _ in range(8):
        with handle.segments(row.slot_token_counts):
            logits = forward_packed(model, row)
        assert logits.dtype == torch.bfloat16
        token_loss = torch.nn.functional.cross_entropy(logits[:-1].float(), targets, reduction="none")
        token_loss[mask].sum().backward()
        losses.append(float(token_loss[mask].mean()))
        for slot in range(3):
            opt.add_loss_tokens(slot, int((mask & (row.token_slots[1:].to(CUDA) == slot)).sum()))
        stats = opt.step([0, 1, 2])
        assert not any(s.nonfinite for s in stats.values())
    assert losses[-1] < 0.9 * losses[0], [round(x, 3) for x in losses]
