"""The pool's model path on a CUDA device: the loader's defaults there, packed rows equal samples alone,
the grouped LoRA kernel chosen for bf16.

Skipped without CUDA (CI has none); on a lent GPU, ``bash bench/gpu.sh OUT tests`` runs these and the
CUDA cases of test_lora.py (the grouped kernel and the loop against the dense reference in bf16) and
test_precision.py (a bf16 base training fp32 LoRA master weights, loaded as the worker loads it). The
CPU forms of the packed-row checks are in test_packed_attention.py.
"""

import pytest
import torch

from tests.trainer_core.test_lora import assert_close_bf16, make_layer
from tests.trainer_core.test_packed_attention import VOCAB, mixed_row, sample_spans
from trainer_core.lora import SegmentLayout
from trainer_core.modeling import forward_packed
from trainer_core.models.attention import PACKED_ATTENTION
from trainer_core.models.registry import load_base_model
from trainer_core.models.tiny import ARCHS, Arch, build_model

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
