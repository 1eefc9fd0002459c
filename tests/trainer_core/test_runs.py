"""MultiRunManager with a DirectoryRunSource on a temporary directory (single process)."""

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import torch

from contracts.run_config import RunConfig
from trainer_core.runs import (
    CONFIG_ERROR_FILE,
    EVICTED_FILE,
    DirectoryRunSource,
    MultiRunManager,
    Progress,
    RunRecord,
    validate_run_id,
)

RUN_A = "run_aaaaaaaaaaaa"
RUN_B = "run_bbbbbbbbbbbb"
RUN_C = "run_cccccccccccc"
RUN_0 = "run_000000000000"
RUN_Z = "run_ffffffffffff"


def make_run(root: Path, run_id: str, config: dict[str, Any] | str | None = None) -> Path:
    """A run directory; `config` None leaves it without orch.toml (not ready)."""
    control = root / run_id / "control"
    control.mkdir(parents=True, exist_ok=True)
    if config is not None:
        text = config if isinstance(config, str) else tomli_w.dumps(config)
        (control / "orch.toml").write_text(text)
    return root / run_id


def error_file(root: Path, run_id: str) -> Path:
    return root / run_id / "control" / CONFIG_ERROR_FILE


def assert_consistent(m: MultiRunManager) -> None:
    assert {v: k for k, v in m.idx_2_id.items()} == dict(m.id_2_idx)
    assert sorted(m.used_idxs + m.unused_idxs) == list(range(m.max_runs))
    assert set(m.config) == set(m.progress) == set(m.used_idxs)
    assert all(0 <= i < m.max_runs for i in m.used_idxs)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "outputs"


def test_discovers_ready_runs_and_ignores_the_rest(root: Path) -> None:
    make_run(root, RUN_A, {"batch_size": 4, "lora": {"rank": 2}})
    make_run(root, RUN_B, {})
    make_run(root, RUN_C)  # no orch.toml yet: not ready
    make_run(root, "run_bad name", {})  # path-unsafe name
    (root / "run_file").write_text("not a directory")
    make_run(root, "other", {})
    m = MultiRunManager(DirectoryRunSource(root), max_runs=4)
    m.discover_runs()
    assert dict(m.idx_2_id) == {0: RUN_A, 1: RUN_B}
    assert m.config[0].batch_size == 4 and m.config[0].lora.rank == 2
    assert m.config[1] == RunConfig()
    assert m.progress[0] == Progress()
    assert m.unused_idxs == [2, 3]
    assert m.get_run_dir(1) == root / RUN_B
    assert_consistent(m)

    (root / RUN_C / "control" / "orch.toml").write_text("")
    m.discover_runs()
    assert m.id_2_idx[RUN_C] == 2


def test_missing_output_dir_is_empty(tmp_path: Path) -> None:
    m = MultiRunManager(DirectoryRunSource(tmp_path / "nope"), max_runs=2)
    m.discover_runs()
    assert m.used_idxs == []


def test_skips_evicted_runs(root: Path) -> None:
    make_run(root, RUN_A, {})
    make_run(root, RUN_B, {})
    (root / RUN_A / "control" / EVICTED_FILE).write_text("done")
    m = MultiRunManager(DirectoryRunSource(root), max_runs=2)
    m.discover_runs()
    assert dict(m.idx_2_id) == {0: RUN_B}


def test_cap_at_max_runs_and_waiting_runs_oldest_seen_first(root: Path) -> None:
    make_run(root, RUN_A, {})
    make_run(root, RUN_B, {})
    m = MultiRunManager(DirectoryRunSource(root), max_runs=2)
    m.discover_runs()
    # RUN_Z is seen before RUN_0 even though it sorts after it.
    make_run(root, RUN_Z, {})
    m.discover_runs()
    make_run(root, RUN_0, {})
    m.discover_runs()
    assert dict(m.idx_2_id) == {0: RUN_A, 1: RUN_B}
    assert m.waiting_run_ids == [RUN_Z, RUN_0]

    shutil.rmtree(root / RUN_A)
    m.discover_runs()
    assert dict(m.idx_2_id) == {0: RUN_Z, 1: RUN_B}
    assert m.waiting_run_ids == [RUN_0]

    m.evict_run(1, "too slow")
    m.discover_runs()
    assert dict(m.idx_2_id) == {0: RUN_Z, 1: RUN_0}
    assert m.waiting_run_ids == []
    assert_consistent(m)


