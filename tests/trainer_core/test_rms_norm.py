"""The loader's RMSNorms through F.rms_norm: the same outputs and gradients as transformers' own."""

import pickle

import pytest
import torch
from torch import nn

from trainer_core.lora import apply_multi_lora
from trainer_core.models.registry import load_base_model
from trainer_core.models.rms_norm import FORMULA_CLASSES, use_functional_rms_norm
from trainer_core.models.tiny import ARCHS, Arch, build_model

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.mark.parametrize("device", ["cpu", CUDA])  # on CUDA, F.rms_norm is a fused kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", FORMULA_CLASSES, ids=lambda c: c.__name__)
def test_functional_forward_equals_the_class_forward(
    cls: type[nn.Module], dtype: torch.dtype, device: str
) -> None:
    torch.manual_seed(0)
    norm: nn.Module = cls(48, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.get_parameter("weight").copy_(torch.randn(48) * 0.5 + 1)
    x = (torch.randn(3, 5, 48) * 4).to(device=device, dtype=dtype).requires_grad_(True)
    want = norm(x)
    (gx_want,) = torch.autograd.grad(want.float().square().sum(), x)
    assert use_functional_rms_norm(norm) == 1
    assert "forward" in vars(norm)  # the instance's forward now, not the class's
    got = norm(x)
    (gx_got,) = torch.autograd.grad(got.float().square().sum(), x)
    assert got.dtype == want.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(gx_got, gx_want, rtol=tol, atol=tol)


@pytest.mark.parametrize("arch", ARCHS)
def test_loaded_model_trains_as_transformers_own(arch: Arch, tmp_path) -> None:
    """Through the pool's loader: every decoder norm replaced, logits and LoRA gradients unchanged."""
    build_model(arch, seed=0).save_pretrained(tmp_path)
    ours = load_base_model(str(tmp_path), dtype="fp32", attn_implementation="sdpa")
    theirs = load_base_model(str(tmp_path), dtype="fp32", attn_implementation="sdpa")
    norms = [m for m in theirs.modules() if type(m) in FORMULA_CLASSES]
    layers = theirs.config.num_hidden_layers
    assert len(norms) == 2 * layers + 1 + (2 * layers if arch == "qwen3" else 0)
    assert all("forward" in vars(m) for m in norms)
    for m in norms:
        del m.forward  # back to transformers' forward
    ids = torch.randint(0, 256, (2, 11))
    grads = []
    for model in (ours, theirs):
        handle = apply_multi_lora(model, ["q_proj", "down_proj"], n_slots=2, max_rank=4)
        handle.reset_slot(0, seed=1)
        with torch.no_grad():
            for p in handle.slot_parameters(0):
                p.add_(0.01)  # B non-zero: gradients reach A too
        with handle.segments([22, 0]):
            logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        grads.append((logits.detach(), [p.grad for p in handle.slot_parameters(0)]))
    (l_ours, g_ours), (l_theirs, g_theirs) = grads
    torch.testing.assert_close(l_ours, l_theirs, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_ours, g_theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_other_norms_are_left_alone() -> None:
    class GemmaLikeRMSNorm(nn.Module):  # (1 + weight): not the formula
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(8))
            self.variance_epsilon = 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * (1 + self.weight)

    model = nn.Sequential(GemmaLikeRMSNorm(), nn.LayerNorm(8))
    assert use_functional_rms_norm(model) == 0
    assert all("forward" not in vars(m) for m in model.modules())


def test_a_model_with_functional_norms_still_pickles(tmp_path) -> None:
    build_model("qwen3", seed=0).save_pretrained(tmp_path)
    model = load_base_model(str(tmp_path), dtype="fp32", attn_implementation="sdpa")
    ids = torch.randint(0, 256, (1, 7))
    copy = pickle.loads(pickle.dumps(model))
    assert all("forward" in vars(m) for m in copy.modules() if type(m) in FORMULA_CLASSES)
    with torch.no_grad():
        torch.testing.assert_close(copy(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
