"""PEFT export / import of one slot: peft loads it unchanged and gives the trainer's logits."""

import json
import re
import tarfile
from io import BytesIO
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from contracts.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from trainer_core import export as export_mod
from trainer_core.export import (
    adapter_files_bytes,
    adapter_tar_bytes,
    export_peft_adapter,
    import_peft_adapter,
)
from trainer_core.lora import MultiLoRA, apply_multi_lora
from trainer_core.models.tiny import ARCHS, Arch, build_model

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEQ = 12


def trained_handle(arch: Arch, *, slot: int = 1, n_slots: int = 3, targets: list[str] = TARGETS) -> MultiLoRA:
    """A model whose `slot` (rank 4 of 8, alpha 8) took a few AdamW steps; other slots random too."""
    model = build_model(arch, seed=0)
    handle = apply_multi_lora(model, targets, n_slots=n_slots, max_rank=8)
    gen = torch.Generator().manual_seed(5)
    for other in range(n_slots):
        with torch.no_grad():
            for p in handle.slot_parameters(other):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    handle.configure_slot(slot, rank=4, alpha=8.0, dropout=0.0)
    handle.reset_slot(slot, seed=11)
    opt = torch.optim.AdamW(handle.slot_parameters(slot), lr=1e-2)
    ids = torch.randint(0, 256, (1, SEQ), generator=gen)
    for _ in range(3):
        opt.zero_grad()
        with handle.segments(one_slot_counts(n_slots, slot)):
            model(ids, labels=ids).loss.backward()
        opt.step()
    return handle


def one_slot_counts(n_slots: int, slot: int, tokens: int = SEQ) -> list[int]:
    counts = [0] * n_slots
    counts[slot] = tokens
    return counts


