"""Gradient checkpointing (`MultiLoRA.enable_gradient_checkpointing`): the recomputed forward routes
tokens to the same slots as the original, so every run's LoRA gradients are those without it; and the
pool's setting (`WorkerSettings.gradient_checkpointing`) turns it on in the real PoolTrainer."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from torch.utils.checkpoint import CheckpointError

from contracts.run_config import RunConfig
from contracts.wire import TrainingBatch, TrainingSample
from tests.e2e.helpers import run_config, synthetic_batch
from tests.trainer_core.memory_pool import train_in_memory
from trainer_core.lora import MultiLoRA, MultiLoRALinear, apply_multi_lora
from trainer_core.memory_client import MemoryPoolClient
from trainer_core.modeling import forward_packed
from trainer_core.models.tiny import build_model
from trainer_core.packing import MicroBatch, Packer

torch.set_num_threads(1)

VOCAB = 128
N_SLOTS = 3
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def packed_row(seed: int) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    packer = Packer(n_slots=N_SLOTS, seq_len=48, dp_world_size=1, pad_to_multiple_of=16)
    for slot, lengths in {0: (9, 5), 2: (12, 7)}.items():
        samples = []
        for n in lengths:
            ids = torch.randint(1, VOCAB, (n,), generator=g).tolist()
            samples.append(
                TrainingSample(
                    prompt_ids=ids[:2],
                    prompt_mask=[True, True],
                    completion_ids=ids[2:],
                    completion_mask=[True] * (n - 2),
                    completion_logprobs=[0.0] * (n - 2),
                    advantage=1.0,
                )
            )
        packer.add_run(slot, batch_size=len(samples))
        packer.add_batch(slot, TrainingBatch(examples=samples), batch_id=slot)
    result = packer.pack(force=True)
    assert result is not None
    ((row,),) = result.micro_batches
    return row


def lora_model() -> tuple[torch.nn.Module, MultiLoRA]:
    model = build_model("llama", seed=0, vocab_size=VOCAB, num_layers=3)
    handle = apply_multi_lora(model, TARGETS, N_SLOTS, max_rank=4)
    for slot in range(N_SLOTS):
        # Dropout on one run: the recomputation must replay the same random masks.
        handle.configure_slot(slot, rank=4, alpha=8.0, dropout=0.2 if slot == 2 else 0.0)
        handle.reset_slot(slot, seed=slot)
        for p in handle.slot_parameters(slot):  # non-zero B, so that A gets a gradient too
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(p.numel() + slot))
    model.train()
    return model, handle


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    return (logits * weights).sum()


def gradients(handle: MultiLoRA) -> dict[str, torch.Tensor]:
    grads = {}
    for slot in range(N_SLOTS):
        for name, p in handle.slot_named_parameters(slot):
            grads[f"{slot}:{name}"] = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
    return grads


def count_lora_calls(handle: MultiLoRA) -> list[int]:
    calls = [0]
    layer = next(iter(handle.layers.values()))
    layer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def train_once(*, checkpointing: bool, backward: str) -> tuple[dict[str, torch.Tensor], int]:
    """One forward/backward of the row; ``backward``: "inside" the segments block, "after" it, or
    "under_another_layout" (inside a different micro-batch's block, as a worker could)."""
    torch.manual_seed(1234)  # the dropout masks
    model, handle = lora_model()
    if checkpointing:
        handle.enable_gradient_checkpointing()
    calls = count_lora_calls(handle)
    row = packed_row(5)
    with handle.segments(row.slot_token_counts):
        loss = loss_of(forward_packed(model, row))
        if backward == "inside":
            loss.backward()
    if backward == "after":
        loss.backward()
    if backward == "under_another_layout":
        with handle.segments([row.num_tokens, 0, 0]):
            loss.backward()
    return gradients(handle), calls[0]


@pytest.fixture(scope="module")
def without_checkpointing() -> dict[str, torch.Tensor]:
    grads, calls = train_once(checkpointing=False, backward="inside")
    assert calls == 1
    assert any(g.abs().max() > 0 for k, g in grads.items() if k.startswith("2:"))
    return grads


@pytest.mark.parametrize("backward", ["inside", "after", "under_another_layout"])
def test_checkpointed_gradients_equal_gradients_without(without_checkpointing, backward):
    grads, calls = train_once(checkpointing=True, backward=backward)
    assert calls == 2, "the layer was not recomputed: checkpointing is not active"
    assert grads.keys() == without_checkpointing.keys()
    for key, want in without_checkpointing.items():
        torch.testing.assert_close(grads[key], want, rtol=1e-6, atol=1e-7, msg=key)


def test_a_recomputation_without_the_layout_is_not_the_same_forward(without_checkpointing):
    """The check above is not vacuous: with plain checkpointing, a backward after the block recomputes
    the layers without LoRA, which torch's checkpoint detects (other tensors saved)."""
    torch.manual_seed(1234)
    model, handle = lora_model()
    model.activation_checkpointing_enable({"use_reentrant": False})
    row = packed_row(5)
    with handle.segments(row.slot_token_counts):
        loss = loss_of(forward_packed(model, row))
    with pytest.raises(CheckpointError, match="different number of tensors"):
        loss.backward()


def test_checkpointing_is_off_in_eval_mode():
    model, handle = lora_model()
    handle.enable_gradient_checkpointing()
    model.eval()
    calls = count_lora_calls(handle)
    row = packed_row(5)
    with handle.segments(row.slot_token_counts):
        loss_of(forward_packed(model, row)).backward()
    assert calls[0] == 1


def _pool_layer_calls(tmp_path: Path, *, gradient_checkpointing: bool) -> tuple[MemoryPoolClient, int]:
    """Two runs trained by the real PoolTrainer with the setting as given; the multi-LoRA layers'
    forward calls over the whole training (a recomputation in the backward is a call more)."""
    config = RunConfig.model_validate(run_config(max_steps=2, seed=5)).model_dump(mode="json")
    payloads = [[synthetic_batch(run * 10 + step, n_samples=4) for step in range(2)] for run in range(2)]
    client = MemoryPoolClient(payloads, config)
    calls = [0]

    def count(module: torch.nn.Module, *_: object) -> None:
        calls[0] += isinstance(module, MultiLoRALinear)

    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        train_in_memory(client, tmp_path, gradient_checkpointing=gradient_checkpointing)
    finally:
        handle.remove()
    return client, calls[0]


def test_the_pool_setting_recomputes_layers_and_trains_the_same_adapters(tmp_path: Path) -> None:
    """`gradient_checkpointing` (LORALOOM_GRADIENT_CHECKPOINTING, `loraloom worker
    --gradient-checkpointing`) reaches the pool's model: the layers run again in the backward, and
    every run's published adapter is the one trained without it."""
    plain, plain_calls = _pool_layer_calls(tmp_path / "plain", gradient_checkpointing=False)
    recomputed, recomputed_calls = _pool_layer_calls(tmp_path / "recomputed", gradient_checkpointing=True)

    assert plain_calls > 0
    assert recomputed_calls > plain_calls, "no layer was recomputed: the setting did not reach the model"
    assert sorted(recomputed.adapters) == sorted(plain.adapters) == ["run_000000000000", "run_000000000001"]
    assert not recomputed.evictions
    for run_id, data in plain.adapters.items():
        want, got = load_safetensors(data), load_safetensors(recomputed.adapters[run_id])
        assert any(v.abs().max() > 0 for k, v in want.items() if "lora_B" in k)  # it trained
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6, msg=f"{run_id} {key}")
