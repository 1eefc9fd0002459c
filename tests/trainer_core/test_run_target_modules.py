"""A run that adapts only some of the modules the pool wraps trains and exports only those. Every
fresh admission re-enabled all of the pool's modules for the slot (`load_initial_weights` configured
it without the run's target_modules, after `admit_slot` had masked the others), so a run asking
for q_proj and v_proj trained, checkpointed and published all seven."""

import json
from pathlib import Path

import pytest
import torch

from contracts.layout import ADAPTER_CONFIG
from tests.e2e.helpers import run_config
from tests.trainer_core.test_directory_pool import (
    RUN_A,
    RUN_B,
    adapter,
    make_run,
    published_steps,
    train,
    write_steps,
)
from tests.trainer_core.test_export import TARGETS, trained_handle
from trainer_core.export import export_peft_adapter, import_peft_adapter
from trainer_core.lora import apply_multi_lora
from trainer_core.models.tiny import build_model


def _modules(weights: dict) -> set[str]:
    return {key.split(".lora_")[0].rpartition(".")[2] for key in weights}


def test_a_run_trains_and_exports_only_its_target_modules(tmp_path: Path) -> None:
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
    some = make_run(tmp_path, RUN_A, run_config(max_steps=1, batch_size=2, seed=1, lora=lora))
    every = make_run(tmp_path, RUN_B, run_config(max_steps=1, batch_size=2, seed=2))
    write_steps(some, [11])
    write_steps(every, [21])
    train(tmp_path)

    assert published_steps(some) == [1] and published_steps(every) == [1]
    assert _modules(adapter(some, 1)) == {"q_proj", "v_proj"}
    config = json.loads((some / "broadcast" / "step_1" / ADAPTER_CONFIG).read_text())
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    # The other run, in the same pool at the same time, keeps every module the pool wraps.
    assert len(_modules(adapter(every, 1))) > 2


def test_an_adapter_of_the_runs_modules_imports_strictly_into_a_pool_wrapping_more(tmp_path: Path) -> None:
    """`init_from` an uploaded adapter of q_proj and v_proj, for a run of those modules, in a pool that
    wraps seven: strict about the run's modules, not the pool's (it failed "lacks wrapped modules")."""
    subset = trained_handle("qwen3", targets=["q_proj", "v_proj"])
    out = export_peft_adapter(subset, 1, tmp_path / "a", base_model_name_or_path="tiny")
    pool = apply_multi_lora(build_model("qwen3", seed=0), TARGETS, n_slots=3, max_rank=8)
    import_peft_adapter(pool, 1, out, target_modules=["q_proj", "v_proj"])
    assert pool.slot_target_modules(1) == ("q_proj", "v_proj")
    assert pool.slot_state_dict(1).keys() == subset.slot_state_dict(1).keys()
    for key, value in subset.slot_state_dict(1).items():
        torch.testing.assert_close(pool.slot_state_dict(1)[key], value, rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside the run's target_modules"):
        import_peft_adapter(pool, 2, out, target_modules=["q_proj"])
