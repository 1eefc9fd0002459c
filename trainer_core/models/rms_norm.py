"""The decoder's RMSNorms through `torch.nn.functional.rms_norm`: the same formula in fewer kernels.

transformers' Llama-family RMSNorm is written as seven tensor ops (cast to fp32, square, mean, add eps,
rsqrt, scale, cast back) and its weight; each is a kernel launch forward and more backward. A model of
24 layers has 49 such norms (97 for Qwen3, whose attention normalises q and k too), and on a GPU the
pool's step is bound by the host's launches, not by the GPU (docs/benchmarks.md, "GPU figures"). On
CUDA `F.rms_norm` is one fused kernel each way, equal to transformers' forward within rounding (an ulp
on a few elements in bf16); on the CPU it is the same composite arithmetic, bit for bit.

`use_functional_rms_norm` gives the norms of the classes in `FORMULA_CLASSES` — those whose forward is
exactly ``weight * (x_fp32 * rsqrt(mean(x_fp32²) + eps)).to(dtype)`` — a forward computing that with
`F.rms_norm`. Other norms (Gemma's ``1 + weight``, anything unknown) are left as they are.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FORMULA_CLASSES", "use_functional_rms_norm"]


def _formula_classes() -> tuple[type[nn.Module], ...]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm)


FORMULA_CLASSES: tuple[type[nn.Module], ...] = _formula_classes()
"""RMSNorm classes whose forward is the formula above (checked by tests/trainer_core/test_rms_norm.py
against the class's own forward): matched by exact type, not by name."""


def _functional_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``weight * rms_norm(x in fp32).to(x's dtype)``: the class's own forward, in fused kernels."""
    weight = self.weight
    assert isinstance(weight, torch.Tensor)
    normed = F.rms_norm(hidden_states.float(), weight.shape, eps=float(self.variance_epsilon))  # type: ignore[arg-type]
    return weight * normed.to(hidden_states.dtype)


def use_functional_rms_norm(model: nn.Module) -> int:
    """Route every `FORMULA_CLASSES` norm of ``model`` through `F.rms_norm` (in place); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) in FORMULA_CLASSES:
            # An instance attribute: nn.Module.__call__ calls self.forward, which finds it first. A
            # partial of a module-level function, so that the model still pickles (a bound method of
            # a function the class does not have would not load back).
            module.forward = functools.partial(_functional_forward, module)
            count += 1
    return count
