"""MultiRunManager with a DirectoryRunSource on a temporary directory (single process)."""

import random
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import torch

from contracts.ids import validate_run_id
from contracts.layout import CONFIG_ERROR_FILE, EVICTED_FILE
from contracts.progress import Progress
from contracts.run_config import RunConfig
from trainer_core.checkpoint import save_checkpoint
from trainer_core.directory_source import DirectoryRunSource
from trainer_core.dist import World
from trainer_core.runs import MultiRunManager, RunRecord, SlotChanges, pool_config_problems

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
    assert {v: k for k, v in m.run_ids.items()} == dict(m.slots)
    assert sorted(m.used_slots + m.free_slots) == list(range(m.max_runs))
    assert set(m.config) == set(m.used_slots)
    assert all(0 <= i < m.max_runs for i in m.used_slots)


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
    source = DirectoryRunSource(root)
    m = MultiRunManager(source, max_runs=4)
    m.discover_runs()
    assert dict(m.run_ids) == {0: RUN_A, 1: RUN_B}
    assert m.config[0].batch_size == 4 and m.config[0].lora.rank == 2
    assert m.config[1] == RunConfig()
    assert m.free_slots == [2, 3]
    assert source.run_dir(RUN_B) == root / RUN_B
    assert_consistent(m)

    (root / RUN_C / "control" / "orch.toml").write_text("")
    m.discover_runs()
    assert m.slots[RUN_C] == 2


def test_missing_output_dir_is_empty(tmp_path: Path) -> None:
    m = MultiRunManager(DirectoryRunSource(tmp_path / "nope"), max_runs=2)
    m.discover_runs()
    assert m.used_slots == []


def test_skips_evicted_runs(root: Path) -> None:
    make_run(root, RUN_A, {})
    make_run(root, RUN_B, {})
    (root / RUN_A / "control" / EVICTED_FILE).write_text("done")
    m = MultiRunManager(DirectoryRunSource(root), max_runs=2)
    m.discover_runs()
    assert dict(m.run_ids) == {0: RUN_B}


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
    assert dict(m.run_ids) == {0: RUN_A, 1: RUN_B}
    assert m.waiting_run_ids == [RUN_Z, RUN_0]

    shutil.rmtree(root / RUN_A)
    m.discover_runs()
    assert dict(m.run_ids) == {0: RUN_Z, 1: RUN_B}
    assert m.waiting_run_ids == [RUN_0]

    m.evict_run(1, "too slow")
    m.discover_runs()
    assert dict(m.run_ids) == {0: RUN_Z, 1: RUN_0}
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
    assert m.used_slots == []
    assert len(source.reports) == 1
    text = error_file(root, RUN_A).read_text()
    assert f"Invalid config for run {RUN_A} (3 problems)" in text
    assert "- batch_size: Input should be greater than or equal to 1 (got 0)" in text
    assert "- lora.rank: Input should be less than or equal to 256 (got 999)" in text
    assert "- lora.colour: Extra inputs are not permitted" in text

    make_run(root, RUN_A, {"batch_size": 2})
    m.discover_runs()
    assert not error_file(root, RUN_A).exists()
    assert dict(m.run_ids) == {0: RUN_A}
    assert m.config[0].batch_size == 2


def test_toml_syntax_error_is_an_invalid_config(root: Path) -> None:
    make_run(root, RUN_A, "batch_size = = 3\n")
    source = CountingSource(root)
    m = MultiRunManager(source, max_runs=2)
    m.discover_runs()
    m.discover_runs()
    assert m.used_slots == []
    assert len(source.reports) == 1
    assert "orch.toml is not valid TOML" in error_file(root, RUN_A).read_text()

    make_run(root, RUN_A, "batch_size = 3\n")
    m.discover_runs()
    assert not error_file(root, RUN_A).exists()
    assert m.config[m.slots[RUN_A]].batch_size == 3


def test_the_pool_check_lists_every_failure_and_a_raising_check_is_a_failure(root: Path) -> None:
    make_run(root, RUN_A, {"lora": {"rank": 64}, "seq_len": 4096})
    make_run(root, RUN_B, {"lora": {"rank": 4}})
    check = partial(
        pool_config_problems,
        base_model=RunConfig().base_model,
        max_rank=16,
        target_modules=("q_proj",),
        seq_len=1024,
    )

    m = MultiRunManager(DirectoryRunSource(root), max_runs=2, check=check)
    m.discover_runs()
    assert m.used_slots == []  # B asks for the default target modules; the pool adapts q_proj only
    text = error_file(root, RUN_A).read_text()
    assert "(3 problems)" in text
    assert "lora.rank: 64 is above this pool's maximum 16" in text
    assert "seq_len: 4096 is above this pool's 1024" in text
    assert "lora.target_modules: ['k_proj', 'o_proj', 'v_proj'] are not adapted by this pool" in text

    make_run(root, RUN_B, {"lora": {"rank": 8, "target_modules": ["q_proj"]}})  # changed: validated again
    m.discover_runs()
    assert dict(m.run_ids) == {0: RUN_B}
    assert RUN_A not in m.slots  # unchanged bad config: still rejected
    assert not error_file(root, RUN_B).exists()

    def boom(config: RunConfig) -> list[str]:
        raise RuntimeError("boom")

    make_run(root, RUN_C, {})
    m = MultiRunManager(DirectoryRunSource(root), max_runs=2, check=boom)
    m.discover_runs()
    assert m.used_slots == []
    assert "the pool's config check failed: RuntimeError('boom')" in error_file(root, RUN_C).read_text()


