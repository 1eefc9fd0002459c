"""Base models by name: the built-in `loraloom-tiny`, a local directory, or a hub id."""

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from trainer_core.models import builtin

DEFAULT_CACHE_DIR = Path(os.environ.get("LORALOOM_MODEL_CACHE", "./.loraloom/models"))


def load_base_model(
    name_or_path: str, *, cache_dir: Path = DEFAULT_CACHE_DIR, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """The frozen base model every rank trains adapters on.

    A local directory loads as it is; any other name except the built-in one is a hub id,
    which transformers resolves (downloading unless HF_HUB_OFFLINE=1 and it is cached).
    """
    if name_or_path == builtin.NAME:
        model = builtin.load(cache_dir)
    else:
        local = Path(name_or_path).expanduser()
        source = str(local) if local.is_dir() else name_or_path
        # eager attention accepts the packed block-diagonal mask on every device.
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="eager")
    model.to(dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    return model
