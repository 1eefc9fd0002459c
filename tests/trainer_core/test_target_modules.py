"""The pool honours each run's `lora.target_modules` (issue 10): a per-slot module mask.

A slot whose run adapts only the attention projections has no delta, no parameters, no optimizer
state and no exported tensors in the MLP layers, even though the pool wraps all seven modules for
the runs that want them; peft, given its exported adapter, computes the trainer's logits.
"""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from contracts.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from contracts.run_config import RunConfig
from tests.e2e.helpers import run_config, synthetic_batch
from tests.trainer_core.memory_pool import train_in_memory
from trainer_core.export import export_peft_adapter
from trainer_core.lora import apply_multi_lora, grouped_mm_available
from trainer_core.memory_client import MemoryPoolClient
from trainer_core.models.tiny import build_model

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
PATHS = ["loop", *(["grouped"] if grouped_mm_available() else [])]


@pytest.mark.parametrize("path", PATHS)
def test_an_attention_only_slot_beside_a_full_one(path: str, tmp_path: Path) -> None:
    model = build_model("qwen2", seed=0)
    handle = apply_multi_lora(model, ALL, n_slots=2, max_rank=8)
    handle.set_path(path)  # type: ignore[arg-type]
    handle.configure_slot(0, rank=4, alpha=8.0, target_modules=ATTENTION)
    handle.reset_slot(0, seed=11)
    handle.configure_slot(1, rank=8, alpha=8.0)
    handle.reset_slot(1, seed=12)
    mlp = [name for name in handle.layers if name.rpartition(".")[2] not in ATTENTION]
    attention = [name for name in handle.layers if name not in mlp]
    assert mlp and attention

    # Both slots in every packed micro-batch, AdamW with weight decay on each slot's own parameters.
    assert len(handle.slot_parameters(0)) == 2 * len(attention)
    assert len(handle.slot_parameters(1)) == 2 * len(handle.layers)
    opts = [torch.optim.AdamW(handle.slot_parameters(s), lr=1e-2, weight_decay=0.1) for s in (0, 1)]
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.randint(0, 256, (1, 16), generator=gen)
        for opt in opts:
            opt.zero_grad()
        with handle.segments([8, 8]):
            model(ids, labels=ids).loss.backward()
        for opt in opts:
            opt.step()

    for name in mlp:
        layer = handle.layers[name]
        assert not layer.lora_A[0].any() and not layer.lora_B[0].any(), name  # never adapted
        assert layer.lora_B[1].any(), name  # the full slot trains its MLP layers
    assert all(handle.layers[name].lora_B[0].any() for name in attention)  # slot 0 did train
    assert handle.slot_target_modules(0) == tuple(sorted(ATTENTION))
    assert {k.rpartition(".")[0] for k in handle.slot_state_dict(0)} == set(attention)

    out = export_peft_adapter(handle, 0, tmp_path / "adapter", base_model_name_or_path="tiny-qwen2")
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == sorted(ATTENTION)
    tensors = load_file(out / ADAPTER_WEIGHTS)
    assert len(tensors) == 2 * len(attention)
    assert not any(m in key for key in tensors for m in ("gate_proj", "up_proj", "down_proj"))

    ids = torch.randint(0, 256, (1, 12), generator=gen)
    with torch.no_grad(), handle.segments([12, 0]):
        ours = model(ids).logits
    peft_model = PeftModel.from_pretrained(build_model("qwen2", seed=0), out).eval()
    with torch.no_grad():
        theirs = peft_model(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    # The slot's mask goes with its next run: configured for every module, the MLP layers adapt again.
    handle.configure_slot(0, rank=4, alpha=8.0)
    handle.reset_slot(0, seed=11)
    assert len(handle.slot_parameters(0)) == 2 * len(handle.layers)
    with pytest.raises(ValueError, match="match none"):
        handle.configure_slot(0, rank=4, alpha=8.0, target_modules=["nonexistent"])


def test_the_pool_trains_and_exports_only_the_runs_modules(tmp_path: Path) -> None:
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ATTENTION}
    config = RunConfig.model_validate(run_config(max_steps=2, seed=5, lora=lora)).model_dump(mode="json")
    client = MemoryPoolClient([[synthetic_batch(1, n_samples=4), synthetic_batch(2, n_samples=4)]], config)
    train_in_memory(client, tmp_path)
    assert client.runs["run_000000000000"].step == 2
    tensors = load_safetensors(client.adapters["run_000000000000"])
    modules = {key.split(".")[-3] for key in tensors}
    assert modules == set(ATTENTION)
    assert any(v.abs().max() > 0 for k, v in tensors.items() if "lora_B" in k)
    # Its checkpoint holds the same modules: a restarted pool restores exactly them.
    ckpt = sorted((tmp_path / "ckpt" / "run_000000000000" / "checkpoints").glob("step_*"))
    assert ckpt


@pytest.mark.filterwarnings("ignore:Model has .tie_word_embeddings=True.:UserWarning")
@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True), ("qwen3", True)])
def test_lm_head_gets_its_own_delta_and_peft_loads_it(arch, tied: bool, tmp_path: Path) -> None:
    """train_unembed: LoRA on the unembedding. With tied embeddings the delta is the slot's own: the
    shared weight stays frozen and shared, a slot without lm_head sees the plain unembedding."""
    model = build_model(arch, seed=0, tie_word_embeddings=tied)
    embedding = model.get_input_embeddings().weight
    assert isinstance(embedding, torch.Tensor)
    assert (model.get_submodule("lm_head").weight is embedding) == tied
    before = embedding.detach().clone()
    handle = apply_multi_lora(model, [*ATTENTION, "lm_head"], n_slots=2, max_rank=4)
    assert "lm_head" in handle.layers
    assert (handle.layers["lm_head"].base.weight is embedding) == tied  # still one weight when tied
    handle.configure_slot(0, rank=4, alpha=8.0)
    handle.reset_slot(0, seed=1)
    handle.configure_slot(1, rank=4, alpha=8.0, target_modules=ATTENTION)
    handle.reset_slot(1, seed=2)
    opt = torch.optim.AdamW(handle.slot_parameters(0) + handle.slot_parameters(1), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        ids = torch.randint(0, 256, (1, 16), generator=gen)
        opt.zero_grad()
        with handle.segments([8, 8]):
            model(ids, labels=ids).loss.backward()
        opt.step()
    assert handle.layers["lm_head"].lora_B[0].any()  # slot 0 trained its unembedding delta
    assert not handle.layers["lm_head"].lora_B[1].any()  # slot 1 has none
    assert torch.equal(embedding, before) and not embedding.requires_grad

    ids = torch.randint(0, 256, (1, 12), generator=gen)
    for slot, counts in ((0, [12, 0]), (1, [0, 12])):
        out = export_peft_adapter(handle, slot, tmp_path / f"adapter{slot}", base_model_name_or_path=arch)
        modules = json.loads((out / ADAPTER_CONFIG).read_text())["target_modules"]
        assert ("lm_head" in modules) == (slot == 0)
        with torch.no_grad(), handle.segments(counts):
            ours = model(ids).logits
        peft_model = PeftModel.from_pretrained(
            build_model(arch, seed=0, tie_word_embeddings=tied), out
        ).eval()
        with torch.no_grad():
            theirs = peft_model(ids).logits
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