def test_changes_on_a_single_rank(root: Path) -> None:
    validated: list[int] = []

    def check(config: RunConfig) -> list[str]:
        validated.append(config.batch_size)
        return []

    m = MultiRunManager(DirectoryRunSource(root), max_runs=2, check=check)
    make_run(root, RUN_A, {"batch_size": 1})
    make_run(root, RUN_B, {"batch_size": 2})
    m.discover_runs()
    changes = m.synchronize_state()
    assert validated == [1, 2]
    assert changes.released == []
    assert [(slot, rid, c.batch_size) for slot, rid, c in changes.admitted] == [(0, RUN_A, 1), (1, RUN_B, 2)]

    validated.clear()
    shutil.rmtree(root / RUN_A)
    make_run(root, RUN_C, {"batch_size": 3})
    m.discover_runs()
    changes = m.synchronize_state()
    assert validated == [3]
    assert changes.released == [(0, RUN_A)]
    assert [(slot, rid, c.batch_size) for slot, rid, c in changes.admitted] == [(0, RUN_C, 3)]

    m.discover_runs()
    assert m.synchronize_state() == SlotChanges()


def test_evict_run_writes_evicted_txt_and_next_discover_frees_the_slot(root: Path) -> None:
    make_run(root, RUN_A, {})
    make_run(root, RUN_B, {})
    m = MultiRunManager(DirectoryRunSource(root), max_runs=2)
    m.discover_runs()
    m.synchronize_state()

    m.evict_run(0, "loss is NaN")
    evicted = root / RUN_A / "control" / EVICTED_FILE
    assert evicted.read_text() == "loss is NaN"
    assert [p.name for p in evicted.parent.iterdir() if p.name.endswith(".tmp")] == []
    assert m.run_ids[0] == RUN_A  # stays until the next discovery

    m.discover_runs()
    assert dict(m.run_ids) == {1: RUN_B}
    assert m.free_slots == [0]
    assert m.synchronize_state() == SlotChanges(released=[(0, RUN_A)])

    with pytest.raises(KeyError):
        m.evict_run(0, "again")


def test_an_admitted_run_keeps_its_slot_while_its_directory_exists(root: Path) -> None:
    make_run(root, RUN_A, {"batch_size": 2})
    m = MultiRunManager(DirectoryRunSource(root), max_runs=1)
    m.discover_runs()
    m.synchronize_state()
    orch = root / RUN_A / "control" / "orch.toml"

    orch.unlink()  # being replaced by its owner, say
    m.discover_runs()
    assert dict(m.run_ids) == {0: RUN_A} and m.synchronize_state() == SlotChanges()
    orch.write_text("batch_size = = 3\n")  # half written
    m.discover_runs()
    assert dict(m.run_ids) == {0: RUN_A} and m.synchronize_state() == SlotChanges()
    assert m.config[0].batch_size == 2  # the config it was admitted with

    shutil.rmtree(root / RUN_A)
    m.discover_runs()
    assert m.synchronize_state() == SlotChanges(released=[(0, RUN_A)])


def test_a_run_whose_checkpoint_reached_max_steps_is_complete(root: Path) -> None:
    make_run(root, RUN_A, {"max_steps": 2})
    make_run(root, RUN_B, {"max_steps": 2})
    m = MultiRunManager(DirectoryRunSource(root), max_runs=1)
    m.discover_runs()
    assert dict(m.run_ids) == {0: RUN_A} and m.waiting_run_ids == [RUN_B]

    write_checkpoint(root / RUN_A, step=2)
    m.discover_runs()  # A is complete: its slot goes to B
    assert dict(m.run_ids) == {0: RUN_B} and m.waiting_run_ids == []
    write_checkpoint(root / RUN_B, step=1)
    m.discover_runs()
    assert dict(m.run_ids) == {0: RUN_B}


def write_checkpoint(run_dir: Path, *, step: int) -> None:
    save_checkpoint(
        run_dir / "checkpoints",
        step,
        adapter={"w": torch.zeros(1)},
        optimizer_state={},
        progress={"step": step, "total_tokens": 10 * step, "total_samples": 2 * step},
        keep_last=1,
    )


