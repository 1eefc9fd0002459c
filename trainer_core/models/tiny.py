"""Tiny Hugging Face causal LMs built from configs: the base model of tests, benchmarks and the demo.

No download: the weights are random, drawn from a seed, so two `build_model(arch, seed=s)`
calls give bit-identical models (a PEFT round trip loads an adapter onto a second copy).

Attention is the pool's: `PACKED_ATTENTION` (per-sample SDPA on packed rows, plain SDPA otherwise,
see `trainer_core.models.attention`), so tests and benchmarks run what the worker runs. Pass
``attn_implementation="sdpa"`` for the dense-mask path: a prepared 4D mask of shape (batch, 1, q_len,
kv_len) is passed to `torch.nn.functional.scaled_dot_product_attention` unchanged, and that accepts
both an additive float mask (0 = attend, a large negative value = masked) and a boolean one (True =
attend) ("eager" would add a boolean mask to the scores as 0/1, silently wrong).
"""

from collections.abc import Callable
from typing import Any, Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from trainer_core.models.attention import PACKED_ATTENTION
from trainer_core.models.construction import one_at_a_time

Arch = Literal["llama", "qwen2", "qwen3", "mistral"]
ARCHS: tuple[Arch, ...] = ("llama", "qwen2", "qwen3", "mistral")
ATTN_IMPLEMENTATION = PACKED_ATTENTION

# Callables rather than type[PretrainedConfig]: the base class does not declare the model fields.
_CONFIG_CLASSES: dict[str, Callable[..., PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
}


def tiny_config(
    arch: Arch,
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
) -> PretrainedConfig:
    """A small config of `arch` with head_dim = hidden_size / num_heads (and untied embeddings unless
    asked: small Qwen models tie theirs)."""
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"unknown arch {arch!r}; known: {sorted(_CONFIG_CLASSES)}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    extra: dict[str, Any] = {}
    if arch == "mistral":
        # Plain causal attention: a sliding window would make the model depend on max length.
        extra["sliding_window"] = None
    if arch == "qwen2":
        extra["use_sliding_window"] = False
    return _CONFIG_CLASSES[arch](
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        # Qwen3 defaults head_dim to 128 whatever the hidden size; pin it for every arch.
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        **extra,
    )


def build_model(
    arch: Arch,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = ATTN_IMPLEMENTATION,
    **config_overrides: Any,
) -> PreTrainedModel:
    """A randomly initialised causal LM of `arch` (see `tiny_config` for the overrides), in eval mode.

    Deterministic in `seed` (whatever the dtype: drawn in fp32, then cast); the global RNG state is left
    as it was.
    """
    config = tiny_config(arch, **config_overrides)
    # The lock first: the RNG is the process's, and another thread's seeding or its fork's restore
    # while this one builds would change its weights (`construction`).
    with one_at_a_time(), torch.random.fork_rng(devices=[]):  # from_config sets the default dtype
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(dtype).eval()