class CountingSource(DirectoryRunSource):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reports: list[tuple[str, str]] = []

    def report_invalid_config(self, run_id: str, message: str) -> None:
        self.reports.append((run_id, message))
        super().report_invalid_config(run_id, message)


def test_invalid_config_is_reported_with_every_problem_then_picked_up_when_fixed(root: Path) -> None:
    make_run(root, RUN_A, {"batch_size": 0, "lora": {"rank": 999, "colour": "red"}})
    source = CountingSource(root)
    m = MultiRunManager(source, max_runs=2)
    m.discover_runs()
    m.discover_runs()  # an unchanged bad config is not reported again
    assert m.used_idxs == []
    assert len(source.reports) == 1
    text = error_file(root, RUN_A).read_text()
    assert f"Invalid config for run {RUN_A} (3 problems)" in text
    assert "- batch_size: Input should be greater than or equal to 1 (got 0)" in text
    assert "- lora.rank: Input should be less than or equal to 256 (got 999)" in text
    assert "- lora.colour: Extra inputs are not permitted" in text

    make_run(root, RUN_A, {"batch_size": 2})
    m.discover_runs()
    assert not error_file(root, RUN_A).exists()
    assert dict(m.idx_2_id) == {0: RUN_A}
    assert m.config[0].batch_size == 2


def test_toml_syntax_error_is_an_invalid_config(root: Path) -> None:
    make_run(root, RUN_A, "batch_size = = 3\n")
    source = CountingSource(root)
    m = MultiRunManager(source, max_runs=2)
    m.discover_runs()
    m.discover_runs()
    assert m.used_idxs == []
    assert len(source.reports) == 1
    assert "orch.toml is not valid TOML" in error_file(root, RUN_A).read_text()

    make_run(root, RUN_A, "batch_size = 3\n")
    m.discover_runs()
    assert not error_file(root, RUN_A).exists()
    assert m.config[m.id_2_idx[RUN_A]].batch_size == 3


def test_validation_hooks_list_every_failure_and_a_raising_hook_is_a_failure(root: Path) -> None:
    make_run(root, RUN_A, {"lora": {"rank": 64}})
    make_run(root, RUN_B, {"lora": {"rank": 4}})

    def max_rank(config: RunConfig) -> tuple[bool, str]:
        return config.lora.rank <= 16, f"lora.rank {config.lora.rank} exceeds the pool's maximum 16"

    def base_model(config: RunConfig) -> tuple[bool, str]:
        raise RuntimeError("boom")

    m = MultiRunManager(DirectoryRunSource(root), max_runs=2)
    m.config_validation_hooks += [max_rank, base_model]
    m.discover_runs()
    assert m.used_idxs == []
    text = error_file(root, RUN_A).read_text()
    assert "(2 problems)" in text
    assert "lora.rank 64 exceeds the pool's maximum 16" in text
    assert "'base_model' failed: RuntimeError('boom')" in text

    m.config_validation_hooks.remove(base_model)
    make_run(root, RUN_B, {"lora": {"rank": 8}})  # changed: validated again
    m.discover_runs()
    assert dict(m.idx_2_id) == {0: RUN_B}
    assert RUN_A not in m.id_2_idx  # unchanged bad config: still rejected