def trainer_logits(handle: MultiLoRA, slot: int, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), handle.segments(one_slot_counts(handle.n_slots, slot, ids.numel())):
        return handle.model(ids).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_peft_round_trip(arch: Arch, tmp_path: Path) -> None:
    handle = trained_handle(arch)
    out = export_peft_adapter(handle, 1, tmp_path / "adapter", base_model_name_or_path=f"tiny-{arch}")
    assert sorted(p.name for p in out.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS])

    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == (
        "LORA",
        "CAUSAL_LM",
        4,
        8.0,
    )
    assert config["target_modules"] == sorted(TARGETS) and config["base_model_name_or_path"] == f"tiny-{arch}"
    tensors = load_file(out / ADAPTER_WEIGHTS)
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 4)
    assert len(tensors) == 2 * len(handle.layers)

    ids = torch.randint(0, 256, (1, SEQ))
    ours = trainer_logits(handle, 1, ids)
    peft_model = PeftModel.from_pretrained(build_model(arch, seed=0), out).eval()
    with torch.no_grad():
        theirs = peft_model(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        base = handle.model(ids).logits
    assert (ours - base).abs().max() > 1e-3  # the adapter does something, so the check means something

    info = import_peft_adapter(handle, 2, out)
    assert (info["rank"], info["alpha"], info["dropout"]) == (4, 8.0, 0.0)
    torch.testing.assert_close(trainer_logits(handle, 2, ids), ours, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(v, handle.slot_state_dict(2)[k]) for k, v in handle.slot_state_dict(1).items())


def test_export_is_atomic_and_refuses_to_clobber(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    handle = trained_handle("llama")
    out = tmp_path / "step_1"
    export_peft_adapter(handle, 1, out, base_model_name_or_path="tiny")
    first = (out / ADAPTER_WEIGHTS).read_bytes()
    with pytest.raises(FileExistsError):
        export_peft_adapter(handle, 1, out, base_model_name_or_path="tiny")
    export_peft_adapter(handle, 0, out, base_model_name_or_path="tiny", overwrite=True)
    assert (out / ADAPTER_WEIGHTS).read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]  # no temporary left behind

    def failing_save(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(export_mod, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        export_peft_adapter(handle, 1, tmp_path / "step_2", base_model_name_or_path="tiny")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_export_is_byte_reproducible_and_tars(tmp_path: Path) -> None:
    handle = trained_handle("qwen2")
    a = export_peft_adapter(handle, 1, tmp_path / "a", base_model_name_or_path="tiny")
    b = export_peft_adapter(handle, 1, tmp_path / "b", base_model_name_or_path="tiny")
    assert adapter_tar_bytes(a) == adapter_tar_bytes(b)
    assert adapter_files_bytes(a) == sum((a / n).stat().st_size for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS))
    with tarfile.open(fileobj=BytesIO(adapter_tar_bytes(a))) as tar:
        assert sorted(tar.getnames()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS])


def test_export_in_bf16(tmp_path: Path) -> None:
    handle = trained_handle("mistral")
    out = export_peft_adapter(handle, 1, tmp_path / "a", base_model_name_or_path="tiny", dtype=torch.bfloat16)
    assert {t.dtype for t in load_file(out / ADAPTER_WEIGHTS).values()} == {torch.bfloat16}


def test_import_rejects_rank_above_max_rank(tmp_path: Path) -> None:
    out = export_peft_adapter(trained_handle("llama"), 1, tmp_path / "a", base_model_name_or_path="tiny")
    small = apply_multi_lora(build_model("llama", seed=0), TARGETS, n_slots=2, max_rank=2)
    before = small.slot_state_dict(0)
    with pytest.raises(ValueError, match=r"r=4 is outside \[1, 2\]"):
        import_peft_adapter(small, 0, out)
    assert all(torch.equal(v, small.slot_state_dict(0)[k]) for k, v in before.items())  # untouched


def test_import_rejects_modules_the_model_does_not_wrap(tmp_path: Path) -> None:
    out = export_peft_adapter(trained_handle("llama"), 1, tmp_path / "a", base_model_name_or_path="tiny")
    fewer = apply_multi_lora(build_model("llama", seed=0), ["q_proj", "v_proj"], n_slots=2, max_rank=8)
    with pytest.raises(ValueError, match="does not wrap"):
        import_peft_adapter(fewer, 0, out)


def test_import_of_a_subset_adapter_is_strict_unless_asked(tmp_path: Path) -> None:
    subset = trained_handle("qwen3", targets=["q_proj", "v_proj"])
    out = export_peft_adapter(subset, 1, tmp_path / "a", base_model_name_or_path="tiny")
    full = apply_multi_lora(build_model("qwen3", seed=0), TARGETS, n_slots=3, max_rank=8)
    with pytest.raises(ValueError, match="lacks wrapped modules"):
        import_peft_adapter(full, 1, out)
    import_peft_adapter(full, 1, out, strict=False)
    fresh_a, fresh_b = full.layers["model.layers.0.mlp.up_proj"].slot_parameters(1)
    assert torch.count_nonzero(fresh_b) == 0 and torch.count_nonzero(fresh_a[:4]) > 0
    ids = torch.randint(0, 256, (1, SEQ))
    torch.testing.assert_close(
        trainer_logits(full, 1, ids), trainer_logits(subset, 1, ids), rtol=1e-5, atol=1e-5
    )


def test_import_rejects_wrong_shapes(tmp_path: Path) -> None:
    out = export_peft_adapter(trained_handle("llama"), 1, tmp_path / "a", base_model_name_or_path="tiny")
    wider = apply_multi_lora(build_model("llama", seed=0, hidden_size=32), TARGETS, n_slots=2, max_rank=8)
    with pytest.raises(
        ValueError, match=r"has shape \[4, 64\], expected \[4, 32\] \(r=4\).* \(and 17 more\)"
    ):
        import_peft_adapter(wider, 0, out)


def test_import_rejects_unsupported_features_and_foreign_keys(tmp_path: Path) -> None:
    handle = trained_handle("llama")
    out = export_peft_adapter(handle, 1, tmp_path / "a", base_model_name_or_path="tiny")
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    (out / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        import_peft_adapter(handle, 0, out)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config))
    tensors = load_file(out / ADAPTER_WEIGHTS)
    tensors["base_model.model.lm_head.weight"] = torch.zeros(1)
    save_file(tensors, out / ADAPTER_WEIGHTS)
    with pytest.raises(ValueError, match="unexpected tensor"):
        import_peft_adapter(handle, 0, out)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"lora_alpha": 0}, "lora_alpha=0 must be a finite number > 0"),
        ({"lora_dropout": 1.0}, "lora_dropout=1.0 must be a number in [0, 1)"),
        ({"r": 4.0}, "rank r=4.0 must be an integer"),
        ({"bias": "all"}, "unsupported adapter features: bias='all'"),
    ],
)
def test_import_refuses_configs_the_upload_refuses(tmp_path: Path, change: dict, problem: str) -> None:
    """The pool's import and the service's upload check share their rules and messages
    (contracts/peft.py). Before, the pool took a rank of 4.0 (and integer factors, below), and refused
    an alpha of 0 or a dropout of 1 only from configure_slot, in words the upload did not use."""
    handle = trained_handle("llama")
    out = export_peft_adapter(handle, 1, tmp_path / "a", base_model_name_or_path="tiny")
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    (out / ADAPTER_CONFIG).write_text(json.dumps(config | change))
    before = handle.slot_state_dict(0)
    with pytest.raises(ValueError, match=re.escape(problem)):
        import_peft_adapter(handle, 0, out)
    assert all(torch.equal(v, handle.slot_state_dict(0)[k]) for k, v in before.items())  # untouched


def test_import_refuses_factors_that_are_not_floats_naming_them(tmp_path: Path) -> None:
    out = export_peft_adapter(trained_handle("llama"), 1, tmp_path / "a", base_model_name_or_path="tiny")
    tensors = load_file(out / ADAPTER_WEIGHTS)
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, out / ADAPTER_WEIGHTS)
    with pytest.raises(ValueError, match=re.escape(f"tensor {name!r} has dtype I32, not floating point")):
        import_peft_adapter(trained_handle("llama"), 0, out)
