"""The base model's dtype and attention implementation: names, defaults per device, validation.

Settings arrive as strings (CLI, config); `resolve_dtype` and `resolve_attn_implementation` turn
``"auto"``/``None`` into the defaults and reject what cannot run, with an error that names the setting:

- dtype: ``"bf16"`` on CUDA (the base is frozen, so its precision only affects activations; LoRA
  weights and their optimizer state stay fp32, see `trainer_core.lora.apply_multi_lora`), ``"fp32"``
  on CPU (bf16 matmuls on CPU are slower, and tests compare at 1e-5). ``"fp16"`` is refused: without
  loss scaling its gradients underflow.
- attention: ``"flash_attention_2"`` on CUDA when ``flash_attn`` is importable and the dtype is a half
  type (its kernels have no fp32), else `PACKED_ATTENTION` (per-sample SDPA, every device and dtype).
  ``"sdpa"``/``"eager"`` stay selectable: they pack with a dense (L, L) mask (the old path, kept for
  comparisons).
"""

from __future__ import annotations

import importlib.util

import torch

from trainer_core.models.attention import PACKED_ATTENTION

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "BASE_DTYPES",
    "DTYPES",
    "default_attn_implementation",
    "default_dtype",
    "dtype_name",
    "parse_dtype",
    "resolve_attn_implementation",
    "resolve_dtype",
]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Setting names of the dtypes (exports accept all of them)."""
BASE_DTYPES = ("fp32", "bf16")
"""What a trained-on base model may be loaded in."""
ATTN_IMPLEMENTATIONS = (PACKED_ATTENTION, "flash_attention_2", "flash_attention_3", "sdpa", "eager")
_HALF = (torch.bfloat16, torch.float16)


def parse_dtype(value: str | torch.dtype, *, allowed: tuple[str, ...] = tuple(DTYPES)) -> torch.dtype:
    """``"bf16"`` (or ``"bfloat16"``, or a ``torch.dtype``) → ``torch.bfloat16``; anything else is an error."""
    if isinstance(value, torch.dtype):
        name = dtype_name(value)
    else:
        aliases = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
        name = aliases.get(value, value)
    if name not in allowed:
        raise ValueError(f"dtype {value!r} is not one of {list(allowed)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    for name, known in DTYPES.items():
        if known == dtype:
            return name
    return str(dtype).removeprefix("torch.")


def default_dtype(device: torch.device | str | None) -> torch.dtype:
    """bf16 on CUDA, fp32 elsewhere (CPU when ``device`` is None)."""
    return torch.bfloat16 if _device_type(device) == "cuda" else torch.float32


def resolve_dtype(value: str | torch.dtype | None, device: torch.device | str | None) -> torch.dtype:
    """The base model's dtype: ``None``/``"auto"`` → `default_dtype`, else the named one (fp32 or bf16)."""
    if value is None or value == "auto":
        return default_dtype(device)
    return parse_dtype(value, allowed=BASE_DTYPES)


def flash_attn_importable() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def default_attn_implementation(device: torch.device | str | None, dtype: torch.dtype) -> str:
    """flash-attention 2 on CUDA in a half dtype when installed, else packed per-sample SDPA."""
    if _device_type(device) == "cuda" and dtype in _HALF and flash_attn_importable():
        return "flash_attention_2"
    return PACKED_ATTENTION


def resolve_attn_implementation(
    value: str | None, device: torch.device | str | None, dtype: torch.dtype
) -> str:
    """``None``/``"auto"`` → `default_attn_implementation`; ``"packed"`` → `PACKED_ATTENTION`; else checked."""
    if value is None or value == "auto":
        return default_attn_implementation(device, dtype)
    if value == "packed":
        return PACKED_ATTENTION
    if value not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {value!r} is not one of {['auto', 'packed', *ATTN_IMPLEMENTATIONS]}"
        )
    if value.startswith("flash_attention"):
        if _device_type(device) != "cuda":
            raise ValueError(f"attention implementation {value!r} needs a CUDA device, got {device}")
        if dtype not in _HALF:
            raise ValueError(
                f"attention implementation {value!r} needs bf16 or fp16, got {dtype_name(dtype)}"
            )
    return value


def _device_type(device: torch.device | str | None) -> str:
    return "cpu" if device is None else torch.device(device).type
