"""Gradient checkpointing (`MultiLoRA.enable_gradient_checkpointing`): the recomputed forward routes
tokens to the same slots as the original, so every run's LoRA gradients are those without it."""

import pytest
import torch
from torch.utils.checkpoint import CheckpointError

from contracts.wire import TrainingBatch, TrainingSample
from trainer_core.lora import MultiLoRA, apply_multi_lora
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