def test_ids_and_slots_stay_consistent_under_churn(root: Path) -> None:
    rng = random.Random(0)
    ids = [f"run_{i:012x}" for i in range(8)]
    m = MultiRunManager(DirectoryRunSource(root), max_runs=3)
    held: list[str] = []
    for _ in range(40):
        rid = rng.choice(ids)
        action = rng.random()
        if action < 0.5:
            make_run(root, rid, {})
        elif action < 0.8:
            shutil.rmtree(root / rid, ignore_errors=True)
        elif m.used_slots:
            m.evict_run(rng.choice(m.used_slots), "churn")
        m.discover_runs()
        changes = m.synchronize_state()
        for _, r in changes.released:
            held.remove(r)
        held.extend(r for _, r, _ in changes.admitted)
        assert_consistent(m)
        assert sorted(held) == sorted(m.run_ids.values())
        listed = {p.name for p in root.glob("run_*") if not (p / "control" / EVICTED_FILE).exists()}
        assert set(m.slots) <= listed
        assert len(m.slots) == min(3, len(listed))


class MemorySource:
    """A source in the shape of the service's: slots and progress come with the runs."""

    def __init__(self, records: list[RunRecord]) -> None:
        self.records = records
        self.evicted: list[tuple[str, str]] = []

    def list_runs(self) -> list[RunRecord]:
        return list(self.records)

    def evict(self, run_id: str, reason: str) -> None:
        self.evicted.append((run_id, reason))

    def fail(self, run_id: str, reason: str) -> None:
        self.evicted.append((run_id, reason))

    def report_invalid_config(self, run_id: str, message: str) -> None:
        raise AssertionError(f"unexpected invalid config for {run_id}: {message}")

    def clear_invalid_config(self, run_id: str) -> None:
        pass


def test_slot_hints_from_the_source() -> None:
    source = MemorySource(
        [
            RunRecord(RUN_A, {}, slot_hint=None),
            RunRecord(RUN_B, {}, slot_hint=2, progress=Progress(step=7, total_tokens=70, total_samples=14)),
            RunRecord(RUN_C, {}, slot_hint=0),
        ]
    )
    m = MultiRunManager(source, max_runs=3)
    m.discover_runs()
    assert dict(m.run_ids) == {0: RUN_C, 1: RUN_A, 2: RUN_B}

    source.records = [RunRecord(RUN_C, {}, slot_hint=0), RunRecord(RUN_0, {}, slot_hint=0)]
    m.discover_runs()  # hint 0 is taken: falls back to the lowest free slot
    assert dict(m.run_ids) == {0: RUN_C, 1: RUN_0}

    m.evict_run(1, "bad data")
    assert source.evicted == [(RUN_0, "bad data")]

    source.records = [RunRecord(RUN_C, {}, progress=Progress(step=RunConfig().max_steps))]
    m.discover_runs()  # the progress the source reports completes a run
    assert dict(m.run_ids) == {}


def test_guards(root: Path) -> None:
    with pytest.raises(ValueError):
        MultiRunManager(DirectoryRunSource(root), max_runs=0)
    with pytest.raises(ValueError):
        MultiRunManager(None, max_runs=1)
    worker = MultiRunManager(None, max_runs=2, world=World(rank=1, world_size=2))
    with pytest.raises(RuntimeError, match="master"):
        worker.discover_runs()
    with pytest.raises(RuntimeError, match="torch.distributed"):
        worker.synchronize_state()
    m = MultiRunManager(DirectoryRunSource(root), max_runs=2)
    with pytest.raises(TypeError):
        m.run_ids[0] = RUN_A  # type: ignore[index]
    for bad in ["run_", "run_../x", "../run_a", "run_a/b", "run_a b", "x" * 10]:
        with pytest.raises(ValueError):
            validate_run_id(bad)
    with pytest.raises(ValueError):
        DirectoryRunSource(root).run_dir("run_../../etc")


def test_release_run_frees_the_slot_and_a_still_listed_run_is_admitted_afresh() -> None:
    """The pool's answer to a run that left mid-step (issue 10): released at the next sync on every
    rank; if the source still lists it (e.g. its leases went back), it is a new admission (from its
    checkpoint), even in the same slot."""
    source = MemorySource([RunRecord(RUN_A, {}, slot_hint=0), RunRecord(RUN_B, {}, slot_hint=1)])
    m = MultiRunManager(source, max_runs=2)
    m.discover_runs()
    m.synchronize_state()

    m.release_run(0, "left during its step 3")
    source.records = [RunRecord(RUN_B, {}, slot_hint=1)]  # A is gone from the service
    m.discover_runs()
    changes = m.synchronize_state()
    assert changes.released == [(0, RUN_A)] and changes.admitted == []

    source.records = [RunRecord(RUN_A, {}, slot_hint=0), RunRecord(RUN_B, {}, slot_hint=1)]
    m.discover_runs()
    m.synchronize_state()
    m.release_run(0, "ack rejected")  # still listed: released and admitted again in one sync
    m.discover_runs()
    changes = m.synchronize_state()
    assert changes.released == [(0, RUN_A)]
    assert [(s, rid) for s, rid, _ in changes.admitted] == [(0, RUN_A)]
    assert dict(m.run_ids) == {0: RUN_A, 1: RUN_B}
    with pytest.raises(KeyError):
        m.release_run(1 + 5, "no such slot")