def test_hook_order_on_a_single_rank(root: Path) -> None:
    log: list[tuple] = []
    m = MultiRunManager(DirectoryRunSource(root), max_runs=2)
    m.forgotten_hooks.append(lambda i, r: log.append(("forgotten", i, r)))
    m.discovered_hooks.append(lambda i, r, c: log.append(("discovered", i, r, c.batch_size)))
    m.deletion_hooks.append(lambda i, r: log.append(("deletion", i, r)))
    m.creation_hooks.append(lambda i, r: log.append(("creation1", i, r)))
    m.register_creation_hook(lambda i, r: log.append(("creation2", i, r)))

    def validate(config: RunConfig) -> tuple[bool, str]:
        log.append(("validation", config.batch_size))
        return True, ""

    m.config_validation_hooks.append(validate)

    make_run(root, RUN_A, {"batch_size": 1})
    make_run(root, RUN_B, {"batch_size": 2})
    m.discover_runs()
    m.synchronize_state()
    assert log == [
        ("validation", 1),
        ("validation", 2),
        ("discovered", 0, RUN_A, 1),
        ("discovered", 1, RUN_B, 2),
        ("creation1", 0, RUN_A),
        ("creation2", 0, RUN_A),
        ("creation1", 1, RUN_B),
        ("creation2", 1, RUN_B),
    ]

    log.clear()
    shutil.rmtree(root / RUN_A)
    make_run(root, RUN_C, {"batch_size": 3})
    m.discover_runs()
    m.synchronize_state()
    assert log == [
        ("forgotten", 0, RUN_A),
        ("validation", 3),
        ("discovered", 0, RUN_C, 3),
        ("deletion", 0, RUN_A),
        ("creation1", 0, RUN_C),
        ("creation2", 0, RUN_C),
    ]

    log.clear()
    m.discover_runs()
    m.synchronize_state()
    assert log == []


def test_evict_run_writes_evicted_txt_and_next_discover_frees_the_slot(root: Path) -> None:
    make_run(root, RUN_A, {})
    make_run(root, RUN_B, {})
    log: list[tuple] = []
    m = MultiRunManager(DirectoryRunSource(root), max_runs=2)
    m.forgotten_hooks.append(lambda i, r: log.append(("forgotten", i, r)))
    m.deletion_hooks.append(lambda i, r: log.append(("deletion", i, r)))
    m.discover_runs()
    m.synchronize_state()

    m.evict_run(0, "loss is NaN")
    evicted = root / RUN_A / "control" / EVICTED_FILE
    assert evicted.read_text() == "loss is NaN"
    assert [p.name for p in evicted.parent.iterdir() if p.name.endswith(".tmp")] == []
    assert m.idx_2_id[0] == RUN_A  # stays until the next discovery

    m.discover_runs()
    assert dict(m.idx_2_id) == {1: RUN_B}
    assert m.unused_idxs == [0]
    m.synchronize_state()
    assert log == [("forgotten", 0, RUN_A), ("deletion", 0, RUN_A)]

    with pytest.raises(KeyError):
        m.evict_run(0, "again")


def test_ids_and_idxs_stay_consistent_under_churn(root: Path) -> None:
    rng = random.Random(0)
    ids = [f"run_{i:012x}" for i in range(8)]
    m = MultiRunManager(DirectoryRunSource(root), max_runs=3)
    created: list[str] = []
    m.creation_hooks.append(lambda i, r: created.append(r))
    m.deletion_hooks.append(lambda i, r: created.remove(r))
    for _ in range(40):
        rid = rng.choice(ids)
        action = rng.random()
        if action < 0.5:
            make_run(root, rid, {})
        elif action < 0.8:
            shutil.rmtree(root / rid, ignore_errors=True)
        elif m.used_idxs:
            m.evict_run(rng.choice(m.used_idxs), "churn")
        m.discover_runs()
        m.synchronize_state()
        assert_consistent(m)
        assert sorted(created) == sorted(m.idx_2_id.values())
        listed = {p.name for p in root.glob("run_*") if not (p / "control" / EVICTED_FILE).exists()}
        assert set(m.id_2_idx) <= listed
        assert len(m.id_2_idx) == min(3, len(listed))


