"""Real precision: the loader's dtype and attention are settings with per-device defaults; a bf16 base
trains fp32 LoRA master weights; adapters export in the dtype asked (fp32 by default)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from contracts.layout import ADAPTER_WEIGHTS
from contracts.run_config import OptimSettings, SchedulerSettings
from contracts.wire import TrainingBatch, TrainingSample
from trainer_core.export import export_peft_adapter, import_peft_adapter
from trainer_core.lora import apply_multi_lora, master_dtype
from trainer_core.modeling import forward_packed
from trainer_core.models import builtin, precision
from trainer_core.models.attention import PACKED_ATTENTION
from trainer_core.models.registry import load_base_model
from trainer_core.models.tiny import build_model
from trainer_core.optim import MultiRunOptimizer
from trainer_core.packing import MicroBatch, Packer

torch.set_num_threads(1)

VOCAB = 64
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def test_defaults_per_device(monkeypatch):
    assert precision.resolve_dtype(None, None) == torch.float32
    assert precision.resolve_dtype("auto", "cpu") == torch.float32
    assert precision.resolve_dtype(None, "cuda") == torch.bfloat16
    assert precision.resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert precision.resolve_dtype(torch.float32, "cuda:0") == torch.float32
    assert precision.resolve_attn_implementation(None, "cpu", torch.float32) == PACKED_ATTENTION
    monkeypatch.setattr(precision, "flash_attn_importable", lambda: True)
    assert precision.resolve_attn_implementation("auto", "cuda", torch.bfloat16) == "flash_attention_2"
    assert precision.resolve_attn_implementation("auto", "cuda", torch.float32) == PACKED_ATTENTION
    assert precision.resolve_attn_implementation("auto", "cpu", torch.bfloat16) == PACKED_ATTENTION
    monkeypatch.setattr(precision, "flash_attn_importable", lambda: False)
    assert precision.resolve_attn_implementation("auto", "cuda", torch.bfloat16) == PACKED_ATTENTION
    assert precision.resolve_attn_implementation("packed", "cuda", torch.bfloat16) == PACKED_ATTENTION
    assert precision.resolve_attn_implementation("eager", "cpu", torch.float32) == "eager"


@pytest.mark.parametrize(
    ("dtype", "attn", "device", "message"),
    [
        ("fp16", None, "cuda", r"dtype 'fp16' is not one of \['fp32', 'bf16'\]"),
        ("float64", None, "cpu", "dtype 'float64' is not one of"),
        (None, "flash_attention_2", "cpu", "needs a CUDA device"),
        ("fp32", "flash_attention_2", "cuda", "needs bf16 or fp16, got fp32"),
        (None, "flesh_attention", "cpu", "attention implementation 'flesh_attention' is not one of"),
    ],
)
def test_bad_settings_are_clear_errors(dtype, attn, device, message):
    with pytest.raises(ValueError, match=message):
        dtype_ = precision.resolve_dtype(dtype, device)
        precision.resolve_attn_implementation(attn, device, dtype_)


@pytest.mark.parametrize(
    ("base", "lora"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_lora_master_weights_are_never_a_half_type(base, lora):
    assert master_dtype(base) == lora


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    build_model("llama", seed=0, vocab_size=VOCAB, hidden_size=64, num_layers=2).save_pretrained(path)
    return path


def test_local_model_loads_in_the_dtype_and_attention_asked(saved_model):
    default = load_base_model(str(saved_model))
    assert {p.dtype for p in default.parameters()} == {torch.float32}
    assert default.config._attn_implementation == PACKED_ATTENTION
    bf16 = load_base_model(str(saved_model), dtype="bf16", attn_implementation="eager")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.config._attn_implementation == "eager"
    assert not any(p.requires_grad for p in bf16.parameters())


def test_builtin_model_goes_through_the_same_settings(tmp_path, saved_model):
    # A stand-in for the cached build (the real one takes a warm-up): the loader reads the cache as is.
    cached = builtin.cached_path(tmp_path)
    build_model("llama", seed=0, vocab_size=VOCAB).save_pretrained(cached)
    (cached / "BUILT").write_text(json.dumps({"name": builtin.NAME, "version": builtin.VERSION}))
    model = load_base_model(builtin.NAME, cache_dir=tmp_path, dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == PACKED_ATTENTION
    model = load_base_model(builtin.NAME, cache_dir=tmp_path, attn_implementation="sdpa")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config._attn_implementation == "sdpa"


def copy_task_row(seed: int) -> MicroBatch:
    """Two samples whose completion repeats the prompt: something a few LoRA steps can learn."""
    g = torch.Generator().manual_seed(seed)
    packer = Packer(n_slots=2, seq_len=64, dp_world_size=1)
    samples = []
    for n in (12, 9):
        prompt = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        samples.append(
            TrainingSample(
                prompt_ids=prompt,
                prompt_mask=[True] * n,
                completion_ids=prompt,
                completion_mask=[True] * n,
                completion_logprobs=[0.0] * n,
                advantage=1.0,
            )
        )
    packer.add_run(1, batch_size=len(samples))
    packer.add_batch(1, TrainingBatch(examples=samples), batch_id=0)
    result = packer.pack(force=True)
    assert result is not None
    ((row,),) = result.micro_batches
    return row


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
def test_bf16_base_trains_fp32_lora_master_weights(saved_model, device):
    """As the worker loads and wraps the model (on CUDA with the loader's default dtype, bf16)."""
    model = load_base_model(str(saved_model), dtype="bf16" if device == "cpu" else None, device=device)
    model = torch.nn.Module.to(model, device)
    base_before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = apply_multi_lora(model, TARGETS, n_slots=2, max_rank=8)  # as the worker calls it
    handle.reset_slot(1, seed=0)
    params = handle.slot_parameters(1)
    assert {p.dtype for p in params} == {torch.float32}
    opt = MultiRunOptimizer(2)
    opt.create(1, params, optim=OptimSettings(lr=1e-2), scheduler=SchedulerSettings(), max_steps=20)
    model.train()
    row = copy_task_row(3)
    targets, loss_mask = row.input_ids[1:].to(device), row.loss_mask[1:].to(device)
    losses = []
    for _ in range(8):
        with handle.segments(row.slot_token_counts):
            logits = forward_packed(model, row)
        assert logits.dtype == torch.bfloat16
        token_loss = torch.nn.functional.cross_entropy(logits[:-1].float(), targets, reduction="none")
        loss = token_loss[loss_mask].sum()
        loss.backward()
        assert {p.grad.dtype for p in params} == {torch.float32}
        losses.append(float(loss.detach()) / int(row.loss_mask.sum()))
        opt.add_loss_tokens(1, int(row.loss_mask.sum()))
        (stats,) = opt.step([1]).values()
        assert not stats.nonfinite
    state = opt.state_dict(1)["optimizer"]["state"]
    assert {t.dtype for s in state.values() for k, t in s.items() if k != "step"} == {torch.float32}
    assert losses[-1] < 0.93 * losses[0] and losses[1] < losses[0], [round(x, 3) for x in losses]
    for k, v in model.state_dict().items():  # the base is frozen (LoRA keys are new)
        if k in base_before:
            assert torch.equal(v, base_before[k]), k


def test_adapters_export_fp32_by_default_and_bf16_on_request(tmp_path):
    model = build_model("qwen2", seed=0, vocab_size=VOCAB, dtype=torch.bfloat16)
    handle = apply_multi_lora(model, TARGETS, n_slots=2, max_rank=4, dtype=torch.bfloat16)
    handle.reset_slot(1, seed=3)
    default = export_peft_adapter(handle, 1, tmp_path / "default", base_model_name_or_path="tiny")
    assert {t.dtype for t in load_file(default / ADAPTER_WEIGHTS).values()} == {torch.float32}
    asked = export_peft_adapter(handle, 1, tmp_path / "bf16", base_model_name_or_path="tiny", dtype="bf16")
    assert {t.dtype for t in load_file(asked / ADAPTER_WEIGHTS).values()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype 'int8' is not one of"):
        export_peft_adapter(handle, 1, tmp_path / "bad", base_model_name_or_path="tiny", dtype="int8")
    assert not (tmp_path / "bad").exists()
    # The fp32 export of bf16 values is exact: importing it back gives the same parameters.
    before = handle.slot_state_dict(1)
    import_peft_adapter(handle, 0, default)
    for key, value in handle.slot_state_dict(0).items():
        assert torch.equal(value, before[key]), key
