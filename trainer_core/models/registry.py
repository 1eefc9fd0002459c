"""Base models by name: the built-in `loraloom-tiny`, a local directory, or a hub id."""

import os
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from trainer_core.models import builtin
from trainer_core.models.construction import one_at_a_time
from trainer_core.models.precision import resolve_attn_implementation, resolve_dtype
from trainer_core.models.rms_norm import use_functional_rms_norm

DEFAULT_CACHE_DIR = Path(os.environ.get("LORALOOM_MODEL_CACHE", "./.loraloom/models"))


class BaseModelError(OSError):
    """The base model does not load: a hub id neither cached nor downloadable, a directory that is no
    model transformers knows. The message is one line, transformers' reason included."""


def looks_local(name: str) -> bool:
    """A path, not a hub id (`org/name`): it starts with `.`, `/` or `~`, or has more than one `/`."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def load_base_model(
    name_or_path: str,
    *,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = None,
    device: torch.device | str | None = None,
) -> PreTrainedModel:
    """The frozen base model every rank trains adapters on, on the CPU (the caller moves it).

    A local directory loads as it is; any other name except the built-in one is a hub id,
    which transformers resolves (downloading unless HF_HUB_OFFLINE=1 and it is cached).

    ``device`` is where the model will run: it only picks the defaults. ``dtype``: ``None``/``"auto"``
    (bf16 on CUDA, fp32 otherwise), ``"fp32"``, ``"bf16"`` or a torch dtype. ``attn_implementation``:
    ``None``/``"auto"`` (flash-attention 2 on CUDA when installed, else packed per-sample SDPA),
    ``"packed"``, ``"flash_attention_2"``, ``"sdpa"``, ``"eager"`` (the last two pack with a dense
    mask). See `trainer_core.models.precision`. The Llama-family RMSNorms run through
    `F.rms_norm` (`trainer_core.models.rms_norm`).
    """
    dtype = resolve_dtype(dtype, device)
    attn_implementation = resolve_attn_implementation(attn_implementation, device, dtype)
    if name_or_path == builtin.NAME:
        model = builtin.load(cache_dir, dtype=dtype, attn_implementation=attn_implementation)
    else:
        local = Path(name_or_path).expanduser()
        if not local.is_dir() and looks_local(name_or_path):
            # Not "an invalid hub repo id": the user meant a directory, and it is not there.
            raise FileNotFoundError(f"base model {name_or_path}: the directory {local} does not exist")
        source = str(local) if local.is_dir() else name_or_path
        try:
            with one_at_a_time():  # transformers patches globals while it loads (`construction`)
                model = AutoModelForCausalLM.from_pretrained(
                    source, dtype=dtype, attn_implementation=attn_implementation
                )
        except (OSError, ValueError) as exc:  # not found, unreachable, not a model transformers knows
            raise BaseModelError(f"base model {name_or_path}: {' '.join(str(exc).split())}") from exc
    # Also casts what a checkpoint keeps in fp32 (transformers' `_keep_in_fp32_modules`): one dtype.
    nn.Module.to(model, dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    use_functional_rms_norm(model)  # the same formula in fewer kernel launches
    return model