class MemorySource:
    """A source in the shape of the service's: slots and progress come with the runs."""

    def __init__(self, records: list[RunRecord]) -> None:
        self.records = records
        self.evicted: list[tuple[str, str]] = []

    def list_runs(self) -> list[RunRecord]:
        return list(self.records)

    def evict(self, run_id: str, reason: str) -> None:
        self.evicted.append((run_id, reason))

    def report_invalid_config(self, run_id: str, message: str) -> None:
        raise AssertionError(f"unexpected invalid config for {run_id}: {message}")

    def clear_invalid_config(self, run_id: str) -> None:
        pass


def test_slot_hints_and_progress_from_the_source() -> None:
    source = MemorySource(
        [
            RunRecord(RUN_A, {}, slot_hint=None),
            RunRecord(RUN_B, {}, slot_hint=2, progress=Progress(step=7, total_tokens=70, total_samples=14)),
            RunRecord(RUN_C, {}, slot_hint=0),
        ]
    )
    m = MultiRunManager(source, max_runs=3)
    m.discover_runs()
    assert dict(m.idx_2_id) == {0: RUN_C, 1: RUN_A, 2: RUN_B}
    assert m.progress[2] == Progress(7, 70, 14)
    assert m.progress[2] is not source.records[1].progress  # the trainer owns its copy

    source.records = [RunRecord(RUN_C, {}, slot_hint=0), RunRecord(RUN_0, {}, slot_hint=0)]
    m.discover_runs()  # hint 0 is taken: falls back to the lowest free slot
    assert dict(m.idx_2_id) == {0: RUN_C, 1: RUN_0}

    m.evict_run(1, "bad data")
    assert source.evicted == [(RUN_0, "bad data")]
    with pytest.raises(TypeError, match="no run directories"):
        m.get_run_dir(0)


class TinySlotModule(torch.nn.Module):
    def __init__(self, n_slots: int) -> None:
        super().__init__()
        self.A = torch.nn.Parameter(torch.ones(n_slots, 2, 3))
        self.resets: list[int] = []

    def reset_slot(self, slot: int) -> None:
        self.resets.append(slot)
        with torch.no_grad():
            self.A[slot].zero_()

    def slot_parameters(self, slot: int) -> list[torch.Tensor]:  # a sequence, as MultiLoRALinear's
        return [self.A[slot]]


def test_registered_modules_are_reset_before_creation_hooks(root: Path) -> None:
    m = MultiRunManager(DirectoryRunSource(root), max_runs=2)
    module = TinySlotModule(2)
    m.register_module("layers.0.q_proj", module)
    seen: list[float] = []
    m.creation_hooks.append(
        lambda i, r: seen.append(float(m.get_state_dict_for_run(i)["layers.0.q_proj.0"].sum()))
    )
    make_run(root, RUN_A, {})
    m.discover_runs()
    m.synchronize_state()
    assert module.resets == [0] and seen == [0.0]
    assert [n for n, _ in m.get_named_parameters_for_run(1)] == ["layers.0.q_proj.0"]
    assert float(module.A[1].detach().sum()) == 6.0  # other slots untouched


def test_guards(root: Path) -> None:
    with pytest.raises(ValueError):
        MultiRunManager(DirectoryRunSource(root), max_runs=0)
    with pytest.raises(ValueError):
        MultiRunManager(None, max_runs=1)
    worker = MultiRunManager(None, max_runs=2, rank=1, world_size=2)
    with pytest.raises(RuntimeError, match="master"):
        worker.discover_runs()
    with pytest.raises(RuntimeError, match="torch.distributed"):
        worker.synchronize_state()
    m = MultiRunManager(DirectoryRunSource(root), max_runs=2)
    with pytest.raises(TypeError):
        m.idx_2_id[0] = RUN_A  # type: ignore[index]
    for bad in ["run_", "run_../x", "../run_a", "run_a/b", "run_a b", "x" * 10]:
        with pytest.raises(ValueError):
            validate_run_id(bad)
    with pytest.raises(ValueError):
        DirectoryRunSource(root).run_dir("run_../../etc")
